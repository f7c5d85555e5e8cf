package proxy

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
)

// writeMode is where a NIC's bytes for a GPU land.
type writeMode int

// Modes.
const (
	// modeProxy: the NIC writes a pinned host proxy; the proxy copies it to
	// the GPU.
	modeProxy writeMode = iota
	// modeDirect: the NIC writes GPU memory itself (GPUDirect RDMA).
	modeDirect
)

// String names the mode.
func (m writeMode) String() string {
	if m == modeDirect {
		return "direct"
	}
	return "proxy"
}

// defaultChunk is the default pipelining chunk: big enough that a copy's
// fixed cost (a few microseconds) is small against its transfer time, small
// enough that a 64 MiB tensor has 16 chunks to overlap.
const defaultChunk = 4 << 20

type config struct {
	chunk       int
	direct      bool
	flush       flushMode
	flushSet    bool
	ordered     bool
	flusher     DirectFlusher
	flushTimout time.Duration
	lookupEnv   func(string) (string, bool)
}

// Option configures a Proxy.
type Option func(*config) error

// WithChunk sets the chunk size the sender stages in and that receivers
// advertise to transports (default 4 MiB: big enough that a copy's fixed
// cost is small against its transfer time, small enough that a 64 MiB
// tensor has 16 chunks to overlap).
func WithChunk(n int) Option {
	return func(c *config) error {
		if n <= 0 {
			return fmt.Errorf("%w: chunk of %d bytes", ErrOutOfRange, n)
		}
		c.chunk = n
		return nil
	}
}

// WithDirect makes the proxy's receives land in the GPU's memory itself: the
// NIC reaches the GPU (GPUDirect RDMA, as package gdr decides), so there is
// no proxy tensor and no copy. Before a Direct receive completes, f makes the
// NIC's writes visible to the GPU (a read through a loopback queue pair);
// writesOrdered says that the GPU orders a NIC's writes before its own later
// reads (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING of 100 or
// more), so that no flush is needed. GDRLINK_GDR_FLUSH overrides that
// choice: 1 always flushes, 0 never does, auto (the default) flushes, as
// NCCL does, only when writes are not ordered and the GPU is below compute
// capability 9.0 (or attached over C2C). A flush goes through the driver
// where the device can flush from the host (the CUDA device: attribute
// CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS with its host bit,
// then cuFlushGPUDirectRDMAWrites), through f otherwise; f may be nil. A
// Direct receive that needs a flush and has neither fails.
func WithDirect(f DirectFlusher, writesOrdered bool) Option {
	return func(c *config) error {
		c.direct, c.flusher, c.ordered = true, f, writesOrdered
		return nil
	}
}

// withFlush sets the flush mode, overriding GDRLINK_GDR_FLUSH.
func withFlush(m flushMode) Option {
	return func(c *config) error { c.flush, c.flushSet = m, true; return nil }
}

// DirectFlusher makes a NIC's earlier writes to GPU memory at addr visible to
// the GPU (see WithDirect).
type DirectFlusher interface {
	Flush(ctx context.Context, addr uintptr) error
}

// Proxy copies proxy tensors to one device (and stages the device's tensors
// for sending). It owns a stream on the device and the poller goroutine that
// completes its copies.
type Proxy struct {
	dev    Device
	pool   *alloc.Pool
	cfg    config
	stream Stream
	poll   *poller

	mu     sync.Mutex
	closed bool
	open   map[*Receiver]struct{}
	wg     sync.WaitGroup // receivers and stagings not yet completed

	receives, chunks atomic.Uint64
}

// proxyStats counts what a proxy did.
type proxyStats struct {
	// Receives is the number of receives started.
	Receives uint64
	// Chunks is the number of chunks reported through ChunkArrived: a
	// transport that pipelines reports several per receive, one that does
	// not reports one.
	Chunks uint64
}

