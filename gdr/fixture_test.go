package gdr

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"github.com/gdrlink/gdrlink/internal/sysfs"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the fixture trees under testdata/nodes from their specs")

// The fixture trees under testdata/nodes are node layouts written out as the
// kernel shows them: /sys/devices/pci*/... directories, relative symbolic
// links from /sys/bus/pci/devices and /sys/class/infiniband, and the procfs
// files gdr reads. The specs below are their source; TestFixtureTrees checks
// that the committed trees match them (go test ./gdr -run TestFixtureTrees
// -update rewrites them). Config space files are binary, as in sysfs: 264
// bytes, the standard header and one ACS extended capability at 0x100.

type fxDev struct {
	path    string // sysfs path below /sys/devices, "pci0000:15/0000:15:01.0/..."
	vendor  uint16
	device  uint16
	class   uint32
	numa    int
	cpus    string
	driver  string
	acsCtrl int // ACS control word for bridges; -1: no ACS capability
}

type fxGID struct {
	gid, typ, ndev string
}

type fxPort struct {
	state, phys, layer, rate string
	netdev                   string
	mtu                      int
	gids                     []fxGID
}

type fxNIC struct {
	name  string
	addr  string // "" for a software device
	fw    string
	ports []fxPort
}

type fxNode struct {
	name    string
	release string
	dmabufY bool
	modules []string
	memlock string
	numa    string
	iommu   string // group type, "" for no IOMMU
	groups  int
	huge    [3]uint64 // total, free, size in kB
	devs    []fxDev
	nics    []fxNIC
	facts   *snapshotFacts
	cmdline string
	noIBDir bool
	// verbs are the dynamic symbols of the libibverbs.so.1 installed under
	// /usr/lib/x86_64-linux-gnu (a link to the versioned file, as rdma-core
	// installs it); nil: no library file.
	verbs []string
}

// libibverbsDir is where a fixture installs libibverbs.so.1.
const libibverbsDir = "usr/lib/x86_64-linux-gnu"

// fakeELF returns a little-endian ELF64 shared object that holds only what
// sysfs.ELFExports reads: a dynamic symbol table defining syms (functions
// in the table's own section, which is enough for "defined") and its
// string table.
func fakeELF(syms ...string) []byte {
	le := binary.LittleEndian
	dynstr := []byte{0}
	var dynsym bytes.Buffer
	binary.Write(&dynsym, le, elf.Sym64{}) // the null symbol
	for _, s := range syms {
		binary.Write(&dynsym, le, elf.Sym64{Name: uint32(len(dynstr)), Info: elf.ST_INFO(elf.STB_GLOBAL, elf.STT_FUNC), Shndx: 1, Value: 0x1000, Size: 16})
		dynstr = append(append(dynstr, s...), 0)
	}
	shstr := []byte("\x00.dynsym\x00.dynstr\x00.shstrtab\x00")
	const ehsize, shentsize = 64, 64
	symOff := uint64(ehsize)
	strOff := symOff + uint64(dynsym.Len())
	shstrOff := strOff + uint64(len(dynstr))
	shoff := (shstrOff + uint64(len(shstr)) + 7) &^ 7
	var b bytes.Buffer
	h := elf.Header64{Type: uint16(elf.ET_DYN), Machine: uint16(elf.EM_X86_64), Version: uint32(elf.EV_CURRENT),
		Shoff: shoff, Ehsize: ehsize, Phentsize: 56, Shentsize: shentsize, Shnum: 4, Shstrndx: 3}
	copy(h.Ident[:], elf.ELFMAG)
	h.Ident[elf.EI_CLASS], h.Ident[elf.EI_DATA], h.Ident[elf.EI_VERSION] = byte(elf.ELFCLASS64), byte(elf.ELFDATA2LSB), byte(elf.EV_CURRENT)
	binary.Write(&b, le, h)
	b.Write(dynsym.Bytes())
	b.Write(dynstr)
	b.Write(shstr)
	b.Write(make([]byte, shoff-uint64(b.Len())))
	for _, sh := range []elf.Section64{
		{},
		{Name: 1, Type: uint32(elf.SHT_DYNSYM), Flags: uint64(elf.SHF_ALLOC), Off: symOff, Size: uint64(dynsym.Len()), Link: 2, Info: 1, Addralign: 8, Entsize: 24},
		{Name: 9, Type: uint32(elf.SHT_STRTAB), Flags: uint64(elf.SHF_ALLOC), Off: strOff, Size: uint64(len(dynstr)), Addralign: 1},
		{Name: 17, Type: uint32(elf.SHT_STRTAB), Off: shstrOff, Size: uint64(len(shstr)), Addralign: 1},
	} {
		binary.Write(&b, le, sh)
	}
	return b.Bytes()
}

