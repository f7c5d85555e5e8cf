package ibverbs

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/verbsio"
	"golang.org/x/sys/unix"
)

func TestRegistered(t *testing.T) {
	p, err := verbsio.Lookup(Name)
	if err != nil {
		t.Fatal(err)
	}
	if p.Name() != Name {
		t.Fatalf("name %q", p.Name())
	}
}

// TestNoDeviceSaysWhy points the provider at sysfs trees without RDMA and
// checks that Devices and Open fail with ErrNoDevice and the reason.
func TestNoDeviceSaysWhy(t *testing.T) {
	empty := t.TempDir()
	p := New(WithSysfsRoot(empty))
	_, err := p.Devices()
	if !errors.Is(err, verbsio.ErrNoDevice) {
		t.Fatalf("Devices with no class/infiniband: %v, want ErrNoDevice", err)
	}
	want := "does not exist"
	if ibv.Load() != nil {
		want = "libibverbs unavailable: dlopen"
	}
	if !strings.Contains(err.Error(), want) {
		t.Errorf("Devices error %q does not say %q", err, want)
	}
	if _, err := p.Open(verbsio.DefaultConfig()); !errors.Is(err, verbsio.ErrNoDevice) {
		t.Errorf("Open: %v, want ErrNoDevice", err)
	}
	if ibv.Load() != nil {
		return
	}
	if err := os.MkdirAll(filepath.Join(empty, "class", "infiniband"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Devices(); !errors.Is(err, verbsio.ErrNoDevice) || !strings.Contains(err.Error(), "is empty") {
		t.Errorf("Devices with empty class/infiniband: %v", err)
	}
}

// TestHostFallback checks, on a host without RDMA, that verbsio.Choose
// passes over ibverbs with the reason.
func TestHostFallback(t *testing.T) {
	if _, err := New().Devices(); err == nil {
		t.Skip("skipping: this host has an RDMA device, so ibverbs is not passed over")
	}
	c, _ := verbsio.Choose(false)
	if e := c.Skipped[Name]; !errors.Is(e, verbsio.ErrNoDevice) {
		t.Fatalf("Choose skipped ibverbs with %v, want ErrNoDevice", e)
	}
}

func TestOpenConfigErrors(t *testing.T) {
	cfg := testConfig(t)
	d := openTest(t)
	for _, tc := range []struct {
		name string
		mod  func(*verbsio.Config)
		want error
		says string
	}{
		{"device", func(c *verbsio.Config) { c.Device = "no_such_dev9" }, verbsio.ErrBadConfig, d.Info().Name},
		{"port", func(c *verbsio.Config) { c.Port = 9 }, verbsio.ErrBadConfig, "ports: 1"},
		{"gid", func(c *verbsio.Config) { c.GIDIndex = 65535 }, verbsio.ErrBadConfig, "GIDs: "},
		{"depth", func(c *verbsio.Config) { c.QueueDepth = 65536 }, nil, ""},
		{"mtu", func(c *verbsio.Config) { c.MTU = 1024 }, nil, ""},
		{"timeout", func(c *verbsio.Config) { c.Timeout = 40 }, verbsio.ErrBadConfig, "RDMA_QP_TIMEOUT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := cfg
			tc.mod(&c)
			dev, err := newProvider().openDevice(c)
			if err == nil {
				defer dev.Close()
			}
			if tc.want == nil {
				if err != nil {
					t.Fatalf("open: %v", err)
				}
				return
			}
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("open: %v, want %v naming %q", err, tc.want, tc.says)
			}
		})
	}
	t.Run("env", func(t *testing.T) {
		t.Setenv("RDMA_DEVICE", "no_such_dev9")
		c, err := verbsio.ConfigFromEnv()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := verbsio.Open(Name, c); !errors.Is(err, verbsio.ErrBadConfig) || !strings.Contains(err.Error(), d.Info().Name) {
			t.Fatalf("RDMA_DEVICE=no_such_dev9: %v", err)
		}
	})
}

