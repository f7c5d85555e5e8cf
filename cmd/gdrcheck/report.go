package main

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/gdrlink/gdrlink/gdr"
	"github.com/gdrlink/gdrlink/internal/sysfs"
)

// SchemaVersion is the version of the JSON report (schema.json). It changes
// only when a field is removed or changes meaning; new fields may appear in
// any version.
const SchemaVersion = 1

// Exit codes.
const (
	exitReady    = 0 // every GPU can use GPUDirect RDMA (or no GPU, RDMA usable)
	exitDegraded = 1 // some GPU must go through a CPU proxy
	exitNotReady = 2 // some GPU has no RDMA path, no RDMA at all, or an error
)

// Report is what gdrcheck prints, as JSON with --json.
type Report struct {
	SchemaVersion int    `json:"schema_version"`
	Verdict       string `json:"verdict"`
	ExitCode      int    `json:"exit_code"`
	Summary       string `json:"summary"`
	// Source is the --root argument, "" for this node.
	Source string     `json:"source"`
	Policy gdr.Policy `json:"policy"`
	*gdr.Facts
	Process   *ProcessFacts  `json:"process"`
	JobAuth   JobAuth        `json:"job_auth"` // gdrcheck's environment, not --root's
	ACS       []ACSFinding   `json:"acs"`
	Topology  Topology       `json:"topology"`
	Decisions []gdr.Decision `json:"decisions"`
	Selftest  *Selftest      `json:"selftest,omitempty"`

	// pci holds the PCI devices read from sysfs, by address.
	pci map[string]*sysfs.PCIDevice
}

// ProcessFacts is where this process may run.
type ProcessFacts struct {
	CPUsAllowed string `json:"cpus_allowed"`
	MemsAllowed string `json:"mems_allowed"`
}

// ACSFinding is a bridge between a GPU and a NIC and its ACS state.
type ACSFinding struct {
	Bridge string `json:"bridge"`
	// Control is the ACS control word, nil when it could not be read.
	Control *uint16 `json:"control"`
	// Redirects reports that peer traffic is forced up to the root complex.
	Redirects bool   `json:"redirects"`
	Error     string `json:"error,omitempty"`
	// Between names the GPU and NIC pairs whose path crosses the bridge.
	Between []string `json:"between"`
}

// Topology is the matrix of `nvidia-smi topo -m`: GPUs then NICs.
type Topology struct {
	Devices []string   `json:"devices"`
	Matrix  [][]string `json:"matrix"`
	// CPUAffinity and NUMAAffinity are per device ("" and nil when unknown).
	CPUAffinity  []string `json:"cpu_affinity"`
	NUMAAffinity []*int   `json:"numa_affinity"`
}

// filter keeps the GPUs and NICs named by --gpu and --nic (indices, PCI
// addresses or names, comma-separated).
func filter(f *gdr.Facts, gpus, nics string) error {
	if gpus != "" {
		want := map[string]bool{}
		for _, s := range strings.Split(gpus, ",") {
			s = strings.TrimSpace(s)
			if a, err := sysfs.ParsePCIAddress(s); err == nil && strings.Contains(s, ":") {
				s = a
			}
			want[s] = true
		}
		var keep []gdr.GPUFacts
		for _, g := range f.GPUs {
			if want[strconv.Itoa(g.Index)] || want[g.PCIBusID] {
				keep = append(keep, g)
			}
		}
		if len(keep) == 0 {
			return fmt.Errorf("--gpu %s matches none of the %d GPUs", gpus, len(f.GPUs))
		}
		f.GPUs = keep
	}
	if nics != "" {
		want := map[string]bool{}
		for _, s := range strings.Split(nics, ",") {
			want[strings.TrimSpace(s)] = true
		}
		var keep []gdr.NICFacts
		for _, n := range f.NICs {
			if want[n.Name] || want[n.PCIAddress] {
				keep = append(keep, n)
			}
		}
		if len(keep) == 0 {
			return fmt.Errorf("--nic %s matches none of the %d RDMA devices", nics, len(f.NICs))
		}
		f.NICs = keep
	}
	var pairs []gdr.PairPath
	for _, p := range f.Pairs {
		if gpuOf(f, p.GPU) != nil && hasNIC(f, p.NIC) {
			pairs = append(pairs, p)
		}
	}
	f.Pairs = pairs
	return nil
}

