package collective

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/gdrlink/gdrlink/collective"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// KeyPrefix begins the keys the ring sends under; a program's own Send and
// Recv keys should not begin with it.
const KeyPrefix = "gdrlink/collective/"

const (
	defaultSegment = 1 << 20
	defaultLanes   = 16
	// abortGrace is how long a failing rank waits for its sends in flight
	// before it closes its link to its successor, and how long a
	// neighbour's closing waits for a better cause (run.fail).
	abortGrace = time.Second
)

// Ring is the built-in backend: a ring over the job's zero-copy links.
// AllReduce is a reduce-scatter followed by an all-gather, each of
// Size()-1 steps in which every rank sends one chunk of the tensor to its
// successor (rank+1) and receives one from its predecessor, straight into
// a registered tensor; the chunk sent is a piece of the caller's tensor
// itself, not a copy. A reduce-scatter step's chunk lands in a tensor of
// its own and is added from there; an all-gather step's (and a
// Broadcast's or AllGather's) lands in the caller's tensor itself where
// the link can grant the predecessor those bytes alone
// (rendezvous.Into), and is copied over otherwise. Each chunk is cut into
// segments (WithSegment, at most WithLanes of them), and each segment goes
// through the steps on its own, so sending, receiving and reducing
// overlap; a segment's steps run on the goroutine that delivers what
// they wait for (lane).
//
// The order of additions is fixed per element, so every rank gets the
// same bits and a call gives the same bits every time: the tensor's
// elements are cut into Size() chunks by index (chunk c is elements
// [N·c/Size, N·(c+1)/Size)), and chunk c is summed left to right from rank
// c around the ring: ((x_c + x_c+1) + x_c+2) + … + x_c-1 (indices mod
// Size), whatever the timing, the segments or the transport. Its last
// adder, rank c-1, owns it (and divides it, for Average), and the
// all-gather copies those bits, unchanged, to every other rank. 16-bit
// floats are added in float32 and rounded to nearest even after each
// addition.
//
// On a power-of-two number of ranks, 4 or more, an AllReduce whose chunks
// are one segment each (tensors up to Size() segments) goes by recursive
// halving and doubling instead (halving.go): the same bytes in
// 2·log2(Size()) steps, each an exchange with one partner, and its own
// fixed order of additions (Report.Algorithm says which ran); one of at
// most 128 KiB (WithDoublingMax) in one segment, on 2 ranks too, by
// recursive doubling alone (doubling.go): half as many steps, each the
// whole tensor, the same bits as halving's (and the ring's on 2 ranks).
type Ring struct {
	tr          Transport
	segment     int64
	lanes       int
	doublingMax int64

	// idle are the coroutines of finished calls (lane.go).
	comu   sync.Mutex
	idle   []*coroutine
	closed bool
}

// RingOption configures a Ring.
type RingOption func(*Ring)

// WithSegment sets the size in bytes ring steps are cut into (default 1
// MiB; at most WithLanes segments per chunk).
func WithSegment(n int64) RingOption {
	return func(r *Ring) {
		if n > 0 {
			r.segment = n
		}
	}
}

// WithLanes bounds the segments per chunk, each in flight on its own
// (default 16).
func WithLanes(n int) RingOption {
	return func(r *Ring) {
		if n > 0 {
			r.lanes = n
		}
	}
}

// NewRing returns the ring backend over tr.
func NewRing(tr Transport, opts ...RingOption) *Ring {
	r := &Ring{tr: tr, segment: defaultSegment, lanes: defaultLanes, doublingMax: defaultDoublingMax}
	for _, o := range opts {
		o(r)
	}
	return r
}

// Name is "ring".
func (r *Ring) Name() string { return "ring" }

// AllReduce reduces t over every rank in place (see Ring).
func (r *Ring) AllReduce(ctx context.Context, seq uint64, t *tensor.Tensor, op Op) (collective.Report, error) {
	return r.allReduce(ctx, seq, t, op, nil)
}

// Staging is where a call's tensor really lives when the host tensor the
// ring runs on is a copy of it (a GPU tensor's, in pinned memory): the
// ring loads each segment of the host tensor before it first reads it and
// stores each back once its result is final, so that the copies overlap
// the ring's steps. Offsets and lengths are in bytes of the tensor.
type Staging interface {
	// Load queues the copy of bytes [off, off+n) into the host tensor;
	// ready waits until they are there and returns the copy's error.
	Load(off, n int64) (ready func() error)
	// Store queues the copy of bytes [off, off+n) of the host tensor
	// back. Lanes call it at once from their goroutines.
	Store(off, n int64) error
}

