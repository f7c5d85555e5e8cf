package visitor

import (
	"errors"
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/cuda"
)

// ErrCUDAHostRegister: cuMemHostRegister refused an arena; the driver's error
// (with its CUresult code) is wrapped too.
var ErrCUDAHostRegister = errors.New("visitor: CUDA host registration failed")

// hostRegistrar is the part of a CUDA context the visitor uses; tests give
// it a fake.
type hostRegistrar interface {
	register(ptr uintptr, n int) (interface{ Close() error }, error)
	name() string
}

type ctxRegistrar struct{ ctx *cuda.Context }

func (c ctxRegistrar) register(ptr uintptr, n int) (interface{ Close() error }, error) {
	r, err := c.ctx.MemHostRegister(ptr, n, cuda.HostRegisterPortable|cuda.HostRegisterDeviceMap)
	if err != nil {
		return nil, err
	}
	return r, nil
}

func (c ctxRegistrar) name() string { return c.ctx.Device().String() }

// CUDAHostRegister is a visitor that page-locks every arena of a host pool
// and registers it with the CUDA driver (cuMemHostRegister_v2, portable and
// mapped), so that the GPU copies to and from its tensors asynchronously: a
// pool of proxy tensors over ordinary mmap or memfd arenas. Arenas of GPU
// memory are refused with ErrNotHostMemory, before the driver is asked.
type CUDAHostRegister struct {
	reg hostRegistrar
}

type cudaHostKey struct{ v *CUDAHostRegister }

// NewCUDAHostRegister returns the visitor for the context's driver. The
// context must stay open until the pools using the visitor are closed.
func NewCUDAHostRegister(ctx *cuda.Context) *CUDAHostRegister {
	return &CUDAHostRegister{reg: ctxRegistrar{ctx}}
}

// Name implements alloc.Visitor.
func (v *CUDAHostRegister) Name() string { return "cuda-host-register:" + v.reg.name() }

// Visit implements alloc.Visitor.
func (v *CUDAHostRegister) Visit(a *alloc.Arena) error {
	if a.Device().IsGPU() {
		return fmt.Errorf("%w: %s cannot be registered as host memory with CUDA", ErrNotHostMemory, a)
	}
	if _, ok := a.Handle(cudaHostKey{v}); ok {
		return fmt.Errorf("%w: %s by %s", ErrAlreadyVisited, a, v.Name())
	}
	r, err := v.reg.register(a.Base(), a.Size())
	if err != nil {
		if errors.Is(err, cuda.ErrWrongMemoryType) {
			return fmt.Errorf("%w: %s: %w", ErrNotHostMemory, a, err)
		}
		return fmt.Errorf("%w: %s: %w", ErrCUDAHostRegister, a, err)
	}
	a.SetHandle(cudaHostKey{v}, r)
	return nil
}

// Release implements alloc.Visitor: cuMemHostUnregister.
func (v *CUDAHostRegister) Release(a *alloc.Arena) error {
	h, ok := a.Handle(cudaHostKey{v})
	if !ok {
		return fmt.Errorf("%w: %s by %s", ErrNotVisited, a, v.Name())
	}
	a.DeleteHandle(cudaHostKey{v})
	if err := h.(interface{ Close() error }).Close(); err != nil {
		return fmt.Errorf("%w: unregistering %s: %w", ErrCUDAHostRegister, a, err)
	}
	return nil
}

// CUDARegistered reports whether v registered the arena with CUDA.
func (v *CUDAHostRegister) CUDARegistered(a *alloc.Arena) bool {
	_, ok := a.Handle(cudaHostKey{v})
	return ok
}
