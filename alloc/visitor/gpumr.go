package visitor

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/cuda"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Errors of the GPU memory-region visitor.
var (
	// ErrNotGPUMemory: an arena of host memory given to the GPU visitor.
	ErrNotGPUMemory = errors.New("visitor: arena is not GPU memory")
	// ErrBAR1Exhausted: registering the arena would map more GPU memory
	// than the GPU's BAR1 aperture has free; the message gives the arena's
	// size and BAR1's free and total bytes.
	ErrBAR1Exhausted = errors.New("visitor: GPU BAR1 aperture exhausted")
	// ErrBAR1Unknown: BAR1's size could not be read (no NVML, or built
	// without cgo) and no limit was passed in.
	ErrBAR1Unknown = errors.New("visitor: GPU BAR1 size unknown")
	// ErrGPURegistration: neither dma-buf nor nvidia-peermem registration
	// of a GPU arena worked; both reasons are wrapped.
	ErrGPURegistration = errors.New("visitor: GPU memory registration failed")
)

// GPUMRMethod is how GPU memory is registered with the NIC.
type GPUMRMethod int

// Registration methods.
const (
	// GPUMRAuto tries dma-buf, then nvidia-peermem.
	GPUMRAuto GPUMRMethod = iota
	// GPUMRDMABuf uses only dma-buf: cuMemGetHandleForAddressRange then
	// ibv_reg_dmabuf_mr (kernel 5.12+, CUDA 11.7+, open GPU kernel modules).
	GPUMRDMABuf
	// GPUMRPeerMem uses only ibv_reg_mr on the device pointer, which the
	// nvidia-peermem kernel module resolves.
	GPUMRPeerMem
)

// String names the method.
func (m GPUMRMethod) String() string {
	switch m {
	case GPUMRDMABuf:
		return "dma-buf"
	case GPUMRPeerMem:
		return "peermem"
	}
	return "auto"
}

// GPUMROptions configure NewGPUMemoryRegions.
type GPUMROptions struct {
	// Access is the regions' access; 0 means local write, remote write and
	// remote read.
	Access verbsio.Access
	// Method chooses dma-buf, nvidia-peermem, or both in that order.
	Method GPUMRMethod
	// BAR1Bytes is the BAR1 budget: > 0 caps the bytes this visitor maps;
	// 0 asks NVML for the GPU's free BAR1 before each arena; < 0 skips the
	// check.
	BAR1Bytes int64
}

// GPUMR is what the GPU visitor attaches to an arena.
type GPUMR struct {
	// MR is the memory region: its rkey goes into requests for tensors
	// landing in the arena.
	MR verbsio.MemoryRegion
	// Method is how it was registered ("dma-buf" or "peermem").
	Method GPUMRMethod
	// DMABufErr is why dma-buf was not used, when it was tried and failed.
	DMABufErr error
}

type gpumrKey struct{}

// GPUMemoryRegionOf returns the GPU memory region of an arena that a
// GPUMemoryRegions visitor registered.
func GPUMemoryRegionOf(a *alloc.Arena) (GPUMR, bool) {
	h, ok := a.Handle(gpumrKey{})
	if !ok {
		return GPUMR{}, false
	}
	return h.(GPUMR), true
}

// gpuExporter is what the visitor needs of a CUDA context; tests fake it.
type gpuExporter interface {
	exportDMABuf(ptr uintptr, n int) (fd int, closeFD func() error, err error)
	busID() (string, error)
	device() tensor.Device
}

type ctxExporter struct{ ctx *cuda.Context }

func (c ctxExporter) exportDMABuf(ptr uintptr, n int) (int, func() error, error) {
	b, err := c.ctx.ExportDMABuf(ptr, n)
	if err != nil {
		return -1, nil, err
	}
	return b.FD, b.Close, nil
}

func (c ctxExporter) busID() (string, error) { return c.ctx.Device().PCIBusID() }