func intp(v int) *int       { return &v }
func u64p(v uint64) *uint64 { return &v }
func boolp(v bool) *bool    { return &v }

// bridge and endpoint helpers.
func rootPort(p string, numa int, acs int) fxDev {
	return fxDev{path: p, vendor: 0x8086, device: 0x347a, class: 0x060400, numa: numa, driver: "pcieport", acsCtrl: acs}
}
func swPort(p string, numa int, acs int) fxDev {
	return fxDev{path: p, vendor: 0x10b5, device: 0xc010, class: 0x060400, numa: numa, driver: "pcieport", acsCtrl: acs}
}
func gpuDev(p string, numa int, device uint16, cpus string) fxDev {
	return fxDev{path: p, vendor: sysfs.VendorNVIDIA, device: device, class: 0x030200, numa: numa, cpus: cpus, driver: "nvidia", acsCtrl: -1}
}
func nicDev(p string, numa int, cpus string) fxDev {
	return fxDev{path: p, vendor: sysfs.VendorMellanox, device: 0x101b, class: 0x020700, numa: numa, cpus: cpus, driver: "mlx5_core", acsCtrl: -1}
}

func ibPort(state, phys string) fxPort {
	return fxPort{state: state, phys: phys, layer: "InfiniBand", rate: "400 Gb/sec (4X NDR)", gids: []fxGID{{gid: "fe80:0000:0000:0000:a088:c203:0012:3456"}}}
}

// dgxHalf is one socket of a DGX-style box: a root port, a PCIe switch
// with two second-level switches, GPU and NIC under one (PIX), another GPU
// under the other (PXB to the NIC).
func dgxHalf(hb string, bus byte, numa int, cpus string, acs int) []fxDev {
	a := func(b byte, d, f int) string {
		return fmt.Sprintf("%s:%02x:%02x.%x", strings.Replace(hb, "pci", "", 1)[:4], b, d, f)
	}
	rp := hb + "/" + a(bus, 1, 0)
	up := rp + "/" + a(bus+1, 0, 0)
	d0 := up + "/" + a(bus+2, 0, 0)
	d1 := up + "/" + a(bus+2, 1, 0)
	s2 := d0 + "/" + a(bus+3, 0, 0)
	s2d0 := s2 + "/" + a(bus+4, 0, 0)
	s2d1 := s2 + "/" + a(bus+4, 1, 0)
	s3 := d1 + "/" + a(bus+7, 0, 0)
	s3d0 := s3 + "/" + a(bus+8, 0, 0)
	return []fxDev{
		rootPort(rp, numa, 0), swPort(up, numa, -1), swPort(d0, numa, acs), swPort(d1, numa, acs),
		swPort(s2, numa, -1), swPort(s2d0, numa, acs), swPort(s2d1, numa, acs),
		swPort(s3, numa, -1), swPort(s3d0, numa, acs),
		gpuDev(s2d0+"/"+a(bus+5, 0, 0), numa, 0x2330, cpus),
		nicDev(s2d1+"/"+a(bus+6, 0, 0), numa, cpus),
		gpuDev(s3d0+"/"+a(bus+9, 0, 0), numa, 0x2330, cpus),
	}
}

func h100(idx int, bus string, numa int) GPUFacts {
	return GPUFacts{Index: idx, Name: "NVIDIA H100 80GB HBM3", PCIBusID: bus, NUMANode: intp(numa), BAR1Total: u64p(128 << 30), BAR1Free: u64p(127 << 30),
		PersistenceMode: boolp(true), GDRSupported: boolp(true), DMABufSupported: boolp(true), Source: "nvml"}
}

