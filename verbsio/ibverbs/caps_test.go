package ibverbs

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// fakeSys makes a sysfs tree under a temporary directory with the given
// directories (relative to its sys/) and returns its root.
func fakeSys(t *testing.T, dirs ...string) string {
	t.Helper()
	root := filepath.Join(t.TempDir(), "sys")
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// TestPeerMemMemoryTypes checks that the provider lists GPU memory exactly
// when a GPU peer-memory module is loaded under its sysfs root, and that
// the probe's three outcomes are told apart.
func TestPeerMemMemoryTypes(t *testing.T) {
	notDir := fakeSys(t, "module")
	if err := os.WriteFile(filepath.Join(notDir, "module", "nvidia_peermem"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		root   string
		module string // "" when none is reported
		gpu    bool
		notSup bool // the error wraps ErrNotSupported (else: could not tell)
	}{
		{"nvidia_peermem", fakeSys(t, "module/nvidia_peermem", "module/ib_core"), "nvidia_peermem", true, false},
		{"nv_peer_mem", fakeSys(t, "module/nv_peer_mem"), "nv_peer_mem", true, false},
		{"both", fakeSys(t, "module/nv_peer_mem", "module/nvidia_peermem"), "nvidia_peermem", true, false},
		{"none loaded", fakeSys(t, "module/ib_core", "module/nvidia"), "", false, true},
		{"no module directory", fakeSys(t), "", false, false},
		{"not a directory", notDir, "", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := sysfs{root: tc.root}.peerMem()
			if m != tc.module {
				t.Errorf("peerMem = %q, %v; want %q", m, err, tc.module)
			}
			if (err == nil) != tc.gpu || errors.Is(err, verbsio.ErrNotSupported) != tc.notSup {
				t.Errorf("peerMem error %v; want ErrNotSupported %v", err, tc.notSup)
			}
			kinds, why := newProvider(WithSysfsRoot(tc.root)).memoryTypes("mlx5_0", "0000:3b:00.0")
			if got := slices.Contains(kinds, tensor.GPU); got != tc.gpu {
				t.Errorf("memory types %v: GPU listed %v, want %v (%s)", kinds, got, tc.gpu, why)
			}
			if !slices.Contains(kinds, tensor.CPU) || !slices.Contains(kinds, tensor.PinnedHost) {
				t.Errorf("memory types %v lack host memory", kinds)
			}
			if (why == "") != tc.gpu {
				t.Errorf("reason %q with GPU listed %v", why, tc.gpu)
			}
		})
	}
}

// TestSoftwareDeviceNoGPUMemory: a device with no PCI function (rxe, siw)
// never lists GPU memory, even with a peer-memory module loaded.
func TestSoftwareDeviceNoGPUMemory(t *testing.T) {
	root := fakeSys(t, "module/nvidia_peermem")
	kinds, why := newProvider(WithSysfsRoot(root)).memoryTypes("rxe0", "")
	if slices.Contains(kinds, tensor.GPU) {
		t.Errorf("software device lists GPU memory: %v", kinds)
	}
	if !strings.Contains(why, "software device") || !strings.Contains(why, "rxe0") {
		t.Errorf("reason %q does not name the software device", why)
	}
	kinds, why = newProvider(WithSysfsRoot(root)).memoryTypes("mlx5_0", "0000:3b:00.0")
	if !slices.Contains(kinds, tensor.GPU) || why != "" {
		t.Errorf("PCI device with nvidia_peermem: %v, %q", kinds, why)
	}
}

// TestDeviceCapsPeerMem opens the test device with a sysfs root whose
// class/infiniband is the real one: with module/nvidia_peermem beside it,
// Caps lists GPU memory; without, it does not and says why. The device's
// own Caps agree with this host's /sys.
func TestDeviceCapsPeerMem(t *testing.T) {
	cfg := testConfig(t)
	for _, loaded := range []bool{true, false} {
		root := fakeSys(t, "module/ib_core")
		if loaded {
			if err := os.Mkdir(filepath.Join(root, "module", "nvidia_peermem"), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Symlink("/sys/class", filepath.Join(root, "class")); err != nil {
			t.Fatal(err)
		}
		d, err := newProvider(WithSysfsRoot(root)).openDevice(cfg)
		if err != nil {
			t.Fatalf("open with sysfs root %s: %v", root, err)
		}
		c := d.Caps()
		// Software devices (rxe here) never list GPU memory.
		want := loaded && d.Info().PCIAddress != ""
		if got := slices.Contains(c.MemoryTypes, tensor.GPU); got != want {
			t.Errorf("nvidia_peermem loaded %v: memory types %v (%s)", loaded, c.MemoryTypes, d.GPUMemoryReason())
		}
		if (d.GPUMemoryReason() == "") != want {
			t.Errorf("nvidia_peermem loaded %v: reason %q", loaded, d.GPUMemoryReason())
		}
		c.MemoryTypes[0] = tensor.GPU
		if d.Caps().MemoryTypes[0] != tensor.CPU {
			t.Errorf("Caps shares its MemoryTypes with the caller")
		}
		mustClose(t, "device", d)
	}
	d := openTest(t)
	_, err := sysfs{root: "/sys"}.peerMem()
	if got := slices.Contains(d.Caps().MemoryTypes, tensor.GPU); got != (err == nil && d.Info().PCIAddress != "") {
		t.Errorf("memory types %v, peer-memory module: %v", d.Caps().MemoryTypes, err)
	}
	t.Logf("GPU memory: %q; dma-buf: %v %q", d.GPUMemoryReason(), d.Caps().DMABuf, d.DMABufReason())
}
