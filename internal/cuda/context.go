package cuda

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Context is a retained primary context of a device: the context the CUDA
// runtime and every library on the device share. Everything that allocates
// or copies is a method of it.
type Context struct {
	drv  *Driver
	dev  Device
	ctx  uintptr
	live atomic.Int64

	mu     sync.Mutex
	closed bool
}

// RetainPrimaryContext retains the device's primary context
// (cuDevicePrimaryCtxRetain); Close releases it.
func (v Device) RetainPrimaryContext() (*Context, error) {
	if v.drv == nil || v.drv.isClosed() {
		return nil, ErrClosed
	}
	var c uintptr
	if err := v.drv.call(symPrimaryCtxRetain, v.String(), uintptr(unsafe.Pointer(&c)), uintptr(v.handle)); err != nil {
		return nil, err
	}
	return &Context{drv: v.drv, dev: v, ctx: c}, nil
}

// Device is the context's device.
func (c *Context) Device() Device { return c.dev }

// Driver is the driver the context came from.
func (c *Context) Driver() *Driver { return c.drv }

// Close releases the primary context (cuDevicePrimaryCtxRelease_v2). It fails
// with ErrBusy while allocations, registrations, streams or events made
// through it are open. Idempotent.
func (c *Context) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	if n := c.live.Load(); n > 0 {
		return fmt.Errorf("%w: %d handles of %s still open", ErrBusy, n, c.dev)
	}
	c.closed = true
	return c.drv.call(symPrimaryCtxRelease, c.dev.String(), uintptr(c.dev.handle))
}

func (c *Context) usable() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("%w: context of %s", ErrClosed, c.dev)
	}
	return nil
}

// do runs a driver call with the context current on the calling thread.
//
//go:uintptrescapes
func (c *Context) do(s sym, detail string, args ...uintptr) error {
	if err := c.usable(); err != nil {
		return err
	}
	return c.drv.callIn(c.ctx, s, detail, args...)
}

// Synchronize waits for all work of the context (cuCtxSynchronize).
func (c *Context) Synchronize() error { return c.do(symCtxSynchronize, c.dev.String()) }

// cuFlushGPUDirectRDMAWrites' target and scope (cuda.h:
// CUflushGPUDirectRDMAWritesTarget, CUflushGPUDirectRDMAWritesScope).
const (
	flushTargetCurrentCtx = 0
	flushToOwner          = 100
)

// FlushGPUDirectRDMAWrites makes the NIC writes into this context's device
// memory that have completed so far visible to the device's later work
// (cuFlushGPUDirectRDMAWrites, current context, scope "to owner"). Where the
// device's CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS lacks
// the host bit, the driver refuses; drivers before CUDA 11.3 lack the call
// (ErrNoDriver naming it).
func (c *Context) FlushGPUDirectRDMAWrites() error {
	return c.do(symFlushGPUDirectRDMAWrites, c.dev.String(), flushTargetCurrentCtx, flushToOwner)
}

// MemInfo is the device's free and total memory in bytes (cuMemGetInfo_v2).
func (c *Context) MemInfo() (free, total int64, err error) {
	var f, t uint64
	if err := c.do(symMemGetInfo, c.dev.String(), uintptr(unsafe.Pointer(&f)), uintptr(unsafe.Pointer(&t))); err != nil {
		return 0, 0, err
	}
	return int64(f), int64(t), nil
}

// closer makes an idempotent Close around a release function and keeps the
// context's count of live handles.
type closer struct {
	ctx    *Context
	mu     sync.Mutex
	closed bool
	err    error
}

func (h *closer) open(c *Context) { h.ctx = c; c.live.Add(1) }

// close runs release once; later calls return its first result.
func (h *closer) close(release func() error) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return h.err
	}
	h.closed = true
	h.err = release()
	h.ctx.live.Add(-1)
	return h.err
}

// check fails with ErrClosed once Close ran.
func (h *closer) check(what string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return fmt.Errorf("%w: %s", ErrClosed, what)
	}
	return nil
}

// OpenPrimary opens the driver at its default path (GDRLINK_LIBCUDA or
// libcuda.so.1), finds GPU ordinal and retains its primary context: what
// every user of one GPU starts with. On error nothing stays open.
func OpenPrimary(ordinal int) (*Driver, Device, *Context, error) {
	drv, err := Open("")
	if err != nil {
		return nil, Device{}, nil, err
	}
	d, err := drv.Device(ordinal)
	if err != nil {
		return nil, Device{}, nil, errors.Join(err, drv.Close())
	}
	ctx, err := d.RetainPrimaryContext()
	if err != nil {
		return nil, Device{}, nil, errors.Join(err, drv.Close())
	}
	return drv, d, ctx, nil
}
