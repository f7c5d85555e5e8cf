package gdr

import (
	"bytes"
	"compress/gzip"
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"
)

// SnapshotFactsFile is where a snapshot keeps the facts that are not files
// (NVML's answers, what libibverbs exports), relative to the root.
const SnapshotFactsFile = "/gdrlink/facts.json"

// SnapshotFactsVersion is the version of the SnapshotFacts format.
const SnapshotFactsVersion = 1

// SnapshotFacts is the content of SnapshotFactsFile.
type SnapshotFacts struct {
	Version int `json:"version"`
	// GPUs is what the node's GPU source reported, nil when it had none.
	GPUs *GPUInventory `json:"gpus,omitempty"`
	// GPUSource is the outcome of asking the node's GPU source.
	GPUSource *Check `json:"gpu_source,omitempty"`
	// LibIBVerbs is the outcome of the libibverbs dma-buf probe.
	LibIBVerbs *Check `json:"libibverbs_dmabuf,omitempty"`
}

// ParseSnapshotFacts decodes SnapshotFactsFile's content.
func ParseSnapshotFacts(b []byte) (*SnapshotFacts, error) {
	var s SnapshotFacts
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&s); err != nil {
		return nil, fmt.Errorf("%w: snapshot facts: %w", ErrMalformed, err)
	}
	if s.Version != SnapshotFactsVersion {
		return nil, fmt.Errorf("%w: snapshot facts version %d, want %d", ErrMalformed, s.Version, SnapshotFactsVersion)
	}
	if s.GPUs != nil {
		for i, g := range s.GPUs.GPUs {
			a, err := ParsePCIAddress(g.PCIBusID)
			if err != nil {
				return nil, fmt.Errorf("%w: snapshot GPU %d: %w", ErrMalformed, g.Index, err)
			}
			s.GPUs.GPUs[i].PCIBusID = a
		}
	}
	return &s, nil
}

// CollectOptions says where Collect gets what files cannot tell.
type CollectOptions struct {
	// GPUSources are asked in order: the first that works lists the GPUs,
	// later ones fill fields the earlier left unknown (matched by PCI bus
	// id). When none works, GPUs come from the PCI tree.
	GPUSources []GPUSource
	// NoLive skips live probes of this process and node (getrlimit,
	// libibverbs) even when the root is "/".
	NoLive bool
}

// InterestingModules are the kernel modules Collect reports.
var interestingModules = []string{"nvidia", "nvidia_peermem", "nv_peer_mem", "ib_core", "ib_uverbs", "rdma_ucm", "mlx5_ib", "rdma_rxe"}

// Collect reads the facts of the node under root. It fails only when the
// context ends; whatever cannot be read becomes an unknown Check or a note.
func Collect(ctx context.Context, root *Root, opts CollectOptions) (*Facts, error) {
	f := &Facts{Root: root.Dir()}
	live := root.IsHost() && !opts.NoLive
	var snap *SnapshotFacts
	if b, err := root.ReadFile(SnapshotFactsFile); err == nil {
		if snap, err = ParseSnapshotFacts(b); err != nil {
			f.Notes = append(f.Notes, err.Error())
		}
	}
	steps := []func(){
		func() {
			pci, notes, err := ReadPCIDevices(root)
			if err != nil {
				f.Notes = append(f.Notes, "PCI devices: "+err.Error())
			}
			f.PCI, f.Notes = pci, append(f.Notes, notes...)
		},
		func() { f.NUMANodes = readNUMANodes(root) },
		func() { f.Kernel = readKernel(root) },
		func() { f.Modules, f.PeerMem = readModules(root) },
		func() {
			switch {
			case snap != nil && snap.LibIBVerbs != nil:
				f.LibIBVerbs = *snap.LibIBVerbs
			default:
				f.LibIBVerbs = probeLibIBVerbs(root)
			}
			f.DMABuf = combineDMABuf(f.Kernel.DMABuf, f.LibIBVerbs)
		},
		func() { f.Memlock = readMemlock(root, live) },
		func() { f.Hugepages = readHugepages(root) },
		func() { f.IOMMU = readIOMMU(root) },
		func() { collectGPUs(f, root, snap, opts.GPUSources) },
		func() { f.NICs, f.RDMA = readNICs(root, f.PCI) },
		func() { computePairs(f) },
	}
	for _, step := range steps {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		step()
	}
	return f, nil
}

