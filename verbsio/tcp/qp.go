package tcp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/crc32c"
	"github.com/gdrlink/gdrlink/internal/ctxerr"
	"github.com/gdrlink/gdrlink/internal/jobauth"
	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// qp is a reliable-connected queue pair over one or more TCP connections
// ("lanes") to the peer's queue pair, in each direction: the lanes this
// side dials carry its requests and the peer's responses; the lanes the
// peer dials carry the peer's requests and this side's responses.
//
// Ordering is that of a verbs queue pair: one sequencer goroutine sends the
// work requests in post order on lane 0; a striped write sends its stripes
// on every lane and waits for their acknowledgements before the next work
// request (and, for a write with immediate, before the zero-length frame
// that carries the immediate on lane 0), so whatever follows a write on
// lane 0 finds its bytes in place. Completions are delivered in post order.
type qp struct {
	pd       *pd
	dev      *device
	scq, rcq *cq
	id       uint32
	// quietTimer lowers the marks of lanes left quiet (poll.go's
	// quietCheck); quietArmed says it runs; quietMu guards the timer
	// and quietDone (Close: arm it no more).
	quietTimer *time.Timer
	quietArmed atomic.Bool
	quietMu    sync.Mutex
	quietDone  bool
	nonce      uint64
	// sumWrites: receive completions of writes with immediate carry the
	// CRC-32C of their payload (ChecksumWrites).
	sumWrites atomic.Bool
	maxSend   int
	maxRecv   int
	maxSGE    int
	inline    int
	lanes     int

	// recvMu serializes the inbound operations that consume a posted
	// receive, so receives complete in the order they were posted.
	recvMu sync.Mutex

	mu         sync.Mutex
	state      verbsio.QPState
	why        error
	connecting bool
	remote     *endpointData
	out        []*outLane
	in         map[net.Conn]*inLane
	// The lanes a polling CompletionQueue.Wait reads (see poll.go).
	inLanes      atomic.Pointer[[]*inLane]
	outLanes     atomic.Pointer[[]*outLane]
	polledFrames atomic.Int64 // requests a polling waiter applied
	impliedAcks  atomic.Int64 // requests (flagNoAck) a later response completed
	// sending: a PostSend or the sequencer is writing to lane 0; rest is
	// what a PostSend's write left for the sequencer.
	sending    bool
	rest       net.Buffers
	inlineHdrs []byte
	// inlineBatch and inlineBufs are PostSend's own write's (under
	// sending, as inlineHdrs): reused, so that it allocates nothing.
	inlineBatch []*swr
	inlineBufs  net.Buffers
	// spent are completed work requests whose frames' write may not have
	// returned yet: reused once it has (doneSendingLocked).
	spent []*swr

	inCount   map[srcKey]int
	inWant    map[srcKey]int
	inReady   chan struct{}
	readyShut bool
	sq        []*swr // posted and not completed, in post order
	unsent    []*swr // the tail of sq the sequencer has not sent
	stop      bool   // a work request failed: send nothing more
	nextToken uint64
	rq        []*rwr
	rqTaken   bool // rq[0] is being filled by an inbound operation
	rqPosted  chan struct{}
	rqWaited  bool // a takeRecv holds rqPosted: PostRecv closes it
	kick      chan struct{}
	closing   chan struct{}
	lastBad   error // the last malformed frame seen from any peer
	wg        sync.WaitGroup
}

type srcKey struct {
	qp    uint32
	nonce uint64
}

// swr is a posted send work request.
type swr struct {
	wrid     uint64
	op       verbsio.Opcode
	signaled bool
	bufs     [][]byte
	n        int
	raddr    uint64
	rkey     uint32
	imm      uint32
	token    uint64
	sent     bool
	done     bool
	st       verbsio.Status
	stripes  int
	stripeCh chan struct{}
	// one is bufs' room for the usual single buffer; inl holds a small
	// inline payload (a larger one is allocated).
	one [1][]byte
	inl [swrInline]byte
}

// Posted work requests are reused once done, so that a post allocates none:
// a send work request once its completion is delivered (respond) and no
// write of lane 0 that may have carried it is still running (the peer's
// answer can overtake the return of the writev that sent the frame), and
// only one that no lane's goroutine can still look at (not striped); a
// receive once its taker completed it (finishRecv). Those of a queue pair
// that fails are left to the collector.
var swrs = sync.Pool{New: func() any { return new(swr) }}
var rwrs = sync.Pool{New: func() any { return new(rwr) }}

func getSwr() *swr {
	w := swrs.Get().(*swr)
	w.bufs = w.one[:0]
	return w
}

func putSwr(w *swr) {
	if w.stripeCh != nil {
		return
	}
	*w = swr{}
	swrs.Put(w)
}

func getRwr() *rwr {
	r := rwrs.Get().(*rwr)
	r.bufs = r.one[:0]
	return r
}

func putRwr(r *rwr) {
	*r = rwr{}
	rwrs.Put(r)
}

// swrInline is the largest inline payload a work request keeps in place:
// a control message of a protocol above fits.
const swrInline = 128

// rwr is a posted receive.
type rwr struct {
	wrid uint64
	bufs [][]byte
	n    int
	one  [1][]byte // bufs' room for the usual single buffer
}

// expect is a response an outbound lane waits for.
type expect struct {
	w      *swr
	token  uint64
	read   bool
	n      uint32
	stripe bool
	noAck  bool // sent with flagNoAck: a later response says it succeeded
}

// ackEvery: of so many requests in a row on a lane that nobody waits for
// (unsignaled writes, writes with immediate and sends), one asks for an
// acknowledgement, so that the send queue drains (inlineBatchLocked
// counts them in flight until it does: half of maxInlineInFlight leaves
// the next ones room while an acknowledgement travels).
const ackEvery = maxInlineInFlight / 2

type outLane struct {
	lane
	mu   sync.Mutex
	fifo []expect
	// unacked counts the requests sent with flagNoAck since the
	// last that asked for an acknowledgement (the sender's: one at a
	// time, q.sending).
	unacked int
	jobs    chan net.Buffers
}

