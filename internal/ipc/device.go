package ipc

import (
	"fmt"
	"sync"

	"github.com/gdrlink/gdrlink/proxy"
)

// HandleOpener is a device that opens a peer's exported arena as device
// memory of its own: with CUDA, cuIpcOpenMemHandle on a legacy handle (in
// Msg.Handle) or cuMemImportFromShareableHandle on a POSIX descriptor
// passed beside the message; on gpusim, the simulated counterpart.
type HandleOpener interface {
	// OpenHandle opens the arena h describes; fd (or -1) came beside h and
	// stays the caller's.
	OpenHandle(h Msg, fd int) (proxy.DevicePtr, error)
	// CloseHandle closes what OpenHandle opened.
	CloseHandle(p proxy.DevicePtr) error
}

// Copier queues device-to-device copies (cuMemcpyDtoDAsync) and events.
type Copier interface {
	CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error
	RecordEvent(st proxy.Stream) (proxy.Event, error)
}

// DeviceOpener is the Opener of device arenas.
type DeviceOpener struct{ Dev HandleOpener }

// Open implements Opener; it closes fd.
func (o DeviceOpener) Open(peer uint32, h Msg, fd int) (Mapping, error) {
	defer closeFD(fd)
	if h.Kind != KindExport || h.Size == 0 {
		return nil, fmt.Errorf("%w: export of arena %d (%d bytes)", ErrBadMessage, h.Arena, h.Size)
	}
	p, err := o.Dev.OpenHandle(h, fd)
	if err != nil {
		return nil, err
	}
	return &DeviceMapping{Ptr: p, Size: h.Size, dev: o.Dev}, nil
}

// DeviceMapping is a peer's device arena opened on this device.
type DeviceMapping struct {
	// Ptr is where the arena is in this device's address space.
	Ptr proxy.DevicePtr
	// Size is its size in bytes.
	Size uint64

	dev  HandleOpener
	once sync.Once
	err  error
}

// Close closes the handle; it is idempotent.
func (m *DeviceMapping) Close() error {
	m.once.Do(func() { m.err = m.dev.CloseHandle(m.Ptr) })
	return m.err
}

// PullDevice queues one device-to-device copy of the PULL message's tensor
// from the peer's opened arena into dst on st, and returns the event that
// completes with it. The sender keeps its source until the receiver, after
// the event, answers DONE.
func PullDevice(dev Copier, st proxy.Stream, dst proxy.DevicePtr, mp Mapping, m Msg) (proxy.Event, error) {
	dm, ok := mp.(*DeviceMapping)
	if !ok {
		return nil, fmt.Errorf("%w: %T is not device memory", ErrNotMapped, mp)
	}
	if m.Offset > dm.Size || m.Size > dm.Size-m.Offset || m.Size == 0 {
		return nil, fmt.Errorf("%w: %d bytes at %d of a %d-byte arena", ErrNotMapped, m.Size, m.Offset, dm.Size)
	}
	if err := dev.CopyDtoDAsync(dst, dm.Ptr+proxy.DevicePtr(m.Offset), int(m.Size), st); err != nil {
		return nil, fmt.Errorf("ipc: pull of %d bytes: %w", m.Size, err)
	}
	return dev.RecordEvent(st)
}
