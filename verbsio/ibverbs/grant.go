package ibverbs

import (
	"errors"
	"fmt"
	"runtime"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Grants on ibverbs are type 2 memory windows. A grant is a window of the
// region's protection domain bound over exactly the granted range, with
// remote write, through the queue pair it is given on (a bind is a send
// work request there, and the device then admits writes through the
// window's rkey from that queue pair's peer only). Revoke invalidates the
// window with a local-invalidate work request on the same queue pair and
// waits for it to complete; the window then goes back to the domain's free
// list for the next grant, with a new rkey (ibv_inc_rkey's rule: the same
// 24-bit index, the next 8-bit key).
//
// Binds and invalidations are the provider's own work requests on the
// caller's queue pair: they take send slots reserved beyond the caller's
// depth, are always signaled, and their completions never reach the
// caller's Poll. The goroutine that posts one waits for it, polling the
// queue pair's send completion queue itself if need be (cq.drive), so a
// grant works whether or not anyone else is polling.
//
// What ibverbs grants do not do:
//   - count writes with immediate: a receive completion does not say
//     which rkey the write that consumed it came through, so Grant accepts
//     imms but the grant lasts until Revoke (or the region's or the queue
//     pair's Close). A grant given with imms 0 admits writes with
//     immediate as well as plain writes. The rendezvous protocol revokes
//     every grant when its request ends.
//   - close the region's own rkey: a region registered with remote write
//     keeps admitting writes through its own rkey. A caller that hands
//     out only grants registers its memory without remote write (windows
//     need only local write).
//   - bound a window where the device does not enforce one: Soft-RoCE
//     (rdma_rxe) checks a write through a window against the region under
//     it, not against the window. The device's probe finds that out at
//     open (probeWindows), and such a device gives no grants unless
//     GDRLINK_IBVERBS_WINDOWS=force says otherwise (for testing the window
//     path); GrantsReason says which.

// windowReserve is how many send slots a queue pair keeps beyond its
// caller's depth for binds and invalidations, where regions give grants.
// They are posted one at a time per queue pair (qp.wmu), so one would do;
// the second leaves room for an invalidation whose wait timed out.
const windowReserve = 2

// windowTimeout bounds the wait for a bind or an invalidation. A send
// queue stalled behind a request the peer never answers (a receiver not
// ready, retried forever) holds them up; past it the queue pair is moved
// to the error state, which ends every grant given on it.
var windowTimeout = 30 * time.Second

// The provider's own work requests carry IDs with this tag, so that the
// completion of one whose queue pair was closed meanwhile is still known
// as the provider's.
const (
	windowWRIDTag  = uint64(0x6d77_6772) << 32 // "mwgr"
	windowWRIDMask = uint64(0xffff_ffff) << 32
)

// opWindow is what qp.complete returns for the provider's own requests.
const opWindow verbsio.Opcode = 0xff

// winOp is one bind or invalidation the provider posted, waited for by the
// goroutine that posted it.
type winOp struct {
	done chan struct{}
	st   verbsio.Status
	fin  bool // guarded by the queue pair's mu
}

// finishLocked records the operation's status and wakes its waiter, once.
// Callers hold the queue pair's mu.
func (o *winOp) finishLocked(st verbsio.Status) {
	if o.fin {
		return
	}
	o.fin, o.st = true, st
	close(o.done)
}

// errWindowTimeout: a bind or invalidation did not complete in
// windowTimeout.
var errWindowTimeout = errors.New("memory window operation timed out")

// windowOp posts one bind or invalidation on q and waits for its
// completion. It returns the completion's status, or an error when the
// request could not be posted (the queue pair is not ready: ErrQPState,
// ErrClosed) or did not complete in windowTimeout (errWindowTimeout).
func (q *qp) windowOp(wr ibv.SendWR) (verbsio.Status, error) {
	q.wmu.Lock()
	defer q.wmu.Unlock()
	op := &winOp{done: make(chan struct{})}
	q.mu.Lock()
	if err := q.usable("grant"); err != nil {
		q.mu.Unlock()
		return 0, err
	}
	if q.internal >= q.reserve {
		q.mu.Unlock()
		return 0, fmt.Errorf("%w: queue pair %d has no send slot left for memory window binds (%d reserved)", verbsio.ErrQueueFull, q.q.QPN(), q.reserve)
	}
	q.wseq++
	wr.WRID = windowWRIDTag | uint64(q.wseq)
	wr.Flags |= ibv.SendSignaled
	q.sends.push(posted{wrid: wr.WRID, op: opWindow, signaled: true, win: op})
	q.internal++
	if _, err := q.q.PostSend([]ibv.SendWR{wr}, nil); err != nil {
		q.sends.dropTail(1)
		q.internal--
		err = q.postErr(err, 0, 1)
		q.mu.Unlock()
		return 0, err
	}
	q.mu.Unlock()
	deadline := time.Now().Add(windowTimeout)
	start := time.Now()
	pause := 10 * time.Microsecond
	for {
		select {
		case <-op.done:
			return op.st, nil
		default:
		}
		if err := q.scq.drive(); err != nil {
			return 0, err
		}
		select {
		case <-op.done:
			return op.st, nil
		default:
		}
		now := time.Now()
		if now.After(deadline) {
			return 0, fmt.Errorf("%w: queue pair %d, after %v", errWindowTimeout, q.q.QPN(), windowTimeout)
		}
		// Spin for the first tens of microseconds (a NIC binds in a few),
		// then sleep with growing pauses (adaptspin.Pause: a Go timer
		// under a millisecond would take a millisecond each, on every
		// grant of a device slower to bind, Soft-RoCE's).
		if now.Sub(start) < 50*time.Microsecond {
			runtime.Gosched()
			continue
		}
		adaptspin.Pause(pause)
		pause = min(2*pause, time.Millisecond)
	}
}

// fail moves q to the error state: no write of the peer lands through it
// after, and every request on it flushes.
func (q *qp) fail() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.q.ToError()
	if q.state == verbsio.QPReady || q.state == verbsio.QPInit {
		q.state = verbsio.QPError
	}
}

