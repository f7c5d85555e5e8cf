package visitor

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/cuda"
	"github.com/gdrlink/gdrlink/internal/cuda/cudatest"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
	_ "github.com/gdrlink/gdrlink/verbsio/ibverbs"
)

// fakeVerbs is a protection domain and device that record registrations;
// the visitor's logic (order of methods, BAR1, release) is what is tested.
type fakeVerbs struct {
	verbsio.Device
	verbsio.ProtectionDomain
	caps      verbsio.Caps
	dmabufErr error
	peerErr   error
	regs      []string
	live      int
}

func (f *fakeVerbs) Caps() verbsio.Caps { return f.caps }

// Close resolves the ambiguity between the embedded interfaces; never called.
func (f *fakeVerbs) Close() error { return nil }

type fakeMR struct {
	f      *fakeVerbs
	closed bool
	verbsio.MemoryRegion
}

func (m *fakeMR) Close() error {
	if !m.closed {
		m.closed = true
		m.f.live--
	}
	return nil
}

func (f *fakeVerbs) RegisterDMABuf(fd int, off uint64, n int, iova uint64, acc verbsio.Access) (verbsio.MemoryRegion, error) {
	if f.dmabufErr != nil {
		return nil, f.dmabufErr
	}
	f.regs = append(f.regs, fmt.Sprintf("dmabuf fd=%d off=%d n=%d iova=%#x %s", fd, off, n, iova, acc))
	f.live++
	return &fakeMR{f: f}, nil
}

func (f *fakeVerbs) RegisterMemory(addr uintptr, n int, acc verbsio.Access) (verbsio.MemoryRegion, error) {
	if f.peerErr != nil {
		return nil, f.peerErr
	}
	f.regs = append(f.regs, fmt.Sprintf("mem addr=%#x n=%d %s", addr, n, acc))
	f.live++
	return &fakeMR{f: f}, nil
}

type fakeExporter struct {
	err    error
	open   int
	closed int
}

func (e *fakeExporter) exportDMABuf(ptr uintptr, n int) (int, func() error, error) {
	if e.err != nil {
		return -1, nil, e.err
	}
	e.open++
	return 42, func() error { e.closed++; return nil }, nil
}
func (e *fakeExporter) busID() (string, error) { return "0000:3b:00.0", nil }
func (e *fakeExporter) device() tensor.Device  { return tensor.GPUDevice(0) }

// gpuArena is a GPU arena of size bytes, with its own base address for each
// id.
func gpuArena(t testing.TB, id int, size int) *alloc.Arena {
	return testArena(t, id, &alloc.Region{Base: uintptr(id+1) << 30, Size: size, Device: tensor.GPUDevice(0), FD: -1})
}

func gpuCaps(dmabuf bool) verbsio.Caps {
	return verbsio.Caps{Provider: "fake", MemoryTypes: []tensor.DeviceKind{tensor.CPU, tensor.GPU}, DMABuf: dmabuf}
}