// popFront drops the first element of the queue s (clearing it). A short
// queue moves its elements down rather than slicing past the first, so
// that its array keeps its room: a queue that stays short (a ping-pong, a
// few work requests in flight) allocates nothing.
func popFront[T any](s []T) []T {
	var zero T
	if len(s) <= 8 {
		copy(s, s[1:])
		s[len(s)-1] = zero
		return s[:len(s)-1]
	}
	s[0] = zero
	return s[1:]
}

// dropFront drops the first k elements of the queue s, moving the rest
// down, so that its array keeps its room.
func dropFront[T any](s []T, k int) []T {
	n := copy(s, s[k:])
	clear(s[n:])
	return s[:n]
}

func (l *outLane) expect(e expect) {
	l.mu.Lock()
	l.fifo = append(l.fifo, e)
	l.mu.Unlock()
}

func newQP(p *pd, cfg verbsio.QPConfig) (*qp, error) {
	d := p.dev
	scq, ok1 := cfg.SendCQ.(*cq)
	rcq, ok2 := cfg.RecvCQ.(*cq)
	if !ok1 || !ok2 || scq == nil || rcq == nil || scq.dev != d || rcq.dev != d {
		return nil, fmt.Errorf("%w: queue pair needs completion queues of the same tcp device", verbsio.ErrBadConfig)
	}
	q := &qp{pd: p, dev: d, scq: scq, rcq: rcq, nonce: rand.Uint64(), lanes: d.opt.Lanes,
		maxSend: cfg.MaxSendWR, maxRecv: cfg.MaxRecvWR, maxSGE: cfg.MaxSGE, inline: cfg.MaxInline,
		in: map[net.Conn]*inLane{}, inCount: map[srcKey]int{}, inWant: map[srcKey]int{},
		inReady: make(chan struct{}), rqPosted: make(chan struct{}), kick: make(chan struct{}, 1), closing: make(chan struct{})}
	if q.maxSend == 0 {
		q.maxSend = d.cfg.QueueDepth
	}
	if q.maxRecv == 0 {
		q.maxRecv = d.cfg.QueueDepth
	}
	if q.maxSGE == 0 {
		q.maxSGE = 1
	}
	switch {
	case q.maxSend < 1 || q.maxSend > 65536 || q.maxRecv < 1 || q.maxRecv > 65536:
		return nil, fmt.Errorf("%w: queue depths %d/%d, want 1..65536", verbsio.ErrBadConfig, q.maxSend, q.maxRecv)
	case q.maxSGE < 0 || q.maxSGE > 16:
		return nil, fmt.Errorf("%w: %d SGEs per work request, want 1..16", verbsio.ErrBadConfig, q.maxSGE)
	case q.inline < 0 || q.inline > maxInline:
		return nil, fmt.Errorf("%w: inline size %d, want 0..%d", verbsio.ErrBadConfig, q.inline, maxInline)
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, fmt.Errorf("%w: tcp device", verbsio.ErrClosed)
	}
	for {
		d.nextQP++
		if _, used := d.qps[d.nextQP]; d.nextQP != 0 && !used {
			break
		}
	}
	q.id = d.nextQP
	d.qps[q.id] = q
	d.mu.Unlock()
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		d.mu.Lock()
		delete(d.qps, q.id)
		d.mu.Unlock()
		return nil, fmt.Errorf("%w: protection domain", verbsio.ErrClosed)
	}
	p.qps[q] = struct{}{}
	p.mu.Unlock()
	for _, c := range []*cq{scq, rcq} {
		c.mu.Lock()
		c.refs++
		c.mu.Unlock()
		c.qps.Add(q)
	}
	return q, nil
}

// Endpoint is what the peer needs to connect: this device's address, the
// queue pair's number and a nonce that a stale or forged hello lacks.
func (q *qp) Endpoint() verbsio.Endpoint {
	e := endpointData{lanes: uint8(q.lanes), qp: q.id, nonce: q.nonce, addr: q.dev.addr}
	return verbsio.Endpoint{Provider: Name, Host: q.dev.host, Data: e.Append(nil)}
}

// State is the queue pair's state.
func (q *qp) State() verbsio.QPState {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.state
}

// Connect dials the peer's lanes, waits for the peer's lanes to arrive and
// makes the queue pair ready. Without a deadline in ctx it gives up after
// Config.ConnectTimeout. A peer that does not prove the job key (or that
// requires one this device lacks) fails it at once with an error wrapping
// jobauth.ErrRefused.
func (q *qp) Connect(ctx context.Context, remote verbsio.Endpoint) error {
	if remote.Provider != Name {
		return fmt.Errorf("%w: endpoint of provider %q given to a tcp queue pair", verbsio.ErrBadConfig, remote.Provider)
	}
	ep, err := parseEndpointData(remote.Data)
	if err != nil {
		return err
	}
	q.mu.Lock()
	if q.state != verbsio.QPInit || q.connecting {
		st := q.state
		q.mu.Unlock()
		return fmt.Errorf("%w: Connect on a queue pair in state %v", verbsio.ErrQPState, st)
	}
	q.connecting = true
	q.remote = &ep
	q.checkInReadyLocked()
	q.mu.Unlock()

	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, q.dev.cfg.ConnectTimeout)
		defer cancel()
	}
	lanes := make([]*outLane, 0, q.lanes)
	abort := func(err error) error {
		for _, l := range lanes {
			q.dev.closeLane(l.c)
		}
		q.fail(err, false)
		return err
	}
	for i := 0; i < q.lanes; i++ {
		c, err := q.dev.dial(ctx, ep.addr, hello{lane: uint8(i), lanes: uint8(q.lanes), dstQP: ep.qp, dstNonce: ep.nonce, srcQP: q.id, srcNonce: q.nonce})
		if err != nil {
			if errors.Is(err, jobauth.ErrRefused) && !peerLost(err) && ctx.Err() == nil {
				// Not a lost peer: one that does not hold this job's
				// key. (A handshake cut short wraps both.)
				return abort(fmt.Errorf("tcp: connecting lane %d to %s: %w", i, ep.addr, err))
			}
			return abort(fmt.Errorf("%w: tcp: connecting lane %d to %s: %w", ctxerr.Sentinel(ctx, verbsio.ErrPeerLost), i, ep.addr, err))
		}
		q.dev.addLane(c)
		l := &outLane{}
		l.init(c)
		lanes = append(lanes, l)
	}
	select {
	case <-q.inReady:
	case <-ctx.Done():
		return abort(fmt.Errorf("%w: tcp: peer queue pair %d at %s did not connect back: %w", verbsio.ErrTimeout, ep.qp, ep.addr, ctx.Err()))
	case <-q.closing:
		return abort(fmt.Errorf("%w: queue pair closed while connecting", verbsio.ErrClosed))
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state != verbsio.QPInit {
		for _, l := range lanes {
			q.dev.closeLane(l.c)
		}
		return fmt.Errorf("%w: queue pair %v while connecting: %w", verbsio.ErrQPState, q.state, q.why)
	}
	q.out = lanes
	q.outLanes.Store(&lanes)
	q.state = verbsio.QPReady
	for i, l := range lanes {
		q.wg.Add(1)
		go q.readResponses(l)
		if i > 0 {
			l.jobs = make(chan net.Buffers, 4)
			q.wg.Add(1)
			go q.laneWriter(l)
		}
	}
	q.wg.Add(1)
	go q.sequencer()
	return nil
}