// stats returns the proxy's counters.
func (p *Proxy) stats() proxyStats {
	return proxyStats{Receives: p.receives.Load(), Chunks: p.chunks.Load()}
}

// New makes a proxy for dev whose proxy tensors come from pool, which must
// hand out pinned host memory (a pool over alloc's pinned source, or over a
// host source with the cudahost visitor). GDRLINK_GDR_FLUSH says when Direct
// receives flush (see WithDirect); a value other than 0, 1 or auto fails.
func New(dev Device, pool *alloc.Pool, opts ...Option) (*Proxy, error) {
	if dev == nil || pool == nil {
		return nil, fmt.Errorf("%w: proxy needs a device and a pool", ErrWrongMemory)
	}
	if pool.Device().IsGPU() {
		return nil, fmt.Errorf("%w: pool %s holds %s memory; proxy tensors must be pinned host memory", ErrWrongMemory, pool.Stats().Name, pool.Device())
	}
	cfg := config{chunk: defaultChunk, flushTimout: 10 * time.Second, lookupEnv: os.LookupEnv}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&cfg); err != nil {
			return nil, err
		}
	}
	if !cfg.flushSet {
		if v, ok := cfg.lookupEnv("GDRLINK_GDR_FLUSH"); ok {
			m, err := parseFlushMode(v)
			if err != nil {
				return nil, err
			}
			cfg.flush = m
		}
	}
	s, err := dev.NewStream()
	if err != nil {
		return nil, err
	}
	return &Proxy{dev: dev, pool: pool, cfg: cfg, stream: s, poll: newPoller(), open: map[*Receiver]struct{}{}}, nil
}

// mode is where the proxy's receives land.
func (p *Proxy) mode() writeMode {
	if p.cfg.direct {
		return modeDirect
	}
	return modeProxy
}

// flushPlan decides how Direct receives flush (chooseFlush), from the mode,
// WithDirect's arguments and the device's facts.
func (p *Proxy) flushPlan() (flushMethod, error) {
	var facts *gpuDirectFacts
	if fd, ok := p.dev.(rdmaFlushDevice); ok {
		var f gpuDirectFacts
		f.ComputeCapability, f.C2C, f.HostFlush = fd.GPUDirectFacts()
		facts = &f
	}
	return chooseFlush(p.cfg.flush, p.cfg.ordered, facts, p.cfg.flusher != nil)
}

func (p *Proxy) begin() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("%w: proxy of %s", ErrClosed, p.dev.Info().Name)
	}
	p.wg.Add(1)
	return nil
}

// Receiver is one tensor on its way to the device: the transport writes its
// bytes at Addr (a pinned proxy tensor, or the GPU memory itself for a Direct
// proxy) and calls ChunkArrived as each part lands.
type Receiver struct {
	p    *Proxy
	mode writeMode
	dst  DevicePtr
	n    int
	blk  alloc.Block
	done func(error)
	fin  chan struct{}

	mu      sync.Mutex
	got     []span // arrived ranges, sorted and merged
	arrived int
	queued  bool  // copies were queued on the stream
	err     error // first failure
	aborted bool  // the transport let go of the proxy tensor
	ending  bool  // completion scheduled
	result  error
}

type span struct{ off, end int }