func fixtureSpecs() []fxNode {
	dgxGPUs := &gpuInventory{Driver: GPUDriverFacts{DriverVersion: "550.54.15", CUDAVersion: "12.4"},
		GPUs: []GPUFacts{h100(0, "0000:1a:00.0", 0), h100(1, "0000:1e:00.0", 0), h100(2, "0000:9c:00.0", 1), h100(3, "0000:a0:00.0", 1)}}
	for a := 0; a < 4; a++ {
		for b := a + 1; b < 4; b++ {
			dgxGPUs.Topology = append(dgxGPUs.Topology, GPUTopology{A: a, B: b, Path: PathSYS, NVLinks: 18})
		}
	}
	dgxDevs := append(dgxHalf("pci0000:15", 0x15, 0, "0-55,112-167", 0), dgxHalf("pci0000:97", 0x97, 1, "56-111,168-223", 0)...)
	dgxNICs := []fxNIC{
		{name: "mlx5_0", addr: "0000:1b:00.0", fw: "28.39.1002", ports: []fxPort{ibPort("4: ACTIVE", "5: LinkUp")}},
		{name: "mlx5_1", addr: "0000:9d:00.0", fw: "28.39.1002", ports: []fxPort{ibPort("4: ACTIVE", "5: LinkUp")}},
	}
	base := []string{"nvidia", "nvidia_uvm", "ib_core", "ib_uverbs", "rdma_ucm", "mlx5_ib", "mlx5_core"}
	roce := func(netdev string, mtu int, ip string) fxPort {
		return fxPort{state: "4: ACTIVE", phys: "5: LinkUp", layer: "Ethernet", rate: "100 Gb/sec (2X HDR)", netdev: netdev, mtu: mtu, gids: []fxGID{
			{gid: "fe80:0000:0000:0000:0e42:a1ff:fe6b:7c10", typ: "IB/RoCE v1", ndev: netdev},
			{gid: "fe80:0000:0000:0000:0e42:a1ff:fe6b:7c10", typ: "RoCE v2", ndev: netdev},
			{gid: "0000:0000:0000:0000:0000:ffff:" + ip, typ: "IB/RoCE v1", ndev: netdev},
			{gid: "0000:0000:0000:0000:0000:ffff:" + ip, typ: "RoCE v2", ndev: netdev},
		}}
	}
	brokenDevs := dgxHalf("pci0000:15", 0x15, 0, "0-31", 0x001d)
	lib := "/" + libibverbsDir + "/libibverbs.so.1"
	dmabufLib := &Check{Status: StatusAvailable, Detail: "ibv_reg_dmabuf_mr in " + lib}
	noLib := &Check{Status: StatusNotSupported, Detail: "libibverbs.so.1 not found (rdma-core's libibverbs is not installed)"}
	return []fxNode{
		{
			name: "dgx", release: "5.15.0-105-generic", dmabufY: true, modules: append(base, "nvidia_peermem"), memlock: "unlimited",
			numa: "0-1", iommu: "identity", groups: 4, huge: [3]uint64{0, 0, 2048}, devs: dgxDevs, nics: dgxNICs,
			facts: &snapshotFacts{Version: snapshotFactsVersion, GPUs: dgxGPUs, LibIBVerbs: dmabufLib,
				Verbs: &Check{Status: StatusAvailable, Detail: "libibverbs.so.1 at " + lib}},
		},
		{
			name: "two-socket", release: "6.1.0-18-amd64", dmabufY: true, modules: append(base, "nvidia_peermem"), memlock: "unlimited",
			numa: "0-1", iommu: "", huge: [3]uint64{1024, 1024, 2048},
			devs: []fxDev{
				rootPort("pci0000:00/0000:00:01.0", 0, 0), gpuDev("pci0000:00/0000:00:01.0/0000:01:00.0", 0, 0x20b5, "0-23,48-71"),
				rootPort("pci0000:3a/0000:3a:00.0", 0, 0), gpuDev("pci0000:3a/0000:3a:00.0/0000:3b:00.0", 0, 0x20b5, "0-23,48-71"),
				rootPort("pci0000:d7/0000:d7:00.0", 1, 0), nicDev("pci0000:d7/0000:d7:00.0/0000:d8:00.0", 1, "24-47,72-95"),
			},
			nics:  []fxNIC{{name: "mlx5_0", addr: "0000:d8:00.0", fw: "20.38.1900", ports: []fxPort{roce("ens5f0np0", 9000, "0a00:0005")}}},
			verbs: []string{"ibv_open_device", "ibv_reg_mr", "ibv_reg_dmabuf_mr"},
		},
		{
			name: "cloud-vm", release: "6.8.0-1015-aws", dmabufY: true, modules: base, memlock: "unlimited",
			numa: "0", iommu: "", huge: [3]uint64{0, 0, 2048},
			devs: []fxDev{
				gpuDev("pci0000:00/0000:00:1e.0", -1, 0x2237, "0-47"),
				nicDev("pci0000:00/0000:00:06.0", -1, "0-47"),
				gpuDev("pci0000:10/0000:10:00.0", -1, 0x2237, "0-47"),
			},
			nics: []fxNIC{{name: "mlx5_0", addr: "0000:00:06.0", fw: "16.35.2000", ports: []fxPort{roce("eth1", 1500, "ac1f:0a0b")}}},
			// A snapshot from before the libibverbs fact: Collect derives
			// it from the dma-buf check.
			facts: &snapshotFacts{Version: snapshotFactsVersion, LibIBVerbs: dmabufLib,
				GPUSource: &Check{Status: StatusNotSupported, Detail: "NVML not available: libnvidia-ml.so.1 not found"}},
		},
		{
			name: "no-gpu", release: "6.1.0-18-amd64", dmabufY: true, modules: []string{"ib_core", "ib_uverbs", "mlx5_ib", "mlx5_core"}, memlock: "unlimited",
			numa: "0", iommu: "DMA-FQ", groups: 2, huge: [3]uint64{0, 0, 2048},
			devs: []fxDev{rootPort("pci0000:00/0000:00:02.0", 0, 0), nicDev("pci0000:00/0000:00:02.0/0000:01:00.0", 0, "0-15")},
			nics: []fxNIC{{name: "mlx5_0", addr: "0000:01:00.0", fw: "22.36.1010", ports: []fxPort{roce("ens1np0", 4200, "0a00:0009")}}},
			// rdma-core older than 34: libibverbs without ibv_reg_dmabuf_mr.
			verbs: []string{"ibv_open_device", "ibv_reg_mr"},
		},
		{
			name: "no-rdma", release: "6.1.0-18-amd64", dmabufY: true, modules: []string{"nvidia", "nvidia_uvm"}, memlock: "8388608",
			numa: "0", iommu: "", huge: [3]uint64{0, 0, 2048},
			devs: []fxDev{rootPort("pci0000:00/0000:00:01.0", 0, 0), gpuDev("pci0000:00/0000:00:01.0/0000:01:00.0", 0, 0x26b9, "0-15")},
		},
		{
			name: "broken", release: "5.4.0-150-generic", dmabufY: true, modules: base, memlock: "65536",
			numa: "0", iommu: "DMA", groups: 3, huge: [3]uint64{0, 0, 2048}, devs: brokenDevs,
			nics: []fxNIC{
				{name: "mlx5_0", addr: "0000:1b:00.0", fw: "28.39.1002", ports: []fxPort{ibPort("1: DOWN", "3: Disabled")}},
			},
			// rdma-core is not installed: a snapshot of the node records it.
			facts: &snapshotFacts{Version: snapshotFactsVersion, LibIBVerbs: noLib, Verbs: noLib},
		},
	}
}

