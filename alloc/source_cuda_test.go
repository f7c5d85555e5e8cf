package alloc

import (
	"errors"
	"testing"

	"github.com/gdrlink/gdrlink/internal/cuda"
	"github.com/gdrlink/gdrlink/internal/cuda/cudatest"
)

func TestCUDASourcesWithoutDriver(t *testing.T) {
	s, err := NewCUDADeviceSource(0)
	if err == nil {
		s.Close()
		t.Skip("a CUDA driver is present; the no-driver path cannot be tested here")
	}
	if !errors.Is(err, cuda.ErrNoDriver) {
		t.Fatalf("NewCUDADeviceSource without a driver: %v, want cuda.ErrNoDriver", err)
	}
	if _, err := NewPinnedHostSource(0); !errors.Is(err, cuda.ErrNoDriver) {
		t.Fatalf("NewPinnedHostSource without a driver: %v, want cuda.ErrNoDriver", err)
	}
}

func TestCUDADeviceArenas(t *testing.T) {
	src, err := NewCUDADeviceSource(0)
	cudatest.SkipIfNoDriver(t, err)
	defer func() {
		if err := src.Close(); err != nil {
			t.Error(err)
		}
	}()
	pool, err := New(src, WithInitialArena(3<<20))
	if err != nil {
		t.Fatal(err)
	}
	b, err := pool.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	a, ok := arenaOf(b)
	if !ok {
		t.Fatal("block has no arena")
	}
	if a.Base()%gpuArenaAlignment != 0 || a.Size()%gpuArenaAlignment != 0 || a.Size() < 3<<20 {
		t.Fatalf("GPU arena %v is not 2 MiB-aligned and rounded", a)
	}
	if !a.Device().IsGPU() || b.Bytes() != nil {
		t.Fatalf("GPU block on %v has a host view", a.Device())
	}
	ctx := src.(*cudaSource).ctx
	if mt, err := ctx.MemoryType(b.Addr()); err != nil || mt != cuda.MemoryDevice {
		t.Fatalf("memory type of a GPU block: %v, %v", mt, err)
	}
	if on, err := ctx.SyncMemops(a.Base()); err != nil || !on {
		t.Fatalf("SYNC_MEMOPS of a GPU arena: %v, %v", on, err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if err := pool.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestPinnedHostArenas(t *testing.T) {
	src, err := NewPinnedHostSource(0)
	cudatest.SkipIfNoDriver(t, err)
	defer src.Close()
	pool, err := New(src)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	b, err := pool.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	buf := b.Bytes()
	for i := range buf {
		buf[i] = byte(i)
	}
	if mt, err := src.(*cudaSource).ctx.MemoryType(b.Addr()); err != nil || mt != cuda.MemoryHost {
		t.Fatalf("memory type of a pinned block: %v, %v", mt, err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
}