// AllReduceStaged is AllReduce of t, a host copy of st's tensor, whose
// bytes it loads and stores through st as the steps need them: the
// segments of the chunk this rank sends first, then those of the chunks
// in the order the reduce-scatter adds into them; each segment is stored
// when it is final (its owner's after the reduce-scatter, the others as
// the all-gather brings them). The caller waits for the stores when it
// returns, after a failure too, before t's memory is reused. With one
// rank it copies nothing: st's tensor is already the result.
func (r *Ring) AllReduceStaged(ctx context.Context, seq uint64, t *tensor.Tensor, op Op, st Staging) (collective.Report, error) {
	return r.allReduce(ctx, seq, t, op, st)
}

func (r *Ring) allReduce(ctx context.Context, seq uint64, t *tensor.Tensor, op Op, st Staging) (collective.Report, error) {
	const name = "allreduce"
	if err := checkHost("allreduce", t); err != nil {
		return collective.Report{Op: name}, err
	}
	if op != Sum && op != Average {
		return collective.Report{Op: name}, fmt.Errorf("%w: reduction %s", ErrBadArgument, op)
	}
	k, err := kernelFor(t.Meta().DType)
	if err != nil {
		return collective.Report{Op: name}, err
	}
	x := r.newRun(name, seq, t)
	x.rep.Reduce = op.String()
	x.kern, x.avg = k, op == Average
	n := x.n
	elems := x.elems()
	x.chunks = make([]span, n)
	for c := range n {
		x.chunks[c] = span{elems * int64(c) / int64(n), elems*int64(c+1)/int64(n) - elems*int64(c)/int64(n)}
	}
	if n == 1 {
		return x.finish(nil)
	}
	x.steps = 2 * (n - 1)
	x.setLanes()
	x.setDoubling()
	if !x.doubling {
		x.setHalving()
	}
	if st != nil {
		x.st = st
		x.loaded = make([][]func() error, n)
		for i := range n {
			c := x.mod(x.rank - i) // the order the steps first touch them
			x.loaded[c] = make([]func() error, x.lanes)
			for k := range x.lanes {
				sg := x.seg(c, k)
				x.loaded[c][k] = st.Load(sg.off*x.esize, sg.n*x.esize)
			}
		}
	}
	lane := x.allReduceLane
	x.rep.Algorithm = "ring"
	switch {
	case x.doubling:
		lane = x.doublingLane
		x.rep.Algorithm = "doubling"
	case x.halving:
		lane = x.halvingLane
		x.rep.Algorithm = "halving"
	}
	return x.finish(x.runLanes(ctx, lane))
}

// Broadcast copies root's t to every rank's t, down the ring from root:
// every segment is forwarded as soon as it lands.
func (r *Ring) Broadcast(ctx context.Context, seq uint64, t *tensor.Tensor, root int) (collective.Report, error) {
	const name = "broadcast"
	if err := checkHost("broadcast", t); err != nil {
		return collective.Report{Op: name}, err
	}
	if root < 0 || root >= r.tr.Size() {
		return collective.Report{Op: name}, fmt.Errorf("%w: root %d of %d ranks", ErrBadArgument, root, r.tr.Size())
	}
	x := r.newRun(name, seq, t)
	x.root = root
	x.chunks = []span{{0, x.elems()}}
	if x.n == 1 {
		return x.finish(nil)
	}
	x.steps = 1
	return x.finish(x.runLanes(ctx, x.broadcastLane))
}

// AllGather writes every rank's in into out, rank i's at byte offset i ×
// in's byte size: out has in's element type and Size() times its
// elements (shape [Size(), in's shape...] is the usual one). Each slot
// goes around the ring once.
func (r *Ring) AllGather(ctx context.Context, seq uint64, in, out *tensor.Tensor) (collective.Report, error) {
	const name = "allgather"
	if err := checkHost("allgather input", in); err != nil {
		return collective.Report{Op: name}, err
	}
	if err := checkHost("allgather output", out); err != nil {
		return collective.Report{Op: name}, err
	}
	n := r.tr.Size()
	im, om := in.Meta(), out.Meta()
	if im.DType != om.DType || om.ByteSize != int64(n)*im.ByteSize {
		return collective.Report{Op: name}, fmt.Errorf("%w: allgather of %s into %s: want %s with %d times the elements", ErrBadArgument, im, om, im.DType, n)
	}
	x := r.newRun(name, seq, out)
	each := x.elems() / int64(n)
	x.chunks = make([]span, n)
	for c := range n {
		x.chunks[c] = span{each * int64(c), each}
	}
	src, _ := in.Bytes()
	copy(x.bytes(x.chunks[x.rank]), src)
	if n == 1 {
		return x.finish(nil)
	}
	x.steps = n - 1
	return x.finish(x.runLanes(ctx, x.allGatherLane))
}

