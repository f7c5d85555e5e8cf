package cuda

import (
	"errors"
	"os"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// openOrSkip opens the driver, or skips saying what is missing; with
// GDRLINK_REQUIRE_GPU=1 a missing driver fails the test instead.
func openOrSkip(t *testing.T) (*Driver, *Context) {
	t.Helper()
	d, err := Open("")
	if errors.Is(err, ErrNoDriver) {
		if os.Getenv("GDRLINK_REQUIRE_GPU") == "1" {
			t.Fatalf("GDRLINK_REQUIRE_GPU=1 but: %v", err)
		}
		t.Skipf("libcuda.so.1 not found: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	dev, err := d.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	c, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("context close (leaked handles?): %v", err)
		}
	})
	return d, c
}

func TestOpenMissingLibrary(t *testing.T) {
	_, err := Open("/nonexistent/libcuda.so.1")
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("Open of a missing library: %v, want ErrNoDriver", err)
	}
	if !strings.Contains(err.Error(), "/nonexistent/libcuda.so.1") {
		t.Errorf("error %q does not carry the loader's message", err)
	}
}

func TestOpenLibraryWithoutSymbols(t *testing.T) {
	// libc is on every glibc host and has none of the driver's symbols.
	_, err := Open("libc.so.6")
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("Open(libc.so.6): %v, want ErrNoDriver", err)
	}
	if !strings.Contains(err.Error(), "cuMemAlloc_v2") {
		t.Errorf("error %q does not name the missing symbols", err)
	}
}