func readNUMANodes(root *Root) int {
	s, err := root.ReadString("/sys/devices/system/node/online")
	if err != nil {
		return 0
	}
	n, err := ParseCPUList(s)
	if err != nil {
		return 0
	}
	return n
}

func readKernel(root *Root) KernelFacts {
	var k KernelFacts
	rel, err := root.ReadString("/proc/sys/kernel/osrelease")
	if err != nil {
		k.DMABuf = CheckOf(err, "")
		return k
	}
	k.Release = rel
	maj, min, err := ParseKernelRelease(rel)
	if err != nil {
		k.DMABuf = CheckOf(err, "")
		return k
	}
	if maj < 5 || maj == 5 && min < 12 {
		k.DMABuf = Missing("kernel %s is older than 5.12, the first with dma-buf registration for RDMA", rel)
		return k
	}
	cfg, src, err := readKernelConfig(root, rel)
	if err != nil {
		k.DMABuf = Check{Status: StatusUnknown, Detail: fmt.Sprintf("kernel %s is recent enough, but its config could not be read to check CONFIG_DMA_SHARED_BUFFER: %v", rel, err)}
		return k
	}
	switch v := ParseKernelConfig(cfg, "CONFIG_DMA_SHARED_BUFFER"); v {
	case "y":
		k.DMABuf = Available(fmt.Sprintf("kernel %s with CONFIG_DMA_SHARED_BUFFER=y (%s)", rel, src))
	default:
		k.DMABuf = Missing("kernel %s built without CONFIG_DMA_SHARED_BUFFER (%s)", rel, src)
	}
	return k
}

func readKernelConfig(root *Root, rel string) (string, string, error) {
	if b, err := root.ReadFile("/boot/config-" + rel); err == nil {
		return string(b), "/boot/config-" + rel, nil
	}
	b, err := root.ReadFile("/proc/config.gz")
	if err != nil {
		return "", "", fmt.Errorf("neither /boot/config-%s nor /proc/config.gz", rel)
	}
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		return "", "", fmt.Errorf("%w: /proc/config.gz: %w", ErrMalformed, err)
	}
	out, err := io.ReadAll(io.LimitReader(zr, maxFileSize))
	if err != nil {
		return "", "", fmt.Errorf("%w: /proc/config.gz: %w", ErrMalformed, err)
	}
	return string(out), "/proc/config.gz", nil
}

func readModules(root *Root) ([]ModuleFacts, Check) {
	text, err := root.ReadString("/proc/modules")
	var loaded map[string]bool
	if err == nil {
		loaded = ParseModules(text)
	}
	var out []ModuleFacts
	for _, m := range interestingModules {
		l := loaded[m] || root.Exists("/sys/module/"+m+"/initstate")
		out = append(out, ModuleFacts{Name: m, Loaded: l})
	}
	switch {
	case loaded["nvidia_peermem"] || root.Exists("/sys/module/nvidia_peermem/initstate"):
		return out, Available("nvidia_peermem is loaded")
	case loaded["nv_peer_mem"] || root.Exists("/sys/module/nv_peer_mem/initstate"):
		return out, Available("nv_peer_mem is loaded")
	case err != nil:
		return out, Check{Status: StatusUnknown, Detail: "cannot read /proc/modules: " + err.Error()}
	}
	return out, Missing("neither nvidia_peermem nor nv_peer_mem is loaded")
}

// libDirs are where libibverbs.so.1 is looked for, under the root.
var libDirs = []string{"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64", "/usr/lib", "/lib"}

