package sysfs

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func intp(v int) *int { return &v }

func TestParsePCIAddress(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"0000:3b:00.0", "0000:3b:00.0"},
		{"3b:00.1", "0000:3b:00.1"},
		{"00000000:3B:00.0", "0000:3b:00.0"},
		{"10000:e1:1f.7", "10000:e1:1f.7"},
		{"", ""}, {"0000:3b:00", ""}, {"0000:3b:20.0", ""}, {"0000:3b:00.8", ""}, {"zz:00.0", ""}, {"0000:100:00.0", ""},
	} {
		got, err := ParsePCIAddress(c.in)
		if c.want == "" {
			if !errors.Is(err, ErrBadPCIAddress) {
				t.Errorf("%q: %q, %v; want ErrBadPCIAddress", c.in, got, err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("%q: %q, %v; want %q", c.in, got, err, c.want)
		}
	}
}

func TestParsePCIPath(t *testing.T) {
	p, err := ParsePCIPath("../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:08.0/0000:3d:00.0")
	if err != nil || p.HostBridge != "pci0000:3a" || p.Device != "0000:3d:00.0" || len(p.Bridges) != 3 || p.Bridges[0] != "0000:3a:00.0" {
		t.Fatalf("%+v %v", p, err)
	}
	p, err = ParsePCIPath("../../devices/pci0000:00/0000:00:01.0/0000:06:00.0/infiniband/mlx5_0")
	if err != nil || p.Device != "0000:06:00.0" || len(p.Bridges) != 1 {
		t.Fatalf("%+v %v", p, err)
	}
	p, err = ParsePCIPath("/sys/devices/LNXSYSTM:00/LNXSYBUS:00/VMBUS:00/7870d0c5-5bbc/pci7870:00/7870:00:00.0")
	if err != nil || p.HostBridge != "pci7870:00" || p.Device != "7870:00:00.0" {
		t.Fatalf("vmbus: %+v %v", p, err)
	}
	for _, bad := range []string{"", "../../devices/virtual/infiniband/rxe0", "/sys/devices/pci0000:00", "pci0000:00/infiniband"} {
		if _, err := ParsePCIPath(bad); !errors.Is(err, ErrMalformed) {
			t.Errorf("%q: %v, want ErrMalformed", bad, err)
		}
	}
}

func path3(hb string, addrs ...string) PCIPath {
	return PCIPath{HostBridge: hb, Bridges: addrs[:len(addrs)-1], Device: addrs[len(addrs)-1]}
}

func TestClassifyPath(t *testing.T) {
	n0, n1 := intp(0), intp(1)
	sw := []string{"0000:00:01.0", "0000:01:00.0"}
	cases := []struct {
		name      string
		a, b      PCIPath
		na, nb    *int
		numaNodes int
		want      string
	}{
		{"same", path3("pci0000:00", "0000:00:01.0", "0000:02:00.0"), path3("pci0000:00", "0000:00:01.0", "0000:02:00.0"), n0, n0, 2, "LOC"},
		{"one switch", path3("pci0000:00", append(sw, "0000:02:00.0", "0000:03:00.0")...), path3("pci0000:00", append(sw, "0000:02:08.0", "0000:04:00.0")...), n0, n0, 2, "PIX"},
		{"same bridge", path3("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0"), path3("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.1"), n0, n0, 2, "PIX"},
		{"two switches", path3("pci0000:00", append(sw, "0000:02:00.0", "0000:03:00.0", "0000:04:00.0", "0000:05:00.0")...), path3("pci0000:00", append(sw, "0000:02:08.0", "0000:06:00.0")...), n0, n0, 2, "PXB"},
		{"root ports", path3("pci0000:00", "0000:00:01.0", "0000:01:00.0"), path3("pci0000:00", "0000:00:02.0", "0000:02:00.0"), n0, n0, 2, "PHB"},
		{"flat", path3("pci0000:00", "0000:00:04.0"), path3("pci0000:00", "0000:00:05.0"), nil, nil, 1, "PHB"},
		{"host bridges", path3("pci0000:00", "0000:00:01.0", "0000:01:00.0"), path3("pci0000:3a", "0000:3a:00.0", "0000:3b:00.0"), n0, n0, 2, "NODE"},
		{"sockets", path3("pci0000:00", "0000:00:01.0", "0000:01:00.0"), path3("pci0000:d7", "0000:d7:00.0", "0000:d8:00.0"), n0, n1, 2, "SYS"},
		{"no numa, one node", path3("pci0000:00", "0000:00:04.0"), path3("pci0000:10", "0000:10:00.0"), nil, nil, 1, "NODE"},
		{"no numa, two nodes", path3("pci0000:00", "0000:00:04.0"), path3("pci0000:10", "0000:10:00.0"), nil, nil, 2, "SYS"},
		{"unknown", PCIPath{}, path3("pci0000:10", "0000:10:00.0"), nil, nil, 1, "?"},
	}
	for _, c := range cases {
		got, why := ClassifyPath(c.a, c.b, c.na, c.nb, c.numaNodes)
		back, _ := ClassifyPath(c.b, c.a, c.nb, c.na, c.numaNodes)
		if got != c.want || back != got || why == "" {
			t.Errorf("%s: %s (%s), reversed %s; want %s", c.name, got, why, back, c.want)
		}
	}
}

// acsConfig builds a config space image with extended capabilities chained
// from 0x100: each (id, ctrl) pair, ACS control at +6.
func acsConfig(size int, caps ...[2]uint16) []byte {
	b := make([]byte, size)
	off := 0x100
	for i, c := range caps {
		next := 0
		if i+1 < len(caps) {
			next = off + 0x40
		}
		binary.LittleEndian.PutUint32(b[off:], uint32(c[0])|1<<16|uint32(next)<<20)
		binary.LittleEndian.PutUint16(b[off+6:], c[1])
		off = next
	}
	return b
}

func TestParseACS(t *testing.T) {
	a, err := ParseACS(acsConfig(4096, [2]uint16{0x0001, 0}, [2]uint16{0x000d, 0x001d}))
	if err != nil || a == nil || a.Offset != 0x140 || a.Control != 0x001d || !a.RedirectsP2P() {
		t.Fatalf("%+v %v", a, err)
	}
	a, err = ParseACS(acsConfig(4096, [2]uint16{0x000d, ACSSourceValidation}))
	if err != nil || a == nil || a.RedirectsP2P() {
		t.Fatalf("ACS with only source validation: %+v %v", a, err)
	}
	if a, err := ParseACS(acsConfig(4096, [2]uint16{0x0001, 0})); a != nil || err != nil {
		t.Fatalf("no ACS: %+v %v", a, err)
	}
	if _, err := ParseACS(make([]byte, 256)); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("256-byte image: %v, want ErrNotSupported", err)
	}
	loop := make([]byte, 4096)
	binary.LittleEndian.PutUint32(loop[0x100:], 0x0001|0x100<<20)
	if _, err := ParseACS(loop); !errors.Is(err, ErrMalformed) {
		t.Fatalf("looping list: %v, want ErrMalformed", err)
	}
	short := acsConfig(0x108, [2]uint16{0x000d, 0})[:0x106]
	if _, err := ParseACS(short); !errors.Is(err, ErrMalformed) {
		t.Fatalf("cut short: %v, want ErrMalformed", err)
	}
	var nilACS *ACS
	if nilACS.RedirectsP2P() {
		t.Fatal("nil ACS redirects")
	}
}