// Receive starts receiving n bytes for device memory at dst. done runs once,
// from the proxy's poller goroutine or the caller's, when the bytes are on
// the device (nil) or the receive failed; by then the proxy tensor is back in
// the pool. A receive that fails before every byte has arrived (a copy that
// cannot be queued) keeps its proxy tensor, and reports, only once the
// transport has let go of it: every byte reported through ChunkArrived, or
// Abort. A NIC may still be writing the rest of the tensor until then. dst
// must be device memory and the pool's block pinned host memory, or Receive
// fails with ErrWrongMemory.
func (p *Proxy) Receive(dst DevicePtr, n int, done func(error)) (*Receiver, error) {
	if n <= 0 {
		return nil, fmt.Errorf("%w: receive of %d bytes", ErrOutOfRange, n)
	}
	mt, err := p.dev.MemoryType(uintptr(dst))
	if err != nil {
		return nil, err
	}
	if mt != MemoryDevice {
		return nil, fmt.Errorf("%w: destination %#x is %s memory, not memory of %s", ErrWrongMemory, dst, mt, p.dev.Info().Name)
	}
	if err := p.begin(); err != nil {
		return nil, err
	}
	r := &Receiver{p: p, mode: p.mode(), dst: dst, n: n, done: done, fin: make(chan struct{})}
	if r.mode == modeProxy {
		blk, err := p.pool.Alloc(n)
		if err != nil {
			p.wg.Done()
			return nil, err
		}
		if mt, err := p.dev.MemoryType(blk.Addr()); err != nil || mt != MemoryPinned {
			_ = blk.Free()
			p.wg.Done()
			if err == nil {
				err = fmt.Errorf("%w: pool %s hands out %s memory (%#x); proxy tensors must be pinned (use alloc's pinned source or the cudahost visitor)", ErrWrongMemory, p.pool.Stats().Name, mt, blk.Addr())
			}
			return nil, err
		}
		r.blk = blk
	}
	p.mu.Lock()
	p.open[r] = struct{}{}
	p.mu.Unlock()
	p.receives.Add(1)
	return r, nil
}

// Direct reports whether the transport writes the GPU's memory itself
// (WithDirect) rather than a pinned proxy tensor.
func (r *Receiver) Direct() bool { return r.mode == modeDirect }

// Addr is where the transport writes the tensor's bytes: the proxy tensor,
// or the destination device memory for a Direct receive.
func (r *Receiver) Addr() uintptr {
	if r.mode == modeDirect {
		return uintptr(r.dst)
	}
	return r.blk.Addr()
}

// Block is the proxy tensor (the zero Block for a Direct receive); its arena
// holds the memory region whose rkey the transport sends.
func (r *Receiver) Block() alloc.Block { return r.blk }

// outcome is the receive's outcome once r.fin is closed.
func (r *Receiver) outcome() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.result
}

// Wait blocks until the receive completes or ctx ends; ending ctx aborts it.
func (r *Receiver) Wait(ctx context.Context) error {
	select {
	case <-r.fin:
		return r.outcome()
	case <-ctx.Done():
		r.Abort(fmt.Errorf("%w: %w", ErrCanceled, ctx.Err()))
		<-r.fin
		return r.outcome()
	}
}

