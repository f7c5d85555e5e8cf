package gdr

import (
	"bytes"
	"context"
	"errors"
	"github.com/gdrlink/gdrlink/internal/ibv"
	"os"
	"path/filepath"
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
			{Unavailable, "mlx5_0", PathPIX, []string{"libibverbs: libibverbs.so.1 not found", fixVerbs, "port 1 is DOWN", "RLIMIT_MEMLOCK is 64 KiB", "load nvidia_peermem", "disable ACS on bridge 0000:19:00.0", "older than 5.12"}},
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

	// libibverbs: from the tree's library file, from snapshot facts, from
	// an old snapshot's dma-buf check, or not known.
	const lib = "/usr/lib/x86_64-linux-gnu/libibverbs.so.1"
	for _, c := range []struct {
		node          string
		verbs, dmabuf Status
		detail        string
	}{
		{"dgx", StatusAvailable, StatusAvailable, "libibverbs.so.1 at " + lib},
		{"two-socket", StatusAvailable, StatusAvailable, "libibverbs.so.1 at " + lib},
		{"no-gpu", StatusAvailable, StatusNotSupported, "libibverbs.so.1 at " + lib},
		{"cloud-vm", StatusAvailable, StatusAvailable, "the snapshot's dma-buf check found ibv_reg_dmabuf_mr in " + lib},
		{"broken", StatusNotSupported, StatusNotSupported, "libibverbs.so.1 not found (rdma-core's libibverbs is not installed)"},
		{"no-rdma", StatusUnknown, StatusUnknown, "no libibverbs.so.1 under the root and no snapshot facts about it"},
	} {
		f := collectFixture(t, c.node)
		if f.Verbs.Status != c.verbs || f.Verbs.Detail != c.detail || f.LibIBVerbs.Status != c.dmabuf {
			t.Errorf("%s: libibverbs %v, dma-buf %v; want %s (%s), dma-buf %s", c.node, f.Verbs, f.LibIBVerbs, c.verbs, c.detail, c.dmabuf)
		}
	}
}