func TestParsers(t *testing.T) {
	lim, err := ParseLimits("Limit                     Soft Limit           Hard Limit           Units     \nMax cpu time              unlimited            unlimited            seconds   \nMax locked memory         65536                unlimited            bytes     \nMax nice priority         0                    0                    \n")
	if err != nil || lim["Max locked memory"] != (Limit{Soft: 65536, Hard: Unlimited, Unit: "bytes"}) || lim["Max nice priority"].Soft != 0 {
		t.Fatalf("%+v %v", lim, err)
	}
	if _, err := ParseLimits("garbage"); !errors.Is(err, ErrMalformed) {
		t.Fatalf("limits garbage: %v", err)
	}
	mi, err := ParseMeminfo("HugePages_Total:     16\nHugepagesize:       2048 kB\n")
	if err != nil || mi["HugePages_Total"] != 16 || mi["Hugepagesize"] != 2<<20 {
		t.Fatalf("%v %v", mi, err)
	}
	if _, err := ParseMeminfo("x: 1 MB"); !errors.Is(err, ErrMalformed) {
		t.Fatalf("meminfo unit: %v", err)
	}
	if a, b, err := ParseKernelRelease("6.1.0-56-amd64"); a != 6 || b != 1 || err != nil {
		t.Fatalf("release %d.%d %v", a, b, err)
	}
	if _, _, err := ParseKernelRelease("six"); !errors.Is(err, ErrMalformed) {
		t.Fatal(err)
	}
	if v := ParseKernelConfig("# x\nCONFIG_DMA_SHARED_BUFFER=y\n", "CONFIG_DMA_SHARED_BUFFER"); v != "y" {
		t.Fatal(v)
	}
	if v := ParseKernelConfig("# CONFIG_DMA_SHARED_BUFFER is not set\n", "CONFIG_DMA_SHARED_BUFFER"); v != "" {
		t.Fatal(v)
	}
	if n, s, err := ParsePortState("4: ACTIVE"); n != 4 || s != "ACTIVE" || err != nil {
		t.Fatal(n, s, err)
	}
	if _, _, err := ParsePortState("ACTIVE"); !errors.Is(err, ErrMalformed) {
		t.Fatal(err)
	}
	if v, err := ParseRate("2.5 Gb/sec (1X SDR)"); v != 2.5 || err != nil {
		t.Fatal(v, err)
	}
	if _, err := ParseRate("fast"); !errors.Is(err, ErrMalformed) {
		t.Fatal(err)
	}
	if n, err := ParseCPUList("0-27,56-83"); n != 56 || err != nil {
		t.Fatal(n, err)
	}
	if _, err := ParseCPUList("3-1"); !errors.Is(err, ErrMalformed) {
		t.Fatal(err)
	}
	for mtu, want := range map[int]int{1500: 1024, 9000: 4096, 4200: 4096, 4000: 2048, 300: 0} {
		if got := RoCEActiveMTU(mtu); got != want {
			t.Errorf("RoCEActiveMTU(%d) = %d, want %d", mtu, got, want)
		}
	}
	if m := ParseModules("nvidia_peermem 16384 0 - Live 0x0\nib_core 1 2 - Live 0x0\n"); !m["nvidia_peermem"] || !m["ib_core"] || m["nv_peer_mem"] {
		t.Fatal(m)
	}
}

