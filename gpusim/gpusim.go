// Package gpusim is a simulated GPU: host memory plus a copy goroutine per
// stream with a configurable bandwidth, behind the same proxy.Device
// interface as the real CUDA device. It exists so that the proxy's
// pipelining, ordering and error paths run and are tested on machines
// without a GPU; figures measured on it say nothing about a real GPU, and
// DeviceInfo.Simulated says so.
//
// "Device memory" is anonymous memory mapped off the Go heap; every copy is a
// real memory copy, paced per direction (host-to-device and device-to-host,
// like a GPU's copy engines) so that a copy of n bytes takes at least
// n/Bandwidth. Copies are checked as a GPU would check them: a destination
// outside a device allocation, or a device pointer given as host memory,
// fails with proxy.ErrWrongMemory or proxy.ErrOutOfRange and writes nothing.
//
// Faults can be injected: FailCopies makes chosen copies fail (the error
// surfaces at the next event of the stream, as a GPU's asynchronous errors
// do), and Lose makes the device lost: queued work fails and every later
// call returns proxy.ErrDeviceLost.
//
// A shareable device (Config.Shareable) stands in for CUDA IPC between two
// processes: ExportSimulatedHandle, OpenSimulatedHandle and CopyDtoDAsync
// (ipc.go), all simulated.
package gpusim

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/proxy"
)

// Config sets up a simulated device.
type Config struct {
	// Name is the device's name (default "gpusim").
	Name string
	// Ordinal is the device's number.
	Ordinal int
	// Bandwidth is the copy rate of each direction in bytes per second;
	// 0 means as fast as memory copies go.
	Bandwidth float64
	// MemoryLimit caps the device memory in bytes; 0 means no cap.
	MemoryLimit int64
	// ComputeCapability (major*10+minor), C2C and HostFlush are what the
	// simulated device reports of NIC writes into its memory, for the
	// proxy's choice of GPUDirect flush: the zero values report a GPU of
	// unknown age whose driver cannot flush from the host.
	ComputeCapability int
	C2C, HostFlush    bool
	// Shareable backs each allocation with its own sealed memfd, so that
	// the device's ExportSimulatedHandle method (see ipc.go) can hand it to
	// another process: the simulated counterpart of CUDA IPC.
	Shareable bool
}

// Direction is the direction of a copy.
type Direction int

// Copy directions.
const (
	HostToDevice Direction = iota
	DeviceToHost
	// deviceToDevice: a copy between two device allocations (one may be a
	// peer's, opened with OpenSimulatedHandle); it prints as "DtoD".
	deviceToDevice
)

// String names the direction.
func (d Direction) String() string {
	switch d {
	case HostToDevice:
		return "HtoD"
	case deviceToDevice:
		return "DtoD"
	}
	return "DtoH"
}

// CopyInfo describes one copy to a fault hook.
type CopyInfo struct {
	Dir Direction
	// Dst and Src are the addresses, N the length.
	Dst, Src uintptr
	N        int
	// Seq counts the device's copies from 0, in the order they were queued.
	Seq int64
}

// Stats counts what the device did.
type Stats struct {
	Copies       int64
	BytesHtoD    int64
	BytesDtoH    int64
	BytesDtoD    int64
	FailedCopies int64
	// RDMAFlushes counts simulated driver flushes of NIC writes
	// (FlushRDMAWrites).
	RDMAFlushes  int64
	DeviceMemory int64
	LiveStreams  int
	LiveAllocs   int
}

// span is a range of memory.
type span struct {
	base uintptr
	size int
}

// contains reports whether [addr, addr+n) lies in s; for n == 0, whether
// the byte at addr does (the end of a span is not in it: the kernel often
// maps the next range right there).
func (s span) contains(addr uintptr, n int) bool {
	return addr >= s.base && n >= 0 && uint64(addr-s.base)+uint64(max(n, 1)) <= uint64(s.size)
}

// spans is a list of disjoint ranges sorted by base.
type spans []span