// Abandon fails call seq on this rank before it begins, for a reason of
// this rank's own (cause: it could not stage its tensor, say), and tells
// the others, so that they fail now rather than at their deadlines: its
// successor hears an abort naming this rank on every step it may wait
// for, and passes the failure on round the ring as any failed call
// does. op is the collective ("allreduce", "broadcast" or "allgather")
// and m the meta-data of its tensor (AllGather's output), which fix the
// steps and segments; root is a Broadcast's root. It returns the
// *collective.RankError the call fails with.
//
// A Broadcast abandoned by a rank other than the root would also hold its
// predecessor, whose pieces nobody asks for, until that rank's deadline:
// so this rank takes them and drops them, in the background, until ctx's
// deadline (or drainLimit when it has none). The ranks from the root up
// to the predecessor then complete the call (each has the root's tensor
// and passed it on), and the ranks after this one fail naming it.
func (r *Ring) Abandon(ctx context.Context, seq uint64, op string, m tensor.Meta, root int, cause error) error {
	x := &run{r: r, op: op, seq: seq, n: r.tr.Size(), rank: r.tr.Rank(), esize: int64(m.DType.Size())}
	x.nextRank = (x.rank + 1) % x.n
	x.prevRank = (x.rank + x.n - 1) % x.n
	err := &collective.RankError{Op: op, Rank: x.rank, Err: fmt.Errorf("rank %d: %w", x.rank, cause)}
	if x.n == 1 || x.esize <= 0 {
		return err
	}
	elems := m.ByteSize / x.esize
	switch op {
	case "allreduce":
		x.chunks = make([]span, x.n)
		for c := range x.n {
			lo, hi := elems*int64(c)/int64(x.n), elems*int64(c+1)/int64(x.n)
			x.chunks[c] = span{lo, hi - lo}
		}
		x.steps = 2 * (x.n - 1)
		x.setLanes()
		x.setHalving()
	case "broadcast":
		x.chunks, x.steps = []span{{0, elems}}, 1
	case "allgather":
		each := elems / int64(x.n)
		x.chunks = make([]span, x.n)
		for c := range x.n {
			x.chunks[c] = span{each * int64(c), each}
		}
		x.steps = x.n - 1
	default:
		return err
	}
	x.setLanes()
	if op == "broadcast" && root != x.rank {
		x.drainPredecessor(ctx)
	}
	x.tellSuccessor(ctx, err)
	return err
}

// drainLimit bounds how long an abandoned Broadcast without a deadline
// takes its predecessor's pieces (Abandon).
const drainLimit = time.Minute

// drainPredecessor receives, in the background, the piece of every lane
// that the predecessor sends this rank in a Broadcast, and drops it; it
// stops at ctx's deadline (drainLimit without one), or when the link
// fails.
func (x *run) drainPredecessor(ctx context.Context) {
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(drainLimit)
	}
	dctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	go func() {
		defer cancel()
		prev, err := x.r.tr.Link(dctx, x.prevRank)
		if err != nil {
			return
		}
		var left sync.WaitGroup
		left.Add(x.lanes)
		for k := range x.lanes {
			prev.RecvFunc(dctx, x.key(k), x.step(0), func(t *tensor.Tensor, _ rendezvous.Transfer, err error) {
				if err == nil {
					_ = t.Release()
				}
				left.Done()
			})
		}
		left.Wait()
	}()
}

// span is a range of elements.
type span struct{ off, n int64 }

