package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/dustin/go-humanize"

	"github.com/gdrlink/gdrlink/gdr"
	"github.com/gdrlink/gdrlink/internal/jobauth"
)

// painter colors words on a terminal and leaves them alone elsewhere.
type painter bool

func (p painter) paint(code, s string) string {
	if !p {
		return s
	}
	return "\x1b[" + code + "m" + s + "\x1b[0m"
}

func (p painter) mode(m gdr.Mode) string {
	switch m {
	case gdr.Direct:
		return p.paint("1;32", "DIRECT")
	case gdr.Proxy:
		return p.paint("1;33", "PROXY")
	}
	return p.paint("1;31", "UNAVAILABLE")
}

func (p painter) verdict(v string) string {
	switch v {
	case "ready":
		return p.paint("1;32", "READY")
	case "degraded":
		return p.paint("1;33", "DEGRADED")
	}
	return p.paint("1;31", "NOT READY")
}

func (p painter) check(c gdr.Check) string {
	switch c.Status {
	case gdr.StatusAvailable:
		return p.paint("32", "yes") + " (" + c.Detail + ")"
	case gdr.StatusNotSupported:
		return p.paint("31", "no") + " (" + c.Detail + ")"
	}
	return p.paint("33", "could not tell") + " (" + c.Detail + ")"
}