// probeLibIBVerbs looks for ibv_reg_dmabuf_mr (rdma-core 34 and later) in
// the dynamic symbols of libibverbs.so.1 under the root.
func probeLibIBVerbs(root *Root) Check {
	for _, d := range libDirs {
		p := d + "/libibverbs.so.1"
		b, err := root.ReadFile(p)
		if err != nil {
			continue
		}
		has, err := ELFExports(b, "ibv_reg_dmabuf_mr")
		switch {
		case err != nil:
			return Check{Status: StatusUnknown, Detail: fmt.Sprintf("%s: %v", p, err)}
		case has:
			return Available("ibv_reg_dmabuf_mr in " + p)
		default:
			return Missing("%s has no ibv_reg_dmabuf_mr (rdma-core older than 34)", p)
		}
	}
	if !root.IsHost() {
		return Check{Status: StatusUnknown, Detail: "no libibverbs.so.1 under the root and no snapshot facts about it"}
	}
	return Missing("libibverbs.so.1 not found (rdma-core's libibverbs is not installed)")
}

// ELFExports reports whether an ELF shared object's dynamic symbol table
// defines sym.
func ELFExports(image []byte, sym string) (bool, error) {
	ef, err := elf.NewFile(bytes.NewReader(image))
	if err != nil {
		return false, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	defer ef.Close()
	syms, err := ef.DynamicSymbols()
	if err != nil {
		return false, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	for _, s := range syms {
		if s.Name == sym && s.Section != elf.SHN_UNDEF {
			return true, nil
		}
	}
	return false, nil
}

func combineDMABuf(kernel, lib Check) Check {
	switch {
	case kernel.OK() && lib.OK():
		return Available(kernel.Detail + "; " + lib.Detail)
	case kernel.Status == StatusNotSupported:
		return kernel
	case lib.Status == StatusNotSupported:
		return lib
	case !kernel.OK():
		return kernel
	}
	return lib
}

func readMemlock(root *Root, live bool) MemlockFacts {
	var m MemlockFacts
	if live {
		if soft, hard, err := getMemlock(); err == nil {
			return MemlockFacts{Check: Available("getrlimit(RLIMIT_MEMLOCK) of this process"), Soft: soft, Hard: hard, Live: true}
		}
	}
	text, err := root.ReadString("/proc/self/limits")
	if err != nil {
		m.Check = CheckOf(err, "")
		return m
	}
	lim, err := ParseLimits(text)
	if err != nil {
		m.Check = CheckOf(err, "")
		return m
	}
	l, ok := lim["Max locked memory"]
	if !ok {
		m.Check = Check{Status: StatusUnknown, Detail: "no \"Max locked memory\" row in /proc/self/limits"}
		return m
	}
	m.Check, m.Soft, m.Hard = Available("/proc/self/limits"), l.Soft, l.Hard
	return m
}

func readHugepages(root *Root) HugepageFacts {
	var h HugepageFacts
	text, err := root.ReadString("/proc/meminfo")
	if err != nil {
		h.Check = CheckOf(err, "")
		return h
	}
	mi, err := ParseMeminfo(text)
	if err != nil {
		h.Check = CheckOf(err, "")
		return h
	}
	h.Total, h.Free, h.Size = mi["HugePages_Total"], mi["HugePages_Free"], mi["Hugepagesize"]
	h.THP, _ = root.ReadString("/sys/kernel/mm/transparent_hugepage/enabled")
	if h.Total == 0 {
		h.Check = Missing("no huge pages reserved (vm.nr_hugepages=0)")
	} else {
		h.Check = Available(fmt.Sprintf("%d of %d huge pages free", h.Free, h.Total))
	}
	return h
}

func readIOMMU(root *Root) IOMMUFacts {
	var io IOMMUFacts
	groups, err := root.ReadDir("/sys/kernel/iommu_groups")
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		io.Check = CheckOf(err, "")
		return io
	}
	io.Groups = len(groups)
	if len(groups) == 0 {
		io.Mode, io.Check = "off", Missing("no IOMMU groups: the IOMMU is off or absent")
		return io
	}
	types := map[string]int{}
	for _, g := range groups {
		if t, err := root.ReadString("/sys/kernel/iommu_groups/" + g + "/type"); err == nil {
			types[t]++
		}
	}
	switch {
	case types["identity"] > 0 && types["DMA"]+types["DMA-FQ"] == 0:
		io.Mode = "passthrough"
	case types["DMA"]+types["DMA-FQ"] > 0:
		io.Mode = "translated"
	default:
		if cmd, err := root.ReadString("/proc/cmdline"); err == nil && (strings.Contains(cmd, "iommu=pt") || strings.Contains(cmd, "iommu.passthrough=1")) {
			io.Mode = "passthrough"
		}
	}
	io.Check = Available(fmt.Sprintf("%d IOMMU groups, mode %s", len(groups), orUnknown(io.Mode)))
	return io
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

func collectGPUs(f *Facts, root *Root, snap *SnapshotFacts, sources []GPUSource) {
	var tried []string
	var inv *GPUInventory
	srcName := ""
	if snap != nil && snap.GPUs != nil {
		inv, srcName = snap.GPUs, "snapshot"
		for i := range inv.GPUs {
			if inv.GPUs[i].Source == "" {
				inv.GPUs[i].Source = "snapshot"
			}
		}
	} else if snap != nil && snap.GPUSource != nil {
		tried = append(tried, snap.GPUSource.Detail)
	}
	if inv == nil && root.IsHost() {
		for _, s := range sources {
			got, err := s.GPUs()
			if err != nil {
				msg := strings.Replace(err.Error(), ErrNotSupported.Error()+": ", "", 1)
				if !strings.HasPrefix(msg, s.Name()+": ") {
					msg = s.Name() + ": " + msg
				}
				tried = append(tried, msg)
				continue
			}
			if inv == nil {
				inv, srcName = &got, s.Name()
				continue
			}
			fillGPUs(inv, got)
		}
	} else if inv != nil && root.IsHost() {
		for _, s := range sources {
			if got, err := s.GPUs(); err == nil {
				fillGPUs(inv, got)
			}
		}
	}
	if inv != nil {
		f.Driver, f.GPUs, f.GPUTopology = inv.Driver, inv.GPUs, inv.Topology
		f.GPUSource = Available(fmt.Sprintf("%d GPUs from %s", len(inv.GPUs), srcName))
	} else {
		idx := 0
		addrs := make([]string, 0, len(f.PCI))
		for a := range f.PCI {
			addrs = append(addrs, a)
		}
		sort.Strings(addrs)
		for _, a := range addrs {
			d := f.PCI[a]
			if !d.IsGPU() {
				continue
			}
			f.GPUs = append(f.GPUs, GPUFacts{Index: idx, PCIBusID: a, NUMANode: d.NUMANode, Source: "pci"})
			idx++
		}
		f.GPUSourceWhy = strings.Join(tried, "; ")
		if len(tried) == 0 && !root.IsHost() {
			f.GPUSourceWhy = "no NVML data under the root"
		}
		why := ""
		if f.GPUSourceWhy != "" {
			why = " (" + f.GPUSourceWhy + ")"
		}
		if len(f.GPUs) == 0 {
			f.GPUSource = Missing("no NVIDIA GPU on the PCI bus%s", why)
		} else {
			f.GPUSource = Available(fmt.Sprintf("%d GPUs from the PCI tree%s", len(f.GPUs), why))
		}
	}
	for i := range f.GPUs {
		g := &f.GPUs[i]
		d := f.PCI[g.PCIBusID]
		switch {
		case d == nil && len(f.PCI) > 0:
			f.Notes = append(f.Notes, fmt.Sprintf("GPU%d's PCI address %s is not in the PCI tree", g.Index, g.PCIBusID))
		case d != nil && !d.IsGPU():
			f.Notes = append(f.Notes, fmt.Sprintf("GPU%d's PCI address %s is a %04x:%04x class %06x device in the PCI tree, not a GPU", g.Index, g.PCIBusID, d.Vendor, d.Device, d.Class))
		case d != nil && g.NUMANode == nil:
			g.NUMANode = d.NUMANode
		}
	}
	f.Notes = append(f.Notes, CrossCheckTopology(f)...)
}

// CrossCheckTopology compares what NVML says of each GPU pair with the path
// the PCI tree gives, and returns a note for each disagreement. NVLink
// pairs are not compared.
func CrossCheckTopology(f *Facts) []string {
	var notes []string
	for _, t := range f.GPUTopology {
		a, b := f.GPU(t.A), f.GPU(t.B)
		if a == nil || b == nil || t.Path == PathUnknown || t.NVLinks > 0 {
			continue
		}
		da, db := f.PCI[a.PCIBusID], f.PCI[b.PCIBusID]
		if da == nil || db == nil {
			continue
		}
		if p, _ := ClassifyPath(da.Path, db.Path, da.NUMANode, db.NUMANode, f.NUMANodes); p != t.Path {
			notes = append(notes, fmt.Sprintf("NVML says GPU%d-GPU%d is %s, the PCI tree says %s", t.A, t.B, t.Path, p))
		}
	}
	return notes
}

// fillGPUs fills unknown fields of inv's GPUs from another source's.
func fillGPUs(inv *GPUInventory, more GPUInventory) {
	for _, m := range more.GPUs {
		for i := range inv.GPUs {
			g := &inv.GPUs[i]
			if g.PCIBusID != m.PCIBusID {
				continue
			}
			if g.Name == "" {
				g.Name = m.Name
			}
			if g.NUMANode == nil {
				g.NUMANode = m.NUMANode
			}
			if g.BAR1Total == nil {
				g.BAR1Total, g.BAR1Free = m.BAR1Total, m.BAR1Free
			}
			if g.PersistenceMode == nil {
				g.PersistenceMode = m.PersistenceMode
			}
			if g.GDRSupported == nil {
				g.GDRSupported = m.GDRSupported
			}
			if g.DMABufSupported == nil {
				g.DMABufSupported = m.DMABufSupported
			}
		}
	}
	if inv.Driver.DriverVersion == "" {
		inv.Driver.DriverVersion = more.Driver.DriverVersion
	}
	if inv.Driver.CUDAVersion == "" {
		inv.Driver.CUDAVersion = more.Driver.CUDAVersion
	}
}

func readNICs(root *Root, pci map[string]*PCIDevice) ([]NICFacts, Check) {
	const cls = "/sys/class/infiniband"
	names, err := root.ReadDir(cls)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, Missing("no %s: no RDMA device, or the ib_core module is not loaded", cls)
	}
	if err != nil {
		return nil, CheckOf(err, "")
	}
	var out []NICFacts
	for _, n := range names {
		out = append(out, readNIC(root, pci, n))
	}
	if len(out) == 0 {
		return nil, Missing("%s is empty: no RDMA device", cls)
	}
	return out, Available(fmt.Sprintf("%d RDMA device(s)", len(out)))
}

func readNIC(root *Root, pci map[string]*PCIDevice, name string) NICFacts {
	dir := "/sys/class/infiniband/" + name
	n := NICFacts{Name: name}
	target, _ := root.Readlink(dir)
	if strings.Contains(target, "/virtual/") || strings.HasPrefix(name, "rxe") || strings.HasPrefix(name, "siw") {
		n.Software = true
		n.Driver = strings.TrimRight(name, "0123456789")
	}
	if t, err := root.Readlink(dir + "/device"); err == nil && !n.Software {
		if a, err := ParsePCIAddress(path.Base(t)); err == nil {
			n.PCIAddress = a
		}
	}
	if d := pci[n.PCIAddress]; d != nil {
		n.NUMANode, n.LocalCPUs, n.Driver = d.NUMANode, d.LocalCPUs, d.Driver
	}
	n.FWVersion, _ = root.ReadString(dir + "/fw_ver")
	ports, _ := root.ReadDir(dir + "/ports")
	for _, p := range ports {
		num, err := strconv.Atoi(p)
		if err != nil {
			continue
		}
		n.Ports = append(n.Ports, readPort(root, dir+"/ports/"+p, num))
	}
	sort.Slice(n.Ports, func(i, j int) bool { return n.Ports[i].Port < n.Ports[j].Port })
	if n.PCIAddress != "" {
		if nets, err := root.ReadDir("/sys/bus/pci/devices/" + n.PCIAddress + "/net"); err == nil && len(nets) > 0 {
			for i := range n.Ports {
				if n.Ports[i].Netdev == "" && i < len(nets) {
					n.Ports[i].Netdev = nets[i]
				}
			}
		}
	}
	for i := range n.Ports {
		p := &n.Ports[i]
		if p.LinkLayer == "Ethernet" && p.Netdev != "" {
			if s, err := root.ReadString("/sys/class/net/" + p.Netdev + "/mtu"); err == nil {
				if mtu, err := strconv.Atoi(s); err == nil {
					v := RoCEActiveMTU(mtu)
					p.ActiveMTU = &v
				}
			}
		}
	}
	return n
}

func readPort(root *Root, dir string, num int) PortFacts {
	p := PortFacts{Port: num}
	if s, err := root.ReadString(dir + "/state"); err == nil {
		if _, name, err := ParsePortState(s); err == nil {
			p.State = name
		}
	}
	if s, err := root.ReadString(dir + "/phys_state"); err == nil {
		if _, name, err := ParsePortState(s); err == nil {
			p.PhysState = name
		}
	}
	p.LinkLayer, _ = root.ReadString(dir + "/link_layer")
	p.Rate, _ = root.ReadString(dir + "/rate")
	if v, err := ParseRate(p.Rate); err == nil {
		p.RateGbps = &v
	}
	gids, _ := root.ReadDir(dir + "/gids")
	idx := make([]int, 0, len(gids))
	for _, g := range gids {
		if i, err := strconv.Atoi(g); err == nil {
			idx = append(idx, i)
		}
	}
	sort.Ints(idx)
	for _, i := range idx {
		s := strconv.Itoa(i)
		v, err := root.ReadString(dir + "/gids/" + s)
		if err != nil || isZeroGID(v) {
			continue
		}
		g := GID{Index: i, GID: v}
		g.Type, _ = root.ReadString(dir + "/gid_attrs/types/" + s)
		g.Netdev, _ = root.ReadString(dir + "/gid_attrs/ndevs/" + s)
		if p.Netdev == "" {
			p.Netdev = g.Netdev
		}
		p.GIDs = append(p.GIDs, g)
	}
	return p
}

func isZeroGID(s string) bool {
	return strings.Trim(s, "0:") == ""
}

func computePairs(f *Facts) {
	for _, g := range f.GPUs {
		for _, n := range f.NICs {
			pp := PairPath{GPU: g.Index, NIC: n.Name, Bridges: []string{}, ACSBridges: []string{}, ACSUnknown: []string{}}
			dg, dn := f.PCI[g.PCIBusID], f.PCI[n.PCIAddress]
			switch {
			case n.Software:
				pp.Detail = n.Name + " is a software RDMA device, not on the PCI bus"
			case dg == nil:
				pp.Detail = fmt.Sprintf("GPU%d (%s) is not in the PCI tree", g.Index, g.PCIBusID)
			case dn == nil:
				pp.Detail = fmt.Sprintf("%s (%q) is not in the PCI tree", n.Name, n.PCIAddress)
			default:
				pp.Path, pp.Detail = ClassifyPath(dg.Path, dn.Path, firstNonNil(g.NUMANode, dg.NUMANode), dn.NUMANode, f.NUMANodes)
				if pp.Path == PathPIX || pp.Path == PathPXB {
					pp.Bridges = BridgesBetween(dg.Path, dn.Path)
					for _, b := range pp.Bridges {
						bd := f.PCI[b]
						switch {
						case bd == nil || bd.ACSErr != "":
							pp.ACSUnknown = append(pp.ACSUnknown, b)
						case bd.ACS.RedirectsP2P():
							pp.ACSBridges = append(pp.ACSBridges, b)
						}
					}
				}
			}
			f.Pairs = append(f.Pairs, pp)
		}
	}
}

func firstNonNil(a, b *int) *int {
	if a != nil {
		return a
	}
	return b
}