// run is one collective call on this rank.
type run struct {
	r          *Ring
	op         string
	seq        uint64
	n, rank    int
	root       int
	t          *tensor.Tensor
	data       []byte
	esize      int64
	chunks     []span
	lanes      int
	kern       kernel
	avg        bool
	start      time.Time
	next, prev Link
	nextRank   int
	prevRank   int

	parent context.Context
	ctx    context.Context
	cancel context.CancelFunc
	sends  sendCount

	// steps is the number of steps of each lane: those the successor
	// may wait for.
	steps int

	mu  sync.Mutex
	rep collective.Report
	err error // the first failure
	// weak is a neighbour's closing, which waits for a better cause
	// (fail) until weakTimer fires.
	weak      error
	weakTimer *time.Timer
	sentUpTo  []int // per lane: the steps whose sends were made

	// st is where t's bytes are loaded from and stored to (nil: t is
	// the tensor itself), and loaded[c][k] waits for segment k of chunk
	// c to be loaded.
	st     Staging
	loaded [][]func() error

	// co are the lanes' coroutines, and ended counts those running.
	co    []*lane
	ended sync.WaitGroup

	// halving: the AllReduce goes by partners, by recursive halving and
	// doubling (halving.go) or, with doubling, by recursive doubling
	// alone (doubling.go); peers[s] is step s's partner, links[s] the
	// link to it.
	halving bool
	peers   []int
	links   []Link
	// doubling: see halving.
	doubling bool
}

// ready waits until segment k of chunk c is in the host tensor.
func (x *run) ready(c, k int) error {
	if x.loaded == nil {
		return nil
	}
	if err := x.loaded[c][k](); err != nil {
		return &collective.RankError{Op: x.op, Rank: x.rank, Err: fmt.Errorf("rank %d: copying chunk %d to host memory: %w", x.rank, c, err)}
	}
	return nil
}

// store stores segment k of chunk c, final, back where t came from.
func (x *run) store(c, k int) error {
	if x.st == nil {
		return nil
	}
	sg := x.seg(c, k)
	if sg.n == 0 {
		return nil
	}
	if err := x.st.Store(sg.off*x.esize, sg.n*x.esize); err != nil {
		return &collective.RankError{Op: x.op, Rank: x.rank, Err: fmt.Errorf("rank %d: copying chunk %d back: %w", x.rank, c, err)}
	}
	return nil
}

func (r *Ring) newRun(op string, seq uint64, t *tensor.Tensor) *run {
	data, _ := t.Bytes()
	x := &run{r: r, op: op, seq: seq, n: r.tr.Size(), rank: r.tr.Rank(), t: t, data: data, esize: int64(t.Meta().DType.Size()), start: time.Now()}
	x.nextRank, x.prevRank = (x.rank+1)%x.n, (x.rank+x.n-1)%x.n
	x.rep = collective.Report{Op: op, Backend: r.Name(), Ranks: x.n, Bytes: int64(len(data))}
	return x
}

func (x *run) elems() int64 { return int64(len(x.data)) / x.esize }

func (x *run) mod(i int) int { return ((i % x.n) + x.n) % x.n }

// seg is segment k of chunk c.
func (x *run) seg(c, k int) span {
	ch := x.chunks[c]
	lo := ch.off + ch.n*int64(k)/int64(x.lanes)
	hi := ch.off + ch.n*int64(k+1)/int64(x.lanes)
	return span{lo, hi - lo}
}

func (x *run) bytes(s span) []byte {
	return x.data[s.off*x.esize : (s.off+s.n)*x.esize]
}

func (x *run) key(k int) string { return KeyPrefix + strconv.Itoa(k) }

func (x *run) step(s int) int64 { return int64(x.seq)*int64(2*x.n) + int64(s) }

func (x *run) finish(err error) (collective.Report, error) {
	x.rep.Took = time.Since(x.start)
	x.rep.Segments = max(x.lanes, 1)
	return x.rep, err
}

// runLanes connects to the neighbours and runs lane(k) for every segment
// lane at once; on a failure it tells the successor, waits a while for
// its sends and closes its links.
func (x *run) runLanes(ctx context.Context, lane func(k int) error) error {
	x.setLanes()
	x.sentUpTo = make([]int, x.lanes)
	if err := ctx.Err(); err != nil {
		// Ended before it began.
		err := &collective.RankError{Op: x.op, Rank: x.rank, Err: fmt.Errorf("rank %d: %w", x.rank, context.Cause(ctx))}
		x.tellSuccessor(ctx, err)
		return err
	}
	if err := x.connect(ctx); err != nil {
		return err
	}
	x.parent = ctx
	x.ctx, x.cancel = context.WithCancel(ctx)
	defer x.cancel()
	x.startLanes(lane)
	// A lane waiting for a send's completion also ends with the call.
	stop := context.AfterFunc(x.ctx, func() {
		for k := range x.co {
			x.co[k].resume()
		}
	})
	x.ended.Wait()
	x.releaseLanes()
	stop()
	x.mu.Lock()
	if x.weakTimer != nil {
		x.weakTimer.Stop()
	}
	if x.err == nil {
		x.err = x.weak
	}
	ferr := x.err
	x.mu.Unlock()
	if ferr == nil {
		if ferr = x.waitSends(); ferr == nil {
			return nil
		}
	}
	x.abort(ferr)
	return ferr
}

