package gdrlink

import (
	"errors"
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
// sent one is staged there first (Transfer.Path says proxy). Between two
// ranks of one node whose GPUs reach each other, the receiver pulls a GPU
// tensor straight from the sender's GPU memory instead, once the pair's
// on-node path is set up (Transfer.Path says cuda-ipc; GDRLINK_CUDA_IPC; see
// ipclink.go). The CUDA driver is loaded at Join; without it Join fails and
// says why.
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

// gpuSide is a group's GPU: the device, the pool of its GPU tensors, the
// pinned pool of proxy tensors (registered with the device and with every
// provider), the proxy, and the on-node path to peers' GPUs (nil where the
// device has none).
type gpuSide struct {
	ordinal int
	dev     proxy.Device
	tensors *alloc.Pool
	pinned  *alloc.Pool
	px      *proxy.Proxy
	ipc     *gpuIPC
	// collStream is the stream the collectives copy GPU tensors to and
	// from pinned memory on (nil until the first such call).
	collStream proxy.Stream
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
	var tensorVisitors []alloc.Visitor
	if gs.ipc, err = newGPUIPC(g, dev); err != nil {
		return fmt.Errorf("GPU %d on-node path: %w", g.cfg.gpu, err)
	}
	if gs.ipc != nil {
		tensorVisitors = append(tensorVisitors, gs.ipc.visitor())
	}
	where := tensor.GPUDevice(g.cfg.gpu)
	dsrc := &deviceSource{dev: dev, where: where, alloc: dev.Alloc}
	if gs.ipc != nil {
		if a, ok := gs.ipc.dev.(interface {
			alloc(n int) (proxy.DevicePtr, error)
		}); ok {
			dsrc.alloc = a.alloc // arenas the path can export
		}
	}
	if gs.tensors, err = alloc.New(dsrc, alloc.WithVisitors(tensorVisitors...),
		alloc.WithName(fmt.Sprintf("gdrlink rank %d %s", g.Rank(), where))); err != nil {
		return fmt.Errorf("GPU tensor pool: %w", err)
	}
	if gs.ipc != nil {
		gs.ipc.pool = gs.tensors
	}
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

// closeGPU closes the proxy, the pools, the on-node path and the device.
func (gs *gpuSide) close() []error {
	var errs []error
	if gs.collStream != nil {
		errs = append(errs, gs.collStream.Close())
	}
	if gs.px != nil {
		errs = append(errs, gs.px.Close())
	}
	if gs.pinned != nil {
		errs = append(errs, gs.pinned.Close())
	}
	if gs.ipc != nil {
		errs = append(errs, gs.ipc.close())
	}
	if gs.tensors != nil {
		errs = append(errs, gs.tensors.Close())
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

// gpuOptions are a channel's GPU paths to rank: the proxy, and the
// on-node pull where the GPU has one.
func (g *Group) gpuOptions(p *peer) []rendezvous.Option {
	if g.gpu == nil {
		return nil
	}
	opts := []rendezvous.Option{rendezvous.WithProxy(rendezvous.ProxyPath(g.gpu.px, g.allocGPU))}
	if g.gpu.ipc != nil && p != nil && p.local {
		opts = append(opts, rendezvous.WithPull(&ipcPuller{ipc: g.gpu.ipc, p: p}))
	}
	return opts
}

// allocGPU allocates n bytes of the group's GPU as a tensor buffer, from
// its GPU tensor pool.
func (g *Group) allocGPU(n int, dev tensor.Device) (tensor.Buffer, error) {
	if g.gpu == nil || dev.Kind != tensor.GPU || dev.Index != g.gpu.ordinal {
		return nil, fmt.Errorf("gdrlink: %w: no %s in this group (WithGPU, GDRLINK_GPU)", verbsio.ErrNotSupported, dev)
	}
	b, err := g.gpu.tensors.Alloc(max(n, 1))
	if err != nil {
		return nil, fmt.Errorf("gdrlink: %d bytes on %s: %w", n, dev, err)
	}
	return sizedBlock{b, n}, nil
}

// sizedBlock is a block of the GPU tensor pool holding n bytes (a tensor
// of no bytes still takes one).
type sizedBlock struct {
	alloc.Block
	n int
}

func (b sizedBlock) Len() int { return b.n }

// gpuArenaAlign rounds GPU arenas, as alloc's CUDA source does: a NIC's
// registration of an arena (BAR1 pages of up to 2 MiB) never shares a
// page with another allocation.
const gpuArenaAlign = 2 << 20

// deviceSource makes the arenas of a group's GPU tensor pool with the
// group's device (a real GPU or the simulated one): one device allocation
// an arena, which the on-node path exports whole.
type deviceSource struct {
	dev   proxy.Device
	where tensor.Device
	alloc func(n int) (proxy.DevicePtr, error)
}

func (s *deviceSource) Name() string          { return "device:" + s.dev.Info().Name }
func (s *deviceSource) Device() tensor.Device { return s.where }

func (s *deviceSource) Alloc(size int) (*alloc.Region, error) {
	n := (size + gpuArenaAlign - 1) &^ (gpuArenaAlign - 1)
	p, err := s.alloc(n)
	if err != nil {
		if errors.Is(err, proxy.ErrDeviceMemory) {
			return nil, fmt.Errorf("%w: %s: %w", alloc.ErrPoolExhausted, s.Name(), err)
		}
		return nil, err
	}
	return &alloc.Region{Base: uintptr(p), Size: n, Device: s.where, FD: -1}, nil
}

func (s *deviceSource) Free(r *alloc.Region) error { return s.dev.Free(proxy.DevicePtr(r.Base)) }

// Close does nothing: the device is the group's, closed after the pool.
func (s *deviceSource) Close() error { return nil }