// takeWindow returns a window of the domain with no live bind: one from
// the free list, or a new one.
func (p *pd) takeWindow() (*ibv.MW, error) {
	p.wmu.Lock()
	if n := len(p.free); n > 0 {
		w := p.free[n-1]
		p.free[n-1] = nil
		p.free = p.free[:n-1]
		p.wmu.Unlock()
		return w, nil
	}
	p.windows++
	p.wmu.Unlock()
	w, err := p.pd.AllocMW()
	if err != nil {
		p.wmu.Lock()
		p.windows--
		p.wmu.Unlock()
		return nil, wrap(err)
	}
	return w, nil
}

// putWindow puts back a window whose invalidation completed.
func (p *pd) putWindow(w *ibv.MW) {
	p.wmu.Lock()
	p.free = append(p.free, w)
	p.wmu.Unlock()
}

// dropWindow deallocates a window whose state is not known to be unbound
// (its bind or invalidation failed, or its queue pair is gone), which also
// invalidates it.
func (p *pd) dropWindow(w *ibv.MW) error {
	if err := w.Close(); err != nil {
		return wrap(err)
	}
	p.wmu.Lock()
	p.windows--
	p.wmu.Unlock()
	return nil
}

// closeWindows deallocates the free windows, before the domain is.
func (p *pd) closeWindows() error {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	for len(p.free) > 0 {
		w := p.free[len(p.free)-1]
		if err := w.Close(); err != nil {
			return wrap(err)
		}
		p.free = p.free[:len(p.free)-1]
		p.windows--
	}
	return nil
}

// granterMR is a region of a device that gives grants: it implements
// verbsio.Granter.
type granterMR struct{ *mr }

// grant is a window bound over one range of a region through one queue
// pair (verbsio.Grant).
type grant struct {
	m    *mr
	q    *qp
	w    *ibv.MW
	rkey uint32

	mu    chan struct{} // a one-slot lock: held while the grant ends
	ended bool
}