// tellSuccessor tells the successor, whose lanes wait for their first
// step, that this rank's call failed with err before it began (if the
// link is there within abortGrace): an abort on every step of every lane.
func (x *run) tellSuccessor(ctx context.Context, err error) {
	tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), abortGrace)
	defer cancel()
	if x.halving {
		x.tellPartners(tctx, err)
		return
	}
	next, lerr := x.r.tr.Link(tctx, x.nextRank)
	if lerr != nil {
		return
	}
	for k := range x.lanes {
		for s := range x.steps {
			_ = next.SendError(x.key(k), x.step(s), abortText(x.rank, err))
		}
	}
}

// connect gets the links the call's lanes use: to the neighbours, or to
// the partners of a halving call.
func (x *run) connect(ctx context.Context) error {
	if x.halving {
		return x.connectPartners(ctx)
	}
	var err error
	if x.next, err = x.r.tr.Link(ctx, x.nextRank); err != nil {
		return x.linkFailed(ctx, x.nextRank, err)
	}
	if x.prev, err = x.r.tr.Link(ctx, x.prevRank); err != nil {
		return x.linkFailed(ctx, x.prevRank, err)
	}
	return nil
}

// waitSends waits until the successor has taken every piece offered it,
// or the call's context ends: a successor that never asks (its own call
// failed before it began, and it told only its successor) cannot hold
// this rank past its deadline.
func (x *run) waitSends() error {
	// The peers may wait for this rank's confirmations of their pieces,
	// as it may wait for theirs: none is held back now.
	if x.halving {
		for _, l := range x.partnerLinks() {
			l.ConfirmNow()
		}
	} else if x.prev != nil {
		x.prev.ConfirmNow()
	}
	done := x.sends.idle()
	if done == nil {
		return nil
	}
	select {
	case <-done:
		return nil
	case <-x.parent.Done():
		who := fmt.Sprintf("rank %d", x.nextRank)
		if x.halving {
			who = fmt.Sprintf("its partners %v", x.peers)
		}
		return &collective.RankError{Op: x.op, Rank: x.rank, Err: fmt.Errorf("rank %d: waiting for %s to take its pieces: %w", x.rank, who, context.Cause(x.parent))}
	}
}

// setLanes picks the number of segments per chunk: enough for segments
// of the ring's size, at most its lanes, at most the smallest chunk's
// elements.
func (x *run) setLanes() {
	x.lanes = lanesFor(x.chunks, x.esize, x.r.segment, x.r.lanes)
}

// lanesFor is setLanes' choice for chunks of elements of esize bytes,
// segments of segment bytes and at most most lanes.
func lanesFor(chunks []span, esize, segment int64, most int) int {
	biggest := int64(0)
	smallest := int64(-1)
	for _, c := range chunks {
		biggest = max(biggest, c.n*esize)
		if smallest < 0 || c.n < smallest {
			smallest = c.n
		}
	}
	return int(min(int64(most), max(1, (biggest+segment-1)/segment), max(1, smallest)))
}

// linkFailed is the error of a link to peer that could not be had.
func (x *run) linkFailed(ctx context.Context, peer int, err error) error {
	if ctx.Err() != nil {
		return &collective.RankError{Op: x.op, Rank: x.rank, Err: fmt.Errorf("rank %d waiting for its link to rank %d: %w", x.rank, peer, err)}
	}
	return &collective.RankError{Op: x.op, Rank: peer, Err: err}
}

