package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/gdrlink/gdrlink/collective"
	coll "github.com/gdrlink/gdrlink/internal/collective"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/tensor"
)

// The collectives reduce and move host memory. A GPU tensor takes part
// through a pinned host tensor of the group's proxy pool (registered with
// the GPU and with every provider): its bytes are copied there before the
// collective where the collective reads them, the collective runs on the
// pinned tensor, and the result is copied back after it. The copies run on
// a stream of the group's GPU kept for the collectives.

// stagedAllReducer is a backend that runs an AllReduce on a host copy of a
// GPU tensor, loading and storing its pieces as its steps need them (the
// ring).
type stagedAllReducer interface {
	AllReduceStaged(ctx context.Context, seq uint64, t *tensor.Tensor, op coll.Op, st coll.Staging) (collective.Report, error)
}

// overlapMin is the smallest GPU tensor whose AllReduce overlaps its
// copies with the ring's steps. Below it one copy each way costs less:
// on an H100 shared by 4 ranks, a 64 KiB AllReduce took 0.37x the host
// ring's time with a copy per segment and 0.76x with whole copies, while
// from 1 MiB up the overlap was ahead (bench -scenario allreduce -set
// allreduce.gpu=on, 10 runs each; the README has the figures).
const overlapMin = 1 << 20

// allReduceOnHost runs b's AllReduce of t: a GPU tensor on a backend that
// can overlap the copies with its steps goes through AllReduceStaged
// from overlapMin bytes up, any other through onHost.
func (g *Group) allReduceOnHost(ctx context.Context, b coll.Backend, seq uint64, t *tensor.Tensor, op coll.Op) (collective.Report, error) {
	sb, ok := b.(stagedAllReducer)
	if !ok || t == nil || !t.Device().IsGPU() || t.Meta().ByteSize < overlapMin {
		return g.onHost(ctx, callOf(b, seq, "allreduce", t), []stageArg{{t, true, true}}, func(h []*tensor.Tensor) (collective.Report, error) {
			return b.AllReduce(ctx, seq, h[0], op)
		})
	}
	s, host, err := g.pinnedCopy(t)
	if err != nil {
		return collective.Report{}, callOf(b, seq, "allreduce", t).abandon(ctx, err)
	}
	st := &gpuStaging{g: g, s: s, dev: proxy.DevicePtr(t.Addr()), host: host.Addr()}
	start := time.Now()
	rep, err := sb.AllReduceStaged(ctx, seq, host, op, st)
	wait := time.Now()
	// Every copy is waited for, after a failure too, before the pinned
	// tensor goes back to the pool.
	serr := st.finish()
	rep.StageTook = time.Since(wait) + st.queued
	rep.Took = time.Since(start)
	rep.Staged = st.moved
	_ = host.Release()
	if err == nil && serr != nil {
		err = fmt.Errorf("collective result to the GPU: %w", serr)
	}
	return rep, err
}

// gpuStaging loads and stores pieces of a GPU tensor for the ring, with
// copies on the group's collective stream and an event per load.
type gpuStaging struct {
	g    *Group
	s    proxy.Stream
	dev  proxy.DevicePtr
	host uintptr

	mu     sync.Mutex
	events []proxy.Event
	moved  int64
	queued time.Duration // spent queuing loads before the ring began
}

func (st *gpuStaging) Load(off, n int64) func() error {
	if n == 0 {
		return func() error { return nil }
	}
	start := time.Now()
	st.mu.Lock()
	defer st.mu.Unlock()
	defer func() { st.queued += time.Since(start) }()
	dev := st.g.gpu.dev
	if err := dev.CopyDtoHAsync(st.host+uintptr(off), st.dev+proxy.DevicePtr(off), int(n), st.s); err != nil {
		return func() error { return err }
	}
	st.moved += n
	ev, err := dev.RecordEvent(st.s)
	if err != nil {
		return func() error { return err }
	}
	st.events = append(st.events, ev)
	var once sync.Once
	var werr error
	return func() error {
		// In the driver, not by polling with Go timers (see
		// copyAndWait); a queued copy ends at the device's rate.
		once.Do(func() { werr = ev.Wait(context.Background()) })
		return werr
	}
}

