package rendezvous

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// simBuffer is device memory of the simulated GPU as a tensor.Buffer.
type simBuffer struct {
	gpu gpusim.Device
	p   proxy.DevicePtr
	n   int
	dev tensor.Device
}

func (b *simBuffer) Bytes() []byte         { return nil }
func (b *simBuffer) Addr() uintptr         { return uintptr(b.p) }
func (b *simBuffer) Len() int              { return b.n }
func (b *simBuffer) Device() tensor.Device { return b.dev }
func (b *simBuffer) Free() error           { return b.gpu.Free(b.p) }

// connectChannels trades hellos and connects two channels of this process.
func connectChannels(t *testing.T, a, b *Channel) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	var ea, eb error
	ha, hb := a.Hello(), b.Hello()
	wg.Add(2)
	go func() { defer wg.Done(); ea = a.Connect(ctx, hb) }()
	go func() { defer wg.Done(); eb = b.Connect(ctx, ha) }()
	wg.Wait()
	if ea != nil || eb != nil {
		t.Fatalf("connect: %v / %v", ea, eb)
	}
}

// The receiver wants its results on a GPU that the NIC cannot write: each
// lands in the proxy's pinned tensor and the proxy package copies it to the
// (simulated) GPU.
func TestGPUResultGoesThroughProxy(t *testing.T) {
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
	gpu := gpusim.New(gpusim.Config{})
	pinned, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithVisitors(gpu.HostRegisterVisitor(), registration(pd, 0)), alloc.WithName("pinned"))
	if err != nil {
		t.Fatal(err)
	}
	px, err := proxy.New(gpu, pinned, proxy.WithChunk(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	gpuAlloc := func(n int, d tensor.Device) (tensor.Buffer, error) {
		p, err := gpu.Alloc(n)
		if err != nil {
			return nil, err
		}
		return &simBuffer{gpu: gpu, p: p, n: n, dev: d}, nil
	}
	b, err := New(dev, pd, PoolMemory(regionOf, hostPool, pinned), WithName("b"), WithProxy(ProxyPath(px, gpuAlloc)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, err := range []error{b.Close(), px.Close(), pinned.Close(), hostPool.Close(), gpu.Close(), pd.Close(), dev.Close()} {
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
		if tr.Path != PathProxy || !got.Device().IsGPU() {
			t.Fatalf("step %d: path %s, result on %s; want proxy onto the GPU", step, tr.Path, got.Device())
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
	if n := pinned.Stats().Blocks; n != 0 {
		t.Fatalf("%d proxy tensors still out of the pinned pool", n)
	}
}

func TestGPUResultWithoutPathFails(t *testing.T) {
	a, b := pair(t, "tcp")
	ctx := recvCtx(t)
	src, _ := makeTensor(a.pool, "float32", tensor.Shape{64}, "act", 0)
	if err := a.ch.Send("act", 0, src); err != nil {
		t.Fatal(err)
	}
	_, _, err := b.ch.Recv(ctx, "act", 0, OnDevice(tensor.GPUDevice(0)))
	if !errors.Is(err, ErrNoPath) {
		t.Fatalf("Recv onto a GPU with no registered GPU memory and no proxy = %v, want ErrNoPath", err)
	}
	// The sender's tensor is kept for a later request of the same step.
	got, _, err := b.ch.Recv(ctx, "act", 0)
	if err != nil {
		t.Fatal(err)
	}
	_ = got.Release()
}

// A GPU tensor the NIC cannot read is staged by the proxy into a pinned
// tensor and written from there.
func TestGPUSourceStagedThroughProxy(t *testing.T) {
	b, err := openSideRails("tcp", "b", nil)
	if err != nil {
		skipUnavailable(t, "tcp", err)
	}
	t.Cleanup(func() { _ = b.close() })
	dev, err := verbsio.Open("tcp", verbsio.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	gpu := gpusim.New(gpusim.Config{})
	pinned, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithVisitors(gpu.HostRegisterVisitor(), registration(pd, 0)), alloc.WithName("pinned"))
	if err != nil {
		t.Fatal(err)
	}
	px, err := proxy.New(gpu, pinned, proxy.WithChunk(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	noGPU := func(int, tensor.Device) (tensor.Buffer, error) {
		return nil, errors.New("the sender allocates no GPU results")
	}
	a, err := New(dev, pd, PoolMemory(regionOf, pinned), WithName("a"), WithProxy(ProxyPath(px, noGPU)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, err := range []error{a.Close(), px.Close(), pinned.Close(), gpu.Close(), pd.Close(), dev.Close()} {
			if err != nil {
				t.Error(err)
			}
		}
	})
	connectChannels(t, a, b.ch)
	ctx := recvCtx(t)
	stream, err := gpu.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	const n = 3000
	base := pinned.Stats().Blocks // the channel's control buffers
	for step := int64(0); step < 2; step++ {
		// Put the pattern on the GPU through a pinned block.
		blk, err := pinned.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		fill(blk.Bytes(), seedOf("g", step))
		p, err := gpu.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		if err := gpu.CopyHtoDAsync(p, blk.Addr(), n, stream); err != nil {
			t.Fatal(err)
		}
		if err := stream.Synchronize(); err != nil {
			t.Fatal(err)
		}
		_ = blk.Free()
		meta, _ := tensor.MetaFor(tensor.Uint8, tensor.Shape{n})
		src, err := tensor.New(meta, &simBuffer{gpu: gpu, p: p, n: n, dev: tensor.GPUDevice(0)})
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Send("g", step, src); err != nil {
			t.Fatal(err)
		}
		got, _, err := b.ch.Recv(ctx, "g", step)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkTensor(got, "uint8", tensor.Shape{n}, "g", step); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		_ = got.Release()
	}
	if st := a.Stats(); st.Staged != 2 {
		t.Fatalf("%d sends staged, want 2", st.Staged)
	}
	deadline := time.Now().Add(5 * time.Second)
	for pinned.Stats().Blocks != base && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if k := pinned.Stats().Blocks; k != base {
		t.Fatalf("%d pinned blocks out, %d before the sends", k, base)
	}
}
