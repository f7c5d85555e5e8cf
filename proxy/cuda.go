package proxy

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrlink/gdrlink/internal/cuda"
	"github.com/gdrlink/gdrlink/internal/nvml"
)

// cudaDevice is a real GPU, through the CUDA driver loaded at run time.
type cudaDevice struct {
	drv  *cuda.Driver
	ctx  *cuda.Context
	info DeviceInfo
	gdr  gpuDirectFacts

	mu     sync.Mutex
	allocs map[DevicePtr]*cuda.DeviceMemory
	ipcs   map[DevicePtr]*cuda.IPCMapping
	// shared are the shareable allocations (AllocShareable) and the
	// mappings of other processes' (OpenShareable).
	shared map[DevicePtr]*cuda.Shareable
	events []*cuda.Event // completed events, kept for reuse
	closed bool
}

// maxIdleEvents bounds the events a device keeps for reuse. Every receive
// and pull records one; creating and destroying one each time costs
// microseconds of driver calls, as much as the copy of a small tensor.
const maxIdleEvents = 64

var _ rdmaFlushDevice = (*cudaDevice)(nil)

// NewCUDADevice returns the GPU with the given CUDA ordinal as a Device,
// through the CUDA driver loaded at run time: it opens the driver and retains
// the GPU's primary context (the context the CUDA runtime and every library
// on the device share) until Close. Without a driver the error says so.
func NewCUDADevice(ordinal int) (Device, error) {
	drv, d, ctx, err := cuda.OpenPrimary(ordinal)
	if err != nil {
		return nil, err
	}
	name, err := d.Name()
	if err != nil {
		return nil, errors.Join(err, ctx.Close(), drv.Close())
	}
	bus, err := d.PCIBusID()
	if err != nil {
		return nil, errors.Join(err, ctx.Close(), drv.Close())
	}
	f, err := d.Facts()
	if err != nil {
		return nil, errors.Join(err, ctx.Close(), drv.Close())
	}
	// C2C comes from NVML, as NCCL reads it; an NVML that cannot tell (none,
	// or built without cgo) leaves it false, the answer of every GPU not
	// attached over C2C.
	c2c, err := nvml.C2C(bus)
	return &cudaDevice{drv: drv, ctx: ctx, info: DeviceInfo{Name: name, Ordinal: ordinal, PCIBusID: bus},
		gdr: gpuDirectFactsOf(f, c2c && err == nil), allocs: map[DevicePtr]*cuda.DeviceMemory{}, ipcs: map[DevicePtr]*cuda.IPCMapping{}, shared: map[DevicePtr]*cuda.Shareable{}}, nil
}

// flushWritesOptionHost is CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST, the
// bit of CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS that says
// cuFlushGPUDirectRDMAWrites works from the host.
const flushWritesOptionHost = 1

// gpuDirectFactsOf reads the device facts that choose how Direct receives
// flush: the driver's, and whether NVML says the GPU is attached over C2C.
func gpuDirectFactsOf(f cuda.Facts, c2c bool) gpuDirectFacts {
	return gpuDirectFacts{ComputeCapability: f.ComputeCapability, C2C: c2c, HostFlush: f.FlushWritesOptions&flushWritesOptionHost != 0}
}

// GPUDirectFacts reports what chooses how Direct receives flush (see
// rdmaFlushDevice).
func (d *cudaDevice) GPUDirectFacts() (computeCapability int, c2c, hostFlush bool) {
	return d.gdr.ComputeCapability, d.gdr.C2C, d.gdr.HostFlush
}

// FlushRDMAWrites (see rdmaFlushDevice) is cuFlushGPUDirectRDMAWrites on
// the device's primary context.
func (d *cudaDevice) FlushRDMAWrites() error {
	return mapErr(d.ctx.FlushGPUDirectRDMAWrites(), "GPUDirect RDMA flush")
}

// Info implements Device.
func (d *cudaDevice) Info() DeviceInfo { return d.info }