func (st *gpuStaging) Store(off, n int64) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if err := st.g.gpu.dev.CopyHtoDAsync(st.dev+proxy.DevicePtr(off), st.host+uintptr(off), int(n), st.s); err != nil {
		return err
	}
	st.moved += n
	return nil
}

// finish waits for every copy queued and releases the events.
func (st *gpuStaging) finish() error {
	err := st.s.Synchronize()
	st.mu.Lock()
	defer st.mu.Unlock()
	for _, ev := range st.events {
		_ = ev.Close()
	}
	st.events = nil
	return err
}

// stageArg is one tensor of a collective call: load when the collective
// reads its bytes, store when it writes them.
type stageArg struct {
	t           *tensor.Tensor
	load, store bool
}

// onHost runs call on host tensors in place of args' tensors: a host or
// pinned tensor goes as it is; a tensor on the group's GPU goes as a
// pinned host copy, loaded before the call and stored back after a call
// that succeeded. The report counts the copies in Staged and StageTook.
func (g *Group) onHost(ctx context.Context, id callID, args []stageArg, call func(host []*tensor.Tensor) (collective.Report, error)) (collective.Report, error) {
	host := make([]*tensor.Tensor, len(args))
	var staged []int // indexes of args on the GPU
	for i, a := range args {
		host[i] = a.t
		if a.t != nil && a.t.Device().IsGPU() {
			staged = append(staged, i)
		}
	}
	if len(staged) == 0 {
		return call(host)
	}
	var (
		moved int64
		took  time.Duration
	)
	defer func() {
		for _, i := range staged {
			if host[i] != args[i].t {
				_ = host[i].Release()
			}
		}
	}()
	var s proxy.Stream
	var err error
	for _, i := range staged {
		a := args[i]
		var h *tensor.Tensor
		if s, h, err = g.pinnedCopy(a.t); err != nil {
			break
		}
		host[i] = h
		if m := a.t.Meta(); a.load && m.ByteSize > 0 {
			start := time.Now()
			err = g.copyAndWait(ctx, s, func() error {
				return g.gpu.dev.CopyDtoHAsync(host[i].Addr(), proxy.DevicePtr(a.t.Addr()), int(m.ByteSize), s)
			})
			took += time.Since(start)
			moved += m.ByteSize
			if err != nil {
				break
			}
		}
	}
	if err != nil {
		return collective.Report{}, id.abandon(ctx, err)
	}
	rep, err := call(host)
	if err == nil {
		for _, i := range staged {
			a := args[i]
			if n := a.t.Meta().ByteSize; a.store && n > 0 {
				start := time.Now()
				err = g.copyAndWait(ctx, s, func() error {
					return g.gpu.dev.CopyHtoDAsync(proxy.DevicePtr(a.t.Addr()), host[i].Addr(), int(n), s)
				})
				took += time.Since(start)
				moved += n
				if err != nil {
					err = fmt.Errorf("collective result to the GPU: %w", err)
					break
				}
			}
		}
	}
	rep.Staged, rep.StageTook = moved, took
	rep.Took += took
	return rep, err
}

// pinnedCopy checks that t lives on this group's GPU and returns the
// collectives' stream and a pinned host tensor of t's type and shape (its
// bytes not yet copied).
func (g *Group) pinnedCopy(t *tensor.Tensor) (proxy.Stream, *tensor.Tensor, error) {
	s, err := g.collectiveStream(t)
	if err != nil {
		return nil, nil, err
	}
	if err := g.checkGPUTensor(t); err != nil {
		return nil, nil, err
	}
	h, err := g.gpu.pinned.NewTensor(t.Meta())
	if err != nil {
		return nil, nil, fmt.Errorf("pinned host copy of %s: %w", t.Meta(), err)
	}
	return s, h, nil
}

