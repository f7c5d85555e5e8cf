package ibverbs

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"syscall"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/verbsio"
)

// posted is one outstanding work request, kept so that completions (whose
// opcode is undefined on failure) report what was posted.
type posted struct {
	wrid     uint64
	op       verbsio.Opcode
	signaled bool
	// win is set on the provider's own binds and invalidations (grant.go):
	// their completions go to the goroutine waiting on win, never to the
	// caller.
	win *winOp
}

// ring is a fixed-capacity FIFO of outstanding work requests.
type ring struct {
	buf        []posted
	head, size int
}

func newRing(n int) ring { return ring{buf: make([]posted, n)} }

func (r *ring) free() int { return len(r.buf) - r.size }

func (r *ring) push(p posted) {
	r.buf[(r.head+r.size)%len(r.buf)] = p
	r.size++
}

func (r *ring) dropTail(n int) { r.size -= n }

func (r *ring) front() (posted, bool) {
	if r.size == 0 {
		return posted{}, false
	}
	return r.buf[r.head], true
}

func (r *ring) pop() {
	r.head = (r.head + 1) % len(r.buf)
	r.size--
}

type qp struct {
	d        *device
	pd       *pd
	q        *ibv.QP
	scq, rcq *cq
	psn      uint32
	caps     ibv.QPCaps

	mu    sync.Mutex
	state verbsio.QPState
	sends ring
	recvs ring
	wrs   []ibv.SendWR
	rwrs  []ibv.RecvWR
	sges  []ibv.SGE
	// depth is the caller's share of the send ring; the rest, reserve
	// slots, is kept for the provider's own binds and invalidations
	// (grant.go), internal of which are outstanding.
	depth, reserve, internal int
	// grants are the live grants given on this queue pair.
	grants map[*grant]struct{}
	// wmu serialises the provider's own binds and invalidations on this
	// queue pair, each posted and waited for; wseq numbers them.
	wmu  sync.Mutex
	wseq uint32
}

func (p *pd) CreateQP(cfg verbsio.QPConfig) (verbsio.QueuePair, error) {
	scq, ok1 := cfg.SendCQ.(*cq)
	rcq, ok2 := cfg.RecvCQ.(*cq)
	if !ok1 || !ok2 || scq == nil || rcq == nil {
		return nil, fmt.Errorf("%w: queue pair needs completion queues of the ibverbs provider", verbsio.ErrBadConfig)
	}
	if scq.d != p.d || rcq.d != p.d {
		return nil, fmt.Errorf("%w: completion queues of another device", verbsio.ErrBadConfig)
	}
	want := ibv.QPCaps{MaxSendWR: cfg.MaxSendWR, MaxRecvWR: cfg.MaxRecvWR, MaxSendSGE: cfg.MaxSGE, MaxRecvSGE: cfg.MaxSGE, MaxInline: cfg.MaxInline}
	if want.MaxSendWR == 0 {
		want.MaxSendWR = p.d.cfg.QueueDepth
	}
	if want.MaxRecvWR == 0 {
		want.MaxRecvWR = p.d.cfg.QueueDepth
	}
	if want.MaxSendSGE == 0 {
		want.MaxSendSGE, want.MaxRecvSGE = 1, 1
	}
	depth := want.MaxSendWR
	switch {
	case want.MaxSendWR < 0 || want.MaxRecvWR < 0 || want.MaxSendWR > p.d.attr.MaxQPWR || want.MaxRecvWR > p.d.attr.MaxQPWR:
		return nil, fmt.Errorf("%w: queue depth %d/%d, %s allows 1..%d", verbsio.ErrBadConfig, want.MaxSendWR, want.MaxRecvWR, p.d.ch.Device, p.d.attr.MaxQPWR)
	case want.MaxSendSGE < 0 || want.MaxSendSGE > p.d.attr.MaxSGE:
		return nil, fmt.Errorf("%w: %d SGEs per work request, %s allows %d", verbsio.ErrBadConfig, want.MaxSendSGE, p.d.ch.Device, p.d.attr.MaxSGE)
	case want.MaxInline < 0 || want.MaxInline > p.d.caps.MaxInline:
		return nil, fmt.Errorf("%w: inline size %d, %s allows %d", verbsio.ErrBadConfig, want.MaxInline, p.d.ch.Device, p.d.caps.MaxInline)
	}
	// Where regions give grants, a few send slots beyond the caller's
	// depth carry the binds and invalidations of memory windows.
	reserve := 0
	if p.d.grants {
		reserve = min(windowReserve, p.d.attr.MaxQPWR-want.MaxSendWR)
		want.MaxSendWR += reserve
	}
	if err := p.addChild(); err != nil {
		return nil, err
	}
	q, err := p.pd.CreateQP(scq.q, rcq.q, want)
	if err != nil {
		p.dropChild()
		return nil, wrap(err)
	}
	access := ibv.AccessLocalWrite | ibv.AccessRemoteWrite | ibv.AccessRemoteRead
	if err := q.ToInit(p.d.ch.Port.Num, p.d.cfg.PKeyIndex, access); err != nil {
		q.Close()
		p.dropChild()
		return nil, wrap(err)
	}
	caps := q.Caps()
	// The rings hold what we asked for: the device may grant more, but
	// then the caller's view of "queue full" follows its own request.
	depth = min(depth, caps.MaxSendWR-reserve)
	x := &qp{d: p.d, pd: p, q: q, scq: scq, rcq: rcq, psn: rand.Uint32() & 0xffffff, caps: caps,
		state: verbsio.QPInit, sends: newRing(depth + reserve), recvs: newRing(min(caps.MaxRecvWR, want.MaxRecvWR)),
		depth: depth, reserve: reserve, grants: map[*grant]struct{}{}}
	scq.attach(x, true, false)
	rcq.attach(x, false, true)
	return x, nil
}