func TestDeviceFacts(t *testing.T) {
	d := openTest(t)
	c := d.Caps()
	if c.Provider != Name || !c.WriteWithImmediate || c.MaxSGE < 1 || c.MaxQPDepth < 1 || c.MaxMessage < 1 {
		t.Errorf("caps %+v", c)
	}
	gid, typ := d.gid()
	t.Logf("%s: gid %s %s, caps %+v", d, gid, typ, c)
	if d.mtu() < 256 {
		t.Errorf("MTU %d", d.mtu())
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
	if _, err := d.AllocPD(); !errors.Is(err, verbsio.ErrClosed) {
		t.Fatalf("AllocPD on a closed device: %v", err)
	}
}

func TestRegisterAccess(t *testing.T) {
	d := openTest(t)
	pdi, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "pd", pdi)
	mem := mapMem(t, 1<<20)
	for _, a := range []verbsio.Access{0, verbsio.AccessLocalWrite, verbsio.AccessRemoteWrite, verbsio.AccessRemoteRead,
		verbsio.AccessLocalWrite | verbsio.AccessRemoteRead, verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead} {
		m, err := pdi.RegisterMemory(mem.addr(), len(mem), a)
		if err != nil {
			t.Fatalf("register %s: %v", a, err)
		}
		if m.Addr() != mem.addr() || m.Len() != len(mem) || m.Access()&a != a {
			t.Errorf("region %#x+%d %s, registered %#x+%d %s", m.Addr(), m.Len(), m.Access(), mem.addr(), len(mem), a)
		}
		if a&verbsio.AccessRemoteWrite != 0 && m.Access()&verbsio.AccessLocalWrite == 0 {
			t.Errorf("remote write without local write reported as %s", m.Access())
		}
		mustClose(t, "mr", m)
		if err := m.Close(); err != nil {
			t.Errorf("second close: %v", err)
		}
	}
	if _, err := pdi.RegisterMemory(mem.addr(), 0, verbsio.AccessLocalWrite); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("zero length: %v", err)
	}
	if _, err := pdi.RegisterMemory(mem.addr(), 4096, 1<<7); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("unknown access: %v", err)
	}
	// An unmapped range: the kernel refuses to pin it.
	hole := mapMem(t, 3*4096)
	if err := unix.MunmapPtr(unsafe.Pointer(&hole[4096]), 4096); err != nil {
		t.Fatal(err)
	}
	if m, err := pdi.RegisterMemory(hole.addr(), len(hole), verbsio.AccessLocalWrite); err == nil {
		m.Close()
		t.Errorf("registering a range with a hole succeeded")
	} else {
		t.Logf("range with a hole: %v", err)
	}
	// A domain with a live region is busy.
	m, err := pdi.RegisterMemory(mem.addr(), 4096, verbsio.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := pdi.Close(); !errors.Is(err, verbsio.ErrBusy) {
		t.Errorf("closing a domain with a live region: %v", err)
	}
	if err := d.Close(); !errors.Is(err, verbsio.ErrBusy) {
		t.Errorf("closing a device with a live domain: %v", err)
	}
	mustClose(t, "mr", m)
}

// TestDMABuf checks the dma-buf path against what the device advertises:
// Soft-RoCE has no dma-buf registration and must say so with
// ErrNotSupported and the errno; a device that has it must reject a file
// that is not a dma-buf.
func TestDMABuf(t *testing.T) {
	d := openTest(t)
	pdi, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "pd", pdi)
	fd, err := unix.MemfdCreate("not-a-dmabuf", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 1<<16); err != nil {
		t.Fatal(err)
	}
	m, err := pdi.RegisterDMABuf(fd, 0, 1<<16, 0, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	if err == nil {
		m.Close()
		t.Fatal("a memfd registered as a dma-buf")
	}
	if d.Caps().DMABuf {
		if errors.Is(err, verbsio.ErrNotSupported) {
			t.Fatalf("device advertises dma-buf but says %v", err)
		}
		t.Logf("memfd as dma-buf: %v", err)
		return
	}
	if !errors.Is(err, verbsio.ErrNotSupported) || !errors.Is(err, syscall.EOPNOTSUPP) {
		t.Fatalf("dma-buf on a device without it: %v, want ErrNotSupported and EOPNOTSUPP", err)
	}
	t.Logf("as expected: %v", err)
}

// loopPair is two connected queue pairs of one process.
type loopPair struct {
	pd verbsio.ProtectionDomain
	cq [2]verbsio.CompletionQueue
	qp [2]verbsio.QueuePair
}