// callID is one collective call: its backend, sequence number, name and
// the meta-data of the tensor that fixes its steps (AllGather's output).
type callID struct {
	b    coll.Backend
	seq  uint64
	op   string
	meta tensor.Meta
	root int // a Broadcast's
}

func callOf(b coll.Backend, seq uint64, op string, t *tensor.Tensor) callID {
	id := callID{b: b, seq: seq, op: op}
	if t != nil {
		id.meta = t.Meta()
	}
	return id
}

// abandoner is a backend that can fail a call on this rank before it
// begins and tell the other ranks (coll.Ring.Abandon).
type abandoner interface {
	Abandon(ctx context.Context, seq uint64, op string, m tensor.Meta, root int, cause error) error
}

// abandon is the error of a call whose GPU tensor could not be staged
// (no room in the pinned pool, a failed copy): a bad argument is only
// returned (it leaves the group usable); any other failure is one of
// this rank, told to the other ranks where the backend can, so that
// their calls fail now, naming this rank, not at their deadlines.
func (id callID) abandon(ctx context.Context, cause error) error {
	err := gpuErr(cause)
	if errors.Is(err, coll.ErrBadArgument) {
		return err
	}
	if a, ok := id.b.(abandoner); ok {
		return a.Abandon(ctx, id.seq, id.op, id.meta, id.root, err)
	}
	return err
}

// gpuErr says that err came from a collective's copies, unless it is a
// bad argument, which says so already.
func gpuErr(err error) error {
	if errors.Is(err, coll.ErrBadArgument) {
		return err
	}
	return fmt.Errorf("collective on the GPU: %w", err)
}

// checkGPUTensor checks that t lives on this group's GPU.
func (g *Group) checkGPUTensor(t *tensor.Tensor) error {
	m := t.Meta()
	if m.IsDead || !m.DType.DMAable() {
		return fmt.Errorf("%w: tensor %s on %s: dead or not a numeric type", coll.ErrBadArgument, m, t.Device())
	}
	if g.gpu == nil || t.Device().Index != g.gpu.ordinal {
		return fmt.Errorf("%w: tensor on %s: not this group's GPU (WithGPU, GDRLINK_GPU)", coll.ErrBadArgument, t.Device())
	}
	return nil
}

// collectiveStream is the stream of the group's GPU that the collectives'
// copies run on, made at the first call that needs it (calls run one at a
// time, under collMu). t is the call's first GPU tensor, named in the
// error when the group has no GPU.
func (g *Group) collectiveStream(t *tensor.Tensor) (proxy.Stream, error) {
	if g.gpu == nil {
		return nil, fmt.Errorf("%w: tensor on %s: this group has no GPU (WithGPU, GDRLINK_GPU)", coll.ErrBadArgument, t.Device())
	}
	if g.gpu.collStream == nil {
		s, err := g.gpu.dev.NewStream()
		if err != nil {
			return nil, fmt.Errorf("GPU %d stream: %w", g.gpu.ordinal, err)
		}
		g.gpu.collStream = s
	}
	return g.gpu.collStream, nil
}

// copyAndWait queues a copy on s with queue and waits for it to complete,
// in the driver: a copy once queued is waited for whatever ctx does (it
// ends at the device's copy rate), so that none touches the pinned host
// tensor after it goes back to the pool. ctx is checked before the copy
// is queued. (Waiting in the driver rather than polling with Go timers:
// timers under a millisecond fire after about one in an idle process, and
// a 4 KiB copy then took 1.2 ms on an H100.)
func (g *Group) copyAndWait(ctx context.Context, s proxy.Stream, queue func() error) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%w: %w", proxy.ErrCanceled, err)
	}
	if err := queue(); err != nil {
		return err
	}
	ev, err := g.gpu.dev.RecordEvent(s)
	if err != nil {
		return errors.Join(err, s.Synchronize())
	}
	defer ev.Close()
	return ev.Wait(context.WithoutCancel(ctx))
}