// fail records the first failure and stops the other lanes. A
// neighbour that closed its link is a weak cause: it may have closed
// because its own collective failed (and its process ended) before this
// rank heard why along the ring. So that failure waits up to abortGrace
// for a better one (a lost rank, an abort naming one, this rank's
// deadline) before it stops the lanes.
func (x *run) fail(err error) {
	x.mu.Lock()
	if x.err != nil {
		x.mu.Unlock()
		return
	}
	if weakCause(err) {
		if x.weak == nil {
			x.weak = err
			x.weakTimer = time.AfterFunc(abortGrace, func() { x.settle(err) })
		}
		x.mu.Unlock()
		return
	}
	x.err = err
	x.mu.Unlock()
	x.cancel()
}

// settle makes err the failure unless a better one came.
func (x *run) settle(err error) {
	x.mu.Lock()
	if x.err == nil {
		x.err = err
	}
	x.mu.Unlock()
	x.cancel()
}

// weakCause reports whether err is a neighbour's closing: the rank named
// closed its link in good order, which says that it stopped, not why.
func weakCause(err error) bool {
	var re *collective.RankError
	return errors.As(err, &re) && re.Rank >= 0 && errors.Is(err, rendezvous.ErrClosed) && !errors.Is(err, verbsio.ErrPeerLost)
}

// abort tells the successor which rank failed, on every step of every
// lane it has not sent (the successor may be waiting for any of them, or
// ask for them later), and gives the sends in flight a moment. Sends
// still out then are ones the successor will never ask for (it failed
// too), and each holds a piece of the caller's tensor: the link to the
// successor is closed to drop them. Otherwise the links stay, so that
// the successor hears of the failure, with the rank at fault, rather
// than as a link's end. The link to the predecessor holds no sends, only
// receives, which the failure cancelled.
func (x *run) abort(err error) {
	var re *collective.RankError
	rank := x.rank
	if errors.As(err, &re) && re.Rank >= 0 {
		rank = re.Rank
	}
	if x.halving {
		for s := x.sentUpTo[0]; s < x.steps; s++ {
			if x.peers[s] != rank {
				_ = x.links[s].SendError(x.key(0), x.step(s), abortText(rank, err))
			}
		}
	} else if x.nextRank != rank {
		for k := range x.lanes {
			for s := x.sentUpTo[k]; s < x.steps; s++ {
				_ = x.next.SendError(x.key(k), x.step(s), abortText(rank, err))
			}
		}
	}
	done := x.sends.idle()
	if done == nil {
		return
	}
	select {
	case <-done:
		return
	case <-time.After(abortGrace):
	}
	if x.halving {
		x.abortPartners()
	} else {
		_ = x.next.Abort()
	}
	<-done
}

// send offers span s of the tensor to the successor as lane k's step.
func (x *run) send(k, step int, s span) (<-chan error, error) {
	return x.sendTo(x.next, x.nextRank, k, step, s)
}

// sendTo offers span s of the tensor to peer, over l, as lane k's step.
func (x *run) sendTo(l Link, peer, k, step int, s span) (<-chan error, error) {
	p, err := piece(x.t, s.off*x.esize, s.n*x.esize)
	if err != nil {
		return nil, &collective.RankError{Op: x.op, Rank: x.rank, Err: err}
	}
	done := make(chan error, 1)
	x.sends.add()
	n := s.n * x.esize
	err = l.SendFunc(x.key(k), x.step(step), p, func(err error) {
		if err == nil {
			x.mu.Lock()
			x.rep.Sent += n
			x.mu.Unlock()
		} else {
			x.fail(x.linkErr(peer, err))
		}
		done <- err
		x.sends.done()
		x.co[k].resume()
	})
	if err != nil {
		x.sends.done()
		return nil, x.linkErr(peer, err)
	}
	x.mu.Lock()
	x.sentUpTo[k] = step + 1
	x.mu.Unlock()
	return done, nil
}

// result is one receive's outcome.
type result struct {
	t   *tensor.Tensor
	tr  rendezvous.Transfer
	err error
}

// recv asks the predecessor for lane k's step.
func (x *run) recv(k, step int) chan result {
	return x.recvInto(k, step, span{})
}

// recvInto asks the predecessor for lane k's step, to be written straight
// into span s of the tensor where the link can (rendezvous.Into); an
// empty s asks for a tensor of its own.
func (x *run) recvInto(k, step int, s span) chan result {
	return x.recvFrom(x.prev, x.prevRank, k, step, s)
}

