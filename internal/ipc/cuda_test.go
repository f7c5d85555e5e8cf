package ipc

import (
	"context"
	"errors"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
	"unsafe"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/cuda"
	"github.com/gdrlink/gdrlink/proxy"
)

// standInCUDA builds internal/cuda's stand-in driver (host memory behind
// the libcuda API) and opens GPU 0 through it with proxy.NewCUDADevice: the
// CUDA adapter's calls are then checked without a GPU. The stand-in opens
// an IPC handle in the process that made it, so the pull stays in one
// process; the two-process runs are the gpusim and memfd tests.
func standInCUDA(t *testing.T) proxy.Device {
	t.Helper()
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("no C compiler (cc; Debian package gcc) to build the stand-in driver")
	}
	lib := filepath.Join(t.TempDir(), "libfakecuda.so")
	if out, err := exec.Command(cc, "-shared", "-fPIC", "-o", lib, "../cuda/testdata/fakecuda.c").CombinedOutput(); err != nil {
		t.Fatalf("building the stand-in driver: %v\n%s", err, out)
	}
	t.Setenv("GDRLINK_LIBCUDA", lib)
	dev, err := proxy.NewCUDADevice(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := dev.Close(); err != nil {
			t.Error(err)
		}
	})
	return dev
}

func TestCUDAAdapterStandIn(t *testing.T) {
	dev := standInCUDA(t)
	c := CUDA{Dev: dev}
	// The stand-in grants peer access from GPU 0 to GPU 1 only: reaching
	// needs both ways.
	if !c.Ready() || !c.CanReach("0000:3b:00.0") || c.CanReach("0000:3b:01.0") || c.CanReach("0000:99:00.0") {
		t.Errorf("Ready %v, reach self %v, reach gpu 1 %v, reach absent %v",
			c.Ready(), c.CanReach("0000:3b:00.0"), c.CanReach("0000:3b:01.0"), c.CanReach("0000:99:00.0"))
	}
	const n = 4096
	dst, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(dst)
	drv, err := cuda.Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer drv.Close()
	d0, _ := drv.Device(0)
	ctx, err := d0.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	// The exporting side: a GPU pool whose arenas get their IPC handle
	// once, from the visitor.
	srcs, err := alloc.NewCUDADeviceSource(0)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := alloc.New(srcs, alloc.WithVisitors(NewCUDAExport(ctx)), alloc.WithInitialArena(2<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	blk, err := pool.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer blk.Free()
	in := make([]byte, n)
	pattern(in, 3)
	if err := ctx.MemcpyHtoD(blk.Addr(), uintptr(unsafe.Pointer(&in[0])), n); err != nil {
		t.Fatal(err)
	}
	arena, _ := pool.ArenaOf(blk.Addr())
	em, ok := CUDAExportOf(1, "0000:3b:00.0", arena)
	if !ok || len(em.Handle) != 64 || em.Size != uint64(arena.Size()) {
		t.Fatalf("export %+v, %v", em, ok)
	}
	off := uint64(blk.Addr() - arena.Base())
	cache := NewCache(DeviceOpener{c})
	mp, err := cache.Add(1, em, -1)
	if err != nil {
		t.Fatal(err)
	}
	st, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	ev, err := PullDevice(c, st, dst+16, mp, Msg{Kind: KindPull, Arena: em.Arena, Offset: off + 16, Size: n - 16})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := ev.Wait(wctx); err != nil {
		t.Fatal(err)
	}
	ev.Close()
	out := make([]byte, n)
	if err := ctx.MemcpyDtoH(uintptr(unsafe.Pointer(&out[0])), uintptr(dst), n); err != nil {
		t.Fatal(err)
	}
	for i := 16; i < n; i++ {
		if out[i] != in[i] {
			t.Fatalf("byte %d: %d, want %d", i, out[i], in[i])
		}
	}
	if err := cache.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseHandle(mp.(*DeviceMapping).Ptr); !errors.Is(err, proxy.ErrWrongMemory) {
		t.Errorf("second close of the handle: %v", err)
	}
	if _, err := c.OpenHandle(Msg{Handle: []byte{1}}, -1); !errors.Is(err, ErrBadMessage) {
		t.Errorf("short handle: %v", err)
	}
	if _, err := c.OpenHandle(em, 7); !errors.Is(err, ErrNotSupported) {
		t.Errorf("VMM descriptor: %v", err)
	}
	hostPool, err := alloc.New(alloc.NewMemfdSource("cuda-export", alloc.MmapOptions{}), alloc.WithVisitors(NewCUDAExport(ctx)))
	if err == nil {
		defer hostPool.Close()
		_, err = hostPool.Alloc(64)
	}
	if !errors.Is(err, ErrNotSupported) {
		t.Errorf("CUDA export of a host arena: %v", err)
	}
	if (CUDA{}).Ready() {
		t.Error("a CUDA adapter without a device is ready")
	}
}