func TestGPUMRPrefersDMABufThenPeerMem(t *testing.T) {
	noBAR1 := func(string) (int64, int64, error) { return 0, 0, errors.New("no NVML in this test") }
	cases := []struct {
		name      string
		caps      verbsio.Caps
		expErr    error
		dmabufErr error
		method    gpumrMethod
		want      gpumrMethod
		wantErr   error
	}{
		{"dma-buf works", gpuCaps(true), nil, nil, gpumrAuto, gpumrDMABuf, nil},
		{"provider lacks dma-buf", gpuCaps(false), nil, nil, gpumrAuto, gpumrPeerMem, nil},
		{"dma-buf only provider refuses", verbsio.Caps{Provider: "fake", MemoryTypes: []tensor.DeviceKind{tensor.CPU}, DMABuf: true}, nil, verbsio.ErrNotSupported, gpumrAuto, 0, ErrGPURegistration},
		{"driver refuses export", gpuCaps(true), cuda.ErrNotSupported, nil, gpumrAuto, gpumrPeerMem, nil},
		{"provider refuses dma-buf", gpuCaps(true), nil, verbsio.ErrNotSupported, gpumrAuto, gpumrPeerMem, nil},
		{"peermem forced", gpuCaps(true), nil, nil, gpumrPeerMem, gpumrPeerMem, nil},
		{"dma-buf forced and refused", gpuCaps(true), cuda.ErrNotSupported, nil, gpumrDMABuf, 0, ErrGPURegistration},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := &fakeVerbs{caps: c.caps, dmabufErr: c.dmabufErr}
			exp := &fakeExporter{err: c.expErr}
			v, err := newGPUMemoryRegions(exp, f, f, GPUMROptions{method: c.method, BAR1Bytes: -1}, noBAR1)
			if err != nil {
				t.Fatal(err)
			}
			a := gpuArena(t, 0, 4<<20)
			err = v.Visit(a)
			if c.wantErr != nil {
				if !errors.Is(err, c.wantErr) {
					t.Fatalf("Visit: %v, want %v", err, c.wantErr)
				}
				if _, ok := gpuMemoryRegionOf(a); ok || f.live != 0 {
					t.Fatal("a failed visit left a registration")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			h, ok := gpuMemoryRegionOf(a)
			if !ok || h.Method != c.want {
				t.Fatalf("registered via %v (%v), want %v; registrations %v", h.Method, ok, c.want, f.regs)
			}
			if exp.open != exp.closed {
				t.Fatalf("dma-buf fds: %d exported, %d closed", exp.open, exp.closed)
			}
			if v.mappedBytes() != 4<<20 {
				t.Fatalf("Mapped = %d", v.mappedBytes())
			}
			if err := v.Visit(a); !errors.Is(err, errAlreadyVisited) {
				t.Fatalf("second Visit: %v", err)
			}
			if err := v.Release(a); err != nil {
				t.Fatal(err)
			}
			if f.live != 0 || v.mappedBytes() != 0 {
				t.Fatalf("after Release: %d live regions, %d mapped", f.live, v.mappedBytes())
			}
			if err := v.Release(a); !errors.Is(err, errNotVisited) {
				t.Fatalf("second Release: %v", err)
			}
		})
	}
}

