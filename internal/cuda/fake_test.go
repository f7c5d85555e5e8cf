package cuda

import (
	"errors"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
	"golang.org/x/sys/unix"
)

// fakeDriver builds testdata/fakecuda.c, a stand-in for libcuda.so.1 that
// keeps "device memory" in host memory, and opens it: the binding's calls,
// argument order, output pointers and per-thread context are then tested
// without a GPU.
func fakeDriver(t *testing.T) *Driver {
	t.Helper()
	cc, err := exec.LookPath("cc")
	if err != nil {
		if cc, err = exec.LookPath("gcc"); err != nil {
			t.Skip("no C compiler (cc, gcc; Debian package gcc) to build the stand-in driver")
		}
	}
	lib := filepath.Join(t.TempDir(), "libfakecuda.so")
	out, err := exec.Command(cc, "-shared", "-fPIC", "-o", lib, "testdata/fakecuda.c").CombinedOutput()
	if err != nil {
		t.Fatalf("building the stand-in driver: %v\n%s", err, out)
	}
	d, err := Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	return d
}

func TestStandInDriverDevices(t *testing.T) {
	d := fakeDriver(t)
	if d.Version() != 13000 {
		t.Fatalf("Version = %d", d.Version())
	}
	if n, err := d.DeviceCount(); err != nil || n != 2 {
		t.Fatalf("DeviceCount = %d, %v", n, err)
	}
	if _, err := d.Device(2); !errors.Is(err, ErrInvalidDevice) {
		t.Fatalf("Device(2): %v, want ErrInvalidDevice", err)
	}
	dev, err := d.Device(1)
	if err != nil {
		t.Fatal(err)
	}
	f, err := dev.Facts()
	if err != nil {
		t.Fatal(err)
	}
	// The stand-in answers attribute a of device ordinal o with a*1000+o,
	// which proves both arguments travel in the right registers.
	want := Facts{Ordinal: 1, Name: "Fake GPU 1", PCIBusID: "0000:3b:01.0", TotalMem: 80 << 30,
		ComputeCapability: 75001*10 + 76001, GPUDirectRDMA: true, DMABuf: true,
		FlushWritesOptions: 117001, WritesOrdering: 118001, AsyncEngines: 40001, DriverVersion: 13000}
	if f != want {
		t.Fatalf("Facts = %+v\nwant    %+v", f, want)
	}
	if v, err := dev.Attribute(AttrGPUDirectRDMASupported); err != nil || v != 116001 {
		t.Fatalf("GPU_DIRECT_RDMA_SUPPORTED = %d, %v", v, err)
	}
	if d.ErrorName(ErrorOutOfMemory) != "CUDA_ERROR_OUT_OF_MEMORY" || d.ErrorName(ErrorNotReady) != "CUDA_ERROR_NOT_READY" {
		t.Fatalf("ErrorName: %q, %q", d.ErrorName(ErrorOutOfMemory), d.ErrorName(ErrorNotReady))
	}
}

