package ibv

import (
	"errors"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestIncRKey(t *testing.T) {
	for in, want := range map[uint32]uint32{0x123400: 0x123401, 0x1234fe: 0x1234ff, 0x1234ff: 0x123400, 0xffffffff: 0xffffff00} {
		if got := IncRKey(in); got != want {
			t.Errorf("IncRKey(%#x) = %#x, want %#x", in, got, want)
		}
	}
}

// loopQPs is two RC queue pairs of one device connected to each other over
// its port 1 (the GID SOFTROCE_GID_INDEX or RDMA_GID_INDEX names on RoCE),
// sharing one completion queue.
type loopQPs struct {
	cq *CQ
	qp [2]*QP
}

func newLoopQPs(t *testing.T, c *Context, pd *PD) *loopQPs {
	t.Helper()
	return newLoop(t, c, pd, false)
}

// newLoop is newLoopQPs with RC queue pairs, or UC ones when uc is set.
func newLoop(t *testing.T, c *Context, pd *PD, uc bool) *loopQPs {
	t.Helper()
	pa, err := c.QueryPort(1)
	if err != nil {
		t.Fatal(err)
	}
	l := &loopQPs{}
	if l.cq, err = c.CreateCQ(64); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.cq.Close() })
	rtr := RTRAttr{MTU: min(pa.ActiveMTU, 1024), DLID: pa.LID, Port: 1, HopLimit: 1, MaxDestRdAtomic: 1, MinRNRTimer: 12}
	if pa.LinkLayer == LinkLayerEthernet {
		gidx := 1
		for _, v := range []string{os.Getenv("SOFTROCE_GID_INDEX"), os.Getenv("RDMA_GID_INDEX")} {
			if v != "" {
				if gidx, err = strconv.Atoi(v); err != nil {
					t.Fatalf("GID index %q: %v", v, err)
				}
				break
			}
		}
		e, err := c.QueryGID(1, gidx)
		if err != nil {
			t.Fatal(err)
		}
		rtr.Global, rtr.DGID, rtr.SGIDIndex = true, e.GID, gidx
	}
	for i := range l.qp {
		create := pd.CreateQP
		if uc {
			create = pd.CreateUCQP
		}
		q, err := create(l.cq, l.cq, QPCaps{MaxSendWR: 16, MaxRecvWR: 4, MaxSendSGE: 1, MaxRecvSGE: 1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { q.Close() })
		l.qp[i] = q
	}
	for i, q := range l.qp {
		access := AccessLocalWrite | AccessRemoteWrite | AccessRemoteRead
		if uc {
			access = AccessLocalWrite | AccessRemoteWrite
		}
		if err := q.ToInit(1, 0, access); err != nil {
			t.Fatal(err)
		}
		r := rtr
		r.DestQPN = l.qp[1-i].QPN()
		if err := q.ToRTR(r); err != nil {
			t.Fatal(err)
		}
		if err := q.ToRTS(RTSAttr{Timeout: 14, RetryCount: 6, RNRRetry: 6, MaxRdAtomic: 1}); err != nil {
			t.Fatal(err)
		}
	}
	return l
}

// post posts wr (with sges) on queue pair i and waits for its completion.
func (l *loopQPs) post(t *testing.T, i int, wr SendWR, sges ...SGE) WC {
	t.Helper()
	wr.Flags |= SendSignaled
	if _, err := l.qp[i].PostSend([]SendWR{wr}, sges); err != nil {
		t.Fatalf("post %+v: %v", wr, err)
	}
	wc := make([]WC, 1)
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		n, err := l.cq.Poll(wc)
		if err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			if wc[0].WRID != wr.WRID {
				t.Fatalf("completion of %d, want %d", wc[0].WRID, wr.WRID)
			}
			return wc[0]
		}
		time.Sleep(20 * time.Microsecond)
	}
	t.Fatalf("no completion for work request %d (opcode %d)", wr.WRID, wr.Opcode)
	return WC{}
}

