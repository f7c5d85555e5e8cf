package gpusim_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/proxy"
)

func hostAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

// hostMem is n bytes of host memory off the Go heap, as every buffer a
// device copies asynchronously must be: the garbage collector neither
// moves nor frees it while a copy still reads it through a bare address.
func hostMem(tb testing.TB, n int) []byte {
	tb.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = unix.Munmap(b) })
	return b
}

func TestCopiesRoundTrip(t *testing.T) {
	d := gpusim.New(gpusim.Config{})
	defer d.Close()
	if !d.Info().Simulated {
		t.Fatal("the simulated device does not say it is simulated")
	}
	p, err := d.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	src, dst := hostMem(t, 1<<20), hostMem(t, 1<<20)
	for i := range src {
		src[i] = byte(i * 31)
	}
	if err := d.CopyHtoDAsync(p, hostAddr(src), len(src), s); err != nil {
		t.Fatal(err)
	}
	if err := d.CopyDtoHAsync(hostAddr(dst), p, len(dst), s); err != nil {
		t.Fatal(err)
	}
	ev, err := d.RecordEvent(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := ev.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	for i := range src {
		if src[i] != dst[i] {
			t.Fatalf("byte %d: %d != %d", i, src[i], dst[i])
		}
	}
	if st := d.Stats(); st.BytesHtoD != 1<<20 || st.BytesDtoH != 1<<20 || st.Copies != 2 {
		t.Fatalf("stats %+v", st)
	}
	if mt, _ := d.MemoryType(uintptr(p) + 100); mt != proxy.MemoryDevice {
		t.Fatalf("memory type inside an allocation: %v", mt)
	}
	if mt, _ := d.MemoryType(hostAddr(src)); mt != proxy.MemoryPageable {
		t.Fatalf("memory type of a Go slice: %v", mt)
	}
	un, err := d.RegisterHost(hostAddr(src), len(src))
	if err != nil {
		t.Fatal(err)
	}
	if mt, _ := d.MemoryType(hostAddr(src) + 10); mt != proxy.MemoryPinned {
		t.Fatalf("memory type of registered memory: %v", mt)
	}
	un()
	un()
	if mt, _ := d.MemoryType(hostAddr(src)); mt != proxy.MemoryPageable {
		t.Fatalf("memory type after unregistering: %v", mt)
	}
}

func TestBadCopiesWriteNothing(t *testing.T) {
	d := gpusim.New(gpusim.Config{MemoryLimit: 1 << 20})
	defer d.Close()
	p, _ := d.Alloc(4096)
	s, _ := d.NewStream()
	h := hostMem(t, 8192)
	if err := d.CopyHtoDAsync(p+1, hostAddr(h), 4096, s); !errors.Is(err, proxy.ErrOutOfRange) {
		t.Fatalf("copy past the allocation: %v", err)
	}
	if err := d.CopyHtoDAsync(p, uintptr(p), 16, s); !errors.Is(err, proxy.ErrWrongMemory) {
		t.Fatalf("device pointer as host source: %v", err)
	}
	if err := d.CopyDtoHAsync(hostAddr(h), proxy.DevicePtr(hostAddr(h)), 16, s); !errors.Is(err, proxy.ErrOutOfRange) {
		t.Fatalf("host pointer as device source: %v", err)
	}
	if _, err := d.RegisterHost(uintptr(p), 4096); !errors.Is(err, proxy.ErrWrongMemory) {
		t.Fatalf("registering device memory as host memory: %v", err)
	}
	if _, err := d.Alloc(2 << 20); !errors.Is(err, proxy.ErrDeviceMemory) {
		t.Fatalf("allocation beyond the memory limit: %v", err)
	}
	if err := d.Free(p + 8); !errors.Is(err, proxy.ErrWrongMemory) {
		t.Fatalf("free of an inner pointer: %v", err)
	}
	if st := d.Stats(); st.Copies != 0 {
		t.Fatalf("refused copies ran: %+v", st)
	}
}

func TestPacing(t *testing.T) {
	const bw = 200e6 // 200 MB/s: 4 MiB take at least 20 ms
	d := gpusim.New(gpusim.Config{Bandwidth: bw})
	defer d.Close()
	p, _ := d.Alloc(4 << 20)
	s, _ := d.NewStream()
	h := hostMem(t, 4<<20)
	start := time.Now()
	for off := 0; off < len(h); off += 1 << 20 {
		if err := d.CopyHtoDAsync(p+proxy.DevicePtr(off), hostAddr(h)+uintptr(off), 1<<20, s); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if el, min := time.Since(start), time.Duration(float64(len(h))/bw*float64(time.Second)); el < min {
		t.Fatalf("4 MiB at %.0f B/s took %v, less than %v", bw, el, min)
	}
}

func TestFaultsAndLoss(t *testing.T) {
	d := gpusim.New(gpusim.Config{})
	defer d.Close()
	p, _ := d.Alloc(4096)
	s, _ := d.NewStream()
	h := hostMem(t, 4096)
	d.FailCopies(func(c gpusim.CopyInfo) error {
		if c.Seq == 0 {
			return fmt.Errorf("injected")
		}
		return nil
	})
	_ = d.CopyHtoDAsync(p, hostAddr(h), 4096, s)
	ev1, _ := d.RecordEvent(s)
	_ = d.CopyHtoDAsync(p, hostAddr(h), 4096, s)
	ev2, _ := d.RecordEvent(s)
	if err := ev1.Wait(context.Background()); !errors.Is(err, proxy.ErrCopyFailed) {
		t.Fatalf("event after a failed copy: %v", err)
	}
	if err := ev2.Wait(context.Background()); err != nil {
		t.Fatalf("event after a later good copy: %v", err)
	}
	d.Lose()
	if err := d.CopyHtoDAsync(p, hostAddr(h), 4096, s); !errors.Is(err, proxy.ErrDeviceLost) {
		t.Fatalf("copy on a lost device: %v", err)
	}
	ev3, err := d.RecordEvent(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := ev3.Wait(context.Background()); !errors.Is(err, proxy.ErrDeviceLost) {
		t.Fatalf("event on a lost device: %v", err)
	}
	if _, err := d.Alloc(1); !errors.Is(err, proxy.ErrDeviceLost) {
		t.Fatalf("Alloc on a lost device: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if st := d.Stats(); st.LiveStreams != 0 || st.DeviceMemory != 0 {
		t.Fatalf("after Close: %+v", st)
	}
}

// The simulated device copies for real, at the configured rate.
func ExampleDevice() {
	gpu := gpusim.New(gpusim.Config{Name: "sim0", Bandwidth: 10e9})
	defer gpu.Close()
	dev, _ := gpu.Alloc(5)
	s, _ := gpu.NewStream()
	// Host memory a device reads asynchronously lives off the Go heap.
	src, _ := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	defer unix.Munmap(src)
	copy(src, "hello")
	_ = gpu.CopyHtoDAsync(dev, uintptr(unsafe.Pointer(&src[0])), 5, s)
	ev, _ := gpu.RecordEvent(s)
	_ = ev.Wait(context.Background())
	got, _ := gpu.Peek(dev, 5)
	fmt.Println(gpu.Info().Name, gpu.Info().Simulated, string(got))
	// Output: sim0 true hello
}

// The end of an allocation is not in it: host memory the kernel maps right
// after device memory is host memory.
func TestAllocationEndIsNotDeviceMemory(t *testing.T) {
	d := gpusim.New(gpusim.Config{})
	defer d.Close()
	p, err := d.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	if mt, err := d.MemoryType(uintptr(p) + 4095); err != nil || mt != proxy.MemoryDevice {
		t.Fatalf("last byte: %v, %v", mt, err)
	}
	if mt, err := d.MemoryType(uintptr(p) + 4096); err != nil || mt != proxy.MemoryPageable {
		t.Fatalf("byte after the allocation: %v, %v; want pageable", mt, err)
	}
	un, err := d.RegisterHost(uintptr(p)+4096, 4096)
	if err != nil {
		t.Fatalf("registering the host range right after device memory: %v", err)
	}
	un()
}