// Grant implements verbsio.Granter with a type 2 memory window bound over
// [addr, addr+length) with remote write through qp, which must be
// connected (a bind is a send work request). It returns once the bind has
// completed, so the peer's first write finds the window bound whichever
// queue pair told it the rkey. imms is checked but not counted (see the
// package's notes above): the grant lasts until Revoke.
func (g *granterMR) Grant(addr uintptr, length int, to verbsio.QueuePair, imms int) (verbsio.Grant, error) {
	m := g.mr
	q, ok := to.(*qp)
	switch {
	case !ok || q == nil || q.pd != m.p:
		return nil, fmt.Errorf("%w: a grant needs a queue pair of the region's ibverbs protection domain", verbsio.ErrBadConfig)
	case imms < 0:
		return nil, fmt.Errorf("%w: grant for %d writes with immediate", verbsio.ErrBadConfig, imms)
	case length <= 0 || addr < m.Addr() || uint64(addr-m.Addr())+uint64(length) > uint64(m.Len()):
		return nil, fmt.Errorf("%w: grant of [%#x+%d) outside region [%#x+%d)", verbsio.ErrBadAddress, addr, length, m.Addr(), m.Len())
	case m.access&verbsio.AccessLocalWrite == 0:
		return nil, fmt.Errorf("%w: region lkey %#x has access %v; a grant to write it needs %v", verbsio.ErrLocalProtection, m.LKey(), m.access, verbsio.AccessLocalWrite)
	}
	m.gmu.RLock()
	defer m.gmu.RUnlock()
	if m.closing {
		return nil, fmt.Errorf("%w: memory region", verbsio.ErrClosed)
	}
	w, err := m.p.takeWindow()
	if err != nil {
		return nil, fmt.Errorf("memory window for a grant on %s: %w", m.p.d.ch.Device, err)
	}
	rkey := w.NextRKey()
	st, err := q.windowOp(ibv.SendWR{Opcode: ibv.WRBindMW, Bind: ibv.Bind{MW: w, MR: m.m, RKey: rkey,
		Addr: uint64(addr), Length: uint64(length), Access: ibv.AccessRemoteWrite}})
	if err == nil && st != verbsio.StatusSuccess {
		err = fmt.Errorf("%w: binding a memory window on queue pair %d completed with %s", st.Err(), q.q.QPN(), st)
		if st == verbsio.StatusFlushed {
			err = fmt.Errorf("%w: %w", verbsio.ErrQPState, err)
		}
	}
	if err != nil {
		if errors.Is(err, errWindowTimeout) {
			// The bind may still run: make sure nothing comes through it.
			q.fail()
			err = fmt.Errorf("%w: %w", verbsio.ErrTimeout, err)
		}
		// Its state is not known: never bind it again.
		if derr := m.p.dropWindow(w); derr != nil {
			err = errors.Join(err, derr)
		}
		return nil, err
	}
	w.SetRKey(rkey)
	gr := &grant{m: m, q: q, w: w, rkey: rkey, mu: make(chan struct{}, 1)}
	m.gl.Lock()
	m.grants[gr] = struct{}{}
	m.gl.Unlock()
	q.mu.Lock()
	closed := q.state == verbsio.QPClosed
	if !closed {
		q.grants[gr] = struct{}{}
	}
	q.mu.Unlock()
	if closed {
		// The queue pair closed while the bind completed: it did not see
		// this grant.
		_ = gr.end()
		return nil, fmt.Errorf("%w: queue pair %d", verbsio.ErrClosed, q.q.QPN())
	}
	return gr, nil
}

// RKey implements verbsio.Grant: the window's rkey of this bind.
func (g *grant) RKey() uint32 { return g.rkey }

// Revoke implements verbsio.Grant: it invalidates the window through the
// queue pair it was bound on and waits for the invalidation to complete;
// the window then goes back to the domain's free list. Where the queue
// pair is in the error state (no write can come through it) or the
// invalidation fails, the window is deallocated instead, which invalidates
// it too. Where the invalidation does not complete in time, the queue pair
// is moved to the error state first, and the error says so. Idempotent.
func (g *grant) Revoke() error {
	g.mu <- struct{}{}
	defer func() { <-g.mu }()
	if g.ended {
		return nil
	}
	st, err := g.q.windowOp(ibv.SendWR{Opcode: ibv.WRLocalInv, InvRKey: g.rkey})
	if err == nil && st == verbsio.StatusSuccess {
		g.m.p.putWindow(g.w)
		g.forgetLocked()
		return nil
	}
	var rerr error
	if errors.Is(err, errWindowTimeout) {
		g.q.fail()
		rerr = fmt.Errorf("%w: invalidating grant %#x: %w; queue pair %d moved to the error state", verbsio.ErrTimeout, g.rkey, err, g.q.q.QPN())
	}
	// The queue pair is in the error state (its invalidation flushed, or
	// it could not be posted): the window admits nothing through it, and
	// deallocating it ends it for good.
	if derr := g.m.p.dropWindow(g.w); derr != nil {
		return errors.Join(rerr, fmt.Errorf("revoking grant %#x: %w", g.rkey, derr))
	}
	g.forgetLocked()
	return rerr
}

// end ends the grant of a queue pair that is closing (in the error state
// already): its window is deallocated. Idempotent.
func (g *grant) end() error {
	g.mu <- struct{}{}
	defer func() { <-g.mu }()
	if g.ended {
		return nil
	}
	if err := g.m.p.dropWindow(g.w); err != nil {
		return fmt.Errorf("ending grant %#x of a closed queue pair: %w", g.rkey, err)
	}
	g.forgetLocked()
	return nil
}

// forgetLocked marks the grant ended and takes it off its region's and
// its queue pair's lists. Callers hold g.mu.
func (g *grant) forgetLocked() {
	g.ended = true
	g.m.gl.Lock()
	delete(g.m.grants, g)
	g.m.gl.Unlock()
	g.q.mu.Lock()
	delete(g.q.grants, g)
	g.q.mu.Unlock()
}

// revokeAll revokes the region's live grants, before it is deregistered.
func (m *mr) revokeAll() error {
	m.gl.Lock()
	gs := make([]*grant, 0, len(m.grants))
	for g := range m.grants {
		gs = append(gs, g)
	}
	m.gl.Unlock()
	var errs error
	for _, g := range gs {
		errs = errors.Join(errs, g.Revoke())
	}
	return errs
}