// Endpoint implements verbsio.QueuePair.
func (q *qp) Endpoint() verbsio.Endpoint {
	e := endpointData{MTU: uint16(q.d.ch.MTU), QPN: q.q.QPN(), PSN: q.psn, LID: q.d.ch.Port.Attr.LID, GID: q.d.ch.GID.GID}
	if q.d.ch.Global {
		e.Flags |= epGlobal
	}
	return verbsio.Endpoint{Provider: Name, Host: q.d.host, Data: e.Append(make([]byte, 0, e.Len()))}
}

// Connect implements verbsio.QueuePair: INIT to RTR to RTS towards remote.
func (q *qp) Connect(ctx context.Context, remote verbsio.Endpoint) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%w: connect: %w", verbsio.ErrTimeout, err)
	}
	if remote.Provider != Name {
		return fmt.Errorf("%w: endpoint of provider %q, not %q", verbsio.ErrBadConfig, remote.Provider, Name)
	}
	e, err := parseEndpoint(remote.Data)
	if err != nil {
		return err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state != verbsio.QPInit {
		return fmt.Errorf("%w: connect on a queue pair in state %s", verbsio.ErrQPState, q.state)
	}
	cfg, ch := q.d.cfg, q.d.ch
	mtu := min(ch.MTU, int(e.MTU))
	global := ch.Global || e.Flags&epGlobal != 0
	if global && ch.GID.GID.IsZero() {
		return fmt.Errorf("%w: peer needs a global route and %s port %d has no GID", verbsio.ErrBadConfig, ch.Device, ch.Port.Num)
	}
	rtr := ibv.RTRAttr{DestQPN: e.QPN, RQPSN: e.PSN, MTU: mtu, Global: global, DGID: e.GID, SGIDIndex: ch.GID.Index,
		HopLimit: q.d.p.o.hopLimit, TClass: cfg.TrafficClass, DLID: e.LID, SL: cfg.SL, Port: ch.Port.Num,
		MaxDestRdAtomic: min(16, q.d.attr.MaxQPRdAtom), MinRNRTimer: q.d.p.o.minRNRTimer}
	if err := q.q.ToRTR(rtr); err != nil {
		return fmt.Errorf("%w: %w", verbsio.ErrBadConfig, err)
	}
	rts := ibv.RTSAttr{SQPSN: q.psn, Timeout: cfg.Timeout, RetryCount: q.d.retryCount(), RNRRetry: q.d.p.o.rnrRetry,
		MaxRdAtomic: min(16, q.d.attr.MaxQPInitRdAtom)}
	if err := q.q.ToRTS(rts); err != nil {
		q.q.ToError()
		q.state = verbsio.QPError
		return fmt.Errorf("%w: %w", verbsio.ErrBadConfig, err)
	}
	q.state = verbsio.QPReady
	return nil
}

// State implements verbsio.QueuePair. A ready queue pair asks the device,
// so a failure it has not yet reported through a completion shows too.
func (q *qp) State() verbsio.QPState {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state == verbsio.QPReady {
		if s, err := q.q.State(); err == nil && (s == ibv.QPSErr || s == ibv.QPSSQE) {
			q.state = verbsio.QPError
		}
	}
	return q.state
}

func (q *qp) usable(what string) error {
	switch q.state {
	case verbsio.QPReady:
		return nil
	case verbsio.QPClosed:
		return fmt.Errorf("%w: %s on a closed queue pair", verbsio.ErrClosed, what)
	}
	return fmt.Errorf("%w: %s on a queue pair in state %s", verbsio.ErrQPState, what, q.state)
}