// checkInReadyLocked closes inReady once every lane of the remote arrived.
func (q *qp) checkInReadyLocked() {
	if q.remote == nil || q.readyShut {
		return
	}
	k := srcKey{q.remote.qp, q.remote.nonce}
	if want := q.inWant[k]; want > 0 && q.inCount[k] >= want {
		q.readyShut = true
		close(q.inReady)
	}
}

// addInbound takes an accepted lane whose hello named this queue pair.
// Before Connect any peer holding the endpoint may connect (its requests are
// checked like any other); after, only the connected peer.
func (q *qp) addInbound(c net.Conn, h hello) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state == verbsio.QPError || q.state == verbsio.QPClosed {
		return false
	}
	k := srcKey{h.srcQP, h.srcNonce}
	if q.remote != nil && k != (srcKey{q.remote.qp, q.remote.nonce}) {
		return false
	}
	l := newInLane(c, k)
	q.in[c] = l
	q.setInLanesLocked()
	q.dev.addLane(c)
	q.inCount[k]++
	q.inWant[k] = int(h.lanes)
	q.checkInReadyLocked()
	q.wg.Add(1)
	go q.serve(l)
	return true
}

// PostSend checks the chain and queues it for the sequencer; a bad work
// request rejects the whole chain with an error naming it.
func (q *qp) PostSend(wrs []verbsio.SendWR) error {
	var few [4]*swr // a post of a few work requests allocates no list
	ws := few[:0]
	if len(wrs) > len(few) {
		ws = make([]*swr, 0, len(wrs))
	}
	ws = ws[:len(wrs)]
	for i := range wrs {
		w, err := q.prepare(&wrs[i])
		if err != nil {
			return fmt.Errorf("work request %d (wrid %d): %w", i, wrs[i].WRID, err)
		}
		ws[i] = w
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state != verbsio.QPReady {
		return fmt.Errorf("%w: PostSend on a queue pair in state %v: %v", verbsio.ErrQPState, q.state, q.why)
	}
	if len(q.sq)+len(ws) > q.maxSend {
		return fmt.Errorf("%w: %d outstanding + %d posted > send queue depth %d", verbsio.ErrQueueFull, len(q.sq), len(ws), q.maxSend)
	}
	for _, w := range ws {
		q.nextToken++
		w.token = q.nextToken
	}
	q.sq = append(q.sq, ws...)
	q.unsent = append(q.unsent, ws...)
	if !q.sending && !q.stop {
		if batch := q.inlineBatchLocked(); batch != nil {
			// Sent from this goroutine, as a NIC's doorbell would: no
			// hand-off to the sequencer while lane 0 is idle.
			q.sending = true
			q.mu.Unlock()
			rest, err := q.sendInline(batch)
			q.flushOwed()
			q.mu.Lock()
			switch {
			case err != nil:
				q.doneSendingLocked()
				q.failLocked(fmt.Errorf("%w: tcp: sending to the peer: %w", verbsio.ErrPeerLost, err), true)
				return nil
			case rest != nil:
				q.rest = rest // the sequencer writes it, then clears sending
			default:
				q.doneSendingLocked()
				if len(q.unsent) == 0 {
					return nil
				}
			}
		}
	}
	select {
	case q.kick <- struct{}{}:
	default:
	}
	return nil
}

// maxInlineBatch is the most bytes a PostSend writes itself;
// maxInlineInFlight the most work requests already sent and not completed
// with which it still does. It also sets ackEvery: at 8 one request in 4
// asked for an acknowledgement, a write(2) of the responder and a look
// and a drop of the requester's for every fourth message of a
// ping-pong; at 32 it is one in 16.
const (
	maxInlineBatch    = 64 << 10
	maxInlineInFlight = 32
)

// inlineBatchLocked takes the unsent work requests for PostSend to write
// itself when lane 0 is idle and few others are in flight, or returns nil
// when they are for the sequencer (a stream, a striped write, too many
// bytes, a lane without a descriptor). A few in flight are a protocol's
// exchange (a control message, then the write it announces): handing the
// second to the sequencer would cost a goroutine's wake-up per message.
func (q *qp) inlineBatchLocked() []*swr {
	if len(q.out) == 0 || q.out[0].rc == nil || len(q.unsent) > 16 || len(q.sq)-len(q.unsent) > maxInlineInFlight {
		// Many work requests still in flight: a stream, which the
		// sequencer's batched writes serve better than one write per
		// post.
		return nil
	}
	size := 0
	for _, w := range q.unsent {
		if q.striped(w) {
			return nil
		}
		size += w.n
	}
	if size > maxInlineBatch {
		return nil
	}
	batch := append(q.inlineBatch[:0], q.unsent...)
	q.inlineBatch = batch
	q.unsent = dropFront(q.unsent, len(q.unsent))
	for _, w := range batch {
		w.sent = true
	}
	return batch
}

// sendInline writes batch to lane 0 without waiting; what the socket did
// not take is returned for the sequencer. The caller set q.sending.
func (q *qp) sendInline(batch []*swr) (net.Buffers, error) {
	l0 := q.out[0]
	bufs := q.frames(l0, batch, &q.inlineHdrs, &q.inlineBufs)
	clear(batch) // the queue pair's lists hold them; this one is reused
	rest, err := l0.writeRaw(bufs)
	if len(rest) == 0 {
		rest = nil
	}
	return rest, err
}

// frames registers the responses batch expects on l and returns its frames
// (headers into *hdrs, payloads in place) in *scratch's array.
func (q *qp) frames(l *outLane, batch []*swr, hdrs *[]byte, scratch *net.Buffers) net.Buffers {
	clear(*scratch)
	bufs := (*scratch)[:0]
	if cap(*hdrs) < len(batch)*headerLen {
		*hdrs = make([]byte, 0, max(len(batch), 64)*headerLen)
	}
	h := (*hdrs)[:0]
	for _, w := range batch {
		hd := w.header(w.n)
		e := expect{w: w, token: w.token}
		if w.op == verbsio.OpRead {
			e.read, e.n = true, uint32(w.n)
		}
		if !w.signaled && !e.read && l.unacked < ackEvery-1 {
			hd.flags |= flagNoAck
			e.noAck = true
			l.unacked++
		} else {
			l.unacked = 0
		}
		l.expect(e)
		start := len(h)
		h = hd.Append(h)
		bufs = append(bufs, h[start:len(h):len(h)])
		if w.op != verbsio.OpRead {
			bufs = append(bufs, w.bufs...)
		}
	}
	*hdrs = h
	*scratch = bufs[:0]
	return bufs
}

func (q *qp) prepare(wr *verbsio.SendWR) (*swr, error) {
	w := getSwr()
	w.wrid, w.op, w.signaled, w.raddr, w.rkey = wr.WRID, wr.Op, wr.Signaled, wr.RemoteAddr, wr.RKey
	switch wr.Op {
	case verbsio.OpWrite, verbsio.OpSend, verbsio.OpRead:
	case verbsio.OpWriteImm:
		w.imm = wr.Imm
	default:
		return nil, fmt.Errorf("%w: opcode %v on a send queue", verbsio.ErrNotSupported, wr.Op)
	}
	if len(wr.SG) > q.maxSGE {
		return nil, fmt.Errorf("%w: %d SGEs, queue pair allows %d", verbsio.ErrLocalLength, len(wr.SG), q.maxSGE)
	}
	for _, s := range wr.SG {
		w.n += int(s.Length)
	}
	if w.n > maxPayload {
		return nil, fmt.Errorf("%w: %d bytes, at most %d per work request", verbsio.ErrLocalLength, w.n, maxPayload)
	}
	if wr.Inline {
		if wr.Op == verbsio.OpRead {
			return nil, fmt.Errorf("%w: inline read", verbsio.ErrNotSupported)
		}
		if w.n > q.inline {
			return nil, fmt.Errorf("%w: inline payload of %d bytes, queue pair allows %d", verbsio.ErrLocalLength, w.n, q.inline)
		}
		b := w.inl[:0]
		if w.n > len(w.inl) {
			b = make([]byte, 0, w.n)
		}
		for _, s := range wr.SG {
			b = append(b, offheap.Bytes(s.Addr, int(s.Length))...)
		}
		w.bufs = append(w.bufs, b)
		return w, nil
	}
	var need verbsio.Access
	if wr.Op == verbsio.OpRead {
		need = verbsio.AccessLocalWrite
	}
	for _, s := range wr.SG {
		b, err := q.pd.local(s, need)
		if err != nil {
			return nil, err
		}
		if len(b) > 0 {
			w.bufs = append(w.bufs, b)
		}
	}
	return w, nil
}

// PostRecv checks the chain and posts it; receives may be posted before
// Connect. A bad work request rejects the whole chain.
func (q *qp) PostRecv(wrs []verbsio.RecvWR) error {
	rs := make([]*rwr, len(wrs))
	for i, wr := range wrs {
		if len(wr.SG) > q.maxSGE {
			return fmt.Errorf("receive %d (wrid %d): %w: %d SGEs, queue pair allows %d", i, wr.WRID, verbsio.ErrLocalLength, len(wr.SG), q.maxSGE)
		}
		r := getRwr()
		r.wrid = wr.WRID
		for _, s := range wr.SG {
			b, err := q.pd.local(s, verbsio.AccessLocalWrite)
			if err != nil {
				return fmt.Errorf("receive %d (wrid %d): %w", i, wr.WRID, err)
			}
			if len(b) > 0 {
				r.bufs = append(r.bufs, b)
			}
			r.n += len(b)
		}
		rs[i] = r
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state != verbsio.QPInit && q.state != verbsio.QPReady {
		return fmt.Errorf("%w: PostRecv on a queue pair in state %v: %v", verbsio.ErrQPState, q.state, q.why)
	}
	if len(q.rq)+len(rs) > q.maxRecv {
		return fmt.Errorf("%w: %d posted + %d > receive queue depth %d", verbsio.ErrQueueFull, len(q.rq), len(rs), q.maxRecv)
	}
	q.rq = append(q.rq, rs...)
	if q.rqWaited {
		// Only a wait for a receive (takeRecv) needs the wake-up.
		close(q.rqPosted)
		q.rqPosted = make(chan struct{})
		q.rqWaited = false
	}
	return nil
}

// Close fails what is outstanding as flushed, closes the lanes and waits for
// the queue pair's goroutines. Idempotent.
func (q *qp) Close() error {
	q.mu.Lock()
	if q.state == verbsio.QPClosed {
		q.mu.Unlock()
		return nil
	}
	q.failLocked(fmt.Errorf("%w: queue pair closed", verbsio.ErrClosed), false)
	q.state = verbsio.QPClosed
	q.mu.Unlock()
	q.wg.Wait()
	q.quietMu.Lock()
	q.quietDone = true
	if q.quietTimer != nil {
		q.quietTimer.Stop()
	}
	q.quietMu.Unlock()
	q.dev.mu.Lock()
	delete(q.dev.qps, q.id)
	q.dev.mu.Unlock()
	q.pd.mu.Lock()
	delete(q.pd.qps, q)
	q.pd.mu.Unlock()
	q.pd.dropGrantsOf(q)
	for _, c := range []*cq{q.scq, q.rcq} {
		c.qps.Remove(q)
		c.mu.Lock()
		c.refs--
		c.mu.Unlock()
	}
	return nil
}

func (q *qp) fail(err error, peerGone bool) {
	q.mu.Lock()
	q.failLocked(err, peerGone)
	q.mu.Unlock()
}

// failLocked puts the queue pair in the error state: lanes closed, sent work
// requests completed with StatusRetryExceeded when the peer is gone (else
// flushed), the others and every posted receive flushed.
func (q *qp) failLocked(err error, peerGone bool) {
	if q.state == verbsio.QPError || q.state == verbsio.QPClosed {
		return
	}
	q.state, q.why = verbsio.QPError, err
	close(q.closing)
	for _, l := range q.out {
		q.dev.closeLane(l.c)
	}
	for c := range q.in {
		q.dev.closeLane(c)
	}
	var cs []verbsio.Completion
	for _, w := range q.sq {
		st := verbsio.StatusFlushed
		switch {
		case w.done:
			st = w.st
		case w.sent && peerGone:
			st = verbsio.StatusRetryExceeded
		}
		if st != verbsio.StatusSuccess || w.signaled {
			cs = append(cs, verbsio.Completion{WRID: w.wrid, Status: st, Op: w.op, QP: q})
		}
	}
	q.sq, q.unsent = nil, nil
	q.scq.push(cs...)
	cs = cs[:0]
	for _, r := range q.rq {
		cs = append(cs, verbsio.Completion{WRID: r.wrid, Status: verbsio.StatusFlushed, Op: verbsio.OpRecv, QP: q})
	}
	q.rq, q.rqTaken = nil, false
	q.rcq.push(cs...)
}

// respond records a response to one frame of w and delivers the completions
// that are now due, in post order.
func (q *qp) respond(e expect, st verbsio.Status) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state != verbsio.QPReady {
		return
	}
	w := e.w
	if st != verbsio.StatusSuccess {
		q.stop = true
		if w.st == verbsio.StatusSuccess {
			w.st = st
		}
	}
	if e.stripe {
		w.stripes--
		if w.stripes == 0 {
			close(w.stripeCh)
			if w.op == verbsio.OpWrite || w.st != verbsio.StatusSuccess {
				w.done = true
			}
		}
	} else {
		w.done = true
	}
	var few [4]verbsio.Completion // push copies them
	cs := few[:0]
	var failed *swr
	for len(q.sq) > 0 && q.sq[0].done {
		h := q.sq[0]
		q.sq = popFront(q.sq)
		if h.st != verbsio.StatusSuccess {
			cs = append(cs, verbsio.Completion{WRID: h.wrid, Status: h.st, Op: h.op, QP: q})
			failed = h
			break
		}
		if h.signaled {
			cs = append(cs, verbsio.Completion{WRID: h.wrid, Status: h.st, Op: h.op, QP: q})
		}
		if q.sending {
			// Its frame's write may not have returned yet.
			q.spent = append(q.spent, h)
		} else {
			putSwr(h)
		}
	}
	q.scq.push(cs...)
	if failed != nil {
		// As on a verbs queue pair, an error moves the queue pair to the
		// error state and flushes what follows.
		q.failLocked(fmt.Errorf("work request %d failed: %w", failed.wrid, failed.st.Err()), false)
	}
}

// sequencer sends posted work requests in order: those a PostSend left to
// it, and what a PostSend's own write did not get into the socket.
func (q *qp) sequencer() {
	defer q.wg.Done()
	var hdrs []byte
	var batch []*swr
	var scratch, wb net.Buffers
	for {
		select {
		case <-q.kick:
		case <-q.closing:
			return
		}
		for {
			q.mu.Lock()
			if q.state != verbsio.QPReady {
				q.mu.Unlock()
				break
			}
			l0 := q.out[0]
			if q.rest != nil {
				rest := q.rest
				q.rest = nil
				q.mu.Unlock()
				err := writeAll(l0.c, &wb, rest)
				q.mu.Lock()
				q.doneSendingLocked()
				q.mu.Unlock()
				if err != nil {
					q.fail(fmt.Errorf("%w: tcp: sending to the peer: %w", verbsio.ErrPeerLost, err), true)
					return
				}
				continue
			}
			if q.sending || q.stop || len(q.unsent) == 0 {
				q.mu.Unlock()
				break
			}
			// A batch of small work requests goes out in one writev; a
			// striped write goes alone.
			clear(batch)
			batch = batch[:0]
			size := 0
			for _, w := range q.unsent {
				if len(batch) == 64 || size >= 1<<20 {
					break
				}
				if q.striped(w) {
					if len(batch) == 0 {
						batch = append(batch, w)
					}
					break
				}
				batch = append(batch, w)
				size += w.n
			}
			q.unsent = dropFront(q.unsent, len(batch))
			for _, w := range batch {
				w.sent = true
			}
			q.sending = true
			q.mu.Unlock()
			var err error
			if len(batch) == 1 && q.striped(batch[0]) {
				err = q.sendStriped(batch[0])
			} else {
				err = writeAll(l0.c, &wb, q.frames(l0, batch, &hdrs, &scratch))
			}
			q.mu.Lock()
			q.doneSendingLocked()
			q.mu.Unlock()
			if err != nil {
				q.fail(fmt.Errorf("%w: tcp: sending to the peer: %w", verbsio.ErrPeerLost, err), true)
				return
			}
		}
	}
}

// doneSendingLocked ends a write to lane 0 (sending), and lets the work
// requests that completed meanwhile be reused: nothing reads them now.
func (q *qp) doneSendingLocked() {
	q.sending = false
	for i, w := range q.spent {
		putSwr(w)
		q.spent[i] = nil
	}
	q.spent = q.spent[:0]
}

// writeAll writes bufs to c (writev where c has a descriptor) through
// *w, the caller's (WriteTo takes its address: one made once allocates
// nothing per write).
func writeAll(c net.Conn, w *net.Buffers, bufs net.Buffers) error {
	*w = bufs
	_, err := w.WriteTo(c)
	*w = nil
	return err
}

func (w *swr) header(n int) header {
	h := header{token: w.token, length: uint32(n), raddr: w.raddr, rkey: w.rkey}
	switch w.op {
	case verbsio.OpWrite:
		h.op = opWrite
	case verbsio.OpWriteImm:
		h.op, h.imm, h.flags, h.total = opWriteImm, w.imm, flagLast, uint32(n)
	case verbsio.OpSend:
		h.op, h.raddr, h.rkey = opSend, 0, 0
	case verbsio.OpRead:
		h.op = opReadReq
	}
	return h
}

func (q *qp) striped(w *swr) bool {
	return len(q.out) > 1 && (w.op == verbsio.OpWrite || w.op == verbsio.OpWriteImm) && w.n >= q.dev.opt.StripeMin
}

// sendStriped sends w's bytes as one plain write per lane, waits until every
// stripe is acknowledged, then (write with immediate) sends the zero-length
// frame carrying the immediate on lane 0.
func (q *qp) sendStriped(w *swr) error {
	k := len(q.out)
	part := (w.n + k - 1) / k
	part = (part + 65535) &^ 65535
	q.mu.Lock()
	w.stripeCh = make(chan struct{})
	for off := 0; off < w.n; off += part {
		w.stripes++
	}
	q.mu.Unlock()
	var first net.Buffers
	for i, off := 0, 0; off < w.n; i, off = i+1, off+part {
		n := min(part, w.n-off)
		h := header{op: opWrite, token: w.token, length: uint32(n), raddr: w.raddr + uint64(off), rkey: w.rkey}
		bufs := append(net.Buffers{h.Append(nil)}, slices(w.bufs, off, n)...)
		l := q.out[i]
		l.expect(expect{w: w, token: w.token, stripe: true})
		if i == 0 {
			first = bufs
			continue
		}
		select {
		case l.jobs <- bufs:
		case <-q.closing:
			return nil
		}
	}
	if _, err := first.WriteTo(q.out[0].c); err != nil {
		return err
	}
	select {
	case <-w.stripeCh:
	case <-q.closing:
		return nil
	}
	if w.op != verbsio.OpWriteImm {
		return nil
	}
	q.mu.Lock()
	ok := w.st == verbsio.StatusSuccess && q.state == verbsio.QPReady
	q.mu.Unlock()
	if !ok {
		return nil
	}
	h := header{op: opWriteImm, flags: flagLast, token: w.token, raddr: w.raddr, rkey: w.rkey, imm: w.imm, total: uint32(w.n)}
	q.out[0].expect(expect{w: w, token: w.token})
	_, err := q.out[0].c.Write(h.Append(make([]byte, 0, headerLen)))
	return err
}

func (q *qp) laneWriter(l *outLane) {
	defer q.wg.Done()
	for {
		select {
		case b := <-l.jobs:
			if _, err := b.WriteTo(l.c); err != nil {
				q.fail(fmt.Errorf("%w: tcp: sending to the peer: %w", verbsio.ErrPeerLost, err), true)
				return
			}
		case <-q.closing:
			return
		}
	}
}

// readResponses reads the responses on an outbound lane, in request order,
// taking turns with a polling waiter (see poll.go).
func (q *qp) readResponses(l *outLane) {
	defer q.wg.Done()
	var hb [headerLen]byte
	var err error
	for err == nil {
		if l.rc != nil {
			if err = l.waitReadable(q.closing); err != nil {
				break
			}
			l.take()
			l.quietLocked(false)
		} else {
			l.rd.Lock()
		}
		for err == nil {
			if err = l.err; err != nil {
				break
			}
			if !l.ready() {
				break
			}
			if _, err = io.ReadFull(l.c, hb[:]); err != nil {
				break
			}
			var h header
			if h, err = parseHeader(hb[:]); err == nil {
				err = q.handleResponse(l, h)
			}
		}
		l.rd.Unlock()
	}
	if errors.Is(err, verbsio.ErrBadFrame) {
		q.mu.Lock()
		q.lastBad = err
		q.mu.Unlock()
		q.fail(fmt.Errorf("%w: %w", verbsio.ErrPeerLost, err), true)
		return
	}
	q.fail(fmt.Errorf("%w: tcp: connection to the peer: %w", verbsio.ErrPeerLost, err), true)
}

func (q *qp) handleResponse(l *outLane, h header) error {
	// The requests before it that asked for no acknowledgement succeeded.
	var few [ackEvery]expect
	ok := few[:0]
	l.mu.Lock()
	for len(l.fifo) > 1 && l.fifo[0].noAck && l.fifo[0].token != h.token {
		if len(ok) == cap(ok) {
			// No more than ackEvery-1 go without an acknowledgement.
			l.mu.Unlock()
			return fmt.Errorf("%w: response token %d after %d requests without one", verbsio.ErrBadFrame, h.token, len(ok))
		}
		ok = append(ok, l.fifo[0])
		l.fifo = popFront(l.fifo)
	}
	if len(l.fifo) == 0 {
		l.mu.Unlock()
		return fmt.Errorf("%w: unexpected %s frame", verbsio.ErrBadFrame, opName(h.op))
	}
	e := l.fifo[0]
	l.fifo = popFront(l.fifo)
	l.mu.Unlock()
	if h.token != e.token {
		return fmt.Errorf("%w: response token %d, want %d", verbsio.ErrBadFrame, h.token, e.token)
	}
	q.impliedAcks.Add(int64(len(ok)))
	for _, d := range ok {
		q.respond(d, verbsio.StatusSuccess)
	}
	switch {
	case h.op == opAck && !e.read:
		q.respond(e, verbsio.StatusSuccess)
	case h.op == opNak:
		q.respond(e, h.status)
	case h.op == opReadResp && e.read:
		if h.length != e.n {
			return fmt.Errorf("%w: read response of %d bytes, asked %d", verbsio.ErrBadFrame, h.length, e.n)
		}
		for _, b := range e.w.bufs {
			if _, err := io.ReadFull(l.c, b); err != nil {
				return err
			}
		}
		q.respond(e, verbsio.StatusSuccess)
	default:
		return fmt.Errorf("%w: %s frame in answer to a %v", verbsio.ErrBadFrame, opName(h.op), e.w.op)
	}
	return nil
}

var errRNR = errors.New("no receive posted")

// takeRecv returns the oldest posted receive, waiting up to the RNR timeout
// for one. The caller holds recvMu.
func (q *qp) takeRecv() (*rwr, error) {
	var timer *time.Timer
	for {
		q.mu.Lock()
		if q.state == verbsio.QPError || q.state == verbsio.QPClosed {
			q.mu.Unlock()
			return nil, verbsio.ErrClosed
		}
		if len(q.rq) > 0 {
			q.rqTaken = true
			r := q.rq[0]
			q.mu.Unlock()
			return r, nil
		}
		ch := q.rqPosted
		q.rqWaited = true
		q.mu.Unlock()
		if timer == nil {
			timer = time.NewTimer(q.dev.opt.RNRTimeout)
			defer timer.Stop()
		}
		select {
		case <-ch:
		case <-q.closing:
			return nil, verbsio.ErrClosed
		case <-timer.C:
			return nil, errRNR
		}
	}
}

// recvPosted reports whether takeRecv would return a receive at once. The
// caller holds recvMu, so no other taker can take it meanwhile.
func (q *qp) recvPosted() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.rq) > 0 || q.state == verbsio.QPError || q.state == verbsio.QPClosed
}