func newLoopPair(t *testing.T, d *device, qc verbsio.QPConfig) *loopPair {
	t.Helper()
	l := &loopPair{}
	var err error
	if l.pd, err = d.AllocPD(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mustClose(t, "pd", l.pd) })
	for i := range 2 {
		if l.cq[i], err = d.CreateCQ(256); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { mustClose(t, "cq", l.cq[i]) })
		c := qc
		c.SendCQ, c.RecvCQ = l.cq[i], l.cq[i]
		if l.qp[i], err = l.pd.CreateQP(c); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { mustClose(t, "qp", l.qp[i]) })
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range 2 {
		if err := l.qp[i].Connect(ctx, l.qp[1-i].Endpoint()); err != nil {
			t.Fatalf("connect: %v", err)
		}
	}
	return l
}

// TestChainsCrossOnce posts a chain of writes and checks that it crossed
// into C once, and that the completions came back in one batch.
func TestChainsCrossOnce(t *testing.T) {
	d := openTest(t)
	l := newLoopPair(t, d, verbsio.QPConfig{MaxSendWR: 64, MaxRecvWR: 64})
	src, dst := mapMem(t, 1<<16), mapMem(t, 1<<16)
	pattern(src, 3)
	ms, err := l.pd.RegisterMemory(src.addr(), len(src), verbsio.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "mr", ms)
	md, err := l.pd.RegisterMemory(dst.addr(), len(dst), verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "mr", md)
	const n = 16
	chunk := len(src) / n
	wrs := make([]verbsio.SendWR, n)
	for i := range wrs {
		wrs[i] = verbsio.SendWR{WRID: uint64(i), Op: verbsio.OpWrite, Signaled: true,
			SG:         []verbsio.SGE{{Addr: ms.Addr() + uintptr(i*chunk), Length: uint32(chunk), LKey: ms.LKey()}},
			RemoteAddr: uint64(md.Addr()) + uint64(i*chunk), RKey: md.RKey()}
	}
	before := d.Stats()
	if err := l.qp[0].PostSend(wrs); err != nil {
		t.Fatal(err)
	}
	after := d.Stats()
	if got := after.PostSend - before.PostSend; got != 1 {
		t.Errorf("a chain of %d writes took %d post crossings, want 1", n, got)
	}
	if got := after.SendWRs - before.SendWRs; got != n {
		t.Errorf("posted %d work requests, counted %d", n, got)
	}
	got, err := waitN(l.cq[0], n, 30*time.Second)
	if err != nil {
		t.Fatalf("after %d completions: %v", len(got), err)
	}
	for i, c := range got {
		if c.Status != verbsio.StatusSuccess || c.Op != verbsio.OpWrite || c.WRID != uint64(i) || c.QP != l.qp[0] {
			t.Errorf("completion %d: %+v", i, c)
		}
	}
	if err := checkPattern(dst, 3); err != nil {
		t.Errorf("destination: %v", err)
	}
	s := d.Stats()
	t.Logf("chain of %d writes: %d post crossings, %d poll crossings, %d notify crossings for %d completions", n,
		after.PostSend-before.PostSend, s.Poll-before.Poll, s.Notify-before.Notify, s.Completions-before.Completions)
}

// TestIdleWaitSleeps checks that Wait on an empty queue sleeps in the poller
// instead of spinning: the process's CPU time over an idle wait stays a
// small part of the wait.
func TestIdleWaitSleeps(t *testing.T) {
	d := openTest(t)
	cq, err := d.CreateCQ(16)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "cq", cq)
	var r0, r1 unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &r0)
	const idle = 500 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), idle)
	defer cancel()
	n, err := cq.Wait(ctx, make([]verbsio.Completion, 4))
	unix.Getrusage(unix.RUSAGE_SELF, &r1)
	if n != 0 || !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, verbsio.ErrTimeout) {
		t.Fatalf("idle wait: %d, %v", n, err)
	}
	cpu := time.Duration(r1.Utime.Nano()+r1.Stime.Nano()-r0.Utime.Nano()-r0.Stime.Nano()) * time.Nanosecond
	if cpu > idle/4 {
		t.Errorf("an idle wait of %v used %v of CPU", idle, cpu)
	}
	t.Logf("idle wait of %v used %v of CPU", idle, cpu)
}