var wrOpcode = [...]uint32{verbsio.OpWrite: ibv.WRWrite, verbsio.OpWriteImm: ibv.WRWriteImm, verbsio.OpSend: ibv.WRSend, verbsio.OpRead: ibv.WRRead}

// PostSend implements verbsio.QueuePair: the whole chain crosses into C once.
func (q *qp) PostSend(wrs []verbsio.SendWR) error {
	if len(wrs) == 0 {
		return nil
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if err := q.usable("post send"); err != nil {
		return err
	}
	if free := q.sendFree(); len(wrs) > free {
		return fmt.Errorf("%w: %d work requests, %d of %d send slots free", verbsio.ErrQueueFull, len(wrs), free, q.depth)
	}
	q.wrs, q.sges = q.wrs[:0], q.sges[:0]
	for i := range wrs {
		w := &wrs[i]
		if w.Op != verbsio.OpWrite && w.Op != verbsio.OpWriteImm && w.Op != verbsio.OpSend && w.Op != verbsio.OpRead {
			return fmt.Errorf("%w: work request %d: opcode %s on a send queue", verbsio.ErrNotSupported, i, w.Op)
		}
		if len(w.SG) > q.caps.MaxSendSGE {
			return fmt.Errorf("%w: work request %d has %d SGEs, the queue pair takes %d", verbsio.ErrLocalLength, i, len(w.SG), q.caps.MaxSendSGE)
		}
		var total uint64
		for _, s := range w.SG {
			total += uint64(s.Length)
		}
		if total > uint64(q.d.caps.MaxMessage) {
			return fmt.Errorf("%w: work request %d of %d bytes, the port carries at most %d", verbsio.ErrLocalLength, i, total, q.d.caps.MaxMessage)
		}
		flags := uint32(0)
		if w.Signaled {
			flags |= ibv.SendSignaled
		}
		if w.Inline {
			if w.Op == verbsio.OpRead {
				return fmt.Errorf("%w: work request %d: inline read", verbsio.ErrNotSupported, i)
			}
			if total > uint64(q.caps.MaxInline) {
				return fmt.Errorf("%w: work request %d: %d bytes inline, the queue pair takes %d", verbsio.ErrLocalLength, i, total, q.caps.MaxInline)
			}
			flags |= ibv.SendInline
		}
		q.wrs = append(q.wrs, ibv.SendWR{WRID: w.WRID, RemoteAddr: w.RemoteAddr, RKey: w.RKey, Imm: w.Imm,
			Opcode: wrOpcode[w.Op], Flags: flags, NumSGE: uint32(len(w.SG)), SGEOff: uint32(len(q.sges))})
		for _, s := range w.SG {
			q.sges = append(q.sges, ibv.SGE{Addr: uint64(s.Addr), Length: s.Length, LKey: s.LKey})
		}
	}
	for i := range wrs {
		q.sends.push(posted{wrid: wrs[i].WRID, op: wrs[i].Op, signaled: wrs[i].Signaled})
	}
	n, err := q.q.PostSend(q.wrs, q.sges)
	if err != nil {
		q.sends.dropTail(len(wrs) - n)
		return q.postErr(err, n, len(wrs))
	}
	return nil
}

// sendFree is how many send slots of the caller's depth are free (the
// provider's own binds and invalidations take reserve slots). Callers hold
// q.mu.
func (q *qp) sendFree() int { return q.depth - (q.sends.size - q.internal) }

func (q *qp) postErr(err error, n, total int) error {
	switch {
	case errors.Is(err, syscall.ENOMEM):
		return fmt.Errorf("%w: %w", verbsio.ErrQueueFull, err)
	case errors.Is(err, syscall.EINVAL):
		if s, qerr := q.q.State(); qerr == nil && s != ibv.QPSRTS && s != ibv.QPSRTR {
			q.state = verbsio.QPError
			return fmt.Errorf("%w: %w", verbsio.ErrQPState, err)
		}
		return fmt.Errorf("%w: device rejected work request %d of %d: %w", verbsio.ErrNotSupported, n, total, err)
	}
	return wrap(err)
}

// PostRecv implements verbsio.QueuePair: one crossing into C per chain.
// Receives may be posted before Connect.
func (q *qp) PostRecv(wrs []verbsio.RecvWR) error {
	if len(wrs) == 0 {
		return nil
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state != verbsio.QPInit {
		if err := q.usable("post receive"); err != nil {
			return err
		}
	}
	if len(wrs) > q.recvs.free() {
		return fmt.Errorf("%w: %d receives, %d of %d receive slots free", verbsio.ErrQueueFull, len(wrs), q.recvs.free(), len(q.recvs.buf))
	}
	q.rwrs, q.sges = q.rwrs[:0], q.sges[:0]
	for i := range wrs {
		w := &wrs[i]
		if len(w.SG) > q.caps.MaxRecvSGE {
			return fmt.Errorf("%w: receive %d has %d SGEs, the queue pair takes %d", verbsio.ErrLocalLength, i, len(w.SG), q.caps.MaxRecvSGE)
		}
		q.rwrs = append(q.rwrs, ibv.RecvWR{WRID: w.WRID, NumSGE: uint32(len(w.SG)), SGEOff: uint32(len(q.sges))})
		for _, s := range w.SG {
			q.sges = append(q.sges, ibv.SGE{Addr: uint64(s.Addr), Length: s.Length, LKey: s.LKey})
		}
	}
	for i := range wrs {
		q.recvs.push(posted{wrid: wrs[i].WRID, op: verbsio.OpRecv})
	}
	n, err := q.q.PostRecv(q.rwrs, q.sges)
	if err != nil {
		q.recvs.dropTail(len(wrs) - n)
		return q.postErr(err, n, len(wrs))
	}
	return nil
}

func (q *qp) sendHeadIs(wrid uint64) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	p, ok := q.sends.front()
	return ok && p.wrid == wrid
}

func (q *qp) recvHeadIs(wrid uint64) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	p, ok := q.recvs.front()
	return ok && p.wrid == wrid
}

