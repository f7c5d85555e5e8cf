package gdr

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/gdrlink/gdrlink/internal/ibv"
	"github.com/gdrlink/gdrlink/internal/sysfs"
)

// snapshotFactsFile is where a snapshot keeps the facts that are not files
// (NVML's answers, what libibverbs exports), relative to the root.
const snapshotFactsFile = "/gdrlink/facts.json"

// snapshotFactsVersion is the version of the snapshotFacts format.
const snapshotFactsVersion = 1

// snapshotFacts is the content of snapshotFactsFile.
type snapshotFacts struct {
	Version int `json:"version"`
	// GPUs is what the node's GPU source reported, nil when it had none.
	GPUs *gpuInventory `json:"gpus,omitempty"`
	// GPUSource is the outcome of asking the node's GPU source.
	GPUSource *Check `json:"gpu_source,omitempty"`
	// LibIBVerbs is the outcome of the libibverbs dma-buf probe.
	LibIBVerbs *Check `json:"libibverbs_dmabuf,omitempty"`
	// Verbs is whether libibverbs.so.1 was installed (Facts.Verbs). A
	// snapshot taken before gdrcheck had this fact lacks it;
	// snapshotLibIBVerbs then derives it from LibIBVerbs.
	Verbs *Check `json:"libibverbs,omitempty"`
}

// snapshotLibIBVerbs returns the two libibverbs checks a snapshot records,
// Facts.Verbs and Facts.LibIBVerbs, and false when it records neither (the
// root is then probed). A snapshot that has one of them only gets the other
// derived:
//   - no Verbs (gdrcheck before it): the library was there when the dma-buf
//     check found ibv_reg_dmabuf_mr in it; any other dma-buf outcome does
//     not tell, since "not supported" is either no library or an rdma-core
//     older than 34, so Verbs is unknown.
//   - no LibIBVerbs (written by hand): no library means no
//     ibv_reg_dmabuf_mr either; a library says nothing of its symbols, so
//     the dma-buf check is unknown.
func snapshotLibIBVerbs(s *snapshotFacts) (verbs, dmabuf Check, ok bool) {
	switch {
	case s == nil || s.Verbs == nil && s.LibIBVerbs == nil:
		return Check{}, Check{}, false
	case s.Verbs != nil && s.LibIBVerbs != nil:
		return *s.Verbs, *s.LibIBVerbs, true
	case s.Verbs == nil && s.LibIBVerbs.ok():
		return available("the snapshot's dma-buf check found " + s.LibIBVerbs.Detail), *s.LibIBVerbs, true
	case s.Verbs == nil:
		return Check{Status: StatusUnknown, Detail: fmt.Sprintf("the snapshot predates this check, and its dma-buf check does not tell (%s: %s)", s.LibIBVerbs.Status, s.LibIBVerbs.Detail)}, *s.LibIBVerbs, true
	case s.Verbs.Status == StatusNotSupported:
		return *s.Verbs, *s.Verbs, true
	}
	return *s.Verbs, Check{Status: StatusUnknown, Detail: "the snapshot records libibverbs but not whether it has ibv_reg_dmabuf_mr"}, true
}

// parseSnapshotFacts decodes snapshotFactsFile's content.
func parseSnapshotFacts(b []byte) (*snapshotFacts, error) {
	var s snapshotFacts
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&s); err != nil {
		return nil, fmt.Errorf("%w: snapshot facts: %w", sysfs.ErrMalformed, err)
	}
	if s.Version != snapshotFactsVersion {
		return nil, fmt.Errorf("%w: snapshot facts version %d, want %d", sysfs.ErrMalformed, s.Version, snapshotFactsVersion)
	}
	if s.GPUs != nil {
		for i, g := range s.GPUs.GPUs {
			a, err := sysfs.ParsePCIAddress(g.PCIBusID)
			if err != nil {
				return nil, fmt.Errorf("%w: snapshot GPU %d: %w", sysfs.ErrMalformed, g.Index, err)
			}
			s.GPUs.GPUs[i].PCIBusID = a
		}
	}
	return &s, nil
}