func TestGPUMRBothMethodsFail(t *testing.T) {
	f := &fakeVerbs{caps: gpuCaps(true), peerErr: fmt.Errorf("%w: ibv_reg_mr: EFAULT (nvidia-peermem not loaded?)", verbsio.ErrNotSupported)}
	v, err := newGPUMemoryRegions(&fakeExporter{err: cuda.ErrNotSupported}, f, f, GPUMROptions{BAR1Bytes: -1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = v.Visit(gpuArena(t, 0, 2<<20))
	if !errors.Is(err, ErrGPURegistration) || !errors.Is(err, cuda.ErrNotSupported) || !errors.Is(err, verbsio.ErrNotSupported) {
		t.Fatalf("Visit: %v", err)
	}
	if !strings.Contains(err.Error(), "dma-buf") || !strings.Contains(err.Error(), "nvidia-peermem") {
		t.Fatalf("error %q does not give both reasons", err)
	}
}

func TestGPUMRBAR1(t *testing.T) {
	f := &fakeVerbs{caps: gpuCaps(true)}
	// A passed-in budget of 6 MiB: two 2 MiB arenas fit, a 4 MiB one does not.
	v, err := newGPUMemoryRegions(&fakeExporter{}, f, f, GPUMROptions{BAR1Bytes: 6 << 20}, nil)
	if err != nil {
		t.Fatal(err)
	}
	a0, a1, a2 := gpuArena(t, 0, 2<<20), gpuArena(t, 1, 2<<20), gpuArena(t, 2, 4<<20)
	if err := v.Visit(a0); err != nil {
		t.Fatal(err)
	}
	if err := v.Visit(a1); err != nil {
		t.Fatal(err)
	}
	err = v.Visit(a2)
	if !errors.Is(err, ErrBAR1Exhausted) || !strings.Contains(err.Error(), "BAR1") {
		t.Fatalf("arena beyond the BAR1 budget: %v", err)
	}
	if f.live != 2 {
		t.Fatalf("%d live regions, want 2", f.live)
	}
	if err := v.Release(a0); err != nil {
		t.Fatal(err)
	}
	if err := v.Visit(a2); err != nil {
		t.Fatalf("arena after space was released: %v", err)
	}

	// BAR1 from NVML: the free figure decides, and an unreadable BAR1 is
	// a loud error rather than a silent pass.
	nv := func(free int64, err error) func(string) (int64, int64, error) {
		return func(bus string) (int64, int64, error) {
			if bus != "0000:3b:00.0" {
				t.Errorf("BAR1 asked for %q", bus)
			}
			return free, 32 << 30, err
		}
	}
	v, _ = newGPUMemoryRegions(&fakeExporter{}, f, f, GPUMROptions{}, nv(1<<20, nil))
	if err := v.Visit(gpuArena(t, 5, 2<<20)); !errors.Is(err, ErrBAR1Exhausted) || !strings.Contains(err.Error(), "0000:3b:00.0") {
		t.Fatalf("NVML says 1 MiB free: %v", err)
	}
	v, _ = newGPUMemoryRegions(&fakeExporter{}, f, f, GPUMROptions{}, nv(0, errors.New("NVML unavailable")))
	if err := v.Visit(gpuArena(t, 6, 2<<20)); !errors.Is(err, errBAR1Unknown) {
		t.Fatalf("unreadable BAR1: %v", err)
	}
	v, _ = newGPUMemoryRegions(&fakeExporter{}, f, f, GPUMROptions{}, nv(64<<20, nil))
	if err := v.Visit(gpuArena(t, 7, 2<<20)); err != nil {
		t.Fatalf("BAR1 with room: %v", err)
	}
}

func TestGPUMRRefusals(t *testing.T) {
	cpuOnly := &fakeVerbs{caps: verbsio.Caps{Provider: "tcp", MemoryTypes: []tensor.DeviceKind{tensor.CPU}}}
	if _, err := newGPUMemoryRegions(&fakeExporter{}, cpuOnly, cpuOnly, GPUMROptions{}, nil); !errors.Is(err, verbsio.ErrNotSupported) {
		t.Fatalf("provider without GPU memory: %v", err)
	}
	f := &fakeVerbs{caps: gpuCaps(true)}
	v, _ := newGPUMemoryRegions(&fakeExporter{}, f, f, GPUMROptions{BAR1Bytes: -1}, nil)
	host := testArena(t, 1, &alloc.Region{Base: 1 << 30, Size: 4096, Device: tensor.Host, FD: -1})
	if err := v.Visit(host); !errors.Is(err, errNotGPUMemory) {
		t.Fatalf("host arena: %v", err)
	}
	other := testArena(t, 2, &alloc.Region{Base: 1 << 30, Size: 4096, Device: tensor.GPUDevice(3), FD: -1})
	if err := v.Visit(other); !errors.Is(err, errNotGPUMemory) {
		t.Fatalf("arena of another GPU: %v", err)
	}
}

// TestGPUMRRealDevice registers a real GPU pool's arenas with a verbs
// provider that can register GPU memory.
func TestGPUMRRealDevice(t *testing.T) {
	ctx := cudatest.Context(t)
	var dev verbsio.Device
	for _, name := range verbsio.Providers() {
		d, err := verbsio.Open(name, verbsio.DefaultConfig())
		if err != nil {
			continue
		}
		c := d.Caps()
		gpu := c.DMABuf
		for _, k := range c.MemoryTypes {
			gpu = gpu || k == tensor.GPU
		}
		if gpu && dev == nil {
			dev = d
			continue
		}
		d.Close()
	}
	if dev == nil {
		if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
			t.Fatalf("GDRLINK_REQUIRE_RDMA=1 but no verbs device registers GPU memory; providers: %v", verbsio.Providers())
		}
		t.Skipf("no verbs device here registers GPU memory (dma-buf or nvidia-peermem); providers: %v", verbsio.Providers())
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer pd.Close()
	v, err := NewGPUMemoryRegions(ctx.Device().Ordinal(), dev, pd, GPUMROptions{})
	if err != nil {
		t.Fatal(err)
	}
	src, err := alloc.NewCUDADeviceSource(ctx.Device().Ordinal())
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	pool, err := alloc.New(src, alloc.WithVisitors(v))
	if err != nil {
		t.Fatal(err)
	}
	b, err := pool.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := pool.ArenaOf(b.Addr())
	h, ok := gpuMemoryRegionOf(a)
	if !ok || h.MR.RKey() == 0 && h.MR.LKey() == 0 {
		t.Fatalf("arena %v has no GPU memory region", a)
	}
	t.Logf("registered %v via %v (dma-buf: %v)", a, h.Method, h.DMABufErr)
	b.Free()
	if err := pool.Close(); err != nil {
		t.Fatal(err)
	}
}
