package ibverbs

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/ibvdiag"
	"github.com/gdrlink/gdrlink/verbsio"
)

// TestDecideGrants is the policy: grants only where the device has type 2
// windows and proved that it bounds them, unless forced (a testing knob)
// or turned off; every "no" says why.
func TestDecideGrants(t *testing.T) {
	type2 := windowFacts{Device: "mlx5_0", Type2: true, MaxMW: 1 << 20}
	with := func(b bounds, why string) windowFacts { f := type2; f.Bounds, f.Why = b, why; return f }
	for _, tc := range []struct {
		name   string
		f      windowFacts
		mode   windowMode
		grants bool
		why    string // a part of the reason; "" for none
	}{
		{"enforced", with(boundsEnforced, ""), windowsAuto, true, ""},
		{"enforced, forced", with(boundsEnforced, ""), windowsForce, true, ""},
		{"enforced, off", with(boundsEnforced, ""), windowsOff, false, "turned off"},
		{"no windows", windowFacts{Device: "siw0"}, windowsAuto, false, "no type 2 memory windows"},
		{"no windows, forced", windowFacts{Device: "siw0"}, windowsForce, false, "no type 2 memory windows"},
		{"broken", with(windowsBroken, "bind failed"), windowsAuto, false, "do not work: bind failed"},
		{"broken, forced", with(windowsBroken, "bind failed"), windowsForce, false, "do not work"},
		{"not enforced", with(boundsNotEnforced, "a write past landed"), windowsAuto, false, "does not enforce"},
		{"not enforced, forced", with(boundsNotEnforced, "a write past landed"), windowsForce, true, "do not keep a peer inside its range"},
		{"could not tell", with(boundsUnknown, "probe: timeout"), windowsAuto, false, "could not tell"},
		{"could not tell, forced", with(boundsUnknown, "probe: timeout"), windowsForce, true, "could not tell"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			grants, why := decideGrants(tc.f, tc.mode)
			if grants != tc.grants {
				t.Errorf("grants %v, want %v (%s)", grants, tc.grants, why)
			}
			if tc.why == "" && why != "" || !strings.Contains(why, tc.why) {
				t.Errorf("reason %q, want one with %q", why, tc.why)
			}
			if !grants && why == "" {
				t.Error("no grants and no reason")
			}
			if strings.Contains(tc.why, "no type 2") && !strings.Contains(why, verbsio.ErrNotSupported.Error()) {
				t.Errorf("reason %q does not say not supported", why)
			}
		})
	}
	for _, s := range []string{"", "auto", "force", "off"} {
		if m, err := parseWindowMode(s); err != nil || (s != "" && m.String() != s) {
			t.Errorf("parseWindowMode(%q) = %v, %v", s, m, err)
		}
	}
	if _, err := parseWindowMode("on"); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("parseWindowMode(on): %v", err)
	}
}

// openWindows opens the test device in window mode m, with the probe's
// cache emptied so that it runs again.
func openWindows(t *testing.T, m windowMode) *device {
	t.Helper()
	cfg := testConfig(t)
	probed.Clear()
	d, err := newProvider(withWindows(m)).openDevice(cfg)
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

// TestWindowProbe runs the bounds probe. On Soft-RoCE (rxe*) it must find
// that windows are not bounded (softroce/README.md), so the device gives
// no grants and says why; elsewhere it logs what it found. Caps.Grants
// agrees with whether regions implement verbsio.Granter.
func TestWindowProbe(t *testing.T) {
	d := openWindows(t, windowsAuto)
	start := time.Now()
	probed.Clear()
	f := d.windowFacts(windowsAuto)
	t.Logf("%s: type 2 windows %v (max_mw %d), bounds %d %q; probe took %v", d.ch.Device, f.Type2, f.MaxMW, f.Bounds, f.Why, time.Since(start))
	t.Logf("Caps.Grants %v, reason %q", d.Caps().Grants, d.GrantsReason())
	if dd, ok := ibvdiag.Of(d); !ok || dd.GrantsReason() != d.GrantsReason() {
		t.Errorf("ibvdiag does not report the grants reason")
	}
	if strings.HasPrefix(d.ch.Device, "rxe") {
		if !f.Type2 {
			t.Fatalf("%s lists no type 2 memory windows (rdma_rxe has them)", d.ch.Device)
		}
		if f.Bounds != boundsNotEnforced {
			t.Errorf("%s: probe found bounds %d (%q), want not enforced", d.ch.Device, f.Bounds, f.Why)
		}
		if d.Caps().Grants || !strings.Contains(d.GrantsReason(), "does not enforce") {
			t.Errorf("%s: Grants %v, reason %q", d.ch.Device, d.Caps().Grants, d.GrantsReason())
		}
	}
	pdi, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "pd", pdi)
	mem := mapMem(t, 4096)
	m, err := pdi.RegisterMemory(mem.addr(), len(mem), verbsio.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "mr", m)
	if _, ok := m.(verbsio.Granter); ok != d.Caps().Grants {
		t.Errorf("region implements Granter %v, Caps.Grants %v", ok, d.Caps().Grants)
	}
	if d := openWindows(t, windowsOff); d.Caps().Grants || !strings.Contains(d.GrantsReason(), "off") {
		t.Errorf("windows off: Grants %v, reason %q", d.Caps().Grants, d.GrantsReason())
	}
}

