package visitor

import (
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/cuda"
	"github.com/gdrlink/gdrlink/internal/cuda/cudatest"
	"github.com/gdrlink/gdrlink/tensor"
)

type fakeRegistrar struct {
	err  error
	live map[uintptr]int
}

type fakeReg struct {
	r    *fakeRegistrar
	addr uintptr
}

func (f fakeReg) Close() error { delete(f.r.live, f.addr); return nil }

func (f *fakeRegistrar) register(ptr uintptr, n int) (interface{ Close() error }, error) {
	if f.err != nil {
		return nil, f.err
	}
	f.live[ptr] = n
	return fakeReg{f, ptr}, nil
}
func (f *fakeRegistrar) name() string { return "gpu:0" }

func TestCUDAHostRegisterLogic(t *testing.T) {
	f := &fakeRegistrar{live: map[uintptr]int{}}
	v := &cudaHostRegister{reg: f}
	a := testArena(t, 0, &alloc.Region{Base: 1 << 30, Size: 1 << 21, Device: tensor.Host, FD: -1})
	if err := v.Visit(a); err != nil {
		t.Fatal(err)
	}
	if f.live[1<<30] != 1<<21 || !v.cudaRegistered(a) {
		t.Fatalf("registrations %v", f.live)
	}
	if err := v.Visit(a); !errors.Is(err, errAlreadyVisited) {
		t.Fatalf("second Visit: %v", err)
	}
	if err := v.Release(a); err != nil || len(f.live) != 0 {
		t.Fatalf("Release: %v, %v left", err, f.live)
	}
	if err := v.Release(a); !errors.Is(err, errNotVisited) {
		t.Fatalf("second Release: %v", err)
	}
	gpu := testArena(t, 1, &alloc.Region{Base: 1 << 31, Size: 1 << 21, Device: tensor.GPUDevice(0), FD: -1})
	if err := v.Visit(gpu); !errors.Is(err, errNotHostMemory) {
		t.Fatalf("GPU arena: %v", err)
	}
	f.err = &cuda.Error{Op: "cuMemHostRegister_v2", Code: cuda.ErrorHostMemoryAlreadyRegistered}
	err := v.Visit(a)
	if !errors.Is(err, errCUDAHostRegister) || !errors.Is(err, cuda.ErrHostMemoryAlreadyRegistered) {
		t.Fatalf("driver refusal: %v", err)
	}
	f.err = cuda.ErrWrongMemoryType
	if err := v.Visit(a); !errors.Is(err, errNotHostMemory) {
		t.Fatalf("device pointer as host memory: %v", err)
	}
}

// TestCUDAHostRegisterReal registers a real mmap pool with the driver and
// checks that its tensors become pinned memory.
func TestCUDAHostRegisterReal(t *testing.T) {
	ctx := cudatest.Context(t)
	v := NewCUDAHostRegister(ctx.Device().Ordinal())
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}), alloc.WithVisitors(v))
	if err != nil {
		t.Fatal(err)
	}
	b, err := pool.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	if mt, err := ctx.MemoryType(b.Addr()); err != nil || mt != cuda.MemoryHost {
		t.Fatalf("memory type of a registered arena's block: %v, %v", mt, err)
	}
	b.Free()
	if err := pool.Close(); err != nil {
		t.Fatal(err)
	}
	if mt, err := ctx.MemoryType(b.Addr()); err == nil && mt == cuda.MemoryHost {
		t.Fatal("arena still registered after the pool closed")
	}
}
