package gdr

import (
	"fmt"
	"sort"

	"github.com/dustin/go-humanize"

	"github.com/gdrlink/gdrlink/internal/sysfs"
)

// Mode is how tensors reach a GPU's memory over RDMA.
type Mode uint8

// Modes, worst first.
const (
	// Unavailable: no RDMA path at all (no usable NIC, no libibverbs,
	// memory cannot be registered).
	Unavailable Mode = iota
	// Proxy: the NIC writes a pinned host buffer and a copy moves the bytes
	// to the GPU.
	Proxy
	// Direct: the NIC reads and writes GPU memory (GPUDirect RDMA).
	Direct
)

var modeNames = [...]string{"unavailable", "proxy", "direct"}

// String names the mode.
func (m Mode) String() string {
	if int(m) < len(modeNames) {
		return modeNames[m]
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// MarshalText writes the name.
func (m Mode) MarshalText() ([]byte, error) { return []byte(m.String()), nil }

// unlimited is a limit without a bound.
const unlimited = sysfs.Unlimited

// minMemlock is the smallest RLIMIT_MEMLOCK with which decide expects
// registration of a pool's arenas to work.
const minMemlock = 64 << 20

// minBAR1 is the BAR1 aperture below which decide warns that large
// tensors cannot all be mapped for the NIC at once (consumer boards have 256
// MiB).
const minBAR1 = 1 << 30

// fixVerbs is the fix for a node without libibverbs.so.1.
const fixVerbs = "install rdma-core's libibverbs and its providers (Debian/Ubuntu: libibverbs1 ibverbs-providers; RHEL: libibverbs)"

// pairFacts is what decide needs about one GPU and one NIC.
type pairFacts struct {
	GPU  GPUFacts
	NIC  NICFacts
	Path PairPath
	// Verbs, PeerMem, DMABuf and Memlock are the node's.
	Verbs   Check
	PeerMem Check
	DMABuf  Check
	Memlock MemlockFacts
	// IOMMUMode is the node's IOMMU mode ("translated" slows peer traffic).
	IOMMUMode string
	// NUMANodes is the node's number of NUMA nodes.
	NUMANodes int
}

// Decision is the verdict for a GPU and the NIC it would use.
type Decision struct {
	GPU  int    `json:"gpu"`
	Mode Mode   `json:"mode"`
	NIC  string `json:"nic"`
	// PathType is the PCIe path between the GPU and the NIC.
	PathType PathType `json:"path_type"`
	// Mechanism is how the NIC reaches GPU memory when Direct
	// ("nvidia_peermem", "nv_peer_mem" or "dma-buf").
	Mechanism string `json:"mechanism"`
	// Reasons explain the mode; Fixes say what would make it better.
	Reasons []string `json:"reasons"`
	Fixes   []string `json:"fixes"`
}

// pairFactsOf gathers the facts about a GPU and a NIC from a node's facts.
func pairFactsOf(f *Facts, gpu int, nic string) (pairFacts, bool) {
	g := f.gpu(gpu)
	var n *NICFacts
	for i := range f.NICs {
		if f.NICs[i].Name == nic {
			n = &f.NICs[i]
		}
	}
	pp := f.pair(gpu, nic)
	if g == nil || n == nil || pp == nil {
		return pairFacts{}, false
	}
	return pairFacts{GPU: *g, NIC: *n, Path: *pp, Verbs: f.Verbs, PeerMem: f.PeerMem, DMABuf: f.DMABuf, Memlock: f.Memlock, IOMMUMode: f.IOMMU.Mode, NUMANodes: f.NUMANodes}, true
}

// decide turns the facts about one GPU and one NIC and a policy into a
// decision. It is a pure function: same facts, same decision.
func decide(pf pairFacts, p Policy) Decision {
	g, n := pf.GPU, pf.NIC
	d := Decision{GPU: g.Index, NIC: n.Name, PathType: pf.Path.Path, Reasons: []string{}, Fixes: []string{}}
	gname := fmt.Sprintf("GPU%d (%s)", g.Index, g.PCIBusID)
	reason := func(format string, a ...any) { d.Reasons = append(d.Reasons, fmt.Sprintf(format, a...)) }
	fix := func(format string, a ...any) { d.Fixes = append(d.Fixes, fmt.Sprintf(format, a...)) }

	// What rules out RDMA altogether. Every check runs even when an
	// earlier one has decided, so a person sees every fix at once.
	unavailable := false
	switch v := pf.Verbs; v.Status {
	case StatusNotSupported:
		unavailable = true
		reason("libibverbs: %s", v.Detail)
		fix("%s", fixVerbs)
	case StatusUnknown:
		reason("could not tell whether libibverbs is installed: %s", v.Detail)
	}
	if port := n.activePort(); port == nil {
		unavailable = true
		if len(n.Ports) == 0 {
			reason("%s has no ports in sysfs", n.Name)
			fix("check the driver of %s (dmesg; the mlx5_ib or rdma_rxe module)", n.Name)
		}
		for _, pt := range n.Ports {
			reason("%s port %d is %s (physical state %s)", n.Name, pt.Port, orUnknown(pt.State), orUnknown(pt.PhysState))
			net := ""
			if pt.Netdev != "" {
				net = " (netdev " + pt.Netdev + ": ip link set " + pt.Netdev + " up)"
			}
			fix("bring %s port %d up: check the cable, the switch port and the subnet manager%s", n.Name, pt.Port, net)
		}
	}
	switch m := pf.Memlock; {
	case m.Check.ok() && m.Soft != unlimited && m.Soft < minMemlock:
		unavailable = true
		reason("RLIMIT_MEMLOCK is %s: registering pool arenas with the NIC will fail", humanize.IBytes(uint64(m.Soft)))
		fix("raise memlock to unlimited (ulimit -l unlimited; LimitMEMLOCK=infinity in the systemd unit; \"* - memlock unlimited\" in /etc/security/limits.conf; --ulimit memlock=-1 for containers)")
	case m.Check.ok() && m.Soft != unlimited:
		reason("RLIMIT_MEMLOCK is %s: host arenas beyond it cannot be registered", humanize.IBytes(uint64(m.Soft)))
		fix("raise memlock to unlimited")
	case !m.Check.ok():
		reason("could not tell RLIMIT_MEMLOCK: %s", m.Check.Detail)
	}

	// What rules out Direct.
	direct := true
	if n.Software {
		direct = false
		reason("%s is a software RDMA device (%s): the CPU moves its bytes, it cannot reach GPU memory", n.Name, orUnknown(n.Driver))
		fix("use a hardware RDMA NIC for GPUDirect RDMA")
	}
	switch {
	case g.GDRSupported != nil && !*g.GDRSupported:
		direct = false
		reason("%s does not support GPUDirect RDMA (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED=0)", gname)
		fix("use a data-center GPU for GPUDirect RDMA (consumer boards do not support it)")
	case g.GDRSupported == nil:
		reason("could not tell whether %s supports GPUDirect RDMA (no CUDA device attribute)", gname)
	}
	if g.BAR1Total != nil && *g.BAR1Total < minBAR1 {
		reason("%s has a BAR1 aperture of only %s: the NIC can reach at most that much GPU memory at once", gname, humanize.IBytes(*g.BAR1Total))
		fix("enable Resizable BAR and above-4G decoding in the BIOS (data-center GPUs expose all their memory through BAR1)")
	}
	if g.PersistenceMode != nil && !*g.PersistenceMode {
		reason("persistence mode is off on %s: the driver may tear the GPU down between jobs, and registrations with it", gname)
		fix("turn persistence mode on (nvidia-smi -pm 1, or run nvidia-persistenced)")
	}
	// The mechanism that maps GPU memory for the NIC.
	switch {
	case pf.PeerMem.ok():
		d.Mechanism = pf.PeerMem.Detail
		if len(d.Mechanism) > 0 {
			d.Mechanism = firstWord(d.Mechanism)
		}
	case pf.DMABuf.ok() && (g.DMABufSupported == nil || *g.DMABufSupported):
		d.Mechanism = "dma-buf"
		if g.DMABufSupported == nil {
			reason("dma-buf: could not tell whether %s exports dma-bufs (no CUDA device attribute)", gname)
		}
	default:
		direct = false
		reason("no way to map GPU memory for the NIC: %s", pf.PeerMem.Detail)
		fix("load nvidia_peermem: modprobe nvidia-peermem (it ships with the NVIDIA driver; add it to /etc/modules-load.d)")
		switch {
		case g.DMABufSupported != nil && !*g.DMABufSupported:
			reason("dma-buf: %s cannot export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0; needs the open kernel modules)", gname)
			fix("or use the NVIDIA open kernel modules (nvidia-open) for dma-buf")
		case !pf.DMABuf.ok():
			reason("dma-buf: %s", pf.DMABuf.Detail)
			fix("or use dma-buf: kernel 5.12+ with CONFIG_DMA_SHARED_BUFFER, rdma-core 34+ and the NVIDIA open kernel modules")
		}
	}
	// The path, and whether ACS turns a switch path into a root complex one.
	eff := pf.Path.Path
	switch {
	case n.Software:
	case eff == PathUnknown:
		direct = false
		reason("could not tell the PCIe path between %s and %s: %s", gname, n.Name, pf.Path.Detail)
	default:
		reason("%s and %s: %s (%s)", gname, n.Name, eff, pf.Path.Detail)
		if len(pf.Path.ACSBridges) > 0 && (eff == PathPIX || eff == PathPXB) {
			eff = PathPHB
			for _, b := range pf.Path.ACSBridges {
				reason("ACS redirects peer traffic at bridge %s: it goes up through the root complex (%s in effect)", b, eff)
				fix("disable ACS on bridge %s (setpci -s %s ECAP_ACS+0x6.w=0000, or turn ACS off in the BIOS)", b, b)
			}
		}
		if len(pf.Path.ACSUnknown) > 0 {
			reason("could not read ACS on bridges %v (config space needs root)", pf.Path.ACSUnknown)
		}
		if eff > p.Level {
			direct = false
			reason("%s is farther than the policy level %s (%s)", eff, p.Level, orUnknown(p.LevelSource))
			if eff == PathSYS {
				fix("the NIC is on the other socket (GPU%d on NUMA node %s, %s on %s): use a NIC on the GPU's socket, or place the GPU's work there", g.Index, numa(g.NUMANode), n.Name, numa(n.NUMANode))
			}
			fix("or allow it: %s=%s (peer traffic through the CPU is often slower than the proxy)", EnvLevel, eff)
		}
	}
	if pf.IOMMUMode == "translated" {
		reason("the IOMMU translates DMA addresses: peer-to-peer traffic may be slow or blocked")
		fix("boot with iommu=pt (or intel_iommu=off / amd_iommu=off)")
	}
	switch {
	case unavailable:
		d.Mode = Unavailable
	case direct:
		d.Mode = Direct
	default:
		d.Mode = Proxy
	}
	return d
}

func firstWord(s string) string {
	for i, c := range s {
		if c == ' ' {
			return s[:i]
		}
	}
	return s
}

func numa(n *int) string {
	if n == nil {
		return "?"
	}
	return fmt.Sprint(*n)
}

// DecideGPUByBusID is DecideGPU for the GPU at a PCI bus id, as
// cuDeviceGetPCIBusId or NVML report it (any case, with or without the
// domain). A GPU's CUDA ordinal depends on CUDA_VISIBLE_DEVICES and
// CUDA_DEVICE_ORDER and its NVML index does not, so a caller that knows a
// GPU by its CUDA ordinal must decide by its bus id: the index in Facts is
// the index of the source that found the GPU. A bus id that does not parse
// or names no GPU of f gives Unavailable (GPU -1) with the reason.
func DecideGPUByBusID(f *Facts, busID string, p Policy) Decision {
	addr, err := sysfs.ParsePCIAddress(busID)
	if err != nil {
		return Decision{GPU: -1, Mode: Unavailable, Reasons: []string{fmt.Sprintf("GPU bus id %q: %v", busID, err)}, Fixes: []string{}}
	}
	for _, g := range f.GPUs {
		if g.PCIBusID == addr {
			return DecideGPU(f, g.Index, p)
		}
	}
	return Decision{GPU: -1, Mode: Unavailable, Reasons: []string{fmt.Sprintf("no GPU at %s", addr)}, Fixes: []string{}}
}

// DecideGPU decides for one GPU, named by its index in f (GPUFacts.Index:
// the NVML index, or the CUDA ordinal of the process that collected f when
// CUDA found it; not the caller's CUDA ordinal, see DecideGPUByBusID), over
// every NIC of the node and returns the best: Direct before Proxy before Unavailable, then the shortest path, then
// a NIC on the GPU's NUMA node, then the NIC's name. It is a pure function:
// same facts and policy, same decision. Every check runs even when an
// earlier one has decided, so the Decision lists every fix at once.
func DecideGPU(f *Facts, gpu int, p Policy) Decision {
	g := f.gpu(gpu)
	if g == nil {
		return Decision{GPU: gpu, Mode: Unavailable, Reasons: []string{fmt.Sprintf("no GPU %d", gpu)}, Fixes: []string{}}
	}
	if len(f.NICs) == 0 {
		return Decision{GPU: gpu, Mode: Unavailable, Reasons: []string{"no RDMA device: " + f.RDMA.Detail},
			Fixes: []string{"install an RDMA NIC with its driver (mlx5_core and mlx5_ib for ConnectX); transfers fall back to TCP"}}
	}
	var all []Decision
	for _, n := range f.NICs {
		pf, ok := pairFactsOf(f, gpu, n.Name)
		if !ok {
			continue
		}
		all = append(all, decide(pf, p))
	}
	local := func(d Decision) bool {
		for _, n := range f.NICs {
			if n.Name == d.NIC {
				return n.NUMANode != nil && g.NUMANode != nil && *n.NUMANode == *g.NUMANode
			}
		}
		return false
	}
	pathRank := func(t PathType) int {
		if t == PathUnknown {
			return 100
		}
		return int(t)
	}
	sort.SliceStable(all, func(i, j int) bool {
		a, b := all[i], all[j]
		if a.Mode != b.Mode {
			return a.Mode > b.Mode
		}
		if pathRank(a.PathType) != pathRank(b.PathType) {
			return pathRank(a.PathType) < pathRank(b.PathType)
		}
		if local(a) != local(b) {
			return local(a)
		}
		return a.NIC < b.NIC
	})
	return all[0]
}