func (c ctxExporter) device() tensor.Device { return tensor.GPUDevice(c.ctx.Device().Ordinal()) }

// GPUMemoryRegions is a visitor that registers every arena of a GPU pool
// with a verbs protection domain, so a NIC reads and writes the GPU's
// tensors directly (GPUDirect RDMA). It tries dma-buf first
// (cuMemGetHandleForAddressRange, then ProtectionDomain.RegisterDMABuf) and
// nvidia-peermem second (RegisterMemory on the device pointer), and checks
// the GPU's BAR1 aperture before each arena: a NIC reaches GPU memory
// through BAR1, and an arena larger than what is left of it fails with
// ErrBAR1Exhausted rather than with an obscure driver error.
type GPUMemoryRegions struct {
	exp    gpuExporter
	pd     verbsio.ProtectionDomain
	caps   verbsio.Caps
	opts   GPUMROptions
	bar1   func(busID string) (free, total int64, err error)
	peer   bool // try RegisterMemory on device pointers
	access verbsio.Access

	mu     sync.Mutex
	mapped int64
}

// NewGPUMemoryRegions returns the visitor for GPU arenas of ctx's device,
// registering them with pd of dev. A provider whose Caps do not list GPU
// memory and cannot register dma-bufs fails with verbsio.ErrNotSupported;
// nvidia-peermem registration is tried only with a provider whose Caps list
// GPU memory (or with Method GPUMRPeerMem).
func NewGPUMemoryRegions(ctx *cuda.Context, dev verbsio.Device, pd verbsio.ProtectionDomain, opts GPUMROptions) (*GPUMemoryRegions, error) {
	return newGPUMemoryRegions(ctxExporter{ctx}, dev, pd, opts, nvmlBAR1)
}

func newGPUMemoryRegions(exp gpuExporter, dev verbsio.Device, pd verbsio.ProtectionDomain, opts GPUMROptions, bar1 func(string) (int64, int64, error)) (*GPUMemoryRegions, error) {
	caps := dev.Caps()
	gpuOK := false
	for _, k := range caps.MemoryTypes {
		gpuOK = gpuOK || k == tensor.GPU
	}
	switch {
	case opts.Method == GPUMRDMABuf && !caps.DMABuf:
		return nil, fmt.Errorf("%w: provider %s has no dma-buf registration", verbsio.ErrNotSupported, caps.Provider)
	case opts.Method == GPUMRAuto && !gpuOK && !caps.DMABuf:
		return nil, fmt.Errorf("%w: provider %s can register neither dma-bufs nor GPU memory (its memory types: %v)", verbsio.ErrNotSupported, caps.Provider, caps.MemoryTypes)
	}
	acc := opts.Access
	if acc == 0 {
		acc = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead
	}
	// nvidia-peermem is tried when the provider lists GPU memory among what
	// it registers, or when the caller asks for it by name.
	peer := opts.Method == GPUMRPeerMem || (opts.Method == GPUMRAuto && gpuOK)
	return &GPUMemoryRegions{exp: exp, pd: pd, caps: caps, opts: opts, bar1: bar1, access: acc, peer: peer}, nil
}

// Name implements alloc.Visitor.
func (v *GPUMemoryRegions) Name() string {
	return fmt.Sprintf("gpu-mr:%s:%s", v.exp.device(), v.opts.Method)
}

// Mapped is the number of bytes of GPU memory this visitor has registered.
func (v *GPUMemoryRegions) Mapped() int64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.mapped
}