// recvFrom asks peer, over l, for lane k's step, as recvInto does.
func (x *run) recvFrom(l Link, peer, k, step int, s span) chan result {
	var opts []rendezvous.RecvOption
	if s.n > 0 {
		if p, err := piece(x.t, s.off*x.esize, s.n*x.esize); err == nil {
			opts = append(opts, rendezvous.Into(p))
		}
	}
	ch := make(chan result, 1)
	l.RecvFunc(x.ctx, x.key(k), x.step(step), func(t *tensor.Tensor, tr rendezvous.Transfer, err error) {
		if err != nil && x.ctx.Err() == nil {
			// Stop every lane now, not when this one gets here: it may
			// be waiting on something the failure holds up.
			x.fail(x.linkErr(peer, err))
		}
		ch <- result{t, tr, err}
		x.co[k].resume()
	}, opts...)
	return ch
}

// place puts what was received for span s into the tensor, unless it was
// written there already (recvInto).
func (x *run) place(s span, got *tensor.Tensor) {
	in, _ := got.Bytes()
	dst := x.bytes(s)
	if len(in) > 0 && len(dst) > 0 && &in[0] == &dst[0] {
		x.mu.Lock()
		x.rep.Placed += int64(len(in))
		x.mu.Unlock()
		return
	}
	copy(dst, in)
}

// take waits for a receive and checks what came.
func (x *run) take(k int, ch chan result, want span) (*tensor.Tensor, error) {
	return x.takeFrom(x.prevRank, k, ch, want)
}

// takeFrom waits for a receive from peer and checks what came.
func (x *run) takeFrom(peer, k int, ch chan result, want span) (*tensor.Tensor, error) {
	x.co[k].await(func() bool { return len(ch) > 0 })
	res := <-ch
	if res.err != nil {
		return nil, x.linkErr(peer, res.err)
	}
	x.mu.Lock()
	addLink(&x.rep, peer, res.tr)
	x.mu.Unlock()
	b, err := res.t.Bytes()
	if err == nil && (res.t.Meta().DType != x.t.Meta().DType || int64(len(b)) != want.n*x.esize) {
		err = fmt.Errorf("%w: rank %d sent %s for %d elements of %s", rendezvous.ErrProtocol, peer, res.t.Meta(), want.n, x.t.Meta().DType)
	}
	if err != nil {
		_ = res.t.Release()
		return nil, &collective.RankError{Op: x.op, Rank: peer, Err: err}
	}
	return res.t, nil
}

// drain releases what lane k's receive still brings after a failure.
func (x *run) drain(k int, ch chan result) {
	if ch == nil {
		return
	}
	x.co[k].await(func() bool { return len(ch) > 0 })
	if res := <-ch; res.t != nil {
		_ = res.t.Release()
	}
}

// linkErr names the rank a link failure is about: the neighbour itself,
// the rank a neighbour's abort names, or this rank when its own context
// ended.
func (x *run) linkErr(peer int, err error) error {
	var re *collective.RankError
	if errors.As(err, &re) {
		return err
	}
	if x.parent.Err() != nil {
		return &collective.RankError{Op: x.op, Rank: x.rank, Err: fmt.Errorf("rank %d: %w: %w", x.rank, context.Cause(x.parent), err)}
	}
	if x.ctx.Err() != nil {
		// Another lane failed first and stopped this one.
		return &collective.RankError{Op: x.op, Rank: -1, Err: err}
	}
	if errors.Is(err, rendezvous.ErrRemote) {
		if r, ok := parseAbort(err.Error(), x.n); ok {
			return &collective.RankError{Op: x.op, Rank: r, Err: err}
		}
	}
	if errors.Is(err, verbsio.ErrPeerLost) || errors.Is(err, rendezvous.ErrClosed) {
		return &collective.RankError{Op: x.op, Rank: peer, Err: fmt.Errorf("rank %d lost: %w", peer, err)}
	}
	return &collective.RankError{Op: x.op, Rank: peer, Err: err}
}