func TestRootEscape(t *testing.T) {
	dir := t.TempDir()
	if err := os.Symlink("../../../../../../etc/passwd", filepath.Join(dir, "escape")); err != nil {
		t.Fatal(err)
	}
	r, err := OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := r.ReadFile("/escape"); !errors.Is(err, ErrOutsideRoot) {
		t.Fatalf("reading through an escaping link: %v, want ErrOutsideRoot", err)
	}
	if r.IsHost() {
		t.Fatal("temp dir taken for the host root")
	}
}

func TestELFExports(t *testing.T) {
	if _, err := ELFExports([]byte("not elf"), "x"); !errors.Is(err, ErrMalformed) {
		t.Fatal(err)
	}
	for _, p := range []string{"/usr/lib/x86_64-linux-gnu/libibverbs.so.1", "/usr/lib64/libibverbs.so.1"} {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		has, err := ELFExports(b, "ibv_reg_dmabuf_mr")
		if err != nil {
			t.Fatal(err)
		}
		open, _ := ELFExports(b, "ibv_open_device")
		if !open {
			t.Fatalf("%s does not export ibv_open_device: the symbol reader is broken", p)
		}
		t.Logf("%s exports ibv_reg_dmabuf_mr: %v", p, has)
		return
	}
	t.Skip("libibverbs.so.1 not installed (apt-get install libibverbs1)")
}

type memRecorder struct {
	files map[string]string
	links map[string]string
	dirs  map[string]bool
}

func (m *memRecorder) File(n string, b []byte) { m.files[n] = string(b) }
func (m *memRecorder) Link(n, t string)        { m.links[n] = t }
func (m *memRecorder) Dir(n string)            { m.dirs[n] = true }

func TestRecorder(t *testing.T) {
	r, err := OpenRoot("../../gdr/testdata/nodes/two-socket")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	m := &memRecorder{files: map[string]string{}, links: map[string]string{}, dirs: map[string]bool{}}
	r.SetRecorder(m)
	if _, err := r.ReadString("/sys/bus/pci/devices/0000:3b:00.0/numa_node"); err != nil {
		t.Fatal(err)
	}
	if got := m.links["/sys/bus/pci/devices/0000:3b:00.0"]; got != "../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0" {
		t.Errorf("link recorded as %q", got)
	}
	if got := m.files["/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/numa_node"]; got != "0\n" {
		t.Errorf("file recorded as %q (files %v)", got, m.files)
	}
	if _, err := r.ReadDir("/sys/class/infiniband"); err != nil || !m.dirs["/sys/class/infiniband"] {
		t.Errorf("dir not recorded: %v %v", err, m.dirs)
	}
}