// checkBAR1 refuses an arena that BAR1 cannot hold; called with v.mu held.
func (v *GPUMemoryRegions) checkBAR1(a *alloc.Arena) error {
	size := int64(a.Size())
	switch {
	case v.opts.BAR1Bytes < 0:
		return nil
	case v.opts.BAR1Bytes > 0:
		if v.mapped+size > v.opts.BAR1Bytes {
			return fmt.Errorf("%w: %s needs %d bytes of BAR1; %d of the %d-byte BAR1 budget already registered", ErrBAR1Exhausted, a, size, v.mapped, v.opts.BAR1Bytes)
		}
		return nil
	}
	bus, err := v.exp.busID()
	if err != nil {
		return fmt.Errorf("%w: PCI bus id of %s: %w", ErrBAR1Unknown, v.exp.device(), err)
	}
	free, total, err := v.bar1(bus)
	if err != nil {
		return fmt.Errorf("%w: %s (%s): %w; pass GPUMROptions.BAR1Bytes (or -1 to skip the check)", ErrBAR1Unknown, v.exp.device(), bus, err)
	}
	if size > free {
		return fmt.Errorf("%w: %s needs %d bytes of BAR1; %s (%s) has %d free of %d", ErrBAR1Exhausted, a, size, v.exp.device(), bus, free, total)
	}
	return nil
}

// Visit implements alloc.Visitor.
func (v *GPUMemoryRegions) Visit(a *alloc.Arena) error {
	if !a.Device().IsGPU() {
		return fmt.Errorf("%w: %s", ErrNotGPUMemory, a)
	}
	if a.Device() != v.exp.device() {
		return fmt.Errorf("%w: %s is memory of %s, the visitor registers %s", ErrNotGPUMemory, a, a.Device(), v.exp.device())
	}
	if _, ok := a.Handle(gpumrKey{}); ok {
		return fmt.Errorf("%w: %s by %s", ErrAlreadyVisited, a, v.Name())
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.checkBAR1(a); err != nil {
		return err
	}
	h := GPUMR{}
	var peerErr error
	if v.opts.Method != GPUMRPeerMem {
		h.DMABufErr = v.viaDMABuf(a, &h)
	}
	if h.MR == nil && v.peer {
		mr, err := v.pd.RegisterMemory(a.Base(), a.Size(), v.access)
		if err == nil {
			h.MR, h.Method = mr, GPUMRPeerMem
		}
		peerErr = err
	}
	if h.MR == nil {
		return fmt.Errorf("%w: %s: %w", ErrGPURegistration, a, errors.Join(
			wrapIf("dma-buf", h.DMABufErr), wrapIf("nvidia-peermem", peerErr)))
	}
	a.SetHandle(gpumrKey{}, h)
	v.mapped += int64(a.Size())
	return nil
}

func wrapIf(what string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s: %w", what, err)
}

// viaDMABuf exports the arena as a dma-buf and registers it; the file
// descriptor is closed afterwards either way (the region holds its own
// reference to the buffer).
func (v *GPUMemoryRegions) viaDMABuf(a *alloc.Arena, h *GPUMR) error {
	if !v.caps.DMABuf {
		return fmt.Errorf("%w: provider %s has no dma-buf registration", verbsio.ErrNotSupported, v.caps.Provider)
	}
	fd, closeFD, err := v.exp.exportDMABuf(a.Base(), a.Size())
	if err != nil {
		return err
	}
	mr, err := v.pd.RegisterDMABuf(fd, 0, a.Size(), uint64(a.Base()), v.access)
	if cerr := closeFD(); cerr != nil && err == nil {
		_ = mr.Close()
		return cerr
	}
	if err != nil {
		return err
	}
	h.MR, h.Method = mr, GPUMRDMABuf
	return nil
}

// Release implements alloc.Visitor: the region is deregistered.
func (v *GPUMemoryRegions) Release(a *alloc.Arena) error {
	h, ok := GPUMemoryRegionOf(a)
	if !ok {
		return fmt.Errorf("%w: %s by %s", ErrNotVisited, a, v.Name())
	}
	a.DeleteHandle(gpumrKey{})
	v.mu.Lock()
	v.mapped -= int64(a.Size())
	v.mu.Unlock()
	if err := h.MR.Close(); err != nil {
		return fmt.Errorf("deregistering %s: %w", a, err)
	}
	return nil
}
