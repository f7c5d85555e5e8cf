package rendezvous

import (
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// simGPUSource hands out a simulated GPU's memory as GPU regions. gpusim's
// device memory is host memory at the device address, so the tcp provider
// can register and write it as a NIC writes a GPU's.
type simGPUSource struct{ gpu gpusim.Device }

func (s simGPUSource) Name() string          { return "gpusim-device" }
func (s simGPUSource) Device() tensor.Device { return tensor.GPUDevice(0) }
func (s simGPUSource) Close() error          { return nil }
func (s simGPUSource) Alloc(n int) (*alloc.Region, error) {
	p, err := s.gpu.Alloc(n)
	if err != nil {
		return nil, err
	}
	return &alloc.Region{Base: uintptr(p), Size: n, Device: tensor.GPUDevice(0), FD: -1}, nil
}
func (s simGPUSource) Free(r *alloc.Region) error { return s.gpu.Free(proxy.DevicePtr(r.Base)) }

// TestDirectGPUResultFlushesAsProxyDecides: a GPU result the NIC writes
// directly lands through the channel's proxy, so it flushes as the proxy's
// flush choice says: through the driver on a GPU of compute capability 8.0
// whose driver can flush from the host, not at all on 9.0 (no C2C), and on
// 9.0 with C2C. gpusim counts the flushes.
func TestDirectGPUResultFlushesAsProxyDecides(t *testing.T) {
	t.Setenv("GDRLINK_GDR_FLUSH", "auto")
	for _, c := range []struct {
		name string
		cfg  gpusim.Config
		want int64
	}{
		{"cc80-hostflush", gpusim.Config{ComputeCapability: 80, HostFlush: true}, 3},
		{"cc90", gpusim.Config{ComputeCapability: 90, HostFlush: true}, 0},
		{"cc90-c2c", gpusim.Config{ComputeCapability: 90, C2C: true, HostFlush: true}, 3},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, err := openSideRails("tcp", "a", nil)
			if err != nil {
				skipUnavailable(t, "tcp", err)
			}
			t.Cleanup(func() { _ = a.close() })
			dev, err := verbsio.Open("tcp", verbsio.DefaultConfig())
			if err != nil {
				t.Fatal(err)
			}
			pd, err := dev.AllocPD()
			if err != nil {
				t.Fatal(err)
			}
			hostPool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithVisitors(registration(pd, 0)))
			if err != nil {
				t.Fatal(err)
			}
			gpu := gpusim.New(c.cfg)
			gpuPool, err := alloc.New(simGPUSource{gpu}, alloc.WithVisitors(registration(pd, 0)), alloc.WithName("gpu"))
			if err != nil {
				t.Fatal(err)
			}
			pinned, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
				alloc.WithVisitors(gpu.HostRegisterVisitor(), registration(pd, 0)), alloc.WithName("pinned"))
			if err != nil {
				t.Fatal(err)
			}
			px, err := proxy.New(gpu, pinned, proxy.WithDirect(nil, false))
			if err != nil {
				t.Fatal(err)
			}
			gpuAlloc := func(n int, d tensor.Device) (tensor.Buffer, error) {
				blk, err := gpuPool.Alloc(n)
				if err != nil {
					return nil, err
				}
				return blk, nil
			}
			b, err := New(dev, pd, PoolMemory(regionOf, hostPool, gpuPool, pinned), WithName("b"), WithProxy(ProxyPath(px, gpuAlloc)))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				for _, err := range []error{b.Close(), px.Close(), pinned.Close(), gpuPool.Close(), hostPool.Close(), gpu.Close(), pd.Close(), dev.Close()} {
					if err != nil {
						t.Error(err)
					}
				}
			})
			connectChannels(t, a.ch, b)
			ctx := recvCtx(t)
			for step := int64(0); step < 3; step++ {
				src, _ := makeTensor(a.pool, "float32", tensor.Shape{1000}, "act", step)
				if err := a.ch.Send("act", step, src); err != nil {
					t.Fatal(err)
				}
				got, tr, err := b.Recv(ctx, "act", step, OnDevice(tensor.GPUDevice(0)))
				if err != nil {
					t.Fatal(err)
				}
				if tr.Path != PathDirectGPU || !got.Device().IsGPU() {
					t.Fatalf("step %d: path %s, result on %s; want written directly into the GPU", step, tr.Path, got.Device())
				}
				onGPU, err := gpu.Peek(proxy.DevicePtr(got.Addr()), int(got.Meta().ByteSize))
				if err != nil {
					t.Fatal(err)
				}
				if err := checkFill(onGPU, seedOf("act", step)); err != nil {
					t.Fatalf("step %d on the GPU: %v", step, err)
				}
				_ = got.Release()
			}
			if got := gpu.Stats().RDMAFlushes; got != c.want {
				t.Fatalf("%d driver flushes for 3 direct receives, want %d", got, c.want)
			}
		})
	}
}
