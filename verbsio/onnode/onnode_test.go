package onnode

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

const guard = 0xA5

var rw = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead

func pattern(b []byte, seed int) {
	for i := range b {
		b[i] = byte(i*7 + seed + i>>9)
	}
}

// TestWriteImm writes a tensor-sized range into the middle of a guarded
// region of another process, for each mechanism and kind of target memory,
// and checks the bytes, the guards and the receive completion.
func TestWriteImm(t *testing.T) {
	for _, mech := range []Mechanism{MechVM, MechSHM, MechAuto} {
		for _, kind := range []string{"anon", "memfd", "thp"} {
			t.Run(mech.String()+"/"+kind, func(t *testing.T) {
				n, p := pair(t, mech)
				writeImm(t, n, p, mech, kind)
			})
		}
	}
}

// writeImm writes 3 MiB into a guarded region of kind of the helper with an
// immediate and checks the bytes, the guards and both completions.
func writeImm(t *testing.T, n *node, p *peer, mech Mechanism, kind string) {
	const size, pad = 3<<20 + 123, 4096
	src, err := n.register("anon", size, verbsio.AccessLocalWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	pattern(n.mems[src.RKey()].b, 1)
	want := crc32.ChecksumIEEE(n.mems[src.RKey()].b)
	f := p.one("mr", "reg %s %d %d %d", kind, size+2*pad, rw, guard)
	addr, rkey := atoi(t, f[0]), atoi(t, f[1])
	p.ok("recv 77 %d 0 0", rkey)
	err = n.qp.PostSend([]verbsio.SendWR{{WRID: 5, Op: verbsio.OpWriteImm, Signaled: true, Imm: 0xfeed, RemoteAddr: addr + pad, RKey: uint32(rkey),
		SG: []verbsio.SGE{{Addr: src.Addr(), Length: size, LKey: src.LKey()}}}})
	if err != nil {
		t.Fatal(err)
	}
	if c := waitOne(t, n.scq, 5*time.Second); c.Status != verbsio.StatusSuccess || c.WRID != 5 || c.Op != verbsio.OpWriteImm {
		t.Fatalf("send completion %+v", c)
	}
	mapped := len(n.qp.(*qp).fileMaps) == 1
	if wantMapped := mech != MechVM && kind == "memfd"; mapped != wantMapped {
		t.Errorf("target mapped here: %v, want %v", mapped, wantMapped)
	}
	got := p.do("wait 1 5000")
	if wantLine := fmt.Sprintf("comp 77 0 %d %d %d true", verbsio.OpRecvImm, size, 0xfeed); len(got) != 1 || got[0] != wantLine {
		t.Fatalf("receive completion %q, want %q", got, wantLine)
	}
	if c := p.one("crc", "crc %d %d %d", rkey, pad, size); c[0] != strconv.FormatUint(uint64(want), 10) {
		t.Errorf("target crc %s, want %d", c[0], want)
	}
	for _, off := range []int{0, pad + size} {
		if b := p.one("bad", "check %d %d %d %d", rkey, off, pad, guard); b[0] != "-1" {
			t.Errorf("guard at %d overwritten at +%s", off, b[0])
		}
	}
}

// TestSendRecv sends messages of several sizes, one of them in fragments, and
// a scatter of two SGEs, and checks what the peer received.
func TestSendRecv(t *testing.T) {
	n, p := pair(t, MechAuto)
	sendRecv(t, n, p)
}

func sendRecv(t *testing.T, n *node, p *peer) {
	src, err := n.register("anon", 1<<20, verbsio.AccessLocalWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	b := n.mems[src.RKey()].b
	pattern(b, 3)
	f := p.one("mr", "reg anon %d %d 0", 1<<20, verbsio.AccessLocalWrite)
	rkey := atoi(t, f[1])
	sizes := []int{1, 4096, 3*maxFragment + 17}
	for i, size := range sizes {
		p.ok("recv %d %d 0 %d", 100+i, rkey, 1<<20)
		sg := []verbsio.SGE{{Addr: src.Addr(), Length: uint32(size / 2), LKey: src.LKey()}, {Addr: src.Addr() + uintptr(size/2), Length: uint32(size - size/2), LKey: src.LKey()}}
		if err := n.qp.PostSend([]verbsio.SendWR{{WRID: uint64(i), Op: verbsio.OpSend, SG: sg, Signaled: true}}); err != nil {
			t.Fatal(err)
		}
		if c := waitOne(t, n.scq, 5*time.Second); c.Status != verbsio.StatusSuccess {
			t.Fatalf("send %d: %+v", size, c)
		}
		got := p.do("wait 1 5000")
		if want := fmt.Sprintf("comp %d 0 %d %d 0 false", 100+i, verbsio.OpRecv, size); len(got) != 1 || got[0] != want {
			t.Fatalf("size %d: %q, want %q", size, got, want)
		}
		if c := p.one("crc", "crc %d 0 %d", rkey, size); c[0] != strconv.FormatUint(uint64(crc32.ChecksumIEEE(b[:size])), 10) {
			t.Errorf("size %d: payload differs", size)
		}
	}
	// A send that arrives before its receive waits for it.
	if err := n.qp.PostSend([]verbsio.SendWR{{WRID: 9, Op: verbsio.OpSend, SG: []verbsio.SGE{{Addr: src.Addr(), Length: 10, LKey: src.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	p.ok("recv 200 %d 0 5", rkey) // too small: local length error
	got := p.do("wait 1 5000")
	if want := fmt.Sprintf("comp 200 %d %d 0 0 false", verbsio.StatusLocalLength, verbsio.OpRecv); len(got) != 1 || got[0] != want {
		t.Fatalf("short receive: %q, want %q", got, want)
	}
}

// TestHostileWrites: a wrong key, out-of-bounds ranges, a region without
// remote write and a deregistered region all fail at the sender with
// StatusRemoteAccess and leave the target untouched.
func TestHostileWrites(t *testing.T) {
	for _, mech := range []Mechanism{MechVM, MechSHM} {
		t.Run(mech.String(), func(t *testing.T) {
			n, p := pair(t, mech)
			src, err := n.register("anon", 1<<16, verbsio.AccessLocalWrite, 0x11)
			if err != nil {
				t.Fatal(err)
			}
			const size = 1 << 16
			f := p.one("mr", "reg memfd %d %d %d", size, rw, guard)
			addr, rkey := atoi(t, f[0]), atoi(t, f[1])
			f = p.one("mr", "reg memfd %d %d %d", size, verbsio.AccessLocalWrite|verbsio.AccessRemoteRead, guard)
			roAddr, roKey := atoi(t, f[0]), atoi(t, f[1])
			f = p.one("mr", "reg memfd %d %d %d", size, rw, guard)
			goneAddr, goneKey := atoi(t, f[0]), atoi(t, f[1])
			// The region works once, so its file is mapped here, then it goes.
			write := func(raddr, rk uint64, length int) verbsio.Completion {
				t.Helper()
				err := n.qp.PostSend([]verbsio.SendWR{{WRID: 1, Op: verbsio.OpWrite, Signaled: true, RemoteAddr: raddr, RKey: uint32(rk),
					SG: []verbsio.SGE{{Addr: src.Addr(), Length: uint32(length), LKey: src.LKey()}}}})
				if err != nil {
					t.Fatal(err)
				}
				return waitOne(t, n.scq, 5*time.Second)
			}
			if c := write(goneAddr, goneKey, 64); c.Status != verbsio.StatusSuccess {
				t.Fatalf("write before deregistration: %+v", c)
			}
			p.ok("dereg %d", goneKey)
			cases := []struct {
				name        string
				addr, rkey  uint64
				length      int
				checkKey    uint64
				checkFilled bool
			}{
				{"wrong key", addr, rkey ^ 1<<slotBits, 64, rkey, true},
				{"past the end", addr + size - 32, rkey, 64, rkey, true},
				{"before the start", addr - 1, rkey, 64, rkey, true},
				{"wrapping", addr + 16, rkey, 1<<16 - 1, 0, false},
				{"no remote write", roAddr, roKey, 64, roKey, true},
				{"deregistered", goneAddr, goneKey, 64, 0, false},
			}
			for _, c := range cases {
				if c.name == "wrapping" {
					c.addr = ^uint64(0) - 8
				}
				if got := write(c.addr, c.rkey, c.length); got.Status != verbsio.StatusRemoteAccess {
					t.Errorf("%s: %+v, want remote access error", c.name, got)
				} else if !errors.Is(got.Status.Err(), verbsio.ErrRemoteAccess) || !errors.Is(lastError(n.qp), verbsio.ErrRemoteAccess) {
					t.Errorf("%s: error %v", c.name, lastError(n.qp))
				}
				if n.qp.State() != verbsio.QPError {
					t.Errorf("%s: state %s after a remote access error", c.name, n.qp.State())
				}
				if err := n.qp.PostSend([]verbsio.SendWR{{WRID: 8, Op: verbsio.OpWrite}}); !errors.Is(err, verbsio.ErrQPState) {
					t.Errorf("%s: posting in the error state: %v", c.name, err)
				}
				if c.checkFilled {
					if b := p.one("bad", "check %d 0 %d %d", c.checkKey, size, guard); b[0] != "-1" {
						t.Errorf("%s: target changed at +%s", c.name, b[0])
					}
				}
				if err := n.newQP(); err != nil {
					t.Fatal(err)
				}
				connect(t, n, p, p.one("ep", "newqp"))
			}
		})
	}
}

// TestPeerDies: a helper killed with SIGKILL fails the posted receives and
// the next writes with ErrPeerLost within a deadline.
func TestPeerDies(t *testing.T) {
	n, p := pair(t, MechAuto)
	buf, err := n.register("anon", 4096, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := p.one("mr", "reg anon 4096 %d 0", rw)
	addr, rkey := atoi(t, f[0]), atoi(t, f[1])
	if err := n.qp.PostRecv([]verbsio.RecvWR{{WRID: 42, SG: []verbsio.SGE{{Addr: buf.Addr(), Length: 4096, LKey: buf.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	fmt.Fprintln(p.in, "die")
	p.mu.Unlock()
	p.dead = true
	start := time.Now()
	c := waitOne(t, n.rcq, 5*time.Second)
	if c.WRID != 42 || c.Status != verbsio.StatusRetryExceeded || !errors.Is(c.Status.Err(), verbsio.ErrPeerLost) {
		t.Fatalf("posted receive after the peer died: %+v", c)
	}
	t.Logf("peer loss seen after %v", time.Since(start))
	err = n.qp.PostSend([]verbsio.SendWR{{WRID: 1, Op: verbsio.OpWrite, RemoteAddr: addr, RKey: uint32(rkey), SG: []verbsio.SGE{{Addr: buf.Addr(), Length: 8, LKey: buf.LKey()}}}})
	if err != nil {
		t.Fatalf("PostSend after peer loss: %v", err)
	}
	if c := waitOne(t, n.scq, 5*time.Second); c.Status == verbsio.StatusSuccess {
		t.Fatalf("write after peer loss: %+v", c)
	}
	if err := lastError(n.qp); !errors.Is(err, verbsio.ErrPeerLost) {
		t.Fatalf("lastError after peer loss: %v", err)
	}
	if err := n.qp.PostSend([]verbsio.SendWR{{WRID: 2, Op: verbsio.OpWrite}}); !errors.Is(err, verbsio.ErrQPState) || !errors.Is(err, verbsio.ErrPeerLost) {
		t.Fatalf("second PostSend after peer loss: %v", err)
	}
}

// loopback connects two queue pairs of this process (seams need it).
func loopback(t *testing.T, opts Options, override int) (a, b *node) {
	t.Helper()
	var err error
	if a, err = newNode(opts); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.close)
	if b, err = newNode(opts); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.close)
	a.qp.(*qp).pidOverride = override
	if errA := connectLocal(t, a, b); errA != nil {
		if override == 0 {
			t.Fatal(errA)
		}
		// Tests of a refused Connect read it back with lastError.
		a.qp.(*qp).lastErr.Store(&errA)
	}
	return a, b
}

// connectLocal connects the queue pairs of a and b; it returns a's error and
// fails the test on b's alone.
func connectLocal(t *testing.T, a, b *node) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- b.qp.Connect(ctx, a.qp.Endpoint()) }()
	errA := a.qp.Connect(ctx, b.qp.Endpoint())
	if errB := <-errc; errB != nil && errA == nil {
		t.Fatal(errB)
	}
	return errA
}

// noSuchPID is a process id above the kernel's limit.
func noSuchPID(t *testing.T) int {
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Skipf("cannot read pid_max: %v", err)
	}
	max, err := strconv.Atoi(string(b[:len(b)-1]))
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(max+1, 0); !errors.Is(err, syscall.ESRCH) {
		t.Skipf("pid %d unexpectedly answers: %v", max+1, err)
	}
	return max + 1
}

// TestCrossMemoryRefused: when the kernel refuses process_vm_writev, MechVM
// fails at Connect and MechAuto fails the write, both with ErrCrossMemory and
// the errno.
func TestCrossMemoryRefused(t *testing.T) {
	pid := noSuchPID(t)
	t.Run("vm", func(t *testing.T) {
		a, _ := loopback(t, Options{Mechanism: MechVM}, pid)
		err := lastError(a.qp)
		if !errors.Is(err, ErrCrossMemory) || !errors.Is(err, unix.ESRCH) {
			t.Fatalf("Connect: %v, want ErrCrossMemory and ESRCH", err)
		}
		if a.qp.State() != verbsio.QPInit {
			t.Fatalf("state %s after a failed Connect", a.qp.State())
		}
	})
	t.Run("auto", func(t *testing.T) {
		a, b := loopback(t, Options{Mechanism: MechAuto}, pid)
		src, err := a.register("anon", 4096, verbsio.AccessLocalWrite, 1)
		if err != nil {
			t.Fatal(err)
		}
		dst, err := b.register("anon", 4096, rw, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.qp.PostSend([]verbsio.SendWR{{Op: verbsio.OpWrite, RemoteAddr: uint64(dst.Addr()), RKey: dst.RKey(), SG: []verbsio.SGE{{Addr: src.Addr(), Length: 64, LKey: src.LKey()}}}}); err != nil {
			t.Fatal(err)
		}
		c := waitOne(t, a.scq, 5*time.Second)
		if c.Status != verbsio.StatusRemoteOperation {
			t.Fatalf("completion %+v", c)
		}
		if err := lastError(a.qp); !errors.Is(err, ErrCrossMemory) || !errors.Is(err, unix.ESRCH) {
			t.Fatalf("lastError %v", err)
		}
		if b.mems[dst.RKey()].b[0] != 0 {
			t.Fatal("target written")
		}
	})
}

// TestDeregisterWaitsForWrites: deregistration cannot finish while a peer
// announced a write in the region's counter.
func TestDeregisterWaitsForWrites(t *testing.T) {
	a, b := loopback(t, Options{DeregTimeout: 10 * time.Second}, 0)
	_ = a
	mr, err := b.register("memfd", 4096, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	p := b.pd.(*pd)
	idx := int(mr.RKey() & (tableSlots - 1))
	_, held, ok := readEntry(p.table, b.qp.(*qp).ctrMem, idx, true)
	if !ok {
		t.Fatal("entry not readable")
	}
	done := make(chan struct{})
	go func() { mr.Close(); close(done) }()
	select {
	case <-done:
		t.Fatal("deregistration did not wait for the announced write")
	case <-time.After(50 * time.Millisecond):
	}
	unhold(held)
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("deregistration did not finish after the write")
	}
	e, _, _ := readEntry(p.table, b.qp.(*qp).ctrMem, idx, false)
	if e.flags&flagValid != 0 {
		t.Fatal("entry still valid after Close")
	}
}

// TestWaitIdleBurnsNoCPU: a Wait with nothing to wait for sleeps after its
// spin.
func TestWaitIdleBurnsNoCPU(t *testing.T) {
	a, _ := loopback(t, Options{Spin: defaultSpin}, 0)
	var before, after unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &before)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	var c [4]verbsio.Completion
	n, err := a.rcq.Wait(ctx, c[:])
	if n != 0 || !errors.Is(err, verbsio.ErrTimeout) {
		t.Fatalf("Wait: %d, %v", n, err)
	}
	unix.Getrusage(unix.RUSAGE_SELF, &after)
	cpu := time.Duration(after.Utime.Nano()+after.Stime.Nano()-before.Utime.Nano()-before.Stime.Nano()) * time.Nanosecond
	if cpu > 100*time.Millisecond {
		t.Fatalf("an idle 300ms Wait used %v of CPU", cpu)
	}
	t.Logf("idle 300ms Wait used %v of CPU", cpu)
}

// TestCaps checks the advertisement against what the device does.
func TestCaps(t *testing.T) {
	n, _ := loopback(t, Options{}, 0)
	caps := n.dev.Caps()
	if caps.Provider != Name || !caps.WriteWithImmediate || caps.DMABuf || !caps.SameHostOnly {
		t.Fatalf("caps %+v", caps)
	}
	if _, err := n.pd.RegisterDMABuf(0, 0, 4096, 0, rw); !errors.Is(err, verbsio.ErrNotSupported) {
		t.Fatalf("RegisterDMABuf: %v", err)
	}
	if _, err := n.pd.CreateQP(verbsio.QPConfig{SendCQ: n.scq, RecvCQ: n.rcq, MaxSGE: caps.MaxSGE + 1}); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Fatalf("MaxSGE above the caps: %v", err)
	}
	infos, err := provider{}.Devices()
	if err != nil || len(infos) != 1 || infos[0].Name != deviceName {
		t.Fatalf("Devices: %v %v", infos, err)
	}
	if err := n.pd.Close(); !errors.Is(err, verbsio.ErrBusy) {
		t.Fatalf("closing a busy domain: %v", err)
	}
	if err := n.dev.Close(); !errors.Is(err, verbsio.ErrBusy) {
		t.Fatalf("closing a busy device: %v", err)
	}
	if _, err := n.pd.RegisterMemory(0x1000, 4096, rw); !errors.Is(err, verbsio.ErrLocalProtection) {
		t.Fatalf("registering unmapped memory: %v", err)
	}
	if _, err := n.pd.RegisterMemory(0x1000, 0, rw); !errors.Is(err, verbsio.ErrLocalLength) {
		t.Fatalf("registering nothing: %v", err)
	}
}

// TestFileDetection: memfd memory registers as file-backed, anonymous memory
// does not, and registerMemoryFD rejects a descriptor that does not map it.
func TestFileDetection(t *testing.T) {
	n, _ := loopback(t, Options{}, 0)
	mf, err := n.register("memfd", 1<<20, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	an, err := n.register("anon", 1<<20, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !mf.(*memoryRegion).FileBacked() || an.(*memoryRegion).FileBacked() {
		t.Fatalf("file-backed: memfd %v anon %v", mf.(*memoryRegion).FileBacked(), an.(*memoryRegion).FileBacked())
	}
	fdr := n.pd.(*pd)
	m := n.mems[mf.RKey()]
	mr, err := fdr.registerMemoryFD(offheap.Addr(m.b[4096:]), 4096, rw, m.fd, 4096)
	if err != nil {
		t.Fatal(err)
	}
	mr.Close()
	if _, err := fdr.registerMemoryFD(offheap.Addr(m.b), 4096, rw, m.fd, 8192); !errors.Is(err, errNotShared) {
		t.Fatalf("wrong offset: %v", err)
	}
	if _, err := fdr.registerMemoryFD(offheap.Addr(n.mems[an.RKey()].b), 4096, rw, m.fd, 0); !errors.Is(err, errNotShared) {
		t.Fatalf("anonymous memory: %v", err)
	}
}

// TestIdempotentClose closes every handle twice.
func TestIdempotentClose(t *testing.T) {
	n, _ := loopback(t, Options{}, 0)
	mr, err := n.register("anon", 4096, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if err := mr.Close(); err != nil {
			t.Fatal(err)
		}
		if err := n.qp.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if n.qp.State() != verbsio.QPClosed {
		t.Fatalf("state %s", n.qp.State())
	}
	if err := n.qp.PostSend(nil); !errors.Is(err, verbsio.ErrClosed) {
		t.Fatalf("PostSend after Close: %v", err)
	}
}

// TestRingFull sends more than the notification ring holds while the peer
// does not poll: the sender wakes the peer's progress and every SEND lands
// and completes, in order.
func TestRingFull(t *testing.T) {
	n, p := pair(t, MechAuto)
	const k, size = 40, maxFragment
	src, err := n.register("memfd", k*size, verbsio.AccessLocalWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	pattern(n.mems[src.RKey()].b, 9)
	f := p.one("mr", "reg memfd %d %d 0", k*size, verbsio.AccessLocalWrite)
	rkey := atoi(t, f[1])
	for i := 0; i < k; i++ {
		p.ok("recv %d %d %d %d", 500+i, rkey, i*size, size)
	}
	wrs := make([]verbsio.SendWR, k)
	for i := range wrs {
		wrs[i] = verbsio.SendWR{WRID: uint64(i), Op: verbsio.OpSend, Signaled: true, SG: []verbsio.SGE{{Addr: src.Addr() + uintptr(i*size), Length: size, LKey: src.LKey()}}}
	}
	if k*recordSize(size) <= ringData {
		t.Fatalf("%d sends of %d bytes fit the ring; the test needs more", k, size)
	}
	if err := n.qp.PostSend(wrs); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < k; i++ {
		if c := waitOne(t, n.scq, 10*time.Second); c.WRID != uint64(i) || c.Status != verbsio.StatusSuccess {
			t.Fatalf("send completion %d: %+v", i, c)
		}
	}
	got := p.do("wait %d 10000", k)
	if len(got) != k {
		t.Fatalf("%d receive completions: %q", len(got), got)
	}
	if c := p.one("crc", "crc %d 0 %d", rkey, k*size); c[0] != strconv.FormatUint(uint64(crc32.ChecksumIEEE(n.mems[src.RKey()].b)), 10) {
		t.Fatal("payloads differ")
	}
}

// TestFailedWriteTakesArrivalsFirst: a write that fails at this side
// (StatusRemoteAccess) moves the queue pair to the error state, but what
// the peer published before (here a write with immediate, as a peer's BYE
// SEND before it closes the region the write fails on) completes its
// posted receive first, as a NIC completes what arrived before its queue
// pair failed; only the receives after it are flushed.
func TestFailedWriteTakesArrivalsFirst(t *testing.T) {
	n, p := pair(t, MechAuto)
	dst, err := n.register("memfd", 1<<16, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	src, err := n.register("anon", 1<<16, verbsio.AccessLocalWrite, 0x22)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.qp.PostRecv([]verbsio.RecvWR{{WRID: 41}, {WRID: 42}}); err != nil {
		t.Fatal(err)
	}
	f := p.one("mr", "reg anon %d %d 0", 1<<16, verbsio.AccessLocalWrite)
	prk := atoi(t, f[1])
	// The peer's write with immediate is published in this side's ring;
	// nothing here polls it yet.
	if got := p.do("writeimm %d 0 64 %d %d %d", prk, dst.Addr(), dst.RKey(), 0xbeef); len(got) != 1 || !strings.HasPrefix(got[0], "comp 1 0 ") {
		t.Fatalf("peer's write with immediate: %q", got)
	}
	f = p.one("mr", "reg memfd %d %d %d", 1<<16, rw, guard)
	addr, rkey := atoi(t, f[0]), atoi(t, f[1])
	err = n.qp.PostSend([]verbsio.SendWR{{WRID: 9, Op: verbsio.OpWrite, Signaled: true, RemoteAddr: addr, RKey: uint32(rkey) ^ 1<<slotBits,
		SG: []verbsio.SGE{{Addr: src.Addr(), Length: 64, LKey: src.LKey()}}}})
	if err != nil {
		t.Fatal(err)
	}
	if c := waitOne(t, n.scq, 5*time.Second); c.Status != verbsio.StatusRemoteAccess {
		t.Fatalf("write with a wrong key: %+v, want a remote access error", c)
	}
	first := waitOne(t, n.rcq, 5*time.Second)
	if first.WRID != 41 || first.Status != verbsio.StatusSuccess || first.Op != verbsio.OpRecvImm || first.Imm != 0xbeef {
		t.Fatalf("the receive the peer's write arrived for: %+v, want WRID 41 completed with immediate 0xbeef", first)
	}
	if second := waitOne(t, n.rcq, 5*time.Second); second.WRID != 42 || second.Status == verbsio.StatusSuccess {
		t.Fatalf("the receive after it: %+v, want WRID 42 flushed", second)
	}
}

// TestWaitYields: with Config.Yield a Wait gives up its CPU between the
// polls of its spin (sched_yield), without it not once; either way it
// ends with its context.
func TestWaitYields(t *testing.T) {
	for _, yield := range []bool{false, true} {
		n, err := newNodeConfig(verbsio.Config{Yield: yield}, Options{Spin: defaultSpin})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(n.close)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		var c [4]verbsio.Completion
		k, err := n.rcq.Wait(ctx, c[:])
		cancel()
		if k != 0 || !errors.Is(err, verbsio.ErrTimeout) {
			t.Fatalf("Yield %v: Wait on nothing gave %d, %v", yield, k, err)
		}
		got := n.rcq.(*cq).spin.Stats().Yields
		if yield && got == 0 || !yield && got != 0 {
			t.Errorf("Config.Yield %v: the Wait yielded its CPU %d times", yield, got)
		}
		t.Logf("Config.Yield %v: %d yields in a Wait on nothing", yield, got)
	}
}

// TestReceiveCompletionOrder: a burst of writes with immediate completes
// in order and exactly once, whether a Wait takes a completion straight
// from the ring or from the queue (takes of 1 to 3 completions leave the
// rest of a drained batch queued, and a sleeping Wait leaves the draining
// to the queue pair's progress goroutine).
func TestReceiveCompletionOrder(t *testing.T) {
	n, p := pair(t, MechAuto)
	dst, err := n.register("memfd", 4096, rw, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := p.one("mr", "reg memfd 4096 %d 0", rw)
	const count = 20000
	recvs := make([]verbsio.RecvWR, 64)
	if err := n.qp.PostRecv(recvs); err != nil {
		t.Fatal(err)
	}
	done := make(chan []string, 1)
	go func() { done <- p.do("burst %s 8 %d %d %d", f[1], dst.Addr(), dst.RKey(), count) }()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var buf [3]verbsio.Completion
	next := uint32(0)
	for i := 0; next < count; i++ {
		k, err := n.rcq.Wait(ctx, buf[:1+i%3])
		if err != nil {
			t.Fatalf("after %d of %d immediates: %v", next, count, err)
		}
		for _, c := range buf[:k] {
			if c.Status != verbsio.StatusSuccess || c.Imm != next {
				t.Fatalf("completion %d: %+v, want immediate %d", next, c, next)
			}
			next++
		}
		if err := n.qp.PostRecv(recvs[:k]); err != nil {
			t.Fatal(err)
		}
		if i%1000 == 999 {
			time.Sleep(2 * time.Millisecond) // the peer runs ahead; the Wait after this one sleeps less often
		}
	}
	if got := <-done; len(got) != 0 {
		t.Fatalf("peer: %q", got)
	}
	if k, _ := n.rcq.Poll(buf[:]); k != 0 {
		t.Fatalf("%d completions after the last: %+v", k, buf[:k])
	}
}