// complete retires the work request a completion reports and returns its
// opcode. Sends complete in order, unsignaled ones silently with the next
// signaled one, so entries before the matching one are retired too: a
// successful completion matches the first signaled request with its ID (an
// unsignaled request never completes successfully), a failed one the first
// request with its ID (errors and flushes complete every request).
func (q *qp) complete(w *ibv.WC, recv bool, st verbsio.Status) verbsio.Opcode {
	q.mu.Lock()
	defer q.mu.Unlock()
	if st != verbsio.StatusSuccess && q.state == verbsio.QPReady {
		q.state = verbsio.QPError
	}
	if recv {
		q.recvs.pop0()
		if w.Opcode == ibv.WCRecvRDMAImm && st == verbsio.StatusSuccess {
			return verbsio.OpRecvImm
		}
		return verbsio.OpRecv
	}
	op := opOfWC(w.Opcode)
	for {
		p, ok := q.sends.front()
		if !ok {
			break
		}
		q.sends.pop()
		match := p.wrid == w.WRID && (p.signaled || st != verbsio.StatusSuccess)
		if p.win != nil {
			q.internal--
			if match {
				p.win.finishLocked(st)
			} else {
				// Retired by a later completion: cannot happen, for the
				// provider's own requests are all signaled; fail it rather
				// than leave its waiter to time out.
				p.win.finishLocked(verbsio.StatusGeneral)
			}
		}
		if match {
			op = p.op
			break
		}
	}
	return op
}

// pop0 pops the head if there is one.
func (r *ring) pop0() {
	if r.size > 0 {
		r.pop()
	}
}

// Close implements verbsio.QueuePair: the queue pair goes to the error
// state (outstanding requests flush), the grants given on it end (their
// windows are deallocated: no write can come through a queue pair in the
// error state, and none will be bound again), and it is destroyed.
// Idempotent.
func (q *qp) Close() error {
	q.mu.Lock()
	if q.state == verbsio.QPClosed {
		q.mu.Unlock()
		return nil
	}
	q.q.ToError()
	if q.state == verbsio.QPReady || q.state == verbsio.QPInit {
		q.state = verbsio.QPError
	}
	// Waiters on the provider's own requests learn now that they flushed,
	// without waiting for a completion nobody may poll once the queue
	// pair is gone.
	for i := 0; i < q.sends.size; i++ {
		if p := q.sends.buf[(q.sends.head+i)%len(q.sends.buf)]; p.win != nil {
			p.win.finishLocked(verbsio.StatusFlushed)
		}
	}
	gs := make([]*grant, 0, len(q.grants))
	for g := range q.grants {
		gs = append(gs, g)
	}
	q.mu.Unlock()
	var gerr error
	for _, g := range gs {
		gerr = errors.Join(gerr, g.end())
	}
	q.mu.Lock()
	if q.state == verbsio.QPClosed {
		q.mu.Unlock()
		return nil
	}
	if err := q.q.Close(); err != nil {
		q.mu.Unlock()
		return wrap(err)
	}
	q.state = verbsio.QPClosed
	q.mu.Unlock()
	// Pollers hold the queues' maps while they take q.mu: detach unlocked.
	q.scq.detach(q.q.QPN())
	q.rcq.detach(q.q.QPN())
	q.pd.dropChild()
	return gerr
}
