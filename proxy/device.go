package proxy

import (
	"context"
	"fmt"
)

// DevicePtr is an address in a device's memory.
type DevicePtr uintptr

// MemoryType is the kind of memory an address is, as a device sees it.
type MemoryType int

// Memory types.
const (
	// MemoryPageable is ordinary host memory the device does not know.
	MemoryPageable MemoryType = iota
	// MemoryPinned is page-locked host memory registered with the device.
	MemoryPinned
	// MemoryDevice is the device's own memory.
	MemoryDevice
	// MemoryManaged is memory that migrates between host and device.
	MemoryManaged
)

// String names the memory type.
func (m MemoryType) String() string {
	switch m {
	case MemoryPageable:
		return "pageable"
	case MemoryPinned:
		return "pinned"
	case MemoryDevice:
		return "device"
	case MemoryManaged:
		return "managed"
	}
	return fmt.Sprintf("MemoryType(%d)", int(m))
}

// DeviceInfo describes a device.
type DeviceInfo struct {
	// Name is the device's name ("NVIDIA H100 80GB HBM3", "gpusim").
	Name string
	// Ordinal is the device's number (tensor.GPUDevice(Ordinal)).
	Ordinal int
	// Simulated is true for the simulated device: figures measured on it
	// say nothing about a real GPU.
	Simulated bool
	// PCIBusID is the device's PCI address ("0000:3b:00.0"), by which NVML
	// and sysfs know it; "" when the device has none (the simulated one).
	PCIBusID string
}

// Device is a GPU as the proxy uses it: device memory, streams, asynchronous
// copies and events. Calls are safe for concurrent use. Errors wrap this
// package's sentinels (ErrDeviceLost, ErrCopyFailed, ErrWrongMemory, ...).
type Device interface {
	// Info describes the device.
	Info() DeviceInfo
	// Alloc allocates n bytes of device memory.
	Alloc(n int) (DevicePtr, error)
	// Free frees memory Alloc returned.
	Free(p DevicePtr) error
	// NewStream makes a stream: copies queued on one stream run in order.
	NewStream() (Stream, error)
	// CopyHtoDAsync queues a copy of n bytes from host memory at src to
	// device memory at dst on s. The host memory must stay valid until an
	// event recorded after the copy completes.
	CopyHtoDAsync(dst DevicePtr, src uintptr, n int, s Stream) error
	// CopyDtoHAsync queues a copy of n bytes from device memory at src to
	// host memory at dst on s.
	CopyDtoHAsync(dst uintptr, src DevicePtr, n int, s Stream) error
	// RecordEvent returns an event that completes when all work queued on s
	// so far has completed.
	RecordEvent(s Stream) (Event, error)
	// MemoryType says what kind of memory addr is.
	MemoryType(addr uintptr) (MemoryType, error)
	// Close releases the device handle. Idempotent.
	Close() error
}

// Stream is an ordered queue of device work.
type Stream interface {
	// Synchronize waits until the stream's queued work is done.
	Synchronize() error
	// Close releases the stream; queued work still runs. Idempotent.
	Close() error
}

// Event marks a point in a stream.
type Event interface {
	// Query reports without blocking whether the work before the event is
	// done; the error of that work (a failed copy, a lost device) comes
	// back here.
	Query() (done bool, err error)
	// Wait blocks until the event completes or ctx ends.
	Wait(ctx context.Context) error
	// Close releases the event. Idempotent.
	Close() error
}