// allReduceLane runs segment k through the reduce-scatter and the
// all-gather.
func (x *run) allReduceLane(k int) error {
	n, r := x.n, x.rank
	total := 2 * (n - 1)
	rsSent := make([]<-chan error, n-1)
	cur := x.recv(k, 0)
	for s := 0; s < total; s++ {
		var sendC, recvC int
		if s < n-1 {
			sendC, recvC = x.mod(r-s), x.mod(r-s-1)
			if s == 0 {
				if err := x.ready(sendC, k); err != nil {
					x.drain(k, cur)
					return err
				}
			}
		} else {
			a := s - (n - 1)
			sendC, recvC = x.mod(r+1-a), x.mod(r-a)
			if a == 0 {
				// This rank's own chunk is final (divided by its last
				// addition, for Average).
				if err := x.store(sendC, k); err != nil {
					x.drain(k, cur)
					return err
				}
			}
		}
		done, err := x.send(k, s, x.seg(sendC, k))
		if err != nil {
			x.drain(k, cur)
			return err
		}
		if s < n-1 {
			rsSent[s] = done
		}
		var nxt chan result
		if a := s + 1 - (n - 1); a >= 0 && s+1 < total {
			// An all-gather step: the final chunk lands in place.
			nxt = x.recvInto(k, s+1, x.seg(x.mod(r-a), k))
		} else if s+1 < total {
			nxt = x.recv(k, s+1)
		}
		want := x.seg(recvC, k)
		got, err := x.take(k, cur, want)
		if err != nil {
			x.drain(k, nxt)
			return err
		}
		in, _ := got.Bytes()
		if s < n-1 {
			if err := x.ready(recvC, k); err != nil {
				_ = got.Release()
				x.drain(k, nxt)
				return err
			}
			if x.avg && s == n-2 {
				// The last addition into the chunk this rank owns:
				// divide the sums as they are made.
				x.kern.addDiv(x.bytes(want), in, n)
			} else {
				x.kern.add(x.bytes(want), in)
			}
		} else {
			// The bytes overwritten went out in reduce-scatter step a;
			// they have reached the successor (the chunk came round
			// since), and the send's completion says so here too.
			if err := x.awaitSent(k, rsSent[s-(n-1)]); err != nil {
				_ = got.Release()
				x.drain(k, nxt)
				return x.linkErr(x.nextRank, err)
			}
			x.place(want, got)
			if err := x.store(recvC, k); err != nil {
				_ = got.Release()
				x.drain(k, nxt)
				return err
			}
		}
		_ = got.Release()
		cur = nxt
	}
	return nil
}

// awaitSent waits in lane k for a send's completion (sent, from send)
// and returns its error, or the call's end.
func (x *run) awaitSent(k int, sent <-chan error) error {
	x.co[k].await(func() bool { return len(sent) > 0 || x.ctx.Err() != nil })
	select {
	case err := <-sent:
		return err
	default:
		return x.ctx.Err()
	}
}

// allGatherLane runs segment k of every slot around the ring.
func (x *run) allGatherLane(k int) error {
	n, r := x.n, x.rank
	cur := x.recvInto(k, 0, x.seg(x.mod(r-1), k))
	for a := 0; a < n-1; a++ {
		if _, err := x.send(k, a, x.seg(x.mod(r-a), k)); err != nil {
			x.drain(k, cur)
			return err
		}
		var nxt chan result
		if a+1 < n-1 {
			nxt = x.recvInto(k, a+1, x.seg(x.mod(r-a-2), k))
		}
		want := x.seg(x.mod(r-a-1), k)
		got, err := x.take(k, cur, want)
		if err != nil {
			x.drain(k, nxt)
			return err
		}
		x.place(want, got)
		_ = got.Release()
		cur = nxt
	}
	return nil
}

// broadcastLane passes segment k down the ring from the root.
func (x *run) broadcastLane(k int) error {
	pos := x.mod(x.rank - x.root)
	s := x.seg(0, k)
	if pos != 0 {
		got, err := x.take(k, x.recvInto(k, 0, s), s)
		if err != nil {
			return err
		}
		x.place(s, got)
		_ = got.Release()
	}
	if pos == x.n-1 {
		return nil
	}
	_, err := x.send(k, 0, s)
	return err
}

// sendCount counts a call's sends out, for the waits that need them all
// ended (waitSends, abort) without a goroutine of their own.
type sendCount struct {
	mu sync.Mutex
	n  int
	// zero is closed when n drops to 0; made by the first idle that
	// finds sends out.
	zero chan struct{}
}

func (c *sendCount) add() {
	c.mu.Lock()
	c.n++
	c.mu.Unlock()
}

func (c *sendCount) done() {
	c.mu.Lock()
	if c.n--; c.n == 0 && c.zero != nil {
		close(c.zero)
		c.zero = nil
	}
	c.mu.Unlock()
}

// idle returns nil when no send is out, else a channel closed when none
// is.
func (c *sendCount) idle() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == 0 {
		return nil
	}
	if c.zero == nil {
		c.zero = make(chan struct{})
	}
	return c.zero
}