// TestProbeLibIBVerbs probes roots with and without libibverbs.so.1: one
// read of the file answers both checks.
func TestProbeLibIBVerbs(t *testing.T) {
	const lib = "/usr/lib64/libibverbs.so.1"
	cases := []struct {
		name string
		// file is the content of lib, link its target; neither: no file.
		file, link    []byte
		verbs, dmabuf Check
	}{
		{name: "no library",
			verbs:  Check{Status: StatusUnknown, Detail: "no libibverbs.so.1 under the root and no snapshot facts about it"},
			dmabuf: Check{Status: StatusUnknown, Detail: "no libibverbs.so.1 under the root and no snapshot facts about it"}},
		{name: "rdma-core 34+", file: fakeELF("ibv_open_device", "ibv_reg_dmabuf_mr"),
			verbs: available("libibverbs.so.1 at " + lib), dmabuf: available("ibv_reg_dmabuf_mr in " + lib)},
		{name: "rdma-core 33", file: fakeELF("ibv_open_device"),
			verbs: available("libibverbs.so.1 at " + lib), dmabuf: missing("%s has no ibv_reg_dmabuf_mr (rdma-core older than 34)", lib)},
		{name: "not a shared library", file: []byte("not elf")},
		{name: "absolute link", link: []byte("/usr/lib64/libibverbs.so.1.14.44.0")},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			p := filepath.Join(dir, filepath.FromSlash(lib))
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			var err error
			switch {
			case c.file != nil:
				err = os.WriteFile(p, c.file, 0o644)
			case c.link != nil:
				if err = os.WriteFile(p+".14.44.0", fakeELF("ibv_open_device"), 0o644); err == nil {
					err = os.Symlink(string(c.link), p)
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			root, err := sysfs.OpenRoot(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer root.Close()
			rec := &recording{files: map[string][]byte{}, links: map[string]string{}, dirs: map[string]bool{}}
			root.SetRecorder(rec)
			verbs, dmabuf := probeLibIBVerbs(root)
			if c.verbs.Detail == "" {
				// The file is there but unusable: neither check can tell,
				// and both say why.
				if verbs.Status != StatusUnknown || dmabuf.Status != StatusUnknown || !strings.Contains(verbs.Detail, "libibverbs.so.1") || verbs != dmabuf {
					t.Fatalf("libibverbs %v, dma-buf %v; want both unknown", verbs, dmabuf)
				}
				return
			}
			if verbs != c.verbs || dmabuf != c.dmabuf {
				t.Fatalf("libibverbs %v, dma-buf %v; want %v, %v", verbs, dmabuf, c.verbs, c.dmabuf)
			}
			if n := len(rec.files); c.file != nil && n != 1 {
				t.Errorf("%d files read, want the library once", n)
			}
		})
	}
}

func TestSnapshotLibIBVerbs(t *testing.T) {
	dmabuf := available("ibv_reg_dmabuf_mr in /usr/lib/x86_64-linux-gnu/libibverbs.so.1")
	old := missing("/usr/lib/x86_64-linux-gnu/libibverbs.so.1 has no ibv_reg_dmabuf_mr (rdma-core older than 34)")
	present := available("libibverbs.so.1 at /usr/lib/x86_64-linux-gnu/libibverbs.so.1")
	unknown := Check{Status: StatusUnknown, Detail: "no libibverbs.so.1 under the root and no snapshot facts about it"}
	cases := []struct {
		name          string
		snap          *snapshotFacts
		ok            bool
		verbs, dmabuf Status
	}{
		{"no snapshot", nil, false, 0, 0},
		{"neither check", &snapshotFacts{Version: 1}, false, 0, 0},
		{"both", &snapshotFacts{Version: 1, Verbs: &noVerbs, LibIBVerbs: &noVerbs}, true, StatusNotSupported, StatusNotSupported},
		{"old snapshot, dma-buf available", &snapshotFacts{Version: 1, LibIBVerbs: &dmabuf}, true, StatusAvailable, StatusAvailable},
		{"old snapshot, rdma-core 33", &snapshotFacts{Version: 1, LibIBVerbs: &old}, true, StatusUnknown, StatusNotSupported},
		{"old snapshot, no library", &snapshotFacts{Version: 1, LibIBVerbs: &noVerbs}, true, StatusUnknown, StatusNotSupported},
		{"old snapshot, unknown", &snapshotFacts{Version: 1, LibIBVerbs: &unknown}, true, StatusUnknown, StatusUnknown},
		{"only libibverbs, missing", &snapshotFacts{Version: 1, Verbs: &noVerbs}, true, StatusNotSupported, StatusNotSupported},
		{"only libibverbs, present", &snapshotFacts{Version: 1, Verbs: &present}, true, StatusAvailable, StatusUnknown},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			verbs, dmabuf, ok := snapshotLibIBVerbs(c.snap)
			if ok != c.ok || ok && (verbs.Status != c.verbs || dmabuf.Status != c.dmabuf) {
				t.Fatalf("%v, %v, %v; want %s, %s, %v", verbs, dmabuf, ok, c.verbs, c.dmabuf, c.ok)
			}
			if ok && (verbs.Detail == "" || dmabuf.Detail == "") {
				t.Errorf("a check without a detail: %v, %v", verbs, dmabuf)
			}
		})
	}
	// Collect reads an old snapshot's facts the same way.
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "gdrlink"), 0o755); err != nil {
		t.Fatal(err)
	}
	old1 := `{"version":1,"libibverbs_dmabuf":{"status":"available","detail":"ibv_reg_dmabuf_mr in /usr/lib64/libibverbs.so.1"}}`
	if err := os.WriteFile(filepath.Join(dir, "gdrlink", "facts.json"), []byte(old1), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := Collect(context.Background(), CollectOptions{Root: dir})
	if err != nil {
		t.Fatal(err)
	}
	if want := available("the snapshot's dma-buf check found ibv_reg_dmabuf_mr in /usr/lib64/libibverbs.so.1"); f.Verbs != want {
		t.Errorf("libibverbs from an old snapshot: %v, want %v", f.Verbs, want)
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
	sf, err := parseSnapshotFacts(rec.files[name])
	if err != nil {
		t.Fatal(err)
	}
	if sf.Verbs == nil || *sf.Verbs != f.Verbs || sf.LibIBVerbs == nil || *sf.LibIBVerbs != f.LibIBVerbs {
		t.Errorf("snapshot facts libibverbs %v, dma-buf %v; want %v, %v", sf.Verbs, sf.LibIBVerbs, f.Verbs, f.LibIBVerbs)
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

// TestLiveLibIBVerbs: on the live host, a libibverbs outside the standard
// directories counts as installed exactly when this process can load it.
func TestLiveLibIBVerbs(t *testing.T) {
	verbs, dmabuf := liveLibIBVerbs()
	if err := ibv.Load(); err != nil {
		if verbs.Status != StatusNotSupported || dmabuf.Status != StatusNotSupported || !strings.Contains(verbs.Detail, "install rdma-core") {
			t.Errorf("libibverbs does not load (%v), yet the checks are %+v, %+v", err, verbs, dmabuf)
		}
		return
	}
	if verbs.Status != StatusAvailable || dmabuf.Status == StatusUnknown {
		t.Errorf("libibverbs loads, yet the checks are %+v, %+v", verbs, dmabuf)
	}
}
