package visitor

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/nvml"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Errors of the GPU memory-region visitor.
var (
	// ErrBAR1Exhausted: registering the arena would map more GPU memory
	// than the GPU's BAR1 aperture has free; the message gives the arena's
	// size and BAR1's free and total bytes.
	ErrBAR1Exhausted = errors.New("visitor: GPU BAR1 aperture exhausted")
	// ErrGPURegistration: neither dma-buf nor nvidia-peermem registration
	// of a GPU arena worked; both reasons are wrapped. The GPU's tensors
	// then need a CPU proxy.
	ErrGPURegistration = errors.New("visitor: GPU memory registration failed")
)

var (
	// errNotGPUMemory: an arena of host memory, or of another GPU, given to
	// the GPU visitor.
	errNotGPUMemory = errors.New("visitor: arena is not GPU memory")
	// errBAR1Unknown: BAR1's size could not be read (no NVML, or built
	// without cgo) and no limit was passed in.
	errBAR1Unknown = errors.New("visitor: GPU BAR1 size unknown")
)

// gpumrMethod is how GPU memory is registered with the NIC.
type gpumrMethod int

// Registration methods.
const (
	// gpumrAuto tries dma-buf, then nvidia-peermem.
	gpumrAuto gpumrMethod = iota
	// gpumrDMABuf uses only dma-buf: cuMemGetHandleForAddressRange then
	// ibv_reg_dmabuf_mr (kernel 5.12+, CUDA 11.7+, open GPU kernel modules).
	gpumrDMABuf
	// gpumrPeerMem uses only ibv_reg_mr on the device pointer, which the
	// nvidia-peermem kernel module resolves.
	gpumrPeerMem
)

// String names the method.
func (m gpumrMethod) String() string {
	switch m {
	case gpumrDMABuf:
		return "dma-buf"
	case gpumrPeerMem:
		return "peermem"
	}
	return "auto"
}

// GPUMROptions configure NewGPUMemoryRegions.
type GPUMROptions struct {
	// Access is the regions' access; 0 means local write, remote write and
	// remote read.
	Access verbsio.Access
	// method chooses dma-buf, nvidia-peermem, or both in that order (the
	// default); tests force one.
	method gpumrMethod
	// BAR1Bytes is the BAR1 budget: > 0 caps the bytes this visitor maps;
	// 0 asks NVML for the GPU's free BAR1 before each arena; < 0 skips the
	// check.
	BAR1Bytes int64
}

// gpuMR is what the GPU visitor attaches to an arena.
type gpuMR struct {
	// MR is the memory region: its rkey goes into requests for tensors
	// landing in the arena.
	MR verbsio.MemoryRegion
	// Method is how it was registered ("dma-buf" or "peermem").
	Method gpumrMethod
	// DMABufErr is why dma-buf was not used, when it was tried and failed.
	DMABufErr error
}

type gpumrKey struct{}

// gpuMemoryRegionOf returns the GPU memory region of an arena that a
// NewGPUMemoryRegions visitor registered.
func gpuMemoryRegionOf(a *alloc.Arena) (gpuMR, bool) {
	h, ok := a.Handle(gpumrKey{})
	if !ok {
		return gpuMR{}, false
	}
	return h.(gpuMR), true
}

// gpuExporter is what the visitor needs of a CUDA context; tests fake it.
type gpuExporter interface {
	exportDMABuf(ptr uintptr, n int) (fd int, closeFD func() error, err error)
	busID() (string, error)
	device() tensor.Device
}

// gpuExport exports through the primary context of one GPU, retained for
// each call (and, for a dma-buf, until its descriptor is closed).
type gpuExport struct{ pc *primaryContext }

func (g gpuExport) exportDMABuf(ptr uintptr, n int) (int, func() error, error) {
	ctx, err := g.pc.acquire()
	if err != nil {
		return -1, nil, err
	}
	b, err := ctx.ExportDMABuf(ptr, n)
	if err != nil {
		if rerr := g.pc.release(); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return -1, nil, err
	}
	return b.FD, func() error { return errors.Join(b.Close(), g.pc.release()) }, nil
}

func (g gpuExport) busID() (string, error) {
	ctx, err := g.pc.acquire()
	if err != nil {
		return "", err
	}
	id, err := ctx.Device().PCIBusID()
	if rerr := g.pc.release(); rerr != nil {
		return "", errors.Join(err, rerr)
	}
	return id, err
}

func (g gpuExport) device() tensor.Device { return tensor.GPUDevice(g.pc.ordinal) }