// snapshotFactsOf is what a snapshot of f's node records besides files:
// the snapshot-facts file's name under the root and its content.
func snapshotFactsOf(f *Facts) (string, []byte, error) {
	why := missing("%s", f.GPUSourceWhy)
	sf := snapshotFacts{Version: snapshotFactsVersion, GPUSource: &why, LibIBVerbs: &f.LibIBVerbs, Verbs: &f.Verbs}
	if len(f.GPUs) > 0 && f.GPUs[0].Source != "pci" {
		sf.GPUs = &gpuInventory{Driver: f.Driver, GPUs: f.GPUs, Topology: f.GPUTopology}
	}
	b, err := json.MarshalIndent(sf, "", "  ")
	if err != nil {
		return "", nil, err
	}
	return snapshotFactsFile, append(b, '\n'), nil
}

// CollectOptions says where Collect reads a node from.
type CollectOptions struct {
	// Root is the directory that stands for the node's "/": "" or "/" for
	// this node, /host in a container that mounts the host there, or a copy
	// of another node's tree (a gdrcheck snapshot).
	Root string
	// NoLive skips live probes of this process and node (getrlimit,
	// libibverbs) even when the root is "/".
	NoLive bool
	// Recorder, when not nil, is told everything Collect reads under the
	// root, to copy the node.
	Recorder Recorder

	// sources replace the GPU sources asked on this node (tests).
	sources []gpuSource
}

// Recorder is told what Collect reads under the root, so that the node can
// be copied (gdrcheck's snapshot command archives what it was told). Names
// are absolute paths inside the root with symbolic links resolved; each
// link followed or read on the way is reported with its target. When
// collection ends, a Recorder is also told one file that was not read,
// /gdrlink/facts.json: what Collect learned other than from files (the
// answers of NVML and the CUDA driver, the libibverbs probe), which Collect
// reads back from a root that has it. Collect calls a Recorder from one
// goroutine.
type Recorder interface {
	// File is a regular file that was read, and its content.
	File(name string, data []byte)
	// Link is a symbolic link that was followed or read, and its target.
	Link(name, target string)
	// Dir is a directory that was listed.
	Dir(name string)
}

// interestingModules are the kernel modules Collect reports.
var interestingModules = []string{"nvidia", "nvidia_peermem", "nv_peer_mem", "ib_core", "ib_uverbs", "rdma_ucm", "mlx5_ib", "rdma_rxe"}

// Collect reads the facts of the node under opts.Root: its sysfs and procfs
// files and, when the root is this node's own "/", what NVML and the CUDA
// driver (both loaded at run time, when present) say of its GPUs. It fails
// only when the root cannot be opened or the context ends; whatever cannot
// be read becomes an unknown Check or a note.
func Collect(ctx context.Context, opts CollectOptions) (*Facts, error) {
	root, err := sysfs.OpenRoot(opts.Root)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	if opts.Recorder != nil {
		root.SetRecorder(opts.Recorder)
	}
	f, _, err := collect(ctx, root, opts)
	if err != nil || opts.Recorder == nil {
		return f, err
	}
	name, b, err := snapshotFactsOf(f)
	if err != nil {
		return nil, fmt.Errorf("gdr: snapshot facts: %w", err)
	}
	opts.Recorder.File(name, b)
	return f, nil
}