// mapErr wraps a driver error in this package's sentinels, keeping the
// driver's error (and its code) in the chain.
func mapErr(err error, what string) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, cuda.ErrDeviceLost):
		return fmt.Errorf("%w: %s: %w", ErrDeviceLost, what, err)
	case errors.Is(err, cuda.ErrOutOfMemory):
		return fmt.Errorf("%w: %s: %w", ErrDeviceMemory, what, err)
	case errors.Is(err, cuda.ErrClosed):
		return fmt.Errorf("%w: %s: %w", ErrClosed, what, err)
	case errors.Is(err, cuda.ErrInvalidValue):
		return fmt.Errorf("%w: %s: %w", ErrOutOfRange, what, err)
	}
	return fmt.Errorf("%w: %s: %w", ErrCopyFailed, what, err)
}

// Alloc implements Device.
func (d *cudaDevice) Alloc(n int) (DevicePtr, error) {
	m, err := d.ctx.MemAlloc(n)
	if err != nil {
		return 0, mapErr(err, "device allocation")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.allocs[DevicePtr(m.Ptr)] = m
	return DevicePtr(m.Ptr), nil
}

// Free implements Device; it frees shareable allocations (AllocShareable)
// and unmaps other processes' (OpenShareable) too.
func (d *cudaDevice) Free(p DevicePtr) error {
	d.mu.Lock()
	m, ok := d.allocs[p]
	delete(d.allocs, p)
	sh, shared := d.shared[p]
	delete(d.shared, p)
	d.mu.Unlock()
	if shared {
		return mapErr(sh.Close(), "shareable free")
	}
	if !ok {
		return fmt.Errorf("%w: %#x is not an allocation of this device handle", ErrWrongMemory, p)
	}
	return mapErr(m.Close(), "device free")
}

type cudaStream struct{ s *cuda.Stream }

// Synchronize implements Stream.
func (s cudaStream) Synchronize() error { return mapErr(s.s.Synchronize(), "stream synchronize") }

// Close implements Stream.
func (s cudaStream) Close() error { return mapErr(s.s.Close(), "stream destroy") }

// NewStream implements Device with a non-blocking stream.
func (d *cudaDevice) NewStream() (Stream, error) {
	s, err := d.ctx.NewStream(cuda.StreamNonBlocking)
	if err != nil {
		return nil, mapErr(err, "stream create")
	}
	return cudaStream{s}, nil
}

func (d *cudaDevice) stream(s Stream) (*cuda.Stream, error) {
	cs, ok := s.(cudaStream)
	if !ok {
		return nil, fmt.Errorf("%w: stream %T is not a CUDA stream", ErrWrongMemory, s)
	}
	return cs.s, nil
}

// CopyHtoDAsync implements Device (cuMemcpyHtoDAsync_v2).
func (d *cudaDevice) CopyHtoDAsync(dst DevicePtr, src uintptr, n int, s Stream) error {
	cs, err := d.stream(s)
	if err != nil {
		return err
	}
	return mapErr(d.ctx.MemcpyHtoDAsync(uintptr(dst), src, n, cs), "host-to-device copy")
}

// CopyDtoHAsync implements Device (cuMemcpyDtoHAsync_v2).
func (d *cudaDevice) CopyDtoHAsync(dst uintptr, src DevicePtr, n int, s Stream) error {
	cs, err := d.stream(s)
	if err != nil {
		return err
	}
	return mapErr(d.ctx.MemcpyDtoHAsync(dst, uintptr(src), n, cs), "device-to-host copy")
}

// cudaEvent is an event recorded on a stream; Close gives it back to its
// device for reuse.
type cudaEvent struct {
	e      *cuda.Event
	d      *cudaDevice
	closed atomic.Bool
}

// Query implements Event; a failed event counts as done, with its error.
func (e *cudaEvent) Query() (bool, error) {
	done, err := e.e.Query()
	if err != nil {
		return true, mapErr(err, "event")
	}
	return done, nil
}

// Synchronize waits for the event inside the driver (cuEventSynchronize;
// the event is made with CU_EVENT_BLOCKING_SYNC, so the thread sleeps
// rather than spins). A failed event returns its error.
func (e *cudaEvent) Synchronize() error { return mapErr(e.e.Synchronize(), "event synchronize") }

// waitSpin is how long Wait polls an event before it waits otherwise.
const waitSpin = 50 * time.Microsecond

// Wait polls the event for a short while; then, when ctx can never end, it
// waits inside the driver (a thread sleeps there until the device
// signals); otherwise it polls with a backoff (5 µs doubling to 200 µs) so
// that ctx is honoured. Go timers under a millisecond fire after about a
// millisecond in an idle process, so the backoff is the slow path.
func (e *cudaEvent) Wait(ctx context.Context) error {
	if done, _, err := spinEvent(e, waitSpin); done || err != nil {
		return err
	}
	if ctx.Done() == nil {
		return e.Synchronize()
	}
	sleep := pollMinSleep
	for {
		done, err := e.Query()
		if done || err != nil {
			return err
		}
		t := time.NewTimer(sleep)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w: waiting for a CUDA event: %w", ErrCanceled, ctx.Err())
		}
		if sleep *= 2; sleep > pollMaxSleep {
			sleep = pollMaxSleep
		}
	}
}