type fxEntry struct {
	data []byte
	link string
	dir  bool
}

// render turns a spec into the files of its tree.
func (n fxNode) render() map[string]fxEntry {
	out := map[string]fxEntry{}
	file := func(p, s string) { out[p] = fxEntry{data: []byte(s + "\n")} }
	link := func(p, target string) { out[p] = fxEntry{link: target} }
	dotdots := func(p string) string { return strings.Repeat("../", strings.Count(path.Dir(p), "/")+1) }
	for _, d := range n.devs {
		dir := "sys/devices/" + d.path
		addr := path.Base(d.path)
		file(dir+"/vendor", fmt.Sprintf("0x%04x", d.vendor))
		file(dir+"/device", fmt.Sprintf("0x%04x", d.device))
		file(dir+"/class", fmt.Sprintf("0x%06x", d.class))
		file(dir+"/numa_node", fmt.Sprint(d.numa))
		if d.cpus != "" {
			file(dir+"/local_cpulist", d.cpus)
		}
		if d.driver != "" {
			file("sys/bus/pci/drivers/"+d.driver+"/uevent", "DRIVER="+d.driver)
			link(dir+"/driver", dotdots(dir+"/driver")+"bus/pci/drivers/"+d.driver)
		}
		if d.class>>8 == sysfs.ClassPCIBridge {
			cfg := make([]byte, 0x108)
			binary.LittleEndian.PutUint16(cfg[0:], d.vendor)
			binary.LittleEndian.PutUint16(cfg[2:], d.device)
			cfg[0x0b], cfg[0x0a] = byte(d.class>>16), byte(d.class>>8)
			cfg[0x0e] = 0x01 // header type 1: bridge
			if d.acsCtrl >= 0 {
				binary.LittleEndian.PutUint32(cfg[0x100:], 0x000d|1<<16)
				binary.LittleEndian.PutUint16(cfg[0x104:], 0x005f)
				binary.LittleEndian.PutUint16(cfg[0x106:], uint16(d.acsCtrl))
			}
			out[dir+"/config"] = fxEntry{data: cfg}
		}
		link("sys/bus/pci/devices/"+addr, "../../../devices/"+d.path)
	}
	for _, nic := range n.nics {
		var devPath string
		for _, d := range n.devs {
			if path.Base(d.path) == nic.addr {
				devPath = d.path
			}
		}
		ib := "sys/devices/" + devPath + "/infiniband/" + nic.name
		link("sys/class/infiniband/"+nic.name, "../../devices/"+devPath+"/infiniband/"+nic.name)
		link(ib+"/device", "../../../"+nic.addr)
		file(ib+"/fw_ver", nic.fw)
		file(ib+"/node_type", "1: CA")
		for i, p := range nic.ports {
			pd := fmt.Sprintf("%s/ports/%d", ib, i+1)
			file(pd+"/state", p.state)
			file(pd+"/phys_state", p.phys)
			file(pd+"/link_layer", p.layer)
			file(pd+"/rate", p.rate)
			for gi := 0; gi < 4; gi++ {
				g := fxGID{gid: "0000:0000:0000:0000:0000:0000:0000:0000"}
				if gi < len(p.gids) {
					g = p.gids[gi]
				}
				file(fmt.Sprintf("%s/gids/%d", pd, gi), g.gid)
				if g.typ != "" {
					file(fmt.Sprintf("%s/gid_attrs/types/%d", pd, gi), g.typ)
					file(fmt.Sprintf("%s/gid_attrs/ndevs/%d", pd, gi), g.ndev)
				}
			}
			if p.netdev != "" {
				nd := "sys/devices/" + devPath + "/net/" + p.netdev
				file(nd+"/mtu", fmt.Sprint(p.mtu))
				link("sys/class/net/"+p.netdev, "../../devices/"+devPath+"/net/"+p.netdev)
			}
		}
	}
	var mods strings.Builder
	for _, m := range n.modules {
		fmt.Fprintf(&mods, "%s 16384 0 - Live 0x0000000000000000\n", m)
	}
	file("proc/modules", strings.TrimSuffix(mods.String(), "\n"))
	for _, m := range n.modules {
		file("sys/module/"+m+"/initstate", "live")
	}
	file("proc/self/limits", fmt.Sprintf("Limit                     Soft Limit           Hard Limit           Units     \n"+
		"Max open files            1048576              1048576              files     \n"+
		"Max locked memory         %-20s %-20s bytes     ", n.memlock, n.memlock))
	file("proc/meminfo", fmt.Sprintf("MemTotal:       2113451008 kB\nMemFree:        2013451008 kB\nHugePages_Total:    %d\nHugePages_Free:     %d\nHugepagesize:       %d kB", n.huge[0], n.huge[1], n.huge[2]))
	file("proc/sys/kernel/osrelease", n.release)
	cmd := n.cmdline
	if cmd == "" {
		cmd = "BOOT_IMAGE=/vmlinuz-" + n.release + " ro quiet"
	}
	file("proc/cmdline", cmd)
	dmabuf := "# CONFIG_DMA_SHARED_BUFFER is not set"
	if n.dmabufY {
		dmabuf = "CONFIG_DMA_SHARED_BUFFER=y"
	}
	file("boot/config-"+n.release, "CONFIG_PCI=y\nCONFIG_INFINIBAND=m\n"+dmabuf+"\nCONFIG_PCI_P2PDMA=y")
	file("sys/devices/system/node/online", n.numa)
	file("sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never")
	if n.iommu != "" {
		for g := 0; g < n.groups; g++ {
			file(fmt.Sprintf("sys/kernel/iommu_groups/%d/type", g), n.iommu)
		}
	}
	if n.verbs != nil {
		file := libibverbsDir + "/libibverbs.so.1.14.44.0"
		out[file] = fxEntry{data: fakeELF(n.verbs...)}
		link(libibverbsDir+"/libibverbs.so.1", path.Base(file))
	}
	if n.facts != nil {
		b, _ := json.MarshalIndent(n.facts, "", "  ")
		file(strings.TrimPrefix(snapshotFactsFile, "/"), string(b))
	}
	return out
}