// collect reads the facts of the node under root, and returns the PCI
// devices read on the way too (gdrcheck prints their topology and ACS).
func collect(ctx context.Context, root *sysfs.Root, opts CollectOptions) (*Facts, map[string]*sysfs.PCIDevice, error) {
	f := &Facts{Root: root.Dir()}
	sources := opts.sources
	if sources == nil {
		sources = []gpuSource{nvmlSource{}, cudaSource{}}
	}
	var pci map[string]*sysfs.PCIDevice
	live := root.IsHost() && !opts.NoLive
	var snap *snapshotFacts
	if b, err := root.ReadFile(snapshotFactsFile); err == nil {
		if snap, err = parseSnapshotFacts(b); err != nil {
			f.Notes = append(f.Notes, err.Error())
		}
	}
	steps := []func(){
		func() {
			devs, notes, err := sysfs.ReadPCIDevices(root)
			if err != nil {
				f.Notes = append(f.Notes, "PCI devices: "+err.Error())
			}
			pci, f.Notes = devs, append(f.Notes, notes...)
		},
		func() { f.NUMANodes = readNUMANodes(root) },
		func() { f.Kernel = readKernel(root) },
		func() { f.Modules, f.PeerMem = readModules(root) },
		func() {
			var ok bool
			if f.Verbs, f.LibIBVerbs, ok = snapshotLibIBVerbs(snap); !ok {
				f.Verbs, f.LibIBVerbs = probeLibIBVerbs(root)
			}
			f.DMABuf = combineDMABuf(f.Kernel.DMABuf, f.LibIBVerbs)
		},
		func() { f.Memlock = readMemlock(root, live) },
		func() { f.Hugepages = readHugepages(root) },
		func() { f.IOMMU = readIOMMU(root) },
		func() { collectGPUs(f, root, snap, sources, pci) },
		func() { f.NICs, f.RDMA = readNICs(root, pci) },
		func() { computePairs(f, pci) },
	}
	for _, step := range steps {
		if err := ctx.Err(); err != nil {
			return nil, nil, err
		}
		step()
	}
	return f, pci, nil
}

func readNUMANodes(root *sysfs.Root) int {
	s, err := root.ReadString("/sys/devices/system/node/online")
	if err != nil {
		return 0
	}
	n, err := sysfs.ParseCPUList(s)
	if err != nil {
		return 0
	}
	return n
}

func readKernel(root *sysfs.Root) KernelFacts {
	var k KernelFacts
	rel, err := root.ReadString("/proc/sys/kernel/osrelease")
	if err != nil {
		k.DMABuf = checkOf(err, "")
		return k
	}
	k.Release = rel
	maj, min, err := sysfs.ParseKernelRelease(rel)
	if err != nil {
		k.DMABuf = checkOf(err, "")
		return k
	}
	if maj < 5 || maj == 5 && min < 12 {
		k.DMABuf = missing("kernel %s is older than 5.12, the first with dma-buf registration for RDMA", rel)
		return k
	}
	cfg, src, err := readKernelConfig(root, rel)
	if err != nil {
		k.DMABuf = Check{Status: StatusUnknown, Detail: fmt.Sprintf("kernel %s is recent enough, but its config could not be read to check CONFIG_DMA_SHARED_BUFFER: %v", rel, err)}
		return k
	}
	switch v := sysfs.ParseKernelConfig(cfg, "CONFIG_DMA_SHARED_BUFFER"); v {
	case "y":
		k.DMABuf = available(fmt.Sprintf("kernel %s with CONFIG_DMA_SHARED_BUFFER=y (%s)", rel, src))
	default:
		k.DMABuf = missing("kernel %s built without CONFIG_DMA_SHARED_BUFFER (%s)", rel, src)
	}
	return k
}

func readKernelConfig(root *sysfs.Root, rel string) (string, string, error) {
	if b, err := root.ReadFile("/boot/config-" + rel); err == nil {
		return string(b), "/boot/config-" + rel, nil
	}
	b, err := root.ReadFile("/proc/config.gz")
	if err != nil {
		return "", "", fmt.Errorf("neither /boot/config-%s nor /proc/config.gz", rel)
	}
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		return "", "", fmt.Errorf("%w: /proc/config.gz: %w", sysfs.ErrMalformed, err)
	}
	out, err := io.ReadAll(io.LimitReader(zr, sysfs.MaxFileSize))
	if err != nil {
		return "", "", fmt.Errorf("%w: /proc/config.gz: %w", sysfs.ErrMalformed, err)
	}
	return string(out), "/proc/config.gz", nil
}

func readModules(root *sysfs.Root) ([]ModuleFacts, Check) {
	text, err := root.ReadString("/proc/modules")
	var loaded map[string]bool
	if err == nil {
		loaded = sysfs.ParseModules(text)
	}
	var out []ModuleFacts
	for _, m := range interestingModules {
		l := loaded[m] || root.Exists("/sys/module/"+m+"/initstate")
		out = append(out, ModuleFacts{Name: m, Loaded: l})
	}
	switch {
	case loaded["nvidia_peermem"] || root.Exists("/sys/module/nvidia_peermem/initstate"):
		return out, available("nvidia_peermem is loaded")
	case loaded["nv_peer_mem"] || root.Exists("/sys/module/nv_peer_mem/initstate"):
		return out, available("nv_peer_mem is loaded")
	case err != nil:
		return out, Check{Status: StatusUnknown, Detail: "cannot read /proc/modules: " + err.Error()}
	}
	return out, missing("neither nvidia_peermem nor nv_peer_mem is loaded")
}