// TestGrants runs grants with windows forced (on Soft-RoCE they do not
// bound, but bind, admit and revoke): a write inside a grant lands, a
// write after Revoke is refused with a remote access error and leaves the
// target unchanged; 100 grant, write and revoke cycles reuse one window;
// the binds and invalidations never show in the caller's completions; a
// grant on a queue pair that is not connected, or outside the region, is
// refused; closing a region or a queue pair with live grants works.
func TestGrants(t *testing.T) {
	d := openWindows(t, windowsForce)
	if !d.Caps().Grants {
		t.Skipf("skipping: no grants even forced: %s", d.GrantsReason())
	}
	t.Logf("grants forced: reason %q", d.GrantsReason())
	l := newLoopPair(t, d, verbsio.QPConfig{MaxSendWR: 8, MaxRecvWR: 8})
	const size = 1 << 16
	tmem, smem := mapMem(t, size), mapMem(t, size)
	fill := func() {
		for i := range tmem {
			tmem[i] = 'G'
		}
	}
	for i := range smem {
		smem[i] = 'W'
	}
	// The target allows no remote access through its own rkey.
	tm, err := l.pd.RegisterMemory(tmem.addr(), size, verbsio.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "target", tm)
	sm, err := l.pd.RegisterMemory(smem.addr(), size, verbsio.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "source", sm)
	gr, ok := tm.(verbsio.Granter)
	if !ok {
		t.Fatal("region of a device with Caps.Grants does not implement Granter")
	}
	// Refused before any bind.
	if _, err := gr.Grant(tm.Addr()+size-100, 200, l.qp[1], 1); !errors.Is(err, verbsio.ErrBadAddress) {
		t.Errorf("grant past the region: %v", err)
	}
	if _, err := gr.Grant(tm.Addr(), 64, l.qp[1], -1); !errors.Is(err, verbsio.ErrBadConfig) {
		t.Errorf("grant for -1 writes with immediate: %v", err)
	}
	cq, err := d.CreateCQ(4)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "cq", cq)
	idle, err := l.pd.CreateQP(verbsio.QPConfig{SendCQ: cq, RecvCQ: cq, MaxSendWR: 4, MaxRecvWR: 4})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := gr.Grant(tm.Addr(), 64, idle, 1); !errors.Is(err, verbsio.ErrQPState) {
		t.Errorf("grant on a queue pair that is not connected: %v", err)
	}
	mustClose(t, "idle qp", idle)

	win := tm.Addr() + 4096
	write := func(l *loopPair, rkey uint32, at uintptr, n int) verbsio.Completion {
		t.Helper()
		if err := l.qp[0].PostSend([]verbsio.SendWR{{WRID: 7, Op: verbsio.OpWrite, Signaled: true,
			SG: []verbsio.SGE{{Addr: sm.Addr(), Length: uint32(n), LKey: sm.LKey()}}, RemoteAddr: uint64(at), RKey: rkey}}); err != nil {
			t.Fatal(err)
		}
		got, err := waitN(l.cq[0], 1, 60*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return got[0]
	}
	fill()
	g, err := gr.Grant(win, 4096, l.qp[1], 1)
	if err != nil {
		t.Fatal(err)
	}
	if g.RKey() == tm.RKey() {
		t.Errorf("grant rkey %#x is the region's", g.RKey())
	}
	if c := write(l, g.RKey(), win, 4096); c.Status != verbsio.StatusSuccess || c.WRID != 7 || c.Op != verbsio.OpWrite {
		t.Fatalf("write through the grant: %+v", c)
	}
	if tmem[4096] != 'W' || tmem[8191] != 'W' || tmem[4095] != 'G' || tmem[8192] != 'G' {
		t.Fatalf("write through the grant: bytes around it %q %q %q %q", tmem[4095], tmem[4096], tmem[8191], tmem[8192])
	}
	// The target side's completion queue saw the bind, but its caller sees
	// nothing.
	if n, err := l.cq[1].Poll(make([]verbsio.Completion, 4)); n != 0 || err != nil {
		t.Errorf("the grant's bind showed in the caller's completions: %d, %v", n, err)
	}
	if err := g.Revoke(); err != nil {
		t.Fatal(err)
	}
	if err := g.Revoke(); err != nil {
		t.Errorf("second Revoke: %v", err)
	}
	fill()
	if c := write(l, g.RKey(), win, 16); c.Status != verbsio.StatusRemoteAccess || !errors.Is(c.Status.Err(), verbsio.ErrRemoteAccess) {
		t.Errorf("write after Revoke: %+v, want a remote access error", c)
	}
	if tmem[4096] != 'G' {
		t.Error("write after Revoke changed the target")
	}
	if n, err := l.cq[1].Poll(make([]verbsio.Completion, 4)); n != 0 || err != nil {
		t.Errorf("the invalidation showed in the caller's completions: %d, %v", n, err)
	}
	// A grant on a queue pair in the error state is refused.
	time.Sleep(10 * time.Millisecond)
	if st := l.qp[1].State(); st == verbsio.QPError {
		if _, err := gr.Grant(win, 64, l.qp[1], 1); !errors.Is(err, verbsio.ErrQPState) {
			t.Errorf("grant on a queue pair in the error state: %v", err)
		}
	} else {
		t.Logf("target queue pair in state %s after the refused write", st)
	}

	// Cycles on a fresh pair (the refused write broke the first).
	l2 := newLoopPair(t, d, verbsio.QPConfig{MaxSendWR: 8, MaxRecvWR: 8})
	p2 := l2.pd.(*pd)
	tm2, err := l2.pd.RegisterMemory(tmem.addr(), size, verbsio.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	sm2, err := l2.pd.RegisterMemory(smem.addr(), size, verbsio.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer mustClose(t, "source 2", sm2)
	sm = sm2
	seen := map[uint32]bool{}
	for k := 0; k < 100; k++ {
		fill()
		g, err := tm2.(verbsio.Granter).Grant(win, 4096, l2.qp[1], 1)
		if err != nil {
			t.Fatalf("cycle %d: %v", k, err)
		}
		if seen[g.RKey()] && k < 256 {
			t.Errorf("cycle %d: rkey %#x given twice", k, g.RKey())
		}
		seen[g.RKey()] = true
		if c := write(l2, g.RKey(), win, 64); c.Status != verbsio.StatusSuccess || tmem[4096] != 'W' {
			t.Fatalf("cycle %d: write through %#x: %+v", k, g.RKey(), c)
		}
		if err := g.Revoke(); err != nil {
			t.Fatalf("cycle %d: revoke: %v", k, err)
		}
	}
	p2.wmu.Lock()
	windows, free := p2.windows, len(p2.free)
	p2.wmu.Unlock()
	if windows != 1 || free != 1 {
		t.Errorf("after 100 cycles the domain has %d windows, %d free; want one, reused", windows, free)
	}
	// Live grants end with their region and their queue pair.
	g1, err := tm2.(verbsio.Granter).Grant(win, 64, l2.qp[1], 0)
	if err != nil {
		t.Fatal(err)
	}
	g2, err := tm2.(verbsio.Granter).Grant(win+64, 64, l2.qp[0], 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := l2.qp[0].Close(); err != nil {
		t.Fatalf("closing a queue pair with a live grant: %v", err)
	}
	if err := g2.Revoke(); err != nil {
		t.Errorf("Revoke after the queue pair closed: %v", err)
	}
	if err := tm2.Close(); err != nil {
		t.Fatalf("closing a region with a live grant: %v", err)
	}
	if err := g1.Revoke(); err != nil {
		t.Errorf("Revoke after the region closed: %v", err)
	}
	if q := l2.qp[1].(*qp); q.reserve != windowReserve || q.depth != 8 || len(q.sends.buf) != 8+windowReserve {
		t.Errorf("queue pair depth %d, reserve %d, ring %d", q.depth, q.reserve, len(q.sends.buf))
	}
}