func TestStandInDriverMemory(t *testing.T) {
	d := fakeDriver(t)
	dev, _ := d.Device(0)
	c, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	// Calls from many goroutines (on many threads) all find the context
	// current: the stand-in fails with CUDA_ERROR_INVALID_CONTEXT otherwise.
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread() // a fresh thread with no current context
			defer runtime.UnlockOSThread()
			m, err := c.MemAlloc(1 << 16)
			if err != nil {
				t.Error(err)
				return
			}
			if err := m.Close(); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if _, err := c.MemAlloc(1 << 40); !errors.Is(err, ErrOutOfMemory) {
		t.Fatalf("huge allocation: %v, want ErrOutOfMemory", err)
	}
	if _, err := c.MemAlloc(0); !errors.Is(err, ErrBadArgument) {
		t.Fatalf("empty allocation: %v", err)
	}
	m, err := c.MemAlloc(4 << 20)
	if err != nil {
		t.Fatal(err)
	}
	if mt, err := c.MemoryType(m.Ptr + 10); err != nil || mt != MemoryDevice {
		t.Fatalf("MemoryType(device) = %v, %v", mt, err)
	}
	if on, err := c.SyncMemops(m.Ptr); err != nil || on {
		t.Fatalf("SYNC_MEMOPS before setting: %v, %v", on, err)
	}
	if err := c.SetSyncMemops(m.Ptr, true); err != nil {
		t.Fatal(err)
	}
	if on, err := c.SyncMemops(m.Ptr); err != nil || !on {
		t.Fatalf("SYNC_MEMOPS after setting: %v, %v", on, err)
	}
	host, err := c.MemHostAlloc(1<<20, HostAllocPortable)
	if err != nil {
		t.Fatal(err)
	}
	if mt, err := c.MemoryType(host.Ptr); err != nil || mt != MemoryHost {
		t.Fatalf("MemoryType(pinned) = %v, %v", mt, err)
	}
	b := host.Bytes()
	for i := range b {
		b[i] = byte(i * 5)
	}
	s, err := c.NewStream(StreamNonBlocking)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := c.NewEvent(EventDisableTiming)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.MemcpyHtoDAsync(m.Ptr+4096, host.Ptr, len(b), s); err != nil {
		t.Fatal(err)
	}
	if err := c.Memset8(m.Ptr, 0xAB, 4096); err != nil {
		t.Fatal(err)
	}
	back := make([]byte, 4096+len(b))
	if err := c.MemcpyDtoH(uintptr(unsafe.Pointer(&back[0])), m.Ptr, len(back)); err != nil {
		t.Fatal(err)
	}
	if back[0] != 0xAB || back[4095] != 0xAB || back[4096] != 0 || back[4096+77] != byte(77*5%256) {
		t.Fatalf("device bytes: %x %x %x %x", back[0], back[4095], back[4096], back[4096+77])
	}
	if err := c.MemcpyHtoDAsync(m.Ptr+uintptr(m.Size)-10, host.Ptr, 20, s); !errors.Is(err, ErrInvalidValue) {
		t.Fatalf("copy past the allocation: %v", err)
	}
	if err := ev.Record(s); err != nil {
		t.Fatal(err)
	}
	if done, err := ev.Query(); done || err != nil {
		t.Fatalf("first Query (the stand-in answers NOT_READY): %v, %v", done, err)
	}
	if done, err := ev.Query(); !done || err != nil {
		t.Fatalf("second Query: %v, %v", done, err)
	}
	start, _ := c.NewEvent(EventDefault)
	if ms, err := ev.Elapsed(start); err != nil || ms != 1.5 {
		t.Fatalf("Elapsed = %v, %v (a C float read back)", ms, err)
	}

	// Host registration refuses device memory before the driver is asked,
	// and the driver's own refusals map to their sentinels.
	if _, err := c.MemHostRegister(m.Ptr, 4096, 0); !errors.Is(err, ErrWrongMemoryType) {
		t.Fatalf("registering device memory: %v", err)
	}
	mem, _ := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	defer unix.Munmap(mem)
	p := uintptr(unsafe.Pointer(&mem[0]))
	if mt, err := c.MemoryType(p); err != nil || mt != MemoryPageable {
		t.Fatalf("MemoryType(mmap) = %v, %v", mt, err)
	}
	reg, err := c.MemHostRegister(p, len(mem), HostRegisterPortable)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.MemHostRegister(p, len(mem), 0); !errors.Is(err, ErrHostMemoryAlreadyRegistered) {
		t.Fatalf("second registration: %v", err)
	}
	if dp, err := c.HostDevicePointer(p); err != nil || dp != p {
		t.Fatalf("HostDevicePointer = %#x, %v", dp, err)
	}

	// dma-buf export of a page-aligned range, and its refusals.
	pg := uintptr(unix.Getpagesize())
	base := (m.Ptr + pg - 1) &^ (pg - 1)
	buf, err := c.ExportDMABuf(base, 2<<20)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(buf.FD), unix.F_GETFD, 0); err != nil {
		t.Fatalf("dma-buf fd %d: %v", buf.FD, err)
	}
	if _, err := c.ExportDMABuf(base+1, 4096); !errors.Is(err, ErrBadArgument) {
		t.Fatalf("unaligned export: %v", err)
	}

	// The IPC handle travels by value (64 bytes) into cuIpcOpenMemHandle_v2.
	h, err := c.IPCHandle(m.Ptr)
	if err != nil {
		t.Fatal(err)
	}
	mp, err := c.OpenIPCHandle(h)
	if err != nil {
		t.Fatal(err)
	}
	if mp.Ptr != m.Ptr {
		t.Fatalf("IPC handle opened at %#x, exported from %#x", mp.Ptr, m.Ptr)
	}

	if err := c.Close(); !errors.Is(err, ErrBusy) {
		t.Fatalf("Close with live handles: %v, want ErrBusy", err)
	}
	for _, h := range []interface{ Close() error }{mp, buf, reg, ev, start, s, host, m} {
		if err := h.Close(); err != nil {
			t.Fatalf("%T Close: %v", h, err)
		}
		if err := h.Close(); err != nil {
			t.Fatalf("%T second Close: %v", h, err)
		}
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.MemAlloc(10); !errors.Is(err, ErrClosed) {
		t.Fatalf("MemAlloc on a closed context: %v", err)
	}
}

func TestStandInDriverNoDevice(t *testing.T) {
	d := fakeDriver(t) // builds the library once
	t.Setenv("FAKECUDA_NO_DEVICE", "1")
	_, err := Open(d.Path())
	if !errors.Is(err, ErrNoDriver) || !errors.Is(err, ErrNoDevice) {
		t.Fatalf("cuInit answering CUDA_ERROR_NO_DEVICE: %v, want ErrNoDriver and ErrNoDevice", err)
	}
}