// find returns the index of the span holding [addr, addr+n), or -1.
func (l spans) find(addr uintptr, n int) int {
	i := sort.Search(len(l), func(i int) bool { return l[i].base > addr }) - 1
	if i >= 0 && l[i].contains(addr, n) {
		return i
	}
	return -1
}

func (l spans) insert(s span) spans {
	i := sort.Search(len(l), func(i int) bool { return l[i].base > s.base })
	l = append(l, span{})
	copy(l[i+1:], l[i:])
	l[i] = s
	return l
}

func (l spans) remove(i int) spans { return append(l[:i], l[i+1:]...) }

// Device is a simulated GPU: a proxy.Device, with what tests need to look
// at its memory and to inject faults.
type Device interface {
	proxy.Device
	// Peek returns a host view of n bytes of simulated device memory at p,
	// for tests that check what landed on the "GPU".
	Peek(p proxy.DevicePtr, n int) ([]byte, error)
	// RegisterHost marks [addr, addr+n) of host memory as pinned for this
	// device (what cuMemHostRegister does on a real GPU); unregister undoes
	// it and is idempotent. A device pointer fails with
	// proxy.ErrWrongMemory.
	RegisterHost(addr uintptr, n int) (unregister func(), err error)
	// HostRegisterVisitor is an alloc.Visitor that registers every arena of
	// a host pool as pinned with this device, as alloc/visitor's
	// NewCUDAHostRegister does with cuMemHostRegister on a real GPU.
	HostRegisterVisitor() alloc.Visitor
	// FailCopies installs a fault hook called before every copy; a non-nil
	// error fails that copy (nothing is written) and surfaces, wrapped in
	// proxy.ErrCopyFailed, from the next event of its stream. nil removes
	// it.
	FailCopies(hook func(CopyInfo) error)
	// Lose makes the device lost: queued copies fail, pending events
	// complete with proxy.ErrDeviceLost, and every later call returns it.
	Lose()
	// Stats counts what the device did.
	Stats() Stats
}

// device is the simulated GPU New makes.
type device struct {
	cfg Config

	mu      sync.Mutex
	allocs  spans // device memory
	mems    map[uintptr][]byte
	fds     map[uintptr]int  // memfd of a shareable allocation
	opened  map[uintptr]bool // mappings of a peer's allocation
	pinned  spans            // host ranges registered as pinned
	used    int64
	streams map[*stream]struct{}
	closed  bool
	fail    func(CopyInfo) error

	lost atomic.Bool
	seq  atomic.Int64
	pace [3]pacer

	copies, bytesHtoD, bytesDtoH, bytesDtoD, failed, flushes atomic.Int64
}

var _ Device = (*device)(nil)

// New makes a simulated device; Close releases its memory and streams.
func New(cfg Config) Device {
	if cfg.Name == "" {
		cfg.Name = "gpusim"
	}
	d := &device{cfg: cfg, streams: map[*stream]struct{}{}, mems: map[uintptr][]byte{}, fds: map[uintptr]int{}, opened: map[uintptr]bool{}}
	for i := range d.pace {
		d.pace[i].bw = cfg.Bandwidth
	}
	return d
}

// Info implements proxy.Device; Simulated is true.
func (d *device) Info() proxy.DeviceInfo {
	return proxy.DeviceInfo{Name: d.cfg.Name, Ordinal: d.cfg.Ordinal, Simulated: true}
}

// GPUDirectFacts reports Config's ComputeCapability, C2C and HostFlush, for
// the proxy's choice of GPUDirect flush.
func (d *device) GPUDirectFacts() (computeCapability int, c2c, hostFlush bool) {
	return d.cfg.ComputeCapability, d.cfg.C2C, d.cfg.HostFlush
}

// FlushRDMAWrites is a simulated driver flush of NIC writes, counted in
// Stats; refused where Config.HostFlush is false, as the real driver
// refuses.
func (d *device) FlushRDMAWrites() error {
	if err := d.usable(); err != nil {
		return err
	}
	if !d.cfg.HostFlush {
		return fmt.Errorf("%w: simulated device %s cannot flush NIC writes from the host", proxy.ErrCopyFailed, d.cfg.Name)
	}
	d.flushes.Add(1)
	return nil
}