// TestMemoryWindows binds a type 2 window over 4 KiB of a region that has
// no remote access of its own, writes inside it through the window's
// rkey from the other queue pair, invalidates it, and checks that a write
// after is refused with a remote access error and leaves the target
// unchanged; then runs 100 cycles of bind, write and invalidate on one
// window, which needs the window's rkey kept as each bind gives it.
func TestMemoryWindows(t *testing.T) {
	c := testDevice(t)
	attr, err := c.QueryDevice()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: device_cap_flags %#x, max_mw %d", c.Name(), attr.CapFlags, attr.MaxMW)
	if !attr.MemoryWindowsType2() {
		t.Skipf("skipping: %s has no type 2 memory windows", c.Name())
	}
	pd, err := c.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := pd.Close(); err != nil {
			t.Errorf("dealloc pd: %v", err)
		}
	})
	const size = 1 << 16
	mem, err := unix.Mmap(-1, 0, 2*size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	tgt, src := mem[:size], mem[size:]
	base := uintptr(unsafe.Pointer(&mem[0]))
	tmr, err := pd.RegMR(base, size, AccessLocalWrite|AccessMWBind)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tmr.Close() })
	smr, err := pd.RegMR(base+size, size, AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { smr.Close() })
	for i := range src {
		src[i] = 'W'
	}
	fill := func() {
		for i := range tgt {
			tgt[i] = 'G'
		}
	}
	fill()
	mw, err := pd.AllocMW()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := mw.Close(); err != nil || mw.Close() != nil {
			t.Errorf("dealloc mw: %v", err)
		}
	})
	if err := pd.Close(); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("dealloc of a domain with a window: %v", err)
	}
	win := uint64(base) + 4096
	bind := func(l *loopQPs) uint32 {
		t.Helper()
		rkey := mw.NextRKey()
		wc := l.post(t, 1, SendWR{WRID: 1, Opcode: WRBindMW, Bind: Bind{MW: mw, MR: tmr, RKey: rkey, Addr: win, Length: 4096, Access: AccessRemoteWrite}})
		if wc.Status != WCSuccess {
			t.Fatalf("bind: status %d", wc.Status)
		}
		mw.SetRKey(rkey)
		if mw.RKey() != rkey {
			t.Fatalf("window rkey %#x after SetRKey(%#x)", mw.RKey(), rkey)
		}
		return rkey
	}
	write := func(l *loopQPs, rkey uint32, at uint64, n int) WC {
		return l.post(t, 0, SendWR{WRID: 2, Opcode: WRWrite, NumSGE: 1, RemoteAddr: at, RKey: rkey},
			SGE{Addr: uint64(base + size), Length: uint32(n), LKey: smr.LKey()})
	}
	invalidate := func(l *loopQPs, rkey uint32) {
		t.Helper()
		if wc := l.post(t, 1, SendWR{WRID: 3, Opcode: WRLocalInv, InvRKey: rkey}); wc.Status != WCSuccess {
			t.Fatalf("local invalidate of %#x: status %d", rkey, wc.Status)
		}
	}

	l := newLoopQPs(t, c, pd)
	rkey := bind(l)
	if rkey == tmr.RKey() {
		t.Errorf("window rkey %#x is the region's", rkey)
	}
	if wc := write(l, rkey, win, 4096); wc.Status != WCSuccess {
		t.Fatalf("write inside the window: status %d", wc.Status)
	}
	if tgt[4096] != 'W' || tgt[8191] != 'W' || tgt[4095] != 'G' || tgt[8192] != 'G' {
		t.Fatalf("write inside the window: bytes around it %q %q %q %q", tgt[4095], tgt[4096], tgt[8191], tgt[8192])
	}
	invalidate(l, rkey)
	fill()
	if wc := write(l, rkey, win, 16); wc.Status != WCRemAccessErr {
		t.Errorf("write after the invalidation: status %d, want a remote access error (%d)", wc.Status, WCRemAccessErr)
	}
	if tgt[4096] != 'G' {
		t.Errorf("write after the invalidation changed the target")
	}

	// The refused write moved both queue pairs to the error state: a
	// fresh pair for the cycles.
	l = newLoopQPs(t, c, pd)
	for k := 0; k < 100; k++ {
		fill()
		rkey := bind(l)
		if wc := write(l, rkey, win, 64); wc.Status != WCSuccess || tgt[4096] != 'W' {
			t.Fatalf("cycle %d: write through %#x: status %d", k, rkey, wc.Status)
		}
		invalidate(l, rkey)
	}
	// A bind of a closed window never reaches C.
	other, err := pd.AllocMW()
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Close(); err != nil {
		t.Fatal(err)
	}
	before := c.Counters().Snapshot()
	if _, err := l.qp[1].PostSend([]SendWR{{Opcode: WRBindMW, Bind: Bind{MW: other, MR: tmr}}}, nil); !errors.Is(err, syscall.EBADF) {
		t.Errorf("bind of a closed window: %v", err)
	}
	if got := c.Counters().Snapshot().Sub(before); got.PostSend != 0 {
		t.Errorf("a bind of a closed window crossed into C: %+v", got)
	}
}