func TestClosedDriverMakesNoCalls(t *testing.T) {
	d := fakeDriver(t)
	dev, _ := d.Device(0)
	c, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.MemAlloc(4096); !errors.Is(err, ErrClosed) {
		t.Fatalf("MemAlloc after the driver closed: %v, want ErrClosed", err)
	}
	if _, err := d.DeviceCount(); !errors.Is(err, ErrClosed) {
		t.Fatalf("DeviceCount after Close: %v", err)
	}
	if _, err := d.Device(0); !errors.Is(err, ErrClosed) {
		t.Fatalf("Device after Close: %v", err)
	}
}

func TestStandInDriverTooOld(t *testing.T) {
	d := fakeDriver(t)
	t.Setenv("FAKECUDA_INIT_RESULT", "35") // CUDA_ERROR_INSUFFICIENT_DRIVER
	_, err := Open(d.Path())
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("cuInit answering CUDA_ERROR_INSUFFICIENT_DRIVER: %v, want ErrNoDriver", err)
	}
	t.Setenv("FAKECUDA_INIT_RESULT", "999") // any other failure is not "no driver"
	if _, err := Open(d.Path()); err == nil || errors.Is(err, ErrNoDriver) {
		t.Fatalf("cuInit answering CUDA_ERROR_UNKNOWN: %v, want an error that is not ErrNoDriver", err)
	}
}

// rtldNoload is glibc's RTLD_NOLOAD: dlopen succeeds only for a library
// already loaded.
const rtldNoload = 0x4

func TestDriverLibraryStaysLoaded(t *testing.T) {
	d := fakeDriver(t)
	d2, err := Open(d.Path())
	if err != nil {
		t.Fatal(err)
	}
	if err := d2.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if _, err := purego.Dlopen(d.Path(), purego.RTLD_NOW|rtldNoload); err != nil {
		t.Fatalf("the driver library was unloaded after Close: %v", err)
	}
	// A driver opened again after every handle closed works.
	d3, err := Open(d.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer d3.Close()
	if n, err := d3.DeviceCount(); err != nil || n != 2 {
		t.Fatalf("DeviceCount after reopening = %d, %v", n, err)
	}
}

func TestStandInDriverFlushGPUDirectRDMAWrites(t *testing.T) {
	d := fakeDriver(t)
	dev, _ := d.Device(0)
	c, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	counter, err := purego.Dlsym(d.lib, "fake_flushes")
	if err != nil {
		t.Fatal(err)
	}
	n := (*int32)(ptrAt(counter, 0))
	before := *n
	for i := 0; i < 3; i++ {
		if err := c.FlushGPUDirectRDMAWrites(); err != nil {
			t.Fatal(err)
		}
	}
	if got := *n - before; got != 3 {
		t.Fatalf("the driver saw %d flushes, want 3", got)
	}
}

// TestStandInDriverPeerCopy: the on-node IPC path's calls, a device to
// device copy on a stream and the peer-access check.
func TestStandInDriverPeerCopy(t *testing.T) {
	d := fakeDriver(t)
	d0, err := d.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	d1, err := d.Device(1)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		a, b Device
		want bool
	}{{d0, d0, true}, {d0, d1, true}, {d1, d0, false}} {
		got, err := c.a.CanAccessPeer(c.b)
		if err != nil || got != c.want {
			t.Errorf("%s CanAccessPeer %s = %v, %v; want %v", c.a, c.b, got, err, c.want)
		}
	}
	if v, err := d.DeviceByPCIBusID("0000:3B:01.0"); err != nil || v.Ordinal() != 1 {
		t.Errorf("DeviceByPCIBusID: %v, %v", v, err)
	}
	if _, err := d.DeviceByPCIBusID("0000:99:00.0"); !errors.Is(err, ErrBadArgument) {
		t.Errorf("DeviceByPCIBusID of an absent bus id: %v", err)
	}
	c, err := d0.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	src, err := c.MemAlloc(256)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := c.MemAlloc(256)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	in := make([]byte, 256)
	for i := range in {
		in[i] = byte(i * 3)
	}
	if err := c.MemcpyHtoD(src.Ptr, uintptr(unsafe.Pointer(&in[0])), 256); err != nil {
		t.Fatal(err)
	}
	s, err := c.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := c.MemcpyDtoDAsync(dst.Ptr, src.Ptr, 256, s); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	out := make([]byte, 256)
	if err := c.MemcpyDtoH(uintptr(unsafe.Pointer(&out[0])), dst.Ptr, 256); err != nil {
		t.Fatal(err)
	}
	for i := range out {
		if out[i] != in[i] {
			t.Fatalf("byte %d: %d, want %d", i, out[i], in[i])
		}
	}
	if err := c.MemcpyDtoDAsync(dst.Ptr, src.Ptr+200, 100, s); err == nil {
		t.Fatal("copy past the source allocation succeeded")
	}
}