// libDirs are where libibverbs.so.1 is looked for, under the root.
var libDirs = []string{"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64", "/usr/lib", "/lib"}

// probeLibIBVerbs looks for libibverbs.so.1 in libDirs under the root and
// reads the first it finds once, for both checks that hang on it: whether
// the library is installed (Facts.Verbs), and whether its dynamic symbols
// have ibv_reg_dmabuf_mr, rdma-core 34 and later (Facts.LibIBVerbs). When
// none is found but one could not be read (unreadable, or behind an
// absolute symbolic link, which a Root does not follow), both checks are
// unknown rather than missing. Not finding the library is conclusive only
// on this node's own root: a copy of another node leaves shared libraries
// out and records the checks in its snapshot facts instead.
func probeLibIBVerbs(root *sysfs.Root) (verbs, dmabuf Check) {
	var unreadable error
	for _, d := range libDirs {
		p := d + "/libibverbs.so.1"
		b, err := root.ReadFile(p)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			continue
		case err != nil:
			if unreadable == nil {
				unreadable = err
			}
			continue
		}
		return libIBVerbsChecks(p, b)
	}
	switch {
	case unreadable != nil:
		c := Check{Status: StatusUnknown, Detail: "libibverbs.so.1 could not be read: " + unreadable.Error()}
		return c, c
	case !root.IsHost():
		c := Check{Status: StatusUnknown, Detail: "no libibverbs.so.1 under the root and no snapshot facts about it"}
		return c, c
	}
	return liveLibIBVerbs()
}

// liveLibIBVerbs asks this process's dynamic loader, on the live host, for
// the libibverbs the standard directories lack: one found through
// ld.so.conf, LD_LIBRARY_PATH or $GDRLINK_LIBIBVERBS is what gdrlink would
// load, so it counts as installed.
func liveLibIBVerbs() (verbs, dmabuf Check) {
	path, lacks, err := ibv.LibraryInfo()
	if err != nil {
		c := missing("%v", err)
		return c, c
	}
	verbs = available(path + " loaded by the dynamic loader (outside the standard directories)")
	if slices.Contains(lacks, "ibv_reg_dmabuf_mr") {
		return verbs, missing("%s has no ibv_reg_dmabuf_mr (rdma-core older than 34)", path)
	}
	return verbs, available("ibv_reg_dmabuf_mr in " + path + " (loaded)")
}

// libIBVerbsChecks are the checks that libibverbs.so.1, read at path p
// with content image, answers: the library is installed unless the file is
// not a shared library with dynamic symbols (the loader could not use it
// either, so both checks are unknown); and it has ibv_reg_dmabuf_mr or not.
func libIBVerbsChecks(p string, image []byte) (verbs, dmabuf Check) {
	has, err := sysfs.ELFExports(image, "ibv_reg_dmabuf_mr")
	switch {
	case err != nil:
		c := Check{Status: StatusUnknown, Detail: fmt.Sprintf("%s: %v", p, err)}
		return c, c
	case has:
		return available("libibverbs.so.1 at " + p), available("ibv_reg_dmabuf_mr in " + p)
	}
	return available("libibverbs.so.1 at " + p), missing("%s has no ibv_reg_dmabuf_mr (rdma-core older than 34)", p)
}

func combineDMABuf(kernel, lib Check) Check {
	switch {
	case kernel.ok() && lib.ok():
		return available(kernel.Detail + "; " + lib.Detail)
	case kernel.Status == StatusNotSupported:
		return kernel
	case lib.Status == StatusNotSupported:
		return lib
	case !kernel.ok():
		return kernel
	}
	return lib
}