// finishRecv completes the taken receive r with c (or puts it back when c
// is nil); a receive flushed meanwhile is left alone.
func (q *qp) finishRecv(r *rwr, c *verbsio.Completion) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.rqTaken || len(q.rq) == 0 || q.rq[0] != r {
		return
	}
	q.rqTaken = false
	if c == nil {
		return
	}
	q.rq = popFront(q.rq)
	c.WRID, c.QP = r.wrid, q
	q.rcq.push(*c)
	putRwr(r) // its taker uses it no more
}

// serve answers the requests of one inbound lane. Every request is checked
// (key, range, access, receive posted) before any of its payload is read;
// a payload that has nowhere to go is read into a small scratch buffer and
// dropped.
func (q *qp) serve(l *inLane) {
	defer q.wg.Done()
	var hb [headerLen]byte
	var err error
	for err == nil {
		if l.rc != nil {
			if err = l.waitReadable(q.closing); err != nil {
				break
			}
			l.take()
			l.quietLocked(false)
			if err = l.skipApplied(); err != nil {
				l.rd.Unlock()
				break
			}
			// A waiter that held the lane may have looked at the
			// socket (answering a request too large to peek) and then
			// applied what it saw: this goroutine looks again.
			l.resp.sawNext = false
		} else {
			l.rd.Lock()
		}
		for err == nil {
			if err = l.err; err != nil {
				break
			}
			// The responder's look for a queued request (to hold its
			// answer back) spares this one.
			if !l.resp.sawNext && !l.ready() {
				break
			}
			l.resp.sawNext = false
			if _, err = io.ReadFull(l.c, hb[:]); err != nil {
				break
			}
			var f header
			if f, err = parseHeader(hb[:]); err != nil {
				break
			}
			err = q.serveFrame(l, l.c, f, l.t)
		}
		l.rd.Unlock()
	}
	l.ackTimer.Stop()
	c := l.c
	q.dev.closeLane(c)
	q.mu.Lock()
	defer q.mu.Unlock()
	delete(q.in, c)
	q.setInLanesLocked()
	if errors.Is(err, verbsio.ErrBadFrame) {
		q.lastBad = err
	}
	if q.remote != nil && l.src == (srcKey{q.remote.qp, q.remote.nonce}) {
		if errors.Is(err, verbsio.ErrBadFrame) {
			q.failLocked(err, true)
		} else {
			q.failLocked(fmt.Errorf("%w: tcp: connection from the peer: %w", verbsio.ErrPeerLost, err), true)
		}
	}
}