// Close implements Event: a completed event goes back to its device for
// the next RecordEvent, any other is destroyed. Idempotent.
func (e *cudaEvent) Close() error {
	if e.closed.Swap(true) {
		return nil
	}
	return e.d.putEvent(e.e)
}

// getEvent returns an idle event, or a new one.
func (d *cudaDevice) getEvent() (*cuda.Event, error) {
	d.mu.Lock()
	if n := len(d.events); n > 0 && !d.closed {
		e := d.events[n-1]
		d.events[n-1] = nil
		d.events = d.events[:n-1]
		d.mu.Unlock()
		return e, nil
	}
	d.mu.Unlock()
	e, err := d.ctx.NewEvent(cuda.EventDisableTiming | cuda.EventBlockingSync)
	if err != nil {
		return nil, mapErr(err, "event create")
	}
	return e, nil
}

// putEvent keeps a completed event for reuse, up to maxIdleEvents, and
// destroys any other: one still pending or failed, or one too many.
func (d *cudaDevice) putEvent(e *cuda.Event) error {
	if done, err := e.Query(); done && err == nil {
		d.mu.Lock()
		if !d.closed && len(d.events) < maxIdleEvents {
			d.events = append(d.events, e)
			d.mu.Unlock()
			return nil
		}
		d.mu.Unlock()
	}
	return mapErr(e.Close(), "event destroy")
}

// RecordEvent implements Device with an event without timing (the cheapest
// kind to record and query) that a thread can wait on without spinning
// (Synchronize).
func (d *cudaDevice) RecordEvent(s Stream) (Event, error) {
	cs, err := d.stream(s)
	if err != nil {
		return nil, err
	}
	e, err := d.getEvent()
	if err != nil {
		return nil, err
	}
	if err := e.Record(cs); err != nil {
		_ = e.Close()
		return nil, mapErr(err, "event record")
	}
	return &cudaEvent{e: e, d: d}, nil
}

// MemoryType implements Device (cuPointerGetAttribute MEMORY_TYPE).
func (d *cudaDevice) MemoryType(addr uintptr) (MemoryType, error) {
	mt, err := d.ctx.MemoryType(addr)
	if err != nil {
		return 0, mapErr(err, "pointer attribute")
	}
	switch mt {
	case cuda.MemoryHost:
		return MemoryPinned, nil
	case cuda.MemoryDevice:
		return MemoryDevice, nil
	case cuda.MemoryUnified:
		return MemoryManaged, nil
	}
	return MemoryPageable, nil
}

// Close frees what Alloc made and not yet freed, releases the context and
// the driver. Streams and events must be closed first. Idempotent.
func (d *cudaDevice) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	var errs []error
	for _, e := range d.events {
		errs = append(errs, e.Close())
	}
	d.events = nil
	for p, m := range d.ipcs {
		errs = append(errs, m.Close())
		delete(d.ipcs, p)
	}
	for p, m := range d.allocs {
		errs = append(errs, m.Close())
		delete(d.allocs, p)
	}
	for p, m := range d.shared {
		errs = append(errs, m.Close())
		delete(d.shared, p)
	}
	errs = append(errs, d.ctx.Close(), d.drv.Close())
	return errors.Join(errs...)
}

// The on-node IPC path reaches the methods below by a type assertion on
// the Device that NewCUDADevice returns: another process's allocation
// opened from its legacy IPC handle, device-to-device copies, and the
// peer-access check.