// jobAuth is the job key line of the Host section: the mode, then what it
// means. Running without authentication beyond loopback is a warning.
func (p painter) jobAuth(a JobAuth) string {
	switch a.Mode {
	case authKey:
		job := "job id from " + a.JobIDSource
		if a.JobID != "" {
			job = fmt.Sprintf("job id %q from %s", a.JobID, a.JobIDSource)
		}
		return p.paint("32", "yes") + " (" + a.Source + ", fingerprint " + a.Fingerprint + "); " + job
	case authInsecure:
		return p.paint("33", "none, "+jobauth.InsecureEnv+"=1") + ": jobs accept unauthenticated peers beyond loopback"
	case authError:
		return p.paint("31", "unusable") + ": " + a.Detail
	}
	return "none: jobs listen on loopback only (set " + jobauth.KeyEnv + " or " + jobauth.KeyFileEnv + " on every rank to reach other hosts)"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func numaStr(n *int) string {
	if n == nil {
		return "-"
	}
	return fmt.Sprint(*n)
}

func limitStr(v int64) string {
	if v < 0 { // unbounded
		return "unlimited"
	}
	return humanize.IBytes(uint64(v))
}

// writeHuman prints the report for people.
func writeHuman(w io.Writer, r *Report, color bool) {
	p := painter(color)
	f := r.Facts
	where := "this node"
	if r.Source != "" {
		where = r.Source
	}
	fmt.Fprintf(w, "gdrcheck: GPUDirect RDMA readiness of %s\n", where)
	fmt.Fprintf(w, "Verdict: %s (exit %d): %s\n", p.verdict(r.Verdict), r.ExitCode, r.Summary)
	fmt.Fprintf(w, "Policy: Direct up to %s (%s)\n", r.Policy.Level, r.Policy.LevelSource)

	fmt.Fprintf(w, "\nGPUs: %s\n", p.check(f.GPUSource))
	if f.Driver.DriverVersion != "" || f.Driver.CUDAVersion != "" {
		fmt.Fprintf(w, "  driver %s, CUDA %s\n", orDash(f.Driver.DriverVersion), orDash(f.Driver.CUDAVersion))
	}
	for _, g := range f.GPUs {
		name := g.Name
		if name == "" {
			if d := r.pci[g.PCIBusID]; d != nil {
				name = fmt.Sprintf("NVIDIA [%04x:%04x]", d.Vendor, d.Device)
			}
		}
		bar1 := "BAR1 -"
		if g.BAR1Total != nil && g.BAR1Free != nil {
			bar1 = fmt.Sprintf("BAR1 %s free of %s", humanize.IBytes(*g.BAR1Free), humanize.IBytes(*g.BAR1Total))
		}
		pers := "persistence -"
		if g.PersistenceMode != nil {
			pers = map[bool]string{true: "persistence on", false: "persistence off"}[*g.PersistenceMode]
		}
		fmt.Fprintf(w, "  GPU%d  %s  %s  NUMA %s  %s  %s  GDR attr %s  dma-buf attr %s  (%s)\n", g.Index, orDash(name), g.PCIBusID, numaStr(g.NUMANode), bar1, pers, tri(g.GDRSupported), tri(g.DMABufSupported), g.Source)
	}

	fmt.Fprintf(w, "\nRDMA devices: %s\n", p.check(f.RDMA))
	for _, n := range f.NICs {
		kind := orDash(n.PCIAddress)
		if n.Software {
			kind = "software"
		}
		fmt.Fprintf(w, "  %s  %s  NUMA %s  driver %s  fw %s\n", n.Name, kind, numaStr(n.NUMANode), orDash(n.Driver), orDash(n.FWVersion))
		for _, pt := range n.Ports {
			mtu := "-"
			if pt.ActiveMTU != nil {
				mtu = fmt.Sprint(*pt.ActiveMTU)
			}
			state := pt.State
			if pt.State == "ACTIVE" {
				state = p.paint("32", state)
			} else {
				state = p.paint("31", orDash(state))
			}
			fmt.Fprintf(w, "    port %d  %s  %s  %s  %s  active MTU %s  netdev %s\n", pt.Port, state, orDash(pt.PhysState), orDash(pt.LinkLayer), orDash(pt.Rate), mtu, orDash(pt.Netdev))
			for _, g := range pt.GIDs {
				fmt.Fprintf(w, "      GID %-3d %s  %s  %s\n", g.Index, g.GID, orDash(g.Type), orDash(g.Netdev))
			}
		}
	}

	fmt.Fprintf(w, "\nHost\n")
	fmt.Fprintf(w, "  kernel %s\n", orDash(f.Kernel.Release))
	var on, off []string
	for _, m := range f.Modules {
		if m.Loaded {
			on = append(on, m.Name)
		} else {
			off = append(off, m.Name)
		}
	}
	fmt.Fprintf(w, "  modules loaded: %s; not loaded: %s\n", orDash(strings.Join(on, " ")), orDash(strings.Join(off, " ")))
	fmt.Fprintf(w, "  libibverbs: %s\n", p.check(f.Verbs))
	fmt.Fprintf(w, "  peer memory module: %s\n", p.check(f.PeerMem))
	fmt.Fprintf(w, "  dma-buf (kernel): %s\n", p.check(f.Kernel.DMABuf))
	fmt.Fprintf(w, "  dma-buf (rdma-core): %s\n", p.check(f.LibIBVerbs))
	if f.Memlock.Check.Status == gdr.StatusAvailable {
		src := "/proc/self/limits"
		if f.Memlock.Live {
			src = "getrlimit"
		}
		fmt.Fprintf(w, "  memlock: soft %s, hard %s (%s)\n", limitStr(f.Memlock.Soft), limitStr(f.Memlock.Hard), src)
	} else {
		fmt.Fprintf(w, "  memlock: %s\n", p.check(f.Memlock.Check))
	}
	if f.Hugepages.Check.Status != gdr.StatusUnknown {
		fmt.Fprintf(w, "  hugepages: %d reserved, %d free, %s each; THP %s\n", f.Hugepages.Total, f.Hugepages.Free, humanize.IBytes(f.Hugepages.Size), orDash(f.Hugepages.THP))
	} else {
		fmt.Fprintf(w, "  hugepages: %s\n", p.check(f.Hugepages.Check))
	}
	fmt.Fprintf(w, "  IOMMU: %s, %d groups\n", orDash(f.IOMMU.Mode), f.IOMMU.Groups)
	fmt.Fprintf(w, "  NUMA nodes: %d\n", f.NUMANodes)
	if r.Process != nil {
		fmt.Fprintf(w, "  this process may run on CPUs %s, memory nodes %s\n", orDash(r.Process.CPUsAllowed), orDash(r.Process.MemsAllowed))
	}
	fmt.Fprintf(w, "  job key: %s\n", p.jobAuth(r.JobAuth))

	fmt.Fprintf(w, "\nPCIe ACS on bridges between GPUs and NICs\n")
	if len(r.ACS) == 0 {
		fmt.Fprintf(w, "  no GPU and NIC share a PCIe switch\n")
	}
	for _, a := range r.ACS {
		switch {
		case a.Control == nil && a.Error != "":
			fmt.Fprintf(w, "  %s  could not tell: %s\n", a.Bridge, a.Error)
		case a.Control == nil:
			fmt.Fprintf(w, "  %s  no ACS capability\n", a.Bridge)
		case a.Redirects:
			fmt.Fprintf(w, "  %s  control %#04x: %s  (%s)\n", a.Bridge, *a.Control, p.paint("31", "redirects peer traffic to the root complex"), strings.Join(a.Between, ", "))
		default:
			fmt.Fprintf(w, "  %s  control %#04x: peer traffic stays in the switch\n", a.Bridge, *a.Control)
		}
	}

	fmt.Fprintf(w, "\nTopology\n")
	writeMatrix(w, r.Topology)

	fmt.Fprintf(w, "\nVerdict per GPU\n")
	if len(r.Decisions) == 0 {
		fmt.Fprintf(w, "  no GPU\n")
	}
	for _, d := range r.Decisions {
		via := ""
		if d.NIC != "" {
			via = fmt.Sprintf(" through %s (%s", d.NIC, d.PathType)
			if d.Mode == gdr.Direct && d.Mechanism != "" {
				via += ", " + d.Mechanism
			}
			via += ")"
		}
		fmt.Fprintf(w, "  GPU%d: %s%s\n", d.GPU, p.mode(d.Mode), via)
		for _, s := range d.Reasons {
			fmt.Fprintf(w, "    - %s\n", s)
		}
		for _, s := range d.Fixes {
			fmt.Fprintf(w, "    fix: %s\n", s)
		}
	}
	if len(f.Notes) > 0 {
		fmt.Fprintf(w, "\nNotes\n")
		for _, n := range f.Notes {
			fmt.Fprintf(w, "  %s\n", n)
		}
	}
	if r.Selftest != nil {
		writeSelftest(w, r.Selftest, p)
	}
}

func tri(b *bool) string {
	switch {
	case b == nil:
		return "?"
	case *b:
		return "yes"
	}
	return "no"
}

// writeMatrix prints the matrix as nvidia-smi topo -m does, with a legend.
func writeMatrix(w io.Writer, t Topology) {
	if len(t.Devices) == 0 {
		fmt.Fprintf(w, "  no GPU or RDMA device\n")
		return
	}
	width := 6
	for _, d := range t.Devices {
		if len(d)+2 > width {
			width = len(d) + 2
		}
	}
	fmt.Fprintf(w, "  %-*s", width, "")
	for _, d := range t.Devices {
		fmt.Fprintf(w, "%-*s", width, d)
	}
	fmt.Fprintf(w, "%-16s%s\n", "CPU Affinity", "NUMA Affinity")
	for i, d := range t.Devices {
		fmt.Fprintf(w, "  %-*s", width, d)
		for _, c := range t.Matrix[i] {
			fmt.Fprintf(w, "%-*s", width, c)
		}
		fmt.Fprintf(w, "%-16s%s\n", orDash(t.CPUAffinity[i]), numaStr(t.NUMAAffinity[i]))
	}
	fmt.Fprintf(w, "\n  Legend:\n")
	for _, l := range [][2]string{
		{"X", "Self"},
		{"SYS", "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)"},
		{"NODE", "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node"},
		{"PHB", "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)"},
		{"PXB", "Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)"},
		{"PIX", "Connection traversing at most a single PCIe bridge"},
		{"NV#", "Connection traversing a bonded set of # NVLinks"},
		{"?", "Could not tell (device not in the PCI tree, or software device)"},
	} {
		fmt.Fprintf(w, "    %-4s = %s\n", l[0], l[1])
	}
}