// TestWaitWakes checks that a completion wakes a waiter sleeping on the
// completion channel.
func TestWaitWakes(t *testing.T) {
	d := openTest(t)
	l := newLoopPair(t, d, verbsio.QPConfig{MaxSendWR: 8, MaxRecvWR: 8})
	buf := mapMem(t, 4096)
	m, err := l.pd.RegisterMemory(buf.addr(), len(buf), verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "mr", m)
	if err := l.qp[1].PostRecv([]verbsio.RecvWR{{WRID: 77, SG: []verbsio.SGE{{Addr: m.Addr(), Length: 64, LKey: m.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	var got []verbsio.Completion
	go func() {
		var err error
		got, err = waitN(l.cq[1], 1, 60*time.Second)
		done <- err
	}()
	time.Sleep(100 * time.Millisecond) // let the waiter reach the channel
	before := d.Stats()
	if err := l.qp[0].PostSend([]verbsio.SendWR{{WRID: 1, Op: verbsio.OpWriteImm, Imm: 0xfeed, Signaled: true,
		SG: []verbsio.SGE{{Addr: m.Addr() + 2048, Length: 16, LKey: m.LKey()}}, RemoteAddr: uint64(m.Addr()), RKey: m.RKey()}}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if c := got[0]; c.WRID != 77 || c.Op != verbsio.OpRecvImm || !c.HasImm || c.Imm != 0xfeed || c.Status != verbsio.StatusSuccess {
		t.Fatalf("completion %+v", c)
	}
	if s := d.Stats(); s.Notify == before.Notify {
		t.Logf("waiter found the completion by polling (no channel event needed)")
	}
	if c, err := waitN(l.cq[0], 1, 30*time.Second); err != nil || c[0].Op != verbsio.OpWriteImm {
		t.Fatalf("sender completion %+v, %v", c, err)
	}
}

func TestPostBeforeConnect(t *testing.T) {
	d := openTest(t)
	pdi, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "pd", pdi)
	cq, err := d.CreateCQ(8)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "cq", cq)
	qp, err := pdi.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq, MaxSendWR: 4, MaxRecvWR: 4})
	if err != nil {
		t.Fatal(err)
	}
	if qp.State() != verbsio.QPInit {
		t.Errorf("new queue pair in state %s", qp.State())
	}
	if err := qp.PostSend([]verbsio.SendWR{{Op: verbsio.OpSend}}); !errors.Is(err, verbsio.ErrQPState) {
		t.Errorf("post before connect: %v", err)
	}
	if err := cq.Close(); !errors.Is(err, verbsio.ErrBusy) {
		t.Errorf("closing a queue with a live queue pair: %v", err)
	}
	bad := qp.Endpoint()
	bad.Data = bad.Data[:5]
	if err := qp.Connect(context.Background(), bad); !errors.Is(err, verbsio.ErrBadFrame) {
		t.Errorf("connect to a truncated endpoint: %v", err)
	}
	mustClose(t, "qp", qp)
	if err := qp.Close(); err != nil {
		t.Errorf("second close: %v", err)
	}
	if err := qp.PostRecv([]verbsio.RecvWR{{}}); !errors.Is(err, verbsio.ErrClosed) {
		t.Errorf("post on a closed queue pair: %v", err)
	}
}

func TestSpinEnv(t *testing.T) {
	t.Setenv(spinEnv, "fast")
	if _, err := New().Open(verbsio.DefaultConfig()); !errors.Is(err, verbsio.ErrBadConfig) || !strings.Contains(err.Error(), spinEnv) {
		t.Fatalf("%s=fast: %v, want ErrBadConfig naming it", spinEnv, err)
	}
	// An explicit option wins over the variable.
	d, err := New(WithSpin(time.Millisecond), WithSysfsRoot(t.TempDir())).Open(verbsio.DefaultConfig())
	if err == nil {
		d.Close()
	}
	if errors.Is(err, verbsio.ErrBadConfig) {
		t.Fatalf("WithSpin and a bad %s: %v", spinEnv, err)
	}
}
