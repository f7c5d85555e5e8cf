package alloc

import (
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/tensor"
	"golang.org/x/sys/unix"
)

// guardSource hands out device-like regions backed by PROT_NONE address
// space: any read or write of their memory by the pool would fault, so a
// passing test proves that the pool only does arithmetic on addresses, as it
// must for GPU memory.
type guardSource struct {
	frees int
}

func (s *guardSource) Name() string          { return "guard" }
func (s *guardSource) Device() tensor.Device { return tensor.GPUDevice(3) }

func (s *guardSource) Alloc(size int) (*Region, error) {
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(size), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, err
	}
	return &Region{Base: uintptr(p), Size: size, Device: tensor.GPUDevice(3), FD: -1}, nil
}

func (s *guardSource) Close() error { return nil }

func (s *guardSource) Free(r *Region) error {
	s.frees++
	return unix.MunmapPtr(pointer(r.Base), uintptr(r.Size))
}

func TestDeviceMemoryNeverTouched(t *testing.T) {
	src := &guardSource{}
	p := newTestPool(t, src, WithInitialArena(1<<20))
	if p.Device() != tensor.GPUDevice(3) {
		t.Errorf("Device %v", p.Device())
	}
	var blocks []Block
	for n := 1; n < 3<<20; n = n*5 + 3 {
		blocks = append(blocks, mustAlloc(t, p, n))
	}
	for _, b := range blocks {
		if b.Bytes() != nil || b.Device() != tensor.GPUDevice(3) {
			t.Errorf("GPU block: Bytes %v, Device %v", b.Bytes() != nil, b.Device())
		}
	}
	m, _ := tensor.MetaFor(tensor.Float32, tensor.Shape{1024})
	x, err := p.NewTensor(m)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.Bytes(); !errors.Is(err, tensor.ErrNotDMAable) {
		t.Errorf("host bytes of a GPU tensor: %v", err)
	}
	if x.Device() != tensor.GPUDevice(3) || x.Addr() == 0 {
		t.Errorf("tensor on %v at %#x", x.Device(), x.Addr())
	}
	if err := x.Release(); err != nil {
		t.Fatal(err)
	}
	for _, b := range blocks {
		mustFree(t, b)
	}
	mustCheck(t, p)
}