// serveFrame applies the request f, whose payload is read from in: the
// connection itself (the lane's goroutine) or a rawReader (the waiter).
func (q *qp) serveFrame(l *inLane, in io.Reader, f header, t *transfer) error {
	r := l.resp
	switch f.op {
	case opWrite, opWriteImm:
		return q.serveWrite(in, f, r, t)
	case opSend:
		return q.serveSend(in, f, r)
	case opReadReq:
		src, aerr := q.pd.remote(q, t, f, verbsio.AccessRemoteRead)
		if aerr != nil {
			return r.nak(f, verbsio.StatusRemoteAccess)
		}
		err := r.withPayload(header{op: opReadResp, token: f.token, length: f.length}, src)
		// Cut short (the region closed), the response is torn and
		// the lane ends with err; sent whole, it stands.
		t.end()
		return err
	default:
		return fmt.Errorf("%w: %s frame on a request lane", verbsio.ErrBadFrame, opName(f.op))
	}
}

// responder writes the responses of an inbound lane. A response is held
// back while the next request is already waiting in the socket (SIOCINQ),
// and goes out with the following ones in one write: a burst of small
// writes costs one acknowledging write, not one each. Whatever may block
// (a wait for a posted receive) flushes first.
type responder struct {
	c       net.Conn
	rc      syscall.RawConn // nil when c has no descriptor (tests)
	pending []byte
	// peeked: the waiter applies a request it peeked, and more says
	// whether the next one was queued behind it (so no SIOCINQ is needed
	// to decide whether to hold this response back).
	peeked, more bool
	// hold: the waiter holds the response back (answer).
	hold bool
	// sawNext: the last look (SIOCINQ) found a whole request header
	// queued, so the lane's goroutine reads on without looking again.
	// Only its own look counts: it clears sawNext when it takes the lane.
	sawNext bool
	// inqFn asks for the bytes queued (SIOCINQ) into inq; made once so
	// that the look allocates nothing.
	inqFn func(fd uintptr)
	inq   int
}