func readMemlock(root *sysfs.Root, live bool) MemlockFacts {
	var m MemlockFacts
	if live {
		if soft, hard, err := getMemlock(); err == nil {
			return MemlockFacts{Check: available("getrlimit(RLIMIT_MEMLOCK) of this process"), Soft: soft, Hard: hard, Live: true}
		}
	}
	text, err := root.ReadString("/proc/self/limits")
	if err != nil {
		m.Check = checkOf(err, "")
		return m
	}
	lim, err := sysfs.ParseLimits(text)
	if err != nil {
		m.Check = checkOf(err, "")
		return m
	}
	l, ok := lim["Max locked memory"]
	if !ok {
		m.Check = Check{Status: StatusUnknown, Detail: "no \"Max locked memory\" row in /proc/self/limits"}
		return m
	}
	m.Check, m.Soft, m.Hard = available("/proc/self/limits"), l.Soft, l.Hard
	return m
}

func readHugepages(root *sysfs.Root) HugepageFacts {
	var h HugepageFacts
	text, err := root.ReadString("/proc/meminfo")
	if err != nil {
		h.Check = checkOf(err, "")
		return h
	}
	mi, err := sysfs.ParseMeminfo(text)
	if err != nil {
		h.Check = checkOf(err, "")
		return h
	}
	h.Total, h.Free, h.Size = mi["HugePages_Total"], mi["HugePages_Free"], mi["Hugepagesize"]
	h.THP, _ = root.ReadString("/sys/kernel/mm/transparent_hugepage/enabled")
	if h.Total == 0 {
		h.Check = missing("no huge pages reserved (vm.nr_hugepages=0)")
	} else {
		h.Check = available(fmt.Sprintf("%d of %d huge pages free", h.Free, h.Total))
	}
	return h
}

func readIOMMU(root *sysfs.Root) IOMMUFacts {
	var io IOMMUFacts
	groups, err := root.ReadDir("/sys/kernel/iommu_groups")
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		io.Check = checkOf(err, "")
		return io
	}
	io.Groups = len(groups)
	if len(groups) == 0 {
		io.Mode, io.Check = "off", missing("no IOMMU groups: the IOMMU is off or absent")
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
	io.Check = available(fmt.Sprintf("%d IOMMU groups, mode %s", len(groups), orUnknown(io.Mode)))
	return io
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

func collectGPUs(f *Facts, root *sysfs.Root, snap *snapshotFacts, sources []gpuSource, pci map[string]*sysfs.PCIDevice) {
	var tried []string
	var inv *gpuInventory
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
		f.GPUSource = available(fmt.Sprintf("%d GPUs from %s", len(inv.GPUs), srcName))
	} else {
		idx := 0
		addrs := make([]string, 0, len(pci))
		for a := range pci {
			addrs = append(addrs, a)
		}
		sort.Strings(addrs)
		for _, a := range addrs {
			d := pci[a]
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
			f.GPUSource = missing("no NVIDIA GPU on the PCI bus%s", why)
		} else {
			f.GPUSource = available(fmt.Sprintf("%d GPUs from the PCI tree%s", len(f.GPUs), why))
		}
	}
	for i := range f.GPUs {
		g := &f.GPUs[i]
		d := pci[g.PCIBusID]
		switch {
		case d == nil && len(pci) > 0:
			f.Notes = append(f.Notes, fmt.Sprintf("GPU%d's PCI address %s is not in the PCI tree", g.Index, g.PCIBusID))
		case d != nil && !d.IsGPU():
			f.Notes = append(f.Notes, fmt.Sprintf("GPU%d's PCI address %s is a %04x:%04x class %06x device in the PCI tree, not a GPU", g.Index, g.PCIBusID, d.Vendor, d.Device, d.Class))
		case d != nil && g.NUMANode == nil:
			g.NUMANode = d.NUMANode
		}
	}
	f.Notes = append(f.Notes, crossCheckTopology(f, pci)...)
}

