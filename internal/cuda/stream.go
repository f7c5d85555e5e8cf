package cuda

import (
	"errors"
	"fmt"
	"math"
	"unsafe"
)

// Flags of cuStreamCreate.
const (
	StreamDefault     = 0x0
	StreamNonBlocking = 0x1 // CU_STREAM_NON_BLOCKING: no implicit sync with stream 0
)

// Flags of cuEventCreate.
const (
	EventDefault       = 0x0
	EventBlockingSync  = 0x1 // CU_EVENT_BLOCKING_SYNC
	EventDisableTiming = 0x2 // CU_EVENT_DISABLE_TIMING
	EventInterprocess  = 0x4 // CU_EVENT_INTERPROCESS
)

// Stream is a CUstream.
type Stream struct {
	closer
	h uintptr
}

// NewStream makes a stream (cuStreamCreate).
func (c *Context) NewStream(flags uint32) (*Stream, error) {
	var h uintptr
	if err := c.do(symStreamCreate, c.dev.String(), uintptr(unsafe.Pointer(&h)), uintptr(flags)); err != nil {
		return nil, err
	}
	s := &Stream{h: h}
	s.open(c)
	return s, nil
}

// Synchronize waits for the stream's work (cuStreamSynchronize).
func (s *Stream) Synchronize() error {
	if err := s.check("stream"); err != nil {
		return err
	}
	return s.ctx.do(symStreamSynchronize, "", s.h)
}

// Query reports whether all the stream's work is done (cuStreamQuery).
func (s *Stream) Query() (bool, error) {
	if err := s.check("stream"); err != nil {
		return false, err
	}
	err := s.ctx.do(symStreamQuery, "", s.h)
	if errors.Is(err, ErrNotReady) {
		return false, nil
	}
	return err == nil, err
}

// Close destroys the stream (cuStreamDestroy_v2); work already queued still
// runs. Idempotent.
func (s *Stream) Close() error {
	return s.close(func() error { return s.ctx.do(symStreamDestroy, "", s.h) })
}

func (s *Stream) handle() (uintptr, error) {
	if s == nil {
		return 0, nil // the legacy default stream
	}
	if err := s.check("stream"); err != nil {
		return 0, err
	}
	return s.h, nil
}

// MemcpyHtoDAsync queues a copy of n bytes from host memory src to device
// memory dst on s (cuMemcpyHtoDAsync_v2). src should be pinned for the copy
// to be asynchronous; it must stay valid until the copy completes.
func (c *Context) MemcpyHtoDAsync(dst, src uintptr, n int, s *Stream) error {
	h, err := s.handle()
	if err != nil {
		return err
	}
	return c.do(symMemcpyHtoDAsync, fmt.Sprintf("%d bytes %#x -> %#x", n, src, dst), dst, src, uintptr(n), h)
}

// MemcpyDtoHAsync queues a copy of n bytes from device memory src to host
// memory dst on s (cuMemcpyDtoHAsync_v2).
func (c *Context) MemcpyDtoHAsync(dst, src uintptr, n int, s *Stream) error {
	h, err := s.handle()
	if err != nil {
		return err
	}
	return c.do(symMemcpyDtoHAsync, fmt.Sprintf("%d bytes %#x -> %#x", n, src, dst), dst, src, uintptr(n), h)
}

// MemcpyDtoDAsync queues a copy of n bytes between two device ranges on s
// (cuMemcpyDtoDAsync_v2); either may be another process's allocation
// opened with OpenIPCHandle.
func (c *Context) MemcpyDtoDAsync(dst, src uintptr, n int, s *Stream) error {
	h, err := s.handle()
	if err != nil {
		return err
	}
	return c.do(symMemcpyDtoDAsync, fmt.Sprintf("%d bytes %#x -> %#x", n, src, dst), dst, src, uintptr(n), h)
}

// Event is a CUevent.
type Event struct {
	closer
	h uintptr
}

// NewEvent makes an event (cuEventCreate).
func (c *Context) NewEvent(flags uint32) (*Event, error) {
	var h uintptr
	if err := c.do(symEventCreate, c.dev.String(), uintptr(unsafe.Pointer(&h)), uintptr(flags)); err != nil {
		return nil, err
	}
	e := &Event{h: h}
	e.open(c)
	return e, nil
}

// Record captures the work queued on s so far (cuEventRecord).
func (e *Event) Record(s *Stream) error {
	if err := e.check("event"); err != nil {
		return err
	}
	h, err := s.handle()
	if err != nil {
		return err
	}
	return e.ctx.do(symEventRecord, "", e.h, h)
}

// Query reports whether the captured work is done (cuEventQuery). An error
// of the captured work (an asynchronous copy that failed) is returned here.
func (e *Event) Query() (bool, error) {
	if err := e.check("event"); err != nil {
		return false, err
	}
	err := e.ctx.do(symEventQuery, "", e.h)
	if errors.Is(err, ErrNotReady) {
		return false, nil
	}
	return err == nil, err
}

// Synchronize waits for the captured work (cuEventSynchronize).
func (e *Event) Synchronize() error {
	if err := e.check("event"); err != nil {
		return err
	}
	return e.ctx.do(symEventSynchronize, "", e.h)
}

// Elapsed is the time between two recorded events in milliseconds
// (cuEventElapsedTime_v2); neither may have EventDisableTiming.
func (e *Event) Elapsed(start *Event) (float64, error) {
	if err := e.check("event"); err != nil {
		return 0, err
	}
	var ms uint32 // a C float, read back bit for bit
	if err := e.ctx.do(symEventElapsedTime, "", uintptr(unsafe.Pointer(&ms)), start.h, e.h); err != nil {
		return 0, err
	}
	return float64(math.Float32frombits(ms)), nil
}

// Close destroys the event (cuEventDestroy_v2). Idempotent.
func (e *Event) Close() error {
	return e.close(func() error { return e.ctx.do(symEventDestroy, "", e.h) })
}
