package visitor

import (
	"errors"
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/cuda"
)

// errCUDAHostRegister: cuMemHostRegister refused an arena; the driver's error
// (with its CUresult code) is wrapped too.
var errCUDAHostRegister = errors.New("visitor: CUDA host registration failed")

// hostRegistrar is the part of a CUDA context the visitor uses; tests give
// it a fake.
type hostRegistrar interface {
	register(ptr uintptr, n int) (interface{ Close() error }, error)
	name() string
}

// gpuRegistrar registers through the primary context of one GPU, retained
// while the registration lives.
type gpuRegistrar struct{ pc *primaryContext }

func (g gpuRegistrar) register(ptr uintptr, n int) (interface{ Close() error }, error) {
	ctx, err := g.pc.acquire()
	if err != nil {
		return nil, err
	}
	r, err := ctx.MemHostRegister(ptr, n, cuda.HostRegisterPortable|cuda.HostRegisterDeviceMap)
	if err != nil {
		if rerr := g.pc.release(); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return nil, err
	}
	return closerFunc(func() error { return errors.Join(r.Close(), g.pc.release()) }), nil
}

func (g gpuRegistrar) name() string { return fmt.Sprintf("gpu:%d", g.pc.ordinal) }

// closerFunc adapts a function to Close.
type closerFunc func() error

// Close calls f.
func (f closerFunc) Close() error { return f() }

// cudaHostRegister is the visitor NewCUDAHostRegister returns. Arenas of GPU
// memory are refused with errNotHostMemory, before the driver is asked.
type cudaHostRegister struct {
	reg hostRegistrar
}

type cudaHostKey struct{ v *cudaHostRegister }

// NewCUDAHostRegister returns a visitor that page-locks every arena of a host
// pool and registers it with the CUDA driver (cuMemHostRegister_v2, portable
// and mapped) through the primary context of the GPU with CUDA ordinal gpu,
// so that the GPU copies to and from the pool's tensors asynchronously: a
// pool of proxy tensors over ordinary mmap or memfd arenas. The visitor
// retains the primary context while it has arenas registered, and releases
// it with the last one. Arenas of GPU memory are refused before the driver
// is asked; without a CUDA driver, Visit fails with an error wrapping the
// driver's (no driver, no such GPU).
func NewCUDAHostRegister(gpu int) alloc.Visitor {
	return &cudaHostRegister{reg: gpuRegistrar{newPrimaryContext(gpu)}}
}

// Name implements alloc.Visitor.
func (v *cudaHostRegister) Name() string { return "cuda-host-register:" + v.reg.name() }

// Visit implements alloc.Visitor.
func (v *cudaHostRegister) Visit(a *alloc.Arena) error {
	if a.Device().IsGPU() {
		return fmt.Errorf("%w: %s cannot be registered as host memory with CUDA", errNotHostMemory, a)
	}
	if _, ok := a.Handle(cudaHostKey{v}); ok {
		return fmt.Errorf("%w: %s by %s", errAlreadyVisited, a, v.Name())
	}
	r, err := v.reg.register(a.Base(), a.Size())
	if err != nil {
		if errors.Is(err, cuda.ErrWrongMemoryType) {
			return fmt.Errorf("%w: %s: %w", errNotHostMemory, a, err)
		}
		return fmt.Errorf("%w: %s: %w", errCUDAHostRegister, a, err)
	}
	a.SetHandle(cudaHostKey{v}, r)
	return nil
}

// Release implements alloc.Visitor: cuMemHostUnregister.
func (v *cudaHostRegister) Release(a *alloc.Arena) error {
	h, ok := a.Handle(cudaHostKey{v})
	if !ok {
		return fmt.Errorf("%w: %s by %s", errNotVisited, a, v.Name())
	}
	a.DeleteHandle(cudaHostKey{v})
	if err := h.(interface{ Close() error }).Close(); err != nil {
		return fmt.Errorf("%w: unregistering %s: %w", errCUDAHostRegister, a, err)
	}
	return nil
}

// cudaRegistered reports whether v registered the arena with CUDA.
func (v *cudaHostRegister) cudaRegistered(a *alloc.Arena) bool {
	_, ok := a.Handle(cudaHostKey{v})
	return ok
}