func hasNIC(f *gdr.Facts, name string) bool {
	for _, n := range f.NICs {
		if n.Name == name {
			return true
		}
	}
	return false
}

// nonNil makes every list of the facts an empty list rather than null, as
// the schema wants.
func nonNil(f *gdr.Facts) {
	mk := func(s *[]string) {
		if *s == nil {
			*s = []string{}
		}
	}
	mk(&f.Notes)
	if f.GPUs == nil {
		f.GPUs = []gdr.GPUFacts{}
	}
	if f.NICs == nil {
		f.NICs = []gdr.NICFacts{}
	}
	if f.Pairs == nil {
		f.Pairs = []gdr.PairPath{}
	}
	if f.GPUTopology == nil {
		f.GPUTopology = []gdr.GPUTopology{}
	}
	if f.Modules == nil {
		f.Modules = []gdr.ModuleFacts{}
	}
	for i := range f.NICs {
		n := &f.NICs[i]
		if n.Ports == nil {
			n.Ports = []gdr.PortFacts{}
		}
		for j := range n.Ports {
			if n.Ports[j].GIDs == nil {
				n.Ports[j].GIDs = []gdr.GID{}
			}
		}
	}
	for i := range f.Pairs {
		p := &f.Pairs[i]
		mk(&p.Bridges)
		mk(&p.ACSBridges)
		mk(&p.ACSUnknown)
	}
}

// buildReport decides for every GPU and sums up.
func buildReport(f *gdr.Facts, pci map[string]*sysfs.PCIDevice, p gdr.Policy, source string) *Report {
	nonNil(f)
	r := &Report{SchemaVersion: SchemaVersion, Source: source, Policy: p, Facts: f, Decisions: []gdr.Decision{}, ACS: []ACSFinding{}}
	for _, g := range f.GPUs {
		r.Decisions = append(r.Decisions, gdr.DecideGPU(f, g.Index, p))
	}
	r.pci = pci
	r.Topology = topology(f, pci)
	r.ACS = acsFindings(f, pci)
	usable := 0
	for i := range f.NICs {
		if activePort(&f.NICs[i]) != nil {
			usable++
		}
	}
	count := map[gdr.Mode]int{}
	for _, d := range r.Decisions {
		count[d.Mode]++
	}
	noVerbs := f.Verbs.Status == gdr.StatusNotSupported
	switch {
	case len(f.GPUs) == 0 && usable > 0 && !noVerbs:
		r.Verdict, r.ExitCode = "ready", exitReady
		r.Summary = fmt.Sprintf("no GPU (%s); %d RDMA device(s) with an active port: host-memory RDMA only", f.GPUSource.Detail, usable)
	case len(f.GPUs) == 0:
		// Without libibverbs no RDMA device is usable, whatever its ports
		// say: gdrlink has no RDMA provider then.
		r.Verdict, r.ExitCode = "not-ready", exitNotReady
		var why []string
		switch {
		case f.RDMA.Status != gdr.StatusAvailable:
			why = append(why, f.RDMA.Detail)
		case usable == 0:
			why = append(why, "no RDMA device has an active port")
		}
		if noVerbs {
			why = append(why, "libibverbs: "+f.Verbs.Detail)
		}
		r.Summary = fmt.Sprintf("no GPU (%s) and RDMA is unusable (%s)", f.GPUSource.Detail, strings.Join(why, "; "))
	case count[gdr.Unavailable] > 0:
		r.Verdict, r.ExitCode = "not-ready", exitNotReady
		r.Summary = fmt.Sprintf("%d of %d GPUs have no RDMA path", count[gdr.Unavailable], len(f.GPUs))
	case count[gdr.Proxy] > 0:
		r.Verdict, r.ExitCode = "degraded", exitDegraded
		r.Summary = fmt.Sprintf("%d of %d GPUs need a CPU proxy (no GPUDirect RDMA)", count[gdr.Proxy], len(f.GPUs))
	default:
		r.Verdict, r.ExitCode = "ready", exitReady
		r.Summary = fmt.Sprintf("all %d GPUs can use GPUDirect RDMA", len(f.GPUs))
	}
	return r
}

