package gdrlink

import (
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/internal/nvml"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// WithGPU lets the group hold tensors on the GPU with CUDA ordinal gpu
// (GDRLINK_GPU): NewTensorOn(tensor.GPUDevice(gpu), ...) allocates device
// memory, NewTensorOn(tensor.Device{Kind: tensor.PinnedHost}, ...) page-locked
// host memory, and RecvOn receives onto the GPU. GPU tensors travel through
// a pinned host proxy registered with every provider: a received tensor
// lands there and is copied to the GPU chunk by chunk as it arrives, and a
// sent one is staged there first (Transfer.Path says proxy). The CUDA driver
// is loaded at Join; without it Join fails and says why.
func WithGPU(gpu int) Option {
	return func(c *config) error {
		if gpu < 0 {
			return fmt.Errorf("%w: GPU ordinal %d", verbsio.ErrBadConfig, gpu)
		}
		c.gpu = gpu
		return nil
	}
}

// openCUDA is the GPU of a group with a real CUDA driver: the device and the
// visitor that page-locks and registers host arenas with it.
func openCUDA(ordinal int) (proxy.Device, alloc.Visitor, error) {
	dev, err := proxy.NewCUDADevice(ordinal)
	if err != nil {
		return nil, nil, err
	}
	return dev, visitor.NewCUDAHostRegister(ordinal), nil
}

// gpuSide is a group's GPU: the device, the pinned pool of proxy tensors
// (registered with the device and with every provider) and the proxy.
type gpuSide struct {
	ordinal int
	dev     proxy.Device
	pinned  *alloc.Pool
	px      *proxy.Proxy
	// busID is the GPU's PCI address, "" when the device has none; bar1
	// reads its BAR1 aperture.
	busID string
	bar1  func(busID string) (free, total int64, err error)
}

// setupGPU opens the GPU and its pinned proxy pool, registered by the
// group's provider visitors.
func (g *Group) setupGPU(src alloc.Source, visitors []alloc.Visitor) error {
	open := g.cfg.openGPU
	if open == nil {
		open = openCUDA
	}
	dev, hostReg, err := open(g.cfg.gpu)
	if err != nil {
		return fmt.Errorf("GPU %d: %w", g.cfg.gpu, err)
	}
	gs := &gpuSide{ordinal: g.cfg.gpu, dev: dev, busID: dev.Info().PCIBusID, bar1: g.cfg.bar1}
	if gs.bar1 == nil {
		gs.bar1 = nvml.BAR1
	}
	g.gpu = gs
	vs := append([]alloc.Visitor{hostReg}, visitors...)
	if gs.pinned, err = alloc.New(src, alloc.WithVisitors(vs...), alloc.WithName(fmt.Sprintf("gdrlink rank %d pinned", g.Rank())), alloc.WithLimit(g.poolLimit())); err != nil {
		return fmt.Errorf("pinned proxy pool: %w", err)
	}
	if gs.px, err = proxy.New(dev, gs.pinned); err != nil {
		return fmt.Errorf("GPU %d proxy: %w", g.cfg.gpu, err)
	}
	return nil
}

// bar1 reads the BAR1 aperture of the group's GPU from NVML: the bytes of
// it in use and in all, and the GPU's PCI address. ok is false without a
// GPU, when the GPU has no PCI address (a simulated one) or when NVML
// cannot tell (no libnvidia-ml, no driver); the reason is logged at debug
// level.
func (g *Group) bar1() (bus string, used, total int64, ok bool) {
	gs := g.gpu
	if gs == nil || gs.busID == "" {
		return "", 0, 0, false
	}
	free, total, err := gs.bar1(gs.busID)
	if err != nil {
		g.log.Debug("gdrlink: no BAR1 figures", "gpu", gs.busID, "err", err)
		return "", 0, 0, false
	}
	return gs.busID, total - free, total, true
}

// closeGPU closes the proxy, the pinned pool and the device.
func (gs *gpuSide) close() []error {
	var errs []error
	if gs.px != nil {
		errs = append(errs, gs.px.Close())
	}
	if gs.pinned != nil {
		errs = append(errs, gs.pinned.Close())
	}
	return append(errs, gs.dev.Close())
}

// channelOptions are what a channel needs for GPU tensors: the pinned pool
// among its memory and the proxy path.
func (g *Group) channelMemory(d *device) rendezvous.Memory {
	if g.gpu == nil {
		return rendezvous.PoolMemory(d.regionOf, g.pool)
	}
	return rendezvous.PoolMemory(d.regionOf, g.pool, g.gpu.pinned)
}

func (g *Group) gpuOptions() []rendezvous.Option {
	if g.gpu == nil {
		return nil
	}
	return []rendezvous.Option{rendezvous.WithProxy(rendezvous.ProxyPath(g.gpu.px, g.allocGPU))}
}

// allocGPU allocates n bytes of the group's GPU as a tensor buffer.
func (g *Group) allocGPU(n int, dev tensor.Device) (tensor.Buffer, error) {
	if g.gpu == nil || dev.Kind != tensor.GPU || dev.Index != g.gpu.ordinal {
		return nil, fmt.Errorf("gdrlink: %w: no %s in this group (WithGPU, GDRLINK_GPU)", verbsio.ErrNotSupported, dev)
	}
	p, err := g.gpu.dev.Alloc(max(n, 1))
	if err != nil {
		return nil, fmt.Errorf("gdrlink: %d bytes on %s: %w", n, dev, err)
	}
	return &deviceBuffer{dev: g.gpu.dev, p: p, n: n, where: dev}, nil
}

// deviceBuffer is one allocation of GPU memory.
type deviceBuffer struct {
	dev   proxy.Device
	p     proxy.DevicePtr
	n     int
	where tensor.Device
}

func (b *deviceBuffer) Bytes() []byte         { return nil }
func (b *deviceBuffer) Addr() uintptr         { return uintptr(b.p) }
func (b *deviceBuffer) Len() int              { return b.n }
func (b *deviceBuffer) Device() tensor.Device { return b.where }
func (b *deviceBuffer) Free() error           { return b.dev.Free(b.p) }