// readTree reads a tree the way render describes one.
func readTree(t *testing.T, dir string) map[string]fxEntry {
	out := map[string]fxEntry{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		switch {
		case rel == ".":
		case d.Type()&fs.ModeSymlink != 0:
			l, err := os.Readlink(p)
			if err != nil {
				return err
			}
			out[filepath.ToSlash(rel)] = fxEntry{link: l}
		case d.IsDir():
			if ents, _ := os.ReadDir(p); len(ents) == 0 {
				out[filepath.ToSlash(rel)] = fxEntry{dir: true}
			}
		default:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			out[filepath.ToSlash(rel)] = fxEntry{data: b}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func writeTree(t *testing.T, dir string, files map[string]fxEntry) {
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		e, p := files[n], filepath.Join(dir, filepath.FromSlash(n))
		var err error
		switch {
		case e.dir:
			err = os.MkdirAll(p, 0o755)
		case e.link != "":
			if err = os.MkdirAll(filepath.Dir(p), 0o755); err == nil {
				err = os.Symlink(e.link, p)
			}
		default:
			if err = os.MkdirAll(filepath.Dir(p), 0o755); err == nil {
				err = os.WriteFile(p, e.data, 0o644)
			}
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// normalize drops empty-directory entries that a later file fills.
func normalize(m map[string]fxEntry) map[string]fxEntry {
	out := map[string]fxEntry{}
	for k, v := range m {
		if v.dir {
			full := false
			for k2 := range m {
				if strings.HasPrefix(k2, k+"/") {
					full = true
					break
				}
			}
			if full {
				continue
			}
		}
		out[k] = v
	}
	return out
}

func TestFixtureTrees(t *testing.T) {
	for _, n := range fixtureSpecs() {
		dir := filepath.Join("testdata", "nodes", n.name)
		want := normalize(n.render())
		if *update {
			writeTree(t, dir, want)
			continue
		}
		got := readTree(t, dir)
		for k, w := range want {
			g, ok := got[k]
			switch {
			case !ok:
				t.Errorf("%s: %s missing (go test ./gdr -run TestFixtureTrees -update)", n.name, k)
			case g.link != w.link || g.dir != w.dir || !bytes.Equal(g.data, w.data):
				t.Errorf("%s: %s differs from its spec", n.name, k)
			}
		}
		for k := range got {
			if _, ok := want[k]; !ok {
				t.Errorf("%s: %s is not in the spec", n.name, k)
			}
		}
	}
}

// fixtureRoot opens a committed fixture tree.
func fixtureRoot(t testing.TB, name string) *sysfs.Root {
	t.Helper()
	r, err := sysfs.OpenRoot(filepath.Join("testdata", "nodes", name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}
