package ibverbs

import (
	"context"
	"errors"
	"os"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/gdrlink/gdrlink/verbsio"
	"golang.org/x/sys/unix"
)

// testConfig is the configuration tests open devices with: the RDMA_*
// variables, with SOFTROCE_DEV and SOFTROCE_GID_INDEX (set inside the
// Soft-RoCE guest) filling what they leave unset. Without a device the test
// is skipped with the reason, or fails when GDRLINK_REQUIRE_RDMA=1 says the
// device should be there.
func testConfig(t testing.TB) verbsio.Config {
	t.Helper()
	cfg, err := verbsio.ConfigFromEnv()
	if err != nil {
		t.Fatalf("RDMA_* environment: %v", err)
	}
	if d := os.Getenv("SOFTROCE_DEV"); d != "" && cfg.Device == "" {
		cfg.Device = d
	}
	if g := os.Getenv("SOFTROCE_GID_INDEX"); g != "" && cfg.GIDIndex < 0 {
		if cfg.GIDIndex, err = strconv.Atoi(g); err != nil {
			t.Fatalf("SOFTROCE_GID_INDEX=%q: %v", g, err)
		}
	}
	if _, err := New().Devices(); err != nil {
		if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
			t.Fatalf("GDRLINK_REQUIRE_RDMA=1 but no usable RDMA device: %v", err)
		}
		t.Skipf("skipping: no RDMA device here (run scripts/test-rdma.sh for Soft-RoCE): %v", err)
	}
	return cfg
}

// openTest opens the test device and closes it at cleanup.
func openTest(t testing.TB) *device {
	t.Helper()
	cfg := testConfig(t)
	d, err := newProvider().openDevice(cfg)
	if err != nil {
		t.Fatalf("open %+v: %v", cfg, err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Errorf("device close: %v", err)
		}
	})
	return d
}

// mapped is anonymous memory off the Go heap, as RDMA needs.
type mapped []byte

func mmapAnon(n int) (mapped, error) {
	return unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
}

func mapMem(t testing.TB, n int) mapped {
	t.Helper()
	b, err := mmapAnon(n)
	if err != nil {
		t.Fatalf("mmap %d: %v", n, err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
	return b
}

func (m mapped) addr() uintptr { return uintptr(unsafe.Pointer(&m[0])) }

func mustClose(t testing.TB, what string, c interface{ Close() error }) {
	t.Helper()
	if err := c.Close(); err != nil {
		t.Errorf("close %s: %v", what, err)
	}
}

// waitN waits until n completions arrived on cq, or d passed.
func waitN(cq verbsio.CompletionQueue, n int, d time.Duration) ([]verbsio.Completion, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var got []verbsio.Completion
	buf := make([]verbsio.Completion, 16)
	for len(got) < n {
		k, err := cq.Wait(ctx, buf[:min(len(buf), n-len(got))])
		if err != nil {
			return got, err
		}
		got = append(got, buf[:k]...)
	}
	return got, nil
}

func pattern(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
}

func checkPattern(b []byte, seed byte) error {
	for i := range b {
		if b[i] != byte(i*7)^seed {
			return errors.New("byte " + strconv.Itoa(i) + " = " + strconv.Itoa(int(b[i])) + ", want " + strconv.Itoa(int(byte(i*7)^seed)))
		}
	}
	return nil
}
