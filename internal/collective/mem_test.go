package collective

import (
	"context"
	"fmt"
	"sync"
	"unsafe"

	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// The algorithm tests run the ring's ranks as goroutines over links in
// memory: they check the arithmetic and the order of additions. The
// front door's tests run it across real processes and transports.

// heapBuf is a Buffer on the Go heap, 8-byte aligned.
type heapBuf struct{ b []byte }

func newHeapBuf(n int) *heapBuf {
	w := make([]uint64, (n+7)/8)
	if len(w) == 0 {
		return &heapBuf{b: []byte{}}
	}
	return &heapBuf{b: unsafe.Slice((*byte)(unsafe.Pointer(&w[0])), n)}
}

func (h *heapBuf) Bytes() []byte         { return h.b }
func (h *heapBuf) Addr() uintptr         { return uintptr(unsafe.Pointer(unsafe.SliceData(h.b))) }
func (h *heapBuf) Len() int              { return len(h.b) }
func (h *heapBuf) Device() tensor.Device { return tensor.Host }
func (h *heapBuf) Free() error           { return nil }

func newTensor(dt tensor.DType, n int64) *tensor.Tensor {
	m, err := tensor.MetaFor(dt, tensor.Shape{n})
	if err != nil {
		panic(err)
	}
	t, err := tensor.New(m, newHeapBuf(int(m.ByteSize)))
	if err != nil {
		panic(err)
	}
	return t
}

// memJob is a job whose ranks are goroutines.
type memJob struct {
	size  int
	mu    sync.Mutex
	boxes map[boxKey]*box
	dead  map[int]bool
}

type boxKey struct {
	from, to int
	key      string
	step     int64
}

type box struct {
	t    *tensor.Tensor
	serr error
	done func(error)
	cb   func(*tensor.Tensor, rendezvous.Transfer, error)
}

func newMemJob(size int) *memJob {
	return &memJob{size: size, boxes: map[boxKey]*box{}, dead: map[int]bool{}}
}

// kill makes rank r dead: what waits on it fails as a lost peer.
func (j *memJob) kill(r int) {
	j.mu.Lock()
	j.dead[r] = true
	var fire []func()
	for k, b := range j.boxes {
		if k.from == r || k.to == r {
			delete(j.boxes, k)
			fire = append(fire, j.failBox(b, fmt.Errorf("%w: rank %d", verbsio.ErrPeerLost, r)))
		}
	}
	j.mu.Unlock()
	for _, f := range fire {
		f()
	}
}

func (j *memJob) failBox(b *box, err error) func() {
	return func() {
		if b.done != nil {
			b.done(err)
		}
		if b.cb != nil {
			b.cb(nil, rendezvous.Transfer{}, err)
		}
	}
}

type memTransport struct {
	j    *memJob
	rank int
}

func (t memTransport) Rank() int { return t.rank }
func (t memTransport) Size() int { return t.j.size }
func (t memTransport) Link(ctx context.Context, peer int) (Link, error) {
	return memLink{j: t.j, me: t.rank, peer: peer}, nil
}

type memLink struct {
	j        *memJob
	me, peer int
}

// match delivers a box that has both sides, under j.mu; the returned
// function runs outside it.
func (l memLink) match(k boxKey, b *box) func() {
	if b.cb == nil || (b.t == nil && b.serr == nil) {
		return nil
	}
	delete(l.j.boxes, k)
	if b.serr != nil {
		return func() {
			b.cb(nil, rendezvous.Transfer{}, fmt.Errorf("%w: %v", rendezvous.ErrRemote, b.serr))
		}
	}
	src, _ := b.t.Bytes()
	out := newTensor(b.t.Meta().DType, int64(len(src)/b.t.Meta().DType.Size()))
	ob, _ := out.Bytes()
	copy(ob, src)
	tr := rendezvous.Transfer{Key: k.key, Step: k.step, Path: rendezvous.PathDirect, Provider: "mem", Device: "mem0", Bytes: int64(len(src))}
	return func() { b.done(nil); b.cb(out, tr, nil) }
}

func (l memLink) put(k boxKey, f func(b *box)) error {
	l.j.mu.Lock()
	if l.j.dead[l.peer] || l.j.dead[l.me] {
		l.j.mu.Unlock()
		return fmt.Errorf("%w: rank %d", verbsio.ErrPeerLost, l.peer)
	}
	b := l.j.boxes[k]
	if b == nil {
		b = &box{}
		l.j.boxes[k] = b
	}
	f(b)
	run := l.match(k, b)
	l.j.mu.Unlock()
	if run != nil {
		run()
	}
	return nil
}

func (l memLink) SendFunc(key string, step int64, t *tensor.Tensor, done func(error)) error {
	return l.put(boxKey{l.me, l.peer, key, step}, func(b *box) { b.t, b.done = t, done })
}

// ConfirmNow has nothing to send: memLink confirms nothing.
func (l memLink) ConfirmNow() {}

func (l memLink) SendError(key string, step int64, err error) error {
	return l.put(boxKey{l.me, l.peer, key, step}, func(b *box) { b.serr = err })
}

// RecvFunc ignores opts: every result is a tensor of its own (rendezvous.Into's
// fallback).
func (l memLink) RecvFunc(ctx context.Context, key string, step int64, cb func(*tensor.Tensor, rendezvous.Transfer, error), _ ...rendezvous.RecvOption) {
	k := boxKey{l.peer, l.me, key, step}
	if err := ctx.Err(); err != nil {
		cb(nil, rendezvous.Transfer{}, fmt.Errorf("%w: %w", rendezvous.ErrCancelled, context.Cause(ctx)))
		return
	}
	if err := l.put(k, func(b *box) { b.cb = cb }); err != nil {
		cb(nil, rendezvous.Transfer{}, err)
		return
	}
	context.AfterFunc(ctx, func() {
		l.j.mu.Lock()
		b := l.j.boxes[k]
		if b == nil || b.cb == nil {
			l.j.mu.Unlock()
			return
		}
		b.cb = nil
		l.j.mu.Unlock()
		cb(nil, rendezvous.Transfer{}, fmt.Errorf("%w: %w", rendezvous.ErrCancelled, context.Cause(ctx)))
	})
}

func (l memLink) Abort() error {
	l.j.mu.Lock()
	var fire []func()
	for k, b := range l.j.boxes {
		if k.from == l.me && k.to == l.peer && b.done != nil {
			delete(l.j.boxes, k)
			fire = append(fire, l.j.failBox(&box{done: b.done}, fmt.Errorf("%w: aborted", rendezvous.ErrClosed)))
		}
	}
	l.j.mu.Unlock()
	for _, f := range fire {
		f()
	}
	return nil
}