func TestErrorMatching(t *testing.T) {
	cases := []struct {
		code Result
		want error
		lost bool
		name string
	}{
		{ErrorOutOfMemory, ErrOutOfMemory, false, "CUDA_ERROR_OUT_OF_MEMORY"},
		{ErrorNotSupported, ErrNotSupported, false, "CUDA_ERROR_NOT_SUPPORTED"},
		{ErrorNotReady, ErrNotReady, false, "CUDA_ERROR_NOT_READY"},
		{ErrorIllegalAddress, ErrIllegalAddress, true, "CUDA_ERROR_ILLEGAL_ADDRESS"},
		{ErrorLaunchFailed, nil, true, "CUDA_ERROR_LAUNCH_FAILED"},
		{ErrorECCUncorrectable, nil, true, "CUDA_ERROR_ECC_UNCORRECTABLE"},
		{ErrorHostMemoryAlreadyRegistered, ErrHostMemoryAlreadyRegistered, false, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
		{Result(12345), nil, false, "CUresult(12345)"},
	}
	for _, c := range cases {
		err := check("cuTest", c.code, "detail")
		if c.want != nil && !errors.Is(err, c.want) {
			t.Errorf("%v: not matched by its sentinel", c.code)
		}
		if errors.Is(err, ErrOutOfMemory) != (c.code == ErrorOutOfMemory) {
			t.Errorf("%v: ErrOutOfMemory match is wrong", c.code)
		}
		if errors.Is(err, ErrDeviceLost) != c.lost {
			t.Errorf("%v: ErrDeviceLost match = %v, want %v", c.code, !c.lost, c.lost)
		}
		if !strings.Contains(err.Error(), c.name) || !strings.Contains(err.Error(), "cuTest") {
			t.Errorf("%v: message %q lacks the code name or the call", c.code, err)
		}
	}
	if check("cuTest", Success, "") != nil {
		t.Error("CUDA_SUCCESS is an error")
	}
}

func TestDeviceFacts(t *testing.T) {
	d, c := openOrSkip(t)
	n, err := d.DeviceCount()
	if err != nil || n < 1 {
		t.Fatalf("DeviceCount = %d, %v", n, err)
	}
	f, err := c.Device().Facts()
	if err != nil {
		t.Fatal(err)
	}
	if f.Name == "" || f.TotalMem <= 0 || len(f.PCIBusID) < len("0000:00:00.0") || f.ComputeCapability < 30 {
		t.Fatalf("implausible facts %+v", f)
	}
	t.Logf("%+v", f)
}

func TestDeviceMemorySyncMemops(t *testing.T) {
	_, c := openOrSkip(t)
	m, err := c.MemAlloc(4 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if mt, err := c.MemoryType(m.Ptr); err != nil || mt != MemoryDevice {
		t.Fatalf("MemoryType(device) = %v, %v", mt, err)
	}
	if err := c.SetSyncMemops(m.Ptr, true); err != nil {
		t.Fatal(err)
	}
	on, err := c.SyncMemops(m.Ptr)
	if err != nil || !on {
		t.Fatalf("SYNC_MEMOPS read back %v, %v", on, err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestPinnedHostAndAsyncCopies(t *testing.T) {
	_, c := openOrSkip(t)
	const n = 8 << 20
	src, err := c.MemHostAlloc(n, HostAllocPortable)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := c.MemHostAlloc(n, HostAllocPortable)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	if mt, err := c.MemoryType(src.Ptr); err != nil || mt != MemoryHost {
		t.Fatalf("MemoryType(pinned) = %v, %v", mt, err)
	}
	dev, err := c.MemAlloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	for i, b := 0, src.Bytes(); i < n; i++ {
		b[i] = byte(i*7 + 3)
	}
	s, err := c.NewStream(StreamNonBlocking)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ev, err := c.NewEvent(EventDisableTiming)
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	if err := c.MemcpyHtoDAsync(dev.Ptr, src.Ptr, n, s); err != nil {
		t.Fatal(err)
	}
	if err := c.MemcpyDtoHAsync(dst.Ptr, dev.Ptr, n, s); err != nil {
		t.Fatal(err)
	}
	if err := ev.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := ev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	done, err := ev.Query()
	if err != nil || !done {
		t.Fatalf("event after Synchronize: done=%v, %v", done, err)
	}
	a, b := src.Bytes(), dst.Bytes()
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("byte %d: sent %d, got back %d", i, a[i], b[i])
		}
	}
}

func TestHostRegister(t *testing.T) {
	_, c := openOrSkip(t)
	const n = 2 << 20
	mem, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	p := uintptr(unsafe.Pointer(&mem[0]))
	if mt, err := c.MemoryType(p); err != nil || mt != MemoryPageable {
		t.Fatalf("MemoryType(mmap) = %v, %v", mt, err)
	}
	r, err := c.MemHostRegister(p, n, HostRegisterPortable)
	if err != nil {
		t.Fatal(err)
	}
	if mt, err := c.MemoryType(p); err != nil || mt != MemoryHost {
		t.Fatalf("MemoryType(registered) = %v, %v", mt, err)
	}
	if _, err := c.MemHostRegister(p, n, HostRegisterPortable); !errors.Is(err, ErrHostMemoryAlreadyRegistered) {
		t.Fatalf("second registration: %v", err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	dev, err := c.MemAlloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	if _, err := c.MemHostRegister(dev.Ptr, n, 0); !errors.Is(err, ErrWrongMemoryType) {
		t.Fatalf("registering a device pointer as host memory: %v, want ErrWrongMemoryType", err)
	}
}

func TestDMABufExport(t *testing.T) {
	_, c := openOrSkip(t)
	f, err := c.Device().Facts()
	if err != nil {
		t.Fatal(err)
	}
	m, err := c.MemAlloc(4 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	b, err := c.ExportDMABuf((m.Ptr+2<<20-1)&^(2<<20-1), 2<<20)
	if !f.DMABuf {
		if err == nil {
			b.Close()
		}
		t.Skipf("device %s does not support dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0); export gave %v", f.Name, err)
	}
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(b.FD, &st); err != nil {
		t.Fatalf("dma-buf fd %d: %v", b.FD, err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestIPCHandleAndBusyContext(t *testing.T) {
	_, c := openOrSkip(t)
	m, err := c.MemAlloc(2 << 20)
	if err != nil {
		t.Fatal(err)
	}
	h, err := c.IPCHandle(m.Ptr)
	if err != nil {
		t.Fatal(err)
	}
	if h == (IPCHandle{}) {
		t.Fatal("IPC handle is all zeros")
	}
	if err := c.Close(); !errors.Is(err, ErrBusy) {
		t.Fatalf("Close with a live allocation: %v, want ErrBusy", err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
}