// gpuMemoryRegions is the visitor NewGPUMemoryRegions returns.
type gpuMemoryRegions struct {
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

// NewGPUMemoryRegions returns a visitor that registers every arena of a GPU
// pool of the GPU with CUDA ordinal gpu with pd of dev, so that a NIC reads
// and writes the GPU's tensors directly (GPUDirect RDMA). It tries dma-buf
// first (cuMemGetHandleForAddressRange, then ProtectionDomain.RegisterDMABuf)
// and nvidia-peermem second (RegisterMemory on the device pointer), and checks
// the GPU's BAR1 aperture before each arena: a NIC reaches GPU memory through
// BAR1, and an arena larger than what is left of it fails with
// ErrBAR1Exhausted rather than with an obscure driver error. The visitor
// retains the GPU's primary context only while it exports an arena.
//
// A provider whose Caps do not list GPU memory and cannot register dma-bufs
// fails with verbsio.ErrNotSupported; nvidia-peermem registration is tried
// only with a provider whose Caps list GPU memory.
func NewGPUMemoryRegions(gpu int, dev verbsio.Device, pd verbsio.ProtectionDomain, opts GPUMROptions) (alloc.Visitor, error) {
	v, err := newGPUMemoryRegions(gpuExport{newPrimaryContext(gpu)}, dev, pd, opts, nvml.BAR1)
	if err != nil {
		return nil, err
	}
	return v, nil
}

func newGPUMemoryRegions(exp gpuExporter, dev verbsio.Device, pd verbsio.ProtectionDomain, opts GPUMROptions, bar1 func(string) (int64, int64, error)) (*gpuMemoryRegions, error) {
	caps := dev.Caps()
	gpuOK := false
	for _, k := range caps.MemoryTypes {
		gpuOK = gpuOK || k == tensor.GPU
	}
	switch {
	case opts.method == gpumrDMABuf && !caps.DMABuf:
		return nil, fmt.Errorf("%w: provider %s has no dma-buf registration", verbsio.ErrNotSupported, caps.Provider)
	case opts.method == gpumrAuto && !gpuOK && !caps.DMABuf:
		return nil, fmt.Errorf("%w: provider %s can register neither dma-bufs nor GPU memory (its memory types: %v)", verbsio.ErrNotSupported, caps.Provider, caps.MemoryTypes)
	}
	acc := opts.Access
	if acc == 0 {
		acc = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead
	}
	// nvidia-peermem is tried when the provider lists GPU memory among what
	// it registers, or when the caller asks for it by name.
	peer := opts.method == gpumrPeerMem || (opts.method == gpumrAuto && gpuOK)
	return &gpuMemoryRegions{exp: exp, pd: pd, caps: caps, opts: opts, bar1: bar1, access: acc, peer: peer}, nil
}

// Name implements alloc.Visitor.
func (v *gpuMemoryRegions) Name() string {
	return fmt.Sprintf("gpu-mr:%s:%s", v.exp.device(), v.opts.method)
}

// mappedBytes is the number of bytes of GPU memory this visitor has registered.
func (v *gpuMemoryRegions) mappedBytes() int64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.mapped
}

// checkBAR1 refuses an arena that BAR1 cannot hold; called with v.mu held.
func (v *gpuMemoryRegions) checkBAR1(a *alloc.Arena) error {
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
		return fmt.Errorf("%w: PCI bus id of %s: %w", errBAR1Unknown, v.exp.device(), err)
	}
	free, total, err := v.bar1(bus)
	if err != nil {
		return fmt.Errorf("%w: %s (%s): %w; pass GPUMROptions.BAR1Bytes (or -1 to skip the check)", errBAR1Unknown, v.exp.device(), bus, err)
	}
	if size > free {
		return fmt.Errorf("%w: %s needs %d bytes of BAR1; %s (%s) has %d free of %d", ErrBAR1Exhausted, a, size, v.exp.device(), bus, free, total)
	}
	return nil
}

// Visit implements alloc.Visitor.
func (v *gpuMemoryRegions) Visit(a *alloc.Arena) error {
	if !a.Device().IsGPU() {
		return fmt.Errorf("%w: %s", errNotGPUMemory, a)
	}
	if a.Device() != v.exp.device() {
		return fmt.Errorf("%w: %s is memory of %s, the visitor registers %s", errNotGPUMemory, a, a.Device(), v.exp.device())
	}
	if _, ok := a.Handle(gpumrKey{}); ok {
		return fmt.Errorf("%w: %s by %s", errAlreadyVisited, a, v.Name())
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if err := v.checkBAR1(a); err != nil {
		return err
	}
	h := gpuMR{}
	var peerErr error
	if v.opts.method != gpumrPeerMem {
		h.DMABufErr = v.viaDMABuf(a, &h)
	}
	if h.MR == nil && v.peer {
		mr, err := v.pd.RegisterMemory(a.Base(), a.Size(), v.access)
		if err == nil {
			h.MR, h.Method = mr, gpumrPeerMem
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
func (v *gpuMemoryRegions) viaDMABuf(a *alloc.Arena, h *gpuMR) error {
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
	h.MR, h.Method = mr, gpumrDMABuf
	return nil
}

// Release implements alloc.Visitor: the region is deregistered.
func (v *gpuMemoryRegions) Release(a *alloc.Arena) error {
	h, ok := gpuMemoryRegionOf(a)
	if !ok {
		return fmt.Errorf("%w: %s by %s", errNotVisited, a, v.Name())
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