// ChunkArrived tells the receiver that [off, off+n) has landed at Addr. For
// a proxy tensor the chunk's host-to-device copy is queued at once; when the last
// byte has arrived an event is recorded and the poller completes the
// receive. Chunks may come in any order but must not overlap. After a
// failure, chunks are still taken (and not copied) and return the failure:
// the receive ends when the last byte is in or on Abort.
func (r *Receiver) ChunkArrived(off, n int) error {
	if off < 0 || n <= 0 || off > r.n-n {
		return fmt.Errorf("%w: chunk [%d, +%d) of a %d-byte tensor", ErrOutOfRange, off, n, r.n)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ending {
		if r.err != nil {
			return r.err
		}
		return fmt.Errorf("%w: chunk [%d, +%d) after the whole tensor arrived", errBadChunk, off, n)
	}
	if err := r.addSpan(off, off+n); err != nil {
		return err
	}
	r.arrived += n
	r.p.chunks.Add(1)
	if r.err != nil {
		r.failLocked(r.err) // ends the receive if this was the last byte
		return r.err
	}
	if r.mode == modeProxy {
		if err := r.p.dev.CopyHtoDAsync(r.dst+DevicePtr(off), r.blk.Addr()+uintptr(off), n, r.p.stream); err != nil {
			r.failLocked(err)
			return err
		}
		r.queued = true
	}
	if r.arrived < r.n {
		return nil
	}
	r.ending = true
	if r.mode == modeDirect {
		err := r.p.flushDirect(uintptr(r.dst))
		go r.complete(err) // not under r.mu: done may call back into the receiver
		return err
	}
	ev, err := r.p.dev.RecordEvent(r.p.stream)
	if err != nil {
		r.ending = false
		r.failLocked(err)
		return err
	}
	r.p.poll.add(ev, r.complete)
	return nil
}

// addSpan records [off, end) as arrived, refusing overlaps.
func (r *Receiver) addSpan(off, end int) error {
	i := sort.Search(len(r.got), func(i int) bool { return r.got[i].off >= end })
	if i > 0 && r.got[i-1].end > off {
		return fmt.Errorf("%w: chunk [%d, %d) overlaps [%d, %d) that already arrived", errBadChunk, off, end, r.got[i-1].off, r.got[i-1].end)
	}
	r.got = append(r.got, span{})
	copy(r.got[i+1:], r.got[i:])
	r.got[i] = span{off, end}
	// merge with neighbours so the list stays short
	if i+1 < len(r.got) && r.got[i].end == r.got[i+1].off {
		r.got[i].end = r.got[i+1].end
		r.got = append(r.got[:i+1], r.got[i+2:]...)
	}
	if i > 0 && r.got[i-1].end == r.got[i].off {
		r.got[i-1].end = r.got[i].end
		r.got = append(r.got[:i], r.got[i+1:]...)
	}
	return nil
}

// Abort fails the receive with err (ErrCanceled if nil), or with its
// earlier failure, and tells the proxy that the transport no longer writes
// the proxy tensor. Copies already queued finish before the proxy tensor
// goes back to the pool. Aborting a finished receive does nothing.
func (r *Receiver) Abort(err error) {
	if err == nil {
		err = ErrCanceled
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ending {
		return
	}
	r.aborted = true
	r.failLocked(err)
}

// failLocked records the first failure. The receive completes once the
// transport has let go of the proxy tensor (every byte arrived, or Abort)
// and the copies already queued are done (they read the proxy tensor). A
// device that cannot even record an event is lost: its copies stopped, and
// the tensor goes back at once.
func (r *Receiver) failLocked(err error) {
	if r.err == nil {
		r.err = err
	}
	if r.ending || (r.arrived < r.n && !r.aborted) {
		return
	}
	r.ending = true
	err = r.err
	if r.mode == modeProxy && r.queued {
		if ev, e2 := r.p.dev.RecordEvent(r.p.stream); e2 == nil {
			r.p.poll.add(ev, func(error) { r.complete(err) })
			return
		}
	}
	go r.complete(err)
}

// complete returns the proxy tensor to the pool and reports the outcome.
func (r *Receiver) complete(err error) {
	r.mu.Lock()
	if r.err != nil {
		err = r.err
	} else if err != nil {
		r.err = err
	}
	r.mu.Unlock()
	if r.mode == modeProxy {
		if ferr := r.blk.Free(); ferr != nil {
			err = errors.Join(err, ferr)
		}
	}
	r.mu.Lock()
	r.result = err
	r.mu.Unlock()
	r.p.mu.Lock()
	delete(r.p.open, r)
	r.p.mu.Unlock()
	if r.done != nil {
		r.done(err)
	}
	close(r.fin)
	r.p.wg.Done()
}

func (p *Proxy) flushDirect(addr uintptr) error {
	m, err := p.flushPlan()
	if err != nil {
		return fmt.Errorf("%w (on %s)", err, p.dev.Info().Name)
	}
	switch m {
	case flushByDriver:
		return p.dev.(rdmaFlushDevice).FlushRDMAWrites()
	case flushByRead:
		ctx, cancel := context.WithTimeout(context.Background(), p.cfg.flushTimout)
		defer cancel()
		return p.cfg.flusher.Flush(ctx, addr)
	}
	return nil
}

// Staged is a device tensor staged into a pinned proxy for a NIC that cannot
// read the GPU.
type Staged struct {
	p    *Proxy
	blk  alloc.Block
	n    int
	fin  chan struct{}
	once sync.Once

	mu     sync.Mutex
	result error
	freed  bool
}

// Stage copies n bytes of device memory at src into a pinned proxy tensor,
// chunk by chunk. chunkReady (may be nil) runs from the poller as each chunk
// lands in host memory, so the transport can start writing it while later
// chunks are still copying; done runs once after the last chunk, or with the
// error. The caller releases the proxy tensor with Release once the NIC has
// read it.
func (p *Proxy) Stage(src DevicePtr, n int, chunkReady func(off, n int), done func(error)) (*Staged, error) {
	if n <= 0 {
		return nil, fmt.Errorf("%w: staging of %d bytes", ErrOutOfRange, n)
	}
	mt, err := p.dev.MemoryType(uintptr(src))
	if err != nil {
		return nil, err
	}
	if mt != MemoryDevice {
		return nil, fmt.Errorf("%w: source %#x is %s memory, not memory of %s", ErrWrongMemory, src, mt, p.dev.Info().Name)
	}
	if err := p.begin(); err != nil {
		return nil, err
	}
	blk, err := p.pool.Alloc(n)
	if err != nil {
		p.wg.Done()
		return nil, err
	}
	s := &Staged{p: p, blk: blk, n: n, fin: make(chan struct{})}
	finish := func(err error) {
		s.once.Do(func() {
			s.mu.Lock()
			s.result = err
			s.mu.Unlock()
			if done != nil {
				done(err)
			}
			close(s.fin)
			p.wg.Done()
		})
	}
	var failed error
	for off := 0; off < n && failed == nil; off += p.cfg.chunk {
		c := min(p.cfg.chunk, n-off)
		if err := p.dev.CopyDtoHAsync(blk.Addr()+uintptr(off), src+DevicePtr(off), c, p.stream); err != nil {
			failed = err
			break
		}
		ev, err := p.dev.RecordEvent(p.stream)
		if err != nil {
			failed = err
			break
		}
		last := off+c == n
		o := off
		p.poll.add(ev, func(err error) {
			switch {
			case err != nil:
				finish(err)
			default:
				if chunkReady != nil {
					chunkReady(o, c)
				}
				if last {
					finish(nil)
				}
			}
		})
	}
	if failed != nil {
		// Chunks already queued complete through the poller; the failure
		// is reported after them.
		if ev, err := p.dev.RecordEvent(p.stream); err == nil {
			p.poll.add(ev, func(error) { finish(failed) })
		} else {
			finish(failed)
		}
	}
	return s, nil
}

// Block is the proxy tensor holding the staged bytes: the NIC reads them at
// its Addr, and its arena holds the memory region whose key it needs.
func (s *Staged) Block() alloc.Block { return s.blk }

// wait blocks until staging completes or ctx ends.
func (s *Staged) wait(ctx context.Context) error {
	select {
	case <-s.fin:
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.result
	case <-ctx.Done():
		return fmt.Errorf("%w: staging: %w", ErrCanceled, ctx.Err())
	}
}

// Release returns the proxy tensor to the pool, after waiting for the
// staging copies. Idempotent.
func (s *Staged) Release() error {
	<-s.fin
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.freed {
		return nil
	}
	s.freed = true
	return s.blk.Free()
}

// pending is the number of events the poller is waiting for.
func (p *Proxy) pending() int { return p.poll.len() }

// Close aborts receives still open (their queued copies finish first), waits
// for every receive and staging to complete, then stops the poller and
// releases the stream. Idempotent.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	open := make([]*Receiver, 0, len(p.open))
	for r := range p.open {
		open = append(open, r)
	}
	p.mu.Unlock()
	for _, r := range open {
		r.Abort(fmt.Errorf("%w: proxy of %s", ErrClosed, p.dev.Info().Name))
	}
	p.wg.Wait()
	p.poll.close()
	return p.stream.Close()
}