const maxPendingResponses = 64

func newResponder(c net.Conn) *responder {
	r := &responder{c: c, pending: make([]byte, 0, maxPendingResponses*headerLen)}
	if sc, ok := c.(syscall.Conn); ok {
		r.rc, _ = sc.SyscallConn()
	}
	r.inqFn = func(fd uintptr) { r.inq, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }
	return r
}

// requestWaiting reports whether a whole request header is already queued.
func (r *responder) requestWaiting() bool { return r.queued() >= headerLen }

// queued is how many bytes wait in the socket (SIOCINQ); 0 for a
// connection without a descriptor. Callers hold the lane's rd.
func (r *responder) queued() int {
	if r.rc == nil {
		return 0
	}
	r.inq = 0
	r.rc.Control(r.inqFn)
	return r.inq
}

func (r *responder) answer(h header) error {
	r.pending = h.Append(r.pending)
	// The waiter holds every response back (up to the most pending): it
	// is about to hand a completion to its caller, and the
	// acknowledgement's write would come first. It goes out at the
	// waiter's next look at the lane, the queue pair's next PostSend,
	// the lane goroutine's next answer, or after ackHold (inLane.owe).
	waiting := r.more || r.hold
	if !r.peeked {
		waiting = r.requestWaiting()
		r.sawNext = waiting
	}
	if len(r.pending) < maxPendingResponses*headerLen && waiting {
		return nil
	}
	return r.flush()
}

