package gdr

import (
	"bytes"
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/internal/sysfs"
)

func collectFixture(t testing.TB, name string) *Facts {
	t.Helper()
	f, _ := collectFixturePCI(t, name)
	return f
}

func collectFixturePCI(t testing.TB, name string) (*Facts, map[string]*sysfs.PCIDevice) {
	t.Helper()
	f, pci, err := collect(context.Background(), fixtureRoot(t, name), CollectOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return f, pci
}

// TestFixtureDecisions checks the whole chain, files to verdict, on each
// node layout.
func TestFixtureDecisions(t *testing.T) {
	type want struct {
		mode Mode
		nic  string
		path PathType
		// in are substrings that must appear among the reasons and fixes.
		in []string
	}
	cases := map[string][]want{
		"dgx": {
			{Direct, "mlx5_0", PathPIX, []string{"share the PCIe switch at 0000:18:00.0"}},
			{Direct, "mlx5_0", PathPXB, nil},
			{Direct, "mlx5_1", PathPIX, nil},
			{Direct, "mlx5_1", PathPXB, nil},
		},
		"two-socket": {
			{Proxy, "mlx5_0", PathSYS, []string{"the NIC is on the other socket", "GDRLINK_NET_GDR_LEVEL=SYS"}},
			{Proxy, "mlx5_0", PathSYS, nil},
		},
		"cloud-vm": {
			{Proxy, "mlx5_0", PathPHB, []string{"PHB is farther than the policy level PXB"}},
			{Proxy, "mlx5_0", PathNODE, nil},
		},
		"no-gpu":  {},
		"no-rdma": {{Unavailable, "", PathUnknown, []string{"no RDMA device"}}},
		"broken": {
			{Unavailable, "mlx5_0", PathPIX, []string{"port 1 is DOWN", "RLIMIT_MEMLOCK is 64 KiB", "load nvidia_peermem", "disable ACS on bridge 0000:19:00.0", "older than 5.12"}},
			{Unavailable, "mlx5_0", PathPXB, nil},
		},
	}
	for name, wants := range cases {
		t.Run(name, func(t *testing.T) {
			f := collectFixture(t, name)
			if len(f.GPUs) != len(wants) {
				t.Fatalf("%d GPUs, want %d (%s)", len(f.GPUs), len(wants), f.GPUSource.Detail)
			}
			for i, w := range wants {
				d := DecideGPU(f, f.GPUs[i].Index, defaultPolicy())
				if d.Mode != w.mode || d.NIC != w.nic || d.PathType != w.path {
					t.Errorf("GPU%d: %s via %q %s, want %s via %q %s; reasons %q", i, d.Mode, d.NIC, d.PathType, w.mode, w.nic, w.path, d.Reasons)
				}
				all := strings.Join(append(append([]string{}, d.Reasons...), d.Fixes...), "\n")
				for _, s := range w.in {
					if !strings.Contains(all, s) {
						t.Errorf("GPU%d: %q not among\n%s", i, s, all)
					}
				}
			}
		})
	}
}

func TestCollectFacts(t *testing.T) {
	f := collectFixture(t, "dgx")
	if !f.PeerMem.ok() || !f.DMABuf.ok() || !f.RDMA.ok() || f.NUMANodes != 2 {
		t.Fatalf("dgx facts: peermem %v dmabuf %v rdma %v numa %d", f.PeerMem, f.DMABuf, f.RDMA, f.NUMANodes)
	}
	if f.Memlock.Soft != unlimited || f.Memlock.Live {
		t.Errorf("memlock %+v, want unlimited from the file", f.Memlock)
	}
	if g := f.gpu(0); g == nil || g.Name != "NVIDIA H100 80GB HBM3" || g.BAR1Total == nil || *g.BAR1Total != 128<<30 {
		t.Errorf("GPU0 %+v", g)
	}
	if len(f.NICs) != 2 || f.NICs[0].PCIAddress != "0000:1b:00.0" || f.NICs[0].NUMANode == nil || *f.NICs[0].NUMANode != 0 {
		t.Fatalf("NICs %+v", f.NICs)
	}
	p := f.NICs[0].Ports[0]
	if p.State != "ACTIVE" || p.PhysState != "LinkUp" || p.LinkLayer != "InfiniBand" || p.RateGbps == nil || *p.RateGbps != 400 || len(p.GIDs) != 1 {
		t.Errorf("port %+v", p)
	}
	if f.IOMMU.Mode != "passthrough" {
		t.Errorf("IOMMU %+v", f.IOMMU)
	}

	ts := collectFixture(t, "two-socket")
	rp := ts.NICs[0].Ports[0]
	if rp.Netdev != "ens5f0np0" || rp.ActiveMTU == nil || *rp.ActiveMTU != 4096 || len(rp.GIDs) != 4 || rp.GIDs[1].Type != "RoCE v2" {
		t.Errorf("RoCE port %+v", rp)
	}
	if ts.Hugepages.Total != 1024 || ts.Hugepages.Size != 2<<20 {
		t.Errorf("hugepages %+v", ts.Hugepages)
	}
	if cv := collectFixture(t, "cloud-vm"); *cv.NICs[0].Ports[0].ActiveMTU != 1024 {
		t.Errorf("cloud-vm active MTU %d, want 1024 for a 1500-byte netdev", *cv.NICs[0].Ports[0].ActiveMTU)
	}
	br := collectFixture(t, "broken")
	if br.Memlock.Soft != 64<<10 || br.PeerMem.Status != StatusNotSupported || br.Kernel.DMABuf.Status != StatusNotSupported {
		t.Errorf("broken: memlock %+v peermem %v dmabuf %v", br.Memlock, br.PeerMem, br.Kernel.DMABuf)
	}
	if !errors.Is(br.PeerMem.err(), ErrNotSupported) {
		t.Errorf("peermem Err() = %v, want ErrNotSupported", br.PeerMem.err())
	}
	nr := collectFixture(t, "no-rdma")
	if nr.RDMA.Status != StatusNotSupported || len(nr.NICs) != 0 {
		t.Errorf("no-rdma: %v %v", nr.RDMA, nr.NICs)
	}
}

// TestCollectHost runs Collect on this machine: whatever it has, it must
// return consistent facts without failing.
func TestCollectHost(t *testing.T) {
	r, err := sysfs.OpenRoot("/")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	f, pci, err := collect(context.Background(), r, CollectOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !f.Memlock.Live || !f.Memlock.Check.ok() {
		t.Errorf("memlock on the host should come from getrlimit: %+v", f.Memlock)
	}
	if f.Kernel.Release == "" {
		t.Error("no kernel release read from /proc/sys/kernel/osrelease")
	}
	if len(pci) == 0 {
		t.Log("no PCI devices visible (container without /sys/bus/pci?)")
	}
	for _, g := range f.GPUs {
		_ = DecideGPU(f, g.Index, defaultPolicy())
	}
}

func TestCollectCanceled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Collect(ctx, CollectOptions{Root: "testdata/nodes/dgx"}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Collect with a canceled context: %v", err)
	}
}

// recording is a Recorder that keeps what it is told.
type recording struct {
	files map[string][]byte
	links map[string]string
	dirs  map[string]bool
}

func (r *recording) File(name string, data []byte) { r.files[name] = data }
func (r *recording) Link(name, target string)      { r.links[name] = target }
func (r *recording) Dir(name string)               { r.dirs[name] = true }

func TestCollectRecorder(t *testing.T) {
	rec := &recording{files: map[string][]byte{}, links: map[string]string{}, dirs: map[string]bool{}}
	f, err := Collect(context.Background(), CollectOptions{Root: "testdata/nodes/dgx", Recorder: rec})
	if err != nil {
		t.Fatal(err)
	}
	plain, err := Collect(context.Background(), CollectOptions{Root: "testdata/nodes/dgx"})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(f, plain) {
		t.Errorf("facts with a recorder differ:\n%+v\n%+v", f, plain)
	}
	if _, ok := rec.files["/proc/modules"]; !ok || !rec.dirs["/sys/bus/pci/devices"] || rec.links["/sys/bus/pci/devices/0000:1a:00.0"] == "" {
		t.Errorf("recorded %d files, %d links, %d directories; /proc/modules, /sys/bus/pci/devices or GPU0's link missing", len(rec.files), len(rec.links), len(rec.dirs))
	}
	name, want, err := snapshotFactsOf(f)
	if err != nil {
		t.Fatal(err)
	}
	if got := rec.files[name]; !bytes.Equal(got, want) {
		t.Errorf("recorded %s:\n%s\nwant\n%s", name, got, want)
	}
	if _, err := parseSnapshotFacts(rec.files[name]); err != nil {
		t.Error(err)
	}
}

func TestRootConfinement(t *testing.T) {
	r := fixtureRoot(t, "dgx")
	if _, err := r.ReadFile("/../../../../etc/passwd"); err == nil {
		// "/../x" cleans to "/x", which does not exist in the fixture.
		t.Fatal("read outside the root")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := r.ReadFile("/proc/modules"); !errors.Is(err, sysfs.ErrClosed) {
		t.Fatalf("read after Close: %v", err)
	}
}

func TestCrossCheckTopology(t *testing.T) {
	f, pci := collectFixturePCI(t, "dgx")
	f.GPUTopology = []GPUTopology{
		{A: 0, B: 1, Path: PathPXB},              // agrees with the tree
		{A: 0, B: 2, Path: PathPIX},              // does not: the tree says SYS
		{A: 1, B: 3, Path: PathSYS, NVLinks: 18}, // NVLink: not compared
	}
	notes := crossCheckTopology(f, pci)
	if len(notes) != 1 || notes[0] != "NVML says GPU0-GPU2 is PIX, the PCI tree says SYS" {
		t.Fatalf("%q", notes)
	}
}

func BenchmarkCollect(b *testing.B) {
	r := fixtureRoot(b, "dgx")
	for b.Loop() {
		if _, _, err := collect(context.Background(), r, CollectOptions{}); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDecideGPU(b *testing.B) {
	f := collectFixture(b, "dgx")
	p := defaultPolicy()
	for b.Loop() {
		for _, g := range f.GPUs {
			_ = DecideGPU(f, g.Index, p)
		}
	}
}
