package ipc

import (
	"errors"
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/cuda"
	"github.com/gdrlink/gdrlink/proxy"
)

// ErrNotSupported: a form of handle this build cannot open.
var ErrNotSupported = errors.New("ipc: not supported")

// HandleGetter gets the legacy IPC handle of a device allocation
// (*cuda.Context's IPCHandle, cuIpcGetMemHandle).
type HandleGetter interface {
	IPCHandle(ptr uintptr) (cuda.IPCHandle, error)
}

// cudaExport is the handle NewCUDAExport attaches to a GPU arena.
type cudaExport struct{ h [64]byte }

type cudaExportKey struct{}

// NewCUDAExport returns a visitor for GPU arenas that gets each arena's
// legacy CUDA IPC handle once, through g (a context of the arenas' GPU),
// and attaches it (CUDAExportOf). Getting a handle is cheap, so the visitor
// keeps nothing else; host arenas are refused.
func NewCUDAExport(g HandleGetter) alloc.Visitor {
	return alloc.NewVisitor("cuda-ipc-export", func(a *alloc.Arena) error {
		if !a.Region().Device.IsGPU() {
			return fmt.Errorf("%w: %s is not GPU memory", ErrNotSupported, a)
		}
		h, err := g.IPCHandle(a.Base())
		if err != nil {
			return fmt.Errorf("ipc: CUDA IPC handle of %s: %w", a, err)
		}
		a.SetHandle(cudaExportKey{}, cudaExport{h.Reserved})
		return nil
	}, func(a *alloc.Arena) error {
		a.DeleteHandle(cudaExportKey{})
		return nil
	})
}

// CUDAExportOf returns the EXPORT message of a GPU arena that the visitor
// of NewCUDAExport visited: its legacy CUDA IPC handle, with no descriptor
// beside it. device names this side's GPU (its PCI bus id).
func CUDAExportOf(self uint32, device string, a *alloc.Arena) (Msg, bool) {
	v, ok := a.Handle(cudaExportKey{})
	if !ok {
		return Msg{}, false
	}
	e := v.(cudaExport)
	return Msg{Kind: KindExport, From: self, Arena: uint64(a.ID), Size: uint64(a.Size()), Device: device, Handle: e.h[:]}, true
}

// CUDAPeer is what a GPU from proxy.NewCUDADevice offers this path.
type CUDAPeer interface {
	OpenIPCHandle(h [64]byte) (proxy.DevicePtr, error)
	CloseIPCHandle(p proxy.DevicePtr) error
	CopyDtoDAsync(dst, src proxy.DevicePtr, n int, s proxy.Stream) error
	CanAccessPeer(busID string) (bool, error)
}

// CUDA is the on-node path's view of a GPU from proxy.NewCUDADevice: a
// HandleOpener, a Copier and the answering side's Local.
type CUDA struct {
	// Dev is the GPU; it must also implement CUDAPeer.
	Dev proxy.Device
}

func (c CUDA) peer() (CUDAPeer, error) {
	if c.Dev == nil {
		return nil, fmt.Errorf("%w: no CUDA device", ErrNotSupported)
	}
	p, ok := c.Dev.(CUDAPeer)
	if !ok {
		return nil, fmt.Errorf("%w: %T has no CUDA IPC", ErrNotSupported, c.Dev)
	}
	return p, nil
}

// OpenHandle implements HandleOpener with cuIpcOpenMemHandle on the legacy
// handle in h. A descriptor beside h (the VMM export of
// cuMemExportToShareableHandle) is refused with ErrNotSupported.
func (c CUDA) OpenHandle(h Msg, fd int) (proxy.DevicePtr, error) {
	p, err := c.peer()
	if err != nil {
		return 0, err
	}
	if fd >= 0 {
		return 0, fmt.Errorf("%w: importing a CUDA VMM descriptor", ErrNotSupported)
	}
	if len(h.Handle) != 64 {
		return 0, fmt.Errorf("%w: CUDA IPC handle of %d bytes", ErrBadMessage, len(h.Handle))
	}
	return p.OpenIPCHandle([64]byte(h.Handle))
}

// CloseHandle implements HandleOpener (cuIpcCloseMemHandle).
func (c CUDA) CloseHandle(ptr proxy.DevicePtr) error {
	p, err := c.peer()
	if err != nil {
		return err
	}
	return p.CloseIPCHandle(ptr)
}

// CopyDtoDAsync implements Copier (cuMemcpyDtoDAsync_v2).
func (c CUDA) CopyDtoDAsync(dst, src proxy.DevicePtr, n int, st proxy.Stream) error {
	p, err := c.peer()
	if err != nil {
		return err
	}
	return p.CopyDtoDAsync(dst, src, n, st)
}

// RecordEvent implements Copier.
func (c CUDA) RecordEvent(st proxy.Stream) (proxy.Event, error) { return c.Dev.RecordEvent(st) }

// Ready implements Local: the device is open.
func (c CUDA) Ready() bool { _, err := c.peer(); return err == nil }

// CanReach implements Local: the same GPU, or peer access both ways with
// the GPU of that PCI bus id.
func (c CUDA) CanReach(busID string) bool {
	p, err := c.peer()
	if err != nil {
		return false
	}
	ok, err := p.CanAccessPeer(busID)
	return err == nil && ok
}