func (r *responder) nak(f header, st verbsio.Status) error {
	return r.answer(header{op: opNak, token: f.token, status: st})
}

func (r *responder) flush() error {
	if len(r.pending) == 0 {
		return nil
	}
	_, err := r.c.Write(r.pending)
	r.pending = r.pending[:0]
	return err
}

// withPayload writes what is pending, h and payload in one writev.
func (r *responder) withPayload(h header, payload []byte) error {
	r.pending = h.Append(r.pending)
	bufs := net.Buffers{r.pending, payload}
	_, err := bufs.WriteTo(r.c)
	r.pending = r.pending[:0]
	return err
}

func discard(c io.Reader, n uint32) error {
	_, err := io.CopyN(io.Discard, c, int64(n))
	return err
}

func (q *qp) serveWrite(c io.Reader, f header, resp *responder, t *transfer) error {
	var r *rwr
	if f.op == opWriteImm && f.flags&flagLast != 0 {
		q.recvMu.Lock()
		if !q.recvPosted() {
			// The wait for a receive may be long: the responses held
			// back go out first.
			q.recvMu.Unlock()
			if err := resp.flush(); err != nil {
				return err
			}
			q.recvMu.Lock()
		}
		defer q.recvMu.Unlock()
		var err error
		if r, err = q.takeRecv(); err != nil {
			if err != errRNR {
				return err
			}
			if err := discard(c, f.length); err != nil {
				return err
			}
			return resp.nak(f, verbsio.StatusRemoteOperation)
		}
	}
	dst, aerr := q.pd.remote(q, t, f, verbsio.AccessRemoteWrite)
	if aerr != nil {
		if r != nil {
			q.finishRecv(r, nil)
		}
		if err := discard(c, f.length); err != nil {
			return err
		}
		return resp.nak(f, verbsio.StatusRemoteAccess)
	}
	// A write with immediate that comes whole in this frame has its
	// checksum taken as it lands, where the queue pair's user asked.
	sum := r != nil && f.length == f.total && q.sumWrites.Load()
	var n int
	var crc uint32
	var err error
	if sum {
		n, crc, err = readFullCRC(c, dst)
	} else {
		n, err = io.ReadFull(c, dst)
	}
	if t.end() {
		// The region closed or the grant was revoked under the write:
		// what is left of the payload is skipped and the write fails,
		// as on a deregistered region.
		if r != nil {
			q.finishRecv(r, nil)
		}
		if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			return err
		}
		if err := discard(c, f.length-uint32(n)); err != nil {
			return err
		}
		return resp.nak(f, verbsio.StatusRemoteAccess)
	}
	if err != nil {
		return err
	}
	if r != nil {
		wc := verbsio.Completion{Op: verbsio.OpRecvImm, Status: verbsio.StatusSuccess, ByteLen: f.total, Imm: f.imm, HasImm: true}
		wc.Checksum, wc.HasChecksum = crc, sum
		q.finishRecv(r, &wc)
	}
	if f.flags&flagNoAck != 0 {
		return nil // the next response says so
	}
	return resp.answer(header{op: opAck, token: f.token})
}