func gpuLabel(i int) string { return "GPU" + strconv.Itoa(i) }

func topology(f *gdr.Facts, pci map[string]*sysfs.PCIDevice) Topology {
	t := Topology{Devices: []string{}, Matrix: [][]string{}, CPUAffinity: []string{}, NUMAAffinity: []*int{}}
	type dev struct {
		name string
		addr string
		numa *int
	}
	var devs []dev
	for _, g := range f.GPUs {
		devs = append(devs, dev{gpuLabel(g.Index), g.PCIBusID, g.NUMANode})
	}
	for _, n := range f.NICs {
		devs = append(devs, dev{n.Name, n.PCIAddress, n.NUMANode})
	}
	nvml := map[[2]int]gdr.GPUTopology{}
	for _, g := range f.GPUTopology {
		nvml[[2]int{g.A, g.B}], nvml[[2]int{g.B, g.A}] = g, g
	}
	for i, a := range devs {
		t.Devices = append(t.Devices, a.name)
		cpus := ""
		if d := pci[a.addr]; d != nil {
			cpus = d.LocalCPUs
		}
		t.CPUAffinity = append(t.CPUAffinity, cpus)
		t.NUMAAffinity = append(t.NUMAAffinity, a.numa)
		row := make([]string, len(devs))
		for j, b := range devs {
			switch {
			case i == j:
				row[j] = "X"
				continue
			case i < len(f.GPUs) && j < len(f.GPUs):
				if g, ok := nvml[[2]int{f.GPUs[i].Index, f.GPUs[j].Index}]; ok {
					if g.NVLinks > 0 {
						row[j] = "NV" + strconv.Itoa(g.NVLinks)
						continue
					}
					if g.Path != gdr.PathUnknown {
						row[j] = g.Path.String()
						continue
					}
				}
			}
			da, db := pci[a.addr], pci[b.addr]
			if da == nil || db == nil {
				row[j] = "?"
				continue
			}
			row[j], _ = sysfs.ClassifyPath(da.Path, db.Path, a.numa, b.numa, f.NUMANodes)
		}
		t.Matrix = append(t.Matrix, row)
	}
	return t
}

func acsFindings(f *gdr.Facts, pci map[string]*sysfs.PCIDevice) []ACSFinding {
	by := map[string]*ACSFinding{}
	for _, p := range f.Pairs {
		for _, b := range p.Bridges {
			a := by[b]
			if a == nil {
				a = &ACSFinding{Bridge: b, Between: []string{}}
				if d := pci[b]; d != nil && d.ACS != nil {
					c := d.ACS.Control
					a.Control, a.Redirects = &c, d.ACS.RedirectsP2P()
				} else if d != nil && d.ACSErr != "" {
					a.Error = d.ACSErr
				}
				by[b] = a
			}
			a.Between = append(a.Between, gpuLabel(p.GPU)+"-"+p.NIC)
		}
	}
	out := make([]ACSFinding, 0, len(by))
	for _, a := range by {
		out = append(out, *a)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Bridge < out[j].Bridge })
	return out
}

// readProcess reads the process's allowed CPUs and memory nodes from
// /proc/self/status under the root.
func readProcess(root *sysfs.Root) *ProcessFacts {
	s, err := root.ReadString("/proc/self/status")
	if err != nil {
		return nil
	}
	p := &ProcessFacts{}
	for _, line := range strings.Split(s, "\n") {
		k, v, _ := strings.Cut(line, ":")
		switch k {
		case "Cpus_allowed_list":
			p.CPUsAllowed = strings.TrimSpace(v)
		case "Mems_allowed_list":
			p.MemsAllowed = strings.TrimSpace(v)
		}
	}
	return p
}

// gpuOf returns the GPU with the index, or nil.
func gpuOf(f *gdr.Facts, index int) *gdr.GPUFacts {
	for i := range f.GPUs {
		if f.GPUs[i].Index == index {
			return &f.GPUs[i]
		}
	}
	return nil
}

// activePort returns the NIC's first port that can carry traffic, or nil.
func activePort(n *gdr.NICFacts) *gdr.PortFacts {
	for i := range n.Ports {
		if n.Ports[i].State == "ACTIVE" {
			return &n.Ports[i]
		}
	}
	return nil
}
