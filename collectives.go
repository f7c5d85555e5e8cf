package gdrlink

import (
	"context"
	"errors"
	"fmt"

	"github.com/gdrlink/gdrlink/collective"
	coll "github.com/gdrlink/gdrlink/internal/collective"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
)

// ReduceOp is the reduction of an AllReduce: Sum or Average.
type ReduceOp uint8

// Reductions.
const (
	// Sum adds the ranks' elements (integers wrap around on overflow).
	Sum = ReduceOp(coll.Sum)
	// Average divides the sum by Size(): rounded to the element type for
	// floats, truncated toward zero for integers.
	Average = ReduceOp(coll.Average)
)

// AllReduce reduces t over every rank of the job, in place: afterwards
// every rank's t holds the sum (or average) of all ranks' t, the same
// bits on every rank. t is a tensor of this group of a numeric type
// (integers, float16, bfloat16, float32, float64, complex) and the same
// shape on every rank: in host memory (NewTensor), in pinned memory or on
// the group's GPU (NewTensorOn). A GPU tensor is copied to a pinned host
// tensor, reduced there and copied back (Report.Staged counts the bytes);
// ranks may mix GPU and host tensors. The report says what the
// call did: the backend (ring), the bytes it put on the wire and took
// in, and per neighbour the provider, device and path they came by, as
// Transfer says for a Recv.
//
// The built-in backend is a ring over the group's zero-copy connections
// to its two neighbours: a reduce-scatter then an all-gather, each step
// cut into segments that go through the ring on their own, so sending,
// receiving and adding overlap. The pieces of t go out straight from t
// and land in registered tensors that are added into t as they arrive.
// The order of additions per element is fixed: the elements are cut into
// Size() chunks by index, and chunk c is summed left to right from rank
// c around the ring (((x_c + x_c+1) + x_c+2) + … + x_c-1), whatever
// the timing; its last adder then sends those bits, unchanged, to every
// other rank. So the result is bitwise identical on every rank and from
// run to run. 16-bit floats are added in float32, rounded after each
// addition.
//
// Every rank calls the collectives in the same order; a group runs one at
// a time (concurrent calls wait their turn). Their keys begin with
// "gdrlink/collective/": a program's own Send and Recv keys must not.
// ctx bounds the call: a call that fails takes at most about a second
// more to take back the pieces of t it offered its successor. If a rank
// dies or fails, every rank's pending collective fails with a
// *collective.RankError naming it, and the group can run no more
// collectives (collective.ErrBroken): close it.
func (g *Group) AllReduce(ctx context.Context, t *tensor.Tensor, op ReduceOp) (collective.Report, error) {
	return g.collective(ctx, "allreduce", func(b coll.Backend, seq uint64) (collective.Report, error) {
		return g.allReduceOnHost(ctx, b, seq, t, coll.Op(op))
	})
}

// Broadcast copies root's t into every other rank's t, in place. t is a
// tensor of this group (host, pinned or GPU, as for AllReduce) of the
// same type and shape on every rank. Calls are ordered and fail as AllReduce's are.
func (g *Group) Broadcast(ctx context.Context, t *tensor.Tensor, root int) (collective.Report, error) {
	return g.collective(ctx, "broadcast", func(b coll.Backend, seq uint64) (collective.Report, error) {
		id := callOf(b, seq, "broadcast", t)
		id.root = root
		return g.onHost(ctx, id, []stageArg{{t, g.Rank() == root, g.Rank() != root}}, func(h []*tensor.Tensor) (collective.Report, error) {
			return b.Broadcast(ctx, seq, h[0], root)
		})
	})
}

// AllGather gathers every rank's in into every rank's out: out holds
// Size() slots of in's size, rank i's in at slot i. out is a tensor
// of this group's pool of in's element type with Size() times its
// elements; its shape is the caller's (usually [Size(), in's shape...],
// as torch's all_gather_into_tensor, so that out's first index is the
// rank). in is left as it was. Either may be pinned or on the group's
// GPU, as for AllReduce. Calls are ordered and fail as AllReduce's
// are.
func (g *Group) AllGather(ctx context.Context, in, out *tensor.Tensor) (collective.Report, error) {
	return g.collective(ctx, "allgather", func(b coll.Backend, seq uint64) (collective.Report, error) {
		return g.onHost(ctx, callOf(b, seq, "allgather", out), []stageArg{{in, true, false}, {out, false, true}}, func(h []*tensor.Tensor) (collective.Report, error) {
			return b.AllGather(ctx, seq, h[0], h[1])
		})
	})
}

// collective runs one collective call in its turn and counts it.
func (g *Group) collective(ctx context.Context, op string, call func(coll.Backend, uint64) (collective.Report, error)) (collective.Report, error) {
	if err := g.usable(); err != nil {
		return collective.Report{Op: op}, err
	}
	g.collMu.Lock()
	defer g.collMu.Unlock()
	if g.collErr != nil {
		return collective.Report{Op: op}, fmt.Errorf("gdrlink: rank %d: %s: %w (%w)", g.Rank(), op, collective.ErrBroken, g.collErr)
	}
	rep, err := call(g.coll, g.collSeq)
	if err != nil && !errors.Is(err, coll.ErrBadArgument) {
		// The ranks may disagree on where they are now.
		g.collErr = err
	} else if err == nil {
		g.collSeq++
	}
	// The backend that ran the call: the switchml backend hands
	// Broadcast, AllGather and some element types to the ring.
	backend := rep.Backend
	if backend == "" {
		backend = g.coll.Name()
	}
	g.metrics.collective(op, backend, rep, err)
	if err != nil {
		return rep, fmt.Errorf("gdrlink: rank %d: %w", g.Rank(), err)
	}
	return rep, nil
}

// ringTransport is the ring backend's view of the group: its rank, size
// and zero-copy links.
type ringTransport struct{ g *Group }

func (t ringTransport) Rank() int { return t.g.Rank() }
func (t ringTransport) Size() int { return t.g.Size() }

func (t ringTransport) Link(ctx context.Context, peer int) (coll.Link, error) {
	p, err := t.g.peer(peer)
	if err != nil {
		return nil, err
	}
	ch, err := p.wait(ctx)
	if err != nil {
		return nil, err
	}
	return link{p: p, ch: ch}, nil
}

// link is a connection to one peer as the ring uses it.
type link struct {
	p  *peer
	ch *rendezvous.Channel
}

func (l link) SendFunc(key string, step int64, t *tensor.Tensor, done func(error)) error {
	return l.ch.SendFunc(key, step, t, done)
}

func (l link) SendError(key string, step int64, err error) error {
	return l.ch.SendError(key, step, err)
}

func (l link) RecvFunc(ctx context.Context, key string, step int64, cb func(*tensor.Tensor, rendezvous.Transfer, error), opts ...rendezvous.RecvOption) {
	l.ch.RecvFunc(ctx, key, step, cb, opts...)
}

// Abort closes the connection to the peer for good.
func (l link) Abort() error { return l.p.close() }

// ConfirmNow sends the channel's held confirmations at once.
func (l link) ConfirmNow() { l.ch.ConfirmNow() }