// ChecksumWrites implements verbsio.WriteChecksummer: the receive
// completion of a write with immediate that came in one frame carries the
// CRC-32C of its payload, taken piece by piece as it is read from the
// socket (readFullCRC). A write striped over several lanes has none.
func (q *qp) ChecksumWrites(on bool) { q.sumWrites.Store(on) }

// crcPiece is how much of a payload readFullCRC reads before it takes
// the checksum of what it read: small enough that the bytes are still in
// the cache, large enough that a read takes much at once.
const crcPiece = 256 << 10

// readFullCRC reads len(dst) bytes from c into dst as io.ReadFull does,
// and returns the CRC-32C of the n bytes it read.
func readFullCRC(c io.Reader, dst []byte) (n int, crc uint32, err error) {
	for n < len(dst) {
		m, err := io.ReadFull(c, dst[n:min(len(dst), n+crcPiece)])
		crc = crc32c.Update(crc, dst[n:n+m])
		n += m
		if err != nil {
			return n, crc, err
		}
	}
	return n, crc, nil
}

func (q *qp) serveSend(c io.Reader, f header, resp *responder) error {
	if err := resp.flush(); err != nil {
		return err
	}
	q.recvMu.Lock()
	defer q.recvMu.Unlock()
	r, err := q.takeRecv()
	if err != nil {
		if err != errRNR {
			return err
		}
		if err := discard(c, f.length); err != nil {
			return err
		}
		return resp.nak(f, verbsio.StatusRemoteOperation)
	}
	if int(f.length) > r.n {
		if err := discard(c, f.length); err != nil {
			return err
		}
		q.finishRecv(r, &verbsio.Completion{Op: verbsio.OpRecv, Status: verbsio.StatusLocalLength, ByteLen: f.length})
		return resp.nak(f, verbsio.StatusRemoteOperation)
	}
	for i, left := 0, int(f.length); left > 0; i++ {
		b := r.bufs[i][:min(left, len(r.bufs[i]))]
		if _, err := io.ReadFull(c, b); err != nil {
			return err
		}
		left -= len(b)
	}
	q.finishRecv(r, &verbsio.Completion{Op: verbsio.OpRecv, Status: verbsio.StatusSuccess, ByteLen: f.length})
	return resp.answer(header{op: opAck, token: f.token})
}