// OpenIPCHandle opens another process's allocation from its 64-byte
// CUipcMemHandle (cuIpcOpenMemHandle_v2, peer access enabled lazily).
func (d *cudaDevice) OpenIPCHandle(h [64]byte) (DevicePtr, error) {
	m, err := d.ctx.OpenIPCHandle(cuda.IPCHandle{Reserved: h})
	if err != nil {
		return 0, mapErr(err, "IPC handle open")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.ipcs[DevicePtr(m.Ptr)] = m
	return DevicePtr(m.Ptr), nil
}

// ShareableSupported reports whether this GPU can allocate memory that
// other processes map from a POSIX descriptor (the CUDA virtual memory
// management API with descriptor export).
func (d *cudaDevice) ShareableSupported() bool { return d.ctx.ShareableSupported() }

// AllocShareable allocates at least n bytes of device memory that other
// processes can map (ExportShareable, OpenShareable); Free frees it.
func (d *cudaDevice) AllocShareable(n int) (DevicePtr, error) {
	s, err := d.ctx.AllocShareable(n)
	if err != nil {
		return 0, mapErr(err, "shareable allocation")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.shared[DevicePtr(s.Ptr)] = s
	return DevicePtr(s.Ptr), nil
}

// ExportShareable returns a new POSIX descriptor of the shareable
// allocation at p (cuMemExportToShareableHandle); the caller owns it.
func (d *cudaDevice) ExportShareable(p DevicePtr) (int, error) {
	d.mu.Lock()
	s, ok := d.shared[p]
	d.mu.Unlock()
	if !ok {
		return -1, fmt.Errorf("%w: %#x is not a shareable allocation of this device handle", ErrWrongMemory, p)
	}
	fd, err := s.ExportFD()
	return fd, mapErr(err, "shareable export")
}

// OpenShareable maps size bytes of another process's shareable allocation
// from its descriptor (which stays the caller's); Free unmaps it.
func (d *cudaDevice) OpenShareable(fd int, size int) (DevicePtr, error) {
	s, err := d.ctx.ImportShareable(fd, size)
	if err != nil {
		return 0, mapErr(err, "shareable import")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.shared[DevicePtr(s.Ptr)] = s
	return DevicePtr(s.Ptr), nil
}

// IPCHandle gets the legacy IPC handle of an allocation of this device
// (cuIpcGetMemHandle), for another process's OpenIPCHandle; p must start
// an allocation.
func (d *cudaDevice) IPCHandle(p DevicePtr) ([64]byte, error) {
	h, err := d.ctx.IPCHandle(uintptr(p))
	if err != nil {
		return [64]byte{}, mapErr(err, "IPC handle")
	}
	return h.Reserved, nil
}

// CloseIPCHandle closes what OpenIPCHandle opened (cuIpcCloseMemHandle).
func (d *cudaDevice) CloseIPCHandle(p DevicePtr) error {
	d.mu.Lock()
	m, ok := d.ipcs[p]
	delete(d.ipcs, p)
	d.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %#x is not an opened IPC handle of this device handle", ErrWrongMemory, p)
	}
	return mapErr(m.Close(), "IPC handle close")
}

// CopyDtoDAsync queues a device-to-device copy (cuMemcpyDtoDAsync_v2).
func (d *cudaDevice) CopyDtoDAsync(dst, src DevicePtr, n int, s Stream) error {
	cs, err := d.stream(s)
	if err != nil {
		return err
	}
	return mapErr(d.ctx.MemcpyDtoDAsync(uintptr(dst), uintptr(src), n, cs), "device-to-device copy")
}

// CanAccessPeer reports whether this GPU and the GPU with the given PCI
// bus id can reach each other's memory: the same device, or
// cuDeviceCanAccessPeer both ways.
func (d *cudaDevice) CanAccessPeer(busID string) (bool, error) {
	if strings.EqualFold(busID, d.info.PCIBusID) {
		return true, nil
	}
	peer, err := d.drv.DeviceByPCIBusID(busID)
	if err != nil {
		return false, err
	}
	self := d.ctx.Device()
	a, err := self.CanAccessPeer(peer)
	if err != nil || !a {
		return false, err
	}
	return peer.CanAccessPeer(self)
}