// crossCheckTopology compares what NVML says of each GPU pair with the path
// the PCI tree gives, and returns a note for each disagreement. NVLink
// pairs are not compared.
func crossCheckTopology(f *Facts, pci map[string]*sysfs.PCIDevice) []string {
	var notes []string
	for _, t := range f.GPUTopology {
		a, b := f.gpu(t.A), f.gpu(t.B)
		if a == nil || b == nil || t.Path == PathUnknown || t.NVLinks > 0 {
			continue
		}
		da, db := pci[a.PCIBusID], pci[b.PCIBusID]
		if da == nil || db == nil {
			continue
		}
		if p := classifyPath(da.Path, db.Path, da.NUMANode, db.NUMANode, f.NUMANodes); p != t.Path {
			notes = append(notes, fmt.Sprintf("NVML says GPU%d-GPU%d is %s, the PCI tree says %s", t.A, t.B, t.Path, p))
		}
	}
	return notes
}

// fillGPUs fills unknown fields of inv's GPUs from another source's.
func fillGPUs(inv *gpuInventory, more gpuInventory) {
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

func readNICs(root *sysfs.Root, pci map[string]*sysfs.PCIDevice) ([]NICFacts, Check) {
	const cls = "/sys/class/infiniband"
	names, err := root.ReadDir(cls)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, missing("no %s: no RDMA device, or the ib_core module is not loaded", cls)
	}
	if err != nil {
		return nil, checkOf(err, "")
	}
	var out []NICFacts
	for _, n := range names {
		out = append(out, readNIC(root, pci, n))
	}
	if len(out) == 0 {
		return nil, missing("%s is empty: no RDMA device", cls)
	}
	return out, available(fmt.Sprintf("%d RDMA device(s)", len(out)))
}

func readNIC(root *sysfs.Root, pci map[string]*sysfs.PCIDevice, name string) NICFacts {
	dir := "/sys/class/infiniband/" + name
	n := NICFacts{Name: name}
	target, _ := root.Readlink(dir)
	if strings.Contains(target, "/virtual/") || strings.HasPrefix(name, "rxe") || strings.HasPrefix(name, "siw") {
		n.Software = true
		n.Driver = strings.TrimRight(name, "0123456789")
	}
	if t, err := root.Readlink(dir + "/device"); err == nil && !n.Software {
		if a, err := sysfs.ParsePCIAddress(path.Base(t)); err == nil {
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
					v := sysfs.RoCEActiveMTU(mtu)
					p.ActiveMTU = &v
				}
			}
		}
	}
	return n
}

func readPort(root *sysfs.Root, dir string, num int) PortFacts {
	p := PortFacts{Port: num}
	if s, err := root.ReadString(dir + "/state"); err == nil {
		if _, name, err := sysfs.ParsePortState(s); err == nil {
			p.State = name
		}
	}
	if s, err := root.ReadString(dir + "/phys_state"); err == nil {
		if _, name, err := sysfs.ParsePortState(s); err == nil {
			p.PhysState = name
		}
	}
	p.LinkLayer, _ = root.ReadString(dir + "/link_layer")
	p.Rate, _ = root.ReadString(dir + "/rate")
	if v, err := sysfs.ParseRate(p.Rate); err == nil {
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

func computePairs(f *Facts, pci map[string]*sysfs.PCIDevice) {
	for _, g := range f.GPUs {
		for _, n := range f.NICs {
			pp := PairPath{GPU: g.Index, NIC: n.Name, Bridges: []string{}, ACSBridges: []string{}, ACSUnknown: []string{}}
			dg, dn := pci[g.PCIBusID], pci[n.PCIAddress]
			switch {
			case n.Software:
				pp.Detail = n.Name + " is a software RDMA device, not on the PCI bus"
			case dg == nil:
				pp.Detail = fmt.Sprintf("GPU%d (%s) is not in the PCI tree", g.Index, g.PCIBusID)
			case dn == nil:
				pp.Detail = fmt.Sprintf("%s (%q) is not in the PCI tree", n.Name, n.PCIAddress)
			default:
				name, detail := sysfs.ClassifyPath(dg.Path, dn.Path, firstNonNil(g.NUMANode, dg.NUMANode), dn.NUMANode, f.NUMANodes)
				pp.Path, pp.Detail = pathTypeOf(name), detail
				if pp.Path == PathPIX || pp.Path == PathPXB {
					pp.Bridges = sysfs.BridgesBetween(dg.Path, dn.Path)
					for _, b := range pp.Bridges {
						bd := pci[b]
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
