package rendezvous

import (
	"testing"
	"unsafe"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// nicReachableGPU is host memory that calls itself GPU memory: it stands in
// for a GPU whose memory the NIC registers (dma-buf or peer memory), so the
// channel's choice of the direct GPU path can be tested without a GPU.
type nicReachableGPU struct{ alloc.Source }

func (s nicReachableGPU) Name() string          { return "gpu-stand-in" }
func (s nicReachableGPU) Device() tensor.Device { return tensor.GPUDevice(0) }
func (s nicReachableGPU) Alloc(n int) (*alloc.Region, error) {
	r, err := s.Source.Alloc(n)
	if err == nil {
		r.Device = tensor.GPUDevice(0)
	}
	return r, err
}

func TestGPUResultWrittenDirectly(t *testing.T) {
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
	mmap := alloc.NewMmapSource(alloc.MmapOptions{})
	hostPool, err := alloc.New(mmap, alloc.WithVisitors(registration(pd, 0)))
	if err != nil {
		t.Fatal(err)
	}
	gpuPool, err := alloc.New(nicReachableGPU{mmap}, alloc.WithVisitors(registration(pd, 0)))
	if err != nil {
		t.Fatal(err)
	}
	b, err := New(dev, pd, PoolMemory(regionOf, hostPool, gpuPool), WithName("b"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, err := range []error{b.Close(), gpuPool.Close(), hostPool.Close(), pd.Close(), dev.Close()} {
			if err != nil {
				t.Error(err)
			}
		}
	})
	connectChannels(t, a.ch, b)
	ctx := recvCtx(t)
	for step := int64(0); step < 2; step++ {
		src, _ := makeTensor(a.pool, "int64", tensor.Shape{300}, "w", step)
		if err := a.ch.Send("w", step, src); err != nil {
			t.Fatal(err)
		}
		got, tr, err := b.Recv(ctx, "w", step, OnDevice(tensor.GPUDevice(0)))
		if err != nil {
			t.Fatal(err)
		}
		if tr.Path != PathDirectGPU || !got.Device().IsGPU() {
			t.Fatalf("step %d: path %s onto %s, want direct-gpu", step, tr.Path, got.Device())
		}
		p := *(*unsafe.Pointer)(unsafe.Pointer(&[]uintptr{got.Addr()}[0]))
		if err := checkFill(unsafe.Slice((*byte)(p), got.Meta().ByteSize), seedOf("w", step)); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		_ = got.Release()
	}
}