func (d *device) usable() error {
	if d.lost.Load() {
		return fmt.Errorf("%w: simulated device %s", proxy.ErrDeviceLost, d.cfg.Name)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("%w: simulated device %s", proxy.ErrClosed, d.cfg.Name)
	}
	return nil
}

// Alloc implements proxy.Device with anonymous memory off the Go heap.
func (d *device) Alloc(n int) (proxy.DevicePtr, error) {
	if err := d.usable(); err != nil {
		return 0, err
	}
	if n <= 0 {
		return 0, fmt.Errorf("%w: allocation of %d bytes", proxy.ErrOutOfRange, n)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cfg.MemoryLimit > 0 && d.used+int64(n) > d.cfg.MemoryLimit {
		return 0, fmt.Errorf("%w: %d bytes asked, %d of %d in use on %s", proxy.ErrDeviceMemory, n, d.used, d.cfg.MemoryLimit, d.cfg.Name)
	}
	fd := -1
	var mem []byte
	var err error
	if d.cfg.Shareable {
		fd, mem, err = shareableMem(d.cfg.Name, n)
	} else {
		mem, err = unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	}
	if err != nil {
		return 0, fmt.Errorf("%w: mmap %d bytes: %w", proxy.ErrDeviceMemory, n, err)
	}
	base := uintptr(unsafe.Pointer(&mem[0]))
	if fd >= 0 {
		d.fds[base] = fd
	}
	d.allocs = d.allocs.insert(span{base, n})
	d.mems[base] = mem
	d.used += int64(n)
	return proxy.DevicePtr(base), nil
}

// Free implements proxy.Device.
func (d *device) Free(p proxy.DevicePtr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	i := d.allocs.find(uintptr(p), 0)
	if i < 0 || d.allocs[i].base != uintptr(p) {
		return fmt.Errorf("%w: %#x is not an allocation of %s", proxy.ErrWrongMemory, p, d.cfg.Name)
	}
	d.allocs = d.allocs.remove(i)
	mem := d.mems[uintptr(p)]
	delete(d.mems, uintptr(p))
	if d.opened[uintptr(p)] {
		delete(d.opened, uintptr(p))
	} else {
		d.used -= int64(len(mem))
	}
	if fd, ok := d.fds[uintptr(p)]; ok {
		delete(d.fds, uintptr(p))
		unix.Close(fd)
	}
	return unix.Munmap(mem)
}

// Peek returns a host view of n bytes of simulated device memory at p, for
// tests that check what landed on the "GPU".
func (d *device) Peek(p proxy.DevicePtr, n int) ([]byte, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	i := d.allocs.find(uintptr(p), n)
	if i < 0 {
		return nil, fmt.Errorf("%w: %d bytes at %#x are not device memory of %s", proxy.ErrOutOfRange, n, p, d.cfg.Name)
	}
	off := uintptr(p) - d.allocs[i].base
	return d.mems[d.allocs[i].base][off : off+uintptr(n)], nil
}

// RegisterHost marks [addr, addr+n) of host memory as pinned for this device
// (what cuMemHostRegister does on a real GPU); unregister undoes it and is
// idempotent. A device pointer fails with proxy.ErrWrongMemory.
func (d *device) RegisterHost(addr uintptr, n int) (unregister func(), err error) {
	if err := d.usable(); err != nil {
		return nil, err
	}
	if addr == 0 || n <= 0 {
		return nil, fmt.Errorf("%w: host registration of %d bytes at %#x", proxy.ErrOutOfRange, n, addr)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.allocs.find(addr, 0) >= 0 {
		return nil, fmt.Errorf("%w: %#x is device memory of %s, not host memory", proxy.ErrWrongMemory, addr, d.cfg.Name)
	}
	if d.pinned.find(addr, 0) >= 0 {
		return nil, fmt.Errorf("%w: %#x is already registered with %s", proxy.ErrWrongMemory, addr, d.cfg.Name)
	}
	d.pinned = d.pinned.insert(span{addr, n})
	var once sync.Once
	return func() {
		once.Do(func() {
			d.mu.Lock()
			defer d.mu.Unlock()
			if i := d.pinned.find(addr, 0); i >= 0 && d.pinned[i].base == addr {
				d.pinned = d.pinned.remove(i)
			}
		})
	}, nil
}

type pinKey struct{ d *device }

// HostRegisterVisitor is an alloc.Visitor that registers every arena of a
// host pool as pinned with this device, as the cudahost visitor does with
// cuMemHostRegister on a real GPU.
func (d *device) HostRegisterVisitor() alloc.Visitor {
	return alloc.NewVisitor("gpusim-host-register:"+d.cfg.Name, func(a *alloc.Arena) error {
		un, err := d.RegisterHost(a.Base(), a.Size())
		if err != nil {
			return err
		}
		a.SetHandle(pinKey{d}, un)
		return nil
	}, func(a *alloc.Arena) error {
		if h, ok := a.Handle(pinKey{d}); ok {
			h.(func())()
			a.DeleteHandle(pinKey{d})
		}
		return nil
	})
}

// MemoryType implements proxy.Device.
func (d *device) MemoryType(addr uintptr) (proxy.MemoryType, error) {
	if err := d.usable(); err != nil {
		return 0, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.allocs.find(addr, 0) >= 0:
		return proxy.MemoryDevice, nil
	case d.pinned.find(addr, 0) >= 0:
		return proxy.MemoryPinned, nil
	}
	return proxy.MemoryPageable, nil
}

// FailCopies installs a fault hook called before every copy; a non-nil
// error fails that copy (nothing is written) and surfaces, wrapped in
// proxy.ErrCopyFailed, from the next event of its stream. nil removes it.
func (d *device) FailCopies(hook func(CopyInfo) error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.fail = hook
}

// Lose makes the device lost: queued copies fail, pending events complete
// with proxy.ErrDeviceLost, and every later call returns it.
func (d *device) Lose() { d.lost.Store(true) }

// Stats counts what the device did.
func (d *device) Stats() Stats {
	d.mu.Lock()
	defer d.mu.Unlock()
	return Stats{
		Copies: d.copies.Load(), BytesHtoD: d.bytesHtoD.Load(), BytesDtoH: d.bytesDtoH.Load(), BytesDtoD: d.bytesDtoD.Load(),
		FailedCopies: d.failed.Load(), RDMAFlushes: d.flushes.Load(), DeviceMemory: d.used, LiveStreams: len(d.streams), LiveAllocs: len(d.allocs),
	}
}

// Close stops the device's streams (after their queued work) and frees its
// memory. Idempotent.
func (d *device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	ss := make([]*stream, 0, len(d.streams))
	for s := range d.streams {
		ss = append(ss, s)
	}
	d.mu.Unlock()
	for _, s := range ss {
		_ = s.Close()
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	var first error
	for _, m := range d.mems {
		if err := unix.Munmap(m); err != nil && first == nil {
			first = err
		}
	}
	for _, fd := range d.fds {
		unix.Close(fd)
	}
	d.mems, d.allocs, d.used = map[uintptr][]byte{}, nil, 0
	d.fds, d.opened = map[uintptr]int{}, map[uintptr]bool{}
	return first
}

// pacer makes copies of one direction take n/bw each, back to back, like a
// copy engine: a copy starts when the previous one ends or when it was
// queued, whichever is later, and its goroutine sleeps until it ends. A
// goroutine that wakes late (timer slack on a busy host) therefore does not
// slow the engine down: the next queued copy's slot starts where the last
// one ended, not when the goroutine woke.
type pacer struct {
	mu   sync.Mutex
	bw   float64
	next time.Time
}

func (p *pacer) reserve(n int, queued time.Time) time.Time {
	if p.bw <= 0 {
		return time.Time{}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	start := queued
	if p.next.After(start) {
		start = p.next
	}
	p.next = start.Add(time.Duration(float64(n) / p.bw * float64(time.Second)))
	return p.next
}

// op is one item of a stream's queue: a copy, or an event to complete.
type op struct {
	info   CopyInfo
	ev     *event
	queued time.Time
}

// stream is a simulated stream: a queue and the goroutine that works it.
type stream struct {
	d    *device
	mu   sync.Mutex
	cond *sync.Cond
	q    []op
	err  error // first error since the last event
	busy bool
	shut bool
	done chan struct{}
	once sync.Once
}

// NewStream implements proxy.Device: each stream gets a goroutine that runs
// its queue in order.
func (d *device) NewStream() (proxy.Stream, error) {
	if err := d.usable(); err != nil {
		return nil, err
	}
	s := &stream{d: d, done: make(chan struct{})}
	s.cond = sync.NewCond(&s.mu)
	d.mu.Lock()
	d.streams[s] = struct{}{}
	d.mu.Unlock()
	go s.run()
	return s, nil
}

func (s *stream) push(o op) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shut {
		return fmt.Errorf("%w: stream", proxy.ErrClosed)
	}
	o.queued = time.Now()
	s.q = append(s.q, o)
	s.cond.Signal()
	return nil
}

func (s *stream) run() {
	defer close(s.done)
	for {
		s.mu.Lock()
		for len(s.q) == 0 && !s.shut {
			s.cond.Wait()
		}
		if len(s.q) == 0 {
			s.mu.Unlock()
			return
		}
		o := s.q[0]
		s.q = s.q[1:]
		s.busy = true
		s.mu.Unlock()

		if o.ev != nil {
			s.mu.Lock()
			err := s.err
			s.err = nil
			s.busy = false
			s.mu.Unlock()
			if s.d.lost.Load() {
				err = fmt.Errorf("%w: simulated device %s", proxy.ErrDeviceLost, s.d.cfg.Name)
			}
			o.ev.complete(err)
			continue
		}
		err := s.d.copy(o.info, o.queued)
		s.mu.Lock()
		if err != nil && s.err == nil {
			s.err = err
		}
		s.busy = false
		s.cond.Broadcast()
		s.mu.Unlock()
	}
}

// copy carries out one copy: fault hook, pacing, then the memory copy.
func (d *device) copy(c CopyInfo, queued time.Time) error {
	if d.lost.Load() {
		d.failed.Add(1)
		return fmt.Errorf("%w: simulated device %s", proxy.ErrDeviceLost, d.cfg.Name)
	}
	d.mu.Lock()
	hook := d.fail
	d.mu.Unlock()
	if hook != nil {
		if err := hook(c); err != nil {
			d.failed.Add(1)
			return fmt.Errorf("%w: %s of %d bytes %#x -> %#x (copy %d): %w", proxy.ErrCopyFailed, c.Dir, c.N, c.Src, c.Dst, c.Seq, err)
		}
	}
	end := d.pace[c.Dir].reserve(c.N, queued)
	copy(unsafe.Slice((*byte)(ptr(c.Dst)), c.N), unsafe.Slice((*byte)(ptr(c.Src)), c.N))
	if !end.IsZero() {
		if w := time.Until(end); w > 0 {
			time.Sleep(w)
		}
	}
	d.copies.Add(1)
	switch c.Dir {
	case HostToDevice:
		d.bytesHtoD.Add(int64(c.N))
	case deviceToDevice:
		d.bytesDtoD.Add(int64(c.N))
	default:
		d.bytesDtoH.Add(int64(c.N))
	}
	return nil
}

// ptr turns an address of memory off the Go heap into a pointer.
func ptr(addr uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&addr)) }

// Synchronize implements proxy.Stream.
func (s *stream) Synchronize() error {
	ev := newEvent()
	if err := s.push(op{ev: ev}); err != nil {
		return err
	}
	return ev.Wait(context.Background())
}

// Close implements proxy.Stream: queued work runs, then the goroutine ends.
func (s *stream) Close() error {
	s.once.Do(func() {
		s.mu.Lock()
		s.shut = true
		s.cond.Broadcast()
		s.mu.Unlock()
		<-s.done
		s.d.mu.Lock()
		delete(s.d.streams, s)
		s.d.mu.Unlock()
	})
	return nil
}

func (d *device) streamOf(st proxy.Stream) (*stream, error) {
	s, ok := st.(*stream)
	if !ok || s == nil || s.d != d {
		return nil, fmt.Errorf("%w: stream %T is not a stream of simulated device %s", proxy.ErrWrongMemory, st, d.cfg.Name)
	}
	return s, nil
}

// checkCopy validates a copy the way the driver would, before queuing it.
func (d *device) checkCopy(dir Direction, dev uintptr, host uintptr, n int) error {
	if n <= 0 {
		return fmt.Errorf("%w: copy of %d bytes", proxy.ErrOutOfRange, n)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.allocs.find(dev, n) < 0 {
		return fmt.Errorf("%w: %s copy of %d bytes at device address %#x is outside every allocation of %s", proxy.ErrOutOfRange, dir, n, dev, d.cfg.Name)
	}
	if d.allocs.find(host, 0) >= 0 {
		return fmt.Errorf("%w: %s copy with host address %#x, which is device memory of %s", proxy.ErrWrongMemory, dir, host, d.cfg.Name)
	}
	if host == 0 {
		return fmt.Errorf("%w: %s copy from host address 0", proxy.ErrWrongMemory, dir)
	}
	return nil
}

// CopyHtoDAsync implements proxy.Device.
func (d *device) CopyHtoDAsync(dst proxy.DevicePtr, src uintptr, n int, st proxy.Stream) error {
	if err := d.usable(); err != nil {
		return err
	}
	s, err := d.streamOf(st)
	if err != nil {
		return err
	}
	if err := d.checkCopy(HostToDevice, uintptr(dst), src, n); err != nil {
		return err
	}
	return s.push(op{info: CopyInfo{Dir: HostToDevice, Dst: uintptr(dst), Src: src, N: n, Seq: d.seq.Add(1) - 1}})
}

// CopyDtoHAsync implements proxy.Device.
func (d *device) CopyDtoHAsync(dst uintptr, src proxy.DevicePtr, n int, st proxy.Stream) error {
	if err := d.usable(); err != nil {
		return err
	}
	s, err := d.streamOf(st)
	if err != nil {
		return err
	}
	if err := d.checkCopy(DeviceToHost, uintptr(src), dst, n); err != nil {
		return err
	}
	return s.push(op{info: CopyInfo{Dir: DeviceToHost, Dst: dst, Src: uintptr(src), N: n, Seq: d.seq.Add(1) - 1}})
}

// RecordEvent implements proxy.Device. It works on a lost device too, so
// that callers can wait for copies already queued to drain; such an event
// completes with proxy.ErrDeviceLost.
func (d *device) RecordEvent(st proxy.Stream) (proxy.Event, error) {
	s, err := d.streamOf(st)
	if err != nil {
		return nil, err
	}
	ev := newEvent()
	if err := s.push(op{ev: ev}); err != nil {
		return nil, err
	}
	return ev, nil
}

// event is a simulated event.
type event struct {
	done chan struct{}
	err  error
}

func newEvent() *event { return &event{done: make(chan struct{})} }

func (e *event) complete(err error) {
	e.err = err
	close(e.done)
}

// Query implements proxy.Event.
func (e *event) Query() (bool, error) {
	select {
	case <-e.done:
		return true, e.err
	default:
		return false, nil
	}
}

// Wait implements proxy.Event.
func (e *event) Wait(ctx context.Context) error {
	select {
	case <-e.done:
		return e.err
	case <-ctx.Done():
		return fmt.Errorf("%w: waiting for a simulated event: %w", proxy.ErrCanceled, ctx.Err())
	}
}

// Close implements proxy.Event. Idempotent.
func (e *event) Close() error { return nil }
