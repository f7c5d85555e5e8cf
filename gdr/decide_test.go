package gdr

import (
	"fmt"
	"strings"
	"testing"
)

// goodPair is a GPU and a NIC under one switch on a healthy node; each case
// of TestDecide changes one fact.
func goodPair() pairFacts {
	return pairFacts{
		GPU: GPUFacts{Index: 0, PCIBusID: "0000:1a:00.0", NUMANode: intp(0), GDRSupported: boolp(true), DMABufSupported: boolp(true)},
		NIC: NICFacts{Name: "mlx5_0", PCIAddress: "0000:1b:00.0", NUMANode: intp(0), Ports: []PortFacts{{Port: 1, State: "ACTIVE", PhysState: "LinkUp"}}},
		Path: PairPath{GPU: 0, NIC: "mlx5_0", Path: PathPIX, Detail: "share the PCIe switch at 0000:18:00.0",
			Bridges: []string{"0000:18:00.0", "0000:19:00.0", "0000:19:01.0"}},
		Verbs:     available("libibverbs.so.1 at /usr/lib/x86_64-linux-gnu/libibverbs.so.1"),
		PeerMem:   available("nvidia_peermem is loaded"),
		DMABuf:    available("kernel 6.8 with CONFIG_DMA_SHARED_BUFFER=y; ibv_reg_dmabuf_mr"),
		Memlock:   MemlockFacts{Check: available("getrlimit"), Soft: unlimited, Hard: unlimited},
		NUMANodes: 2,
	}
}

func TestDecide(t *testing.T) {
	cases := []struct {
		name   string
		change func(*pairFacts)
		policy Policy
		mode   Mode
		mech   string
		want   []string // substrings of reasons or fixes
	}{
		{"healthy", func(*pairFacts) {}, defaultPolicy(), Direct, "nvidia_peermem", nil},
		{"dma-buf instead of peermem", func(p *pairFacts) { p.PeerMem = missing("neither nvidia_peermem nor nv_peer_mem is loaded") }, defaultPolicy(), Direct, "dma-buf", nil},
		{"no peermem, GPU without dma-buf", func(p *pairFacts) {
			p.PeerMem = missing("neither nvidia_peermem nor nv_peer_mem is loaded")
			p.GPU.DMABufSupported = boolp(false)
		}, defaultPolicy(), Proxy, "", []string{"load nvidia_peermem", "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0"}},
		{"no peermem, old kernel", func(p *pairFacts) {
			p.PeerMem = missing("neither nvidia_peermem nor nv_peer_mem is loaded")
			p.DMABuf = missing("kernel 5.4 is older than 5.12")
		}, defaultPolicy(), Proxy, "", []string{"load nvidia_peermem", "older than 5.12"}},
		{"GPU without GDR", func(p *pairFacts) { p.GPU.GDRSupported = boolp(false) }, defaultPolicy(), Proxy, "nvidia_peermem", []string{"does not support GPUDirect RDMA"}},
		{"GDR unknown", func(p *pairFacts) { p.GPU.GDRSupported = nil }, defaultPolicy(), Direct, "nvidia_peermem", []string{"could not tell whether GPU0"}},
		{"ACS on", func(p *pairFacts) { p.Path.ACSBridges = []string{"0000:19:00.0"} }, defaultPolicy(), Proxy, "nvidia_peermem", []string{"disable ACS on bridge 0000:19:00.0", "PHB in effect"}},
		{"ACS on, policy PHB", func(p *pairFacts) { p.Path.ACSBridges = []string{"0000:19:00.0"} }, Policy{Level: PathPHB}, Direct, "nvidia_peermem", []string{"ACS redirects"}},
		{"SYS", func(p *pairFacts) { p.Path.Path, p.NIC.NUMANode = PathSYS, intp(1) }, defaultPolicy(), Proxy, "nvidia_peermem", []string{"the NIC is on the other socket", "GDRLINK_NET_GDR_LEVEL=SYS"}},
		{"SYS allowed", func(p *pairFacts) { p.Path.Path = PathSYS }, Policy{Level: PathSYS}, Direct, "nvidia_peermem", nil},
		{"PHB with policy PIX", func(p *pairFacts) { p.Path.Path = PathPHB }, Policy{Level: PathPIX}, Proxy, "nvidia_peermem", []string{"PHB is farther than the policy level PIX"}},
		{"policy LOC", func(*pairFacts) {}, Policy{Level: PathLOC}, Proxy, "nvidia_peermem", []string{"farther than the policy level LOC"}},
		{"path unknown", func(p *pairFacts) { p.Path.Path, p.Path.Detail = PathUnknown, "not in the PCI tree" }, defaultPolicy(), Proxy, "nvidia_peermem", []string{"could not tell the PCIe path"}},
		{"port down", func(p *pairFacts) { p.NIC.Ports[0].State, p.NIC.Ports[0].PhysState = "DOWN", "Disabled" }, defaultPolicy(), Unavailable, "nvidia_peermem", []string{"port 1 is DOWN", "bring mlx5_0 port 1 up"}},
		{"no ports", func(p *pairFacts) { p.NIC.Ports = nil }, defaultPolicy(), Unavailable, "nvidia_peermem", []string{"no ports"}},
		{"memlock 64 KiB", func(p *pairFacts) { p.Memlock.Soft = 64 << 10 }, defaultPolicy(), Unavailable, "nvidia_peermem", []string{"64 KiB", "raise memlock to unlimited"}},
		{"memlock 1 GiB", func(p *pairFacts) { p.Memlock.Soft = 1 << 30 }, defaultPolicy(), Direct, "nvidia_peermem", []string{"1.0 GiB"}},
		{"memlock unknown", func(p *pairFacts) { p.Memlock.Check = Check{Detail: "permission denied"} }, defaultPolicy(), Direct, "nvidia_peermem", []string{"could not tell RLIMIT_MEMLOCK"}},
		{"soft-roce", func(p *pairFacts) {
			p.NIC.Software, p.NIC.Driver, p.NIC.PCIAddress = true, "rxe", ""
			p.Path = PairPath{Detail: "software"}
		}, defaultPolicy(), Proxy, "nvidia_peermem", []string{"software RDMA device"}},
		{"small BAR1", func(p *pairFacts) { p.GPU.BAR1Total = u64p(256 << 20) }, defaultPolicy(), Direct, "nvidia_peermem", []string{"BAR1 aperture of only 256 MiB", "Resizable BAR"}},
		{"persistence off", func(p *pairFacts) { p.GPU.PersistenceMode = boolp(false) }, defaultPolicy(), Direct, "nvidia_peermem", []string{"nvidia-smi -pm 1"}},
		{"iommu translated", func(p *pairFacts) { p.IOMMUMode = "translated" }, defaultPolicy(), Direct, "nvidia_peermem", []string{"iommu=pt"}},
		{"no libibverbs", func(p *pairFacts) { p.Verbs = noVerbs }, defaultPolicy(), Unavailable, "nvidia_peermem", []string{"libibverbs: " + noVerbs.Detail, fixVerbs}},
		{"no libibverbs, port down, small memlock", func(p *pairFacts) {
			p.Verbs = noVerbs
			p.NIC.Ports[0].State = "DOWN"
			p.Memlock.Soft = 64 << 10
		}, defaultPolicy(), Unavailable, "nvidia_peermem", []string{"libibverbs: " + noVerbs.Detail, fixVerbs, "bring mlx5_0 port 1 up", "raise memlock to unlimited"}},
		{"no libibverbs, no peermem, soft-roce", func(p *pairFacts) {
			p.Verbs, p.DMABuf = noVerbs, noVerbs
			p.PeerMem = missing("neither nvidia_peermem nor nv_peer_mem is loaded")
			p.NIC.Software, p.NIC.Driver, p.NIC.PCIAddress = true, "rxe", ""
			p.Path = PairPath{Detail: "software"}
		}, defaultPolicy(), Unavailable, "", []string{fixVerbs, "load nvidia_peermem", "use a hardware RDMA NIC"}},
		{"libibverbs unknown", func(p *pairFacts) { p.Verbs = Check{Detail: "no libibverbs.so.1 under the root"} }, defaultPolicy(), Direct, "nvidia_peermem", []string{"could not tell whether libibverbs is installed: no libibverbs.so.1 under the root"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pf := goodPair()
			c.change(&pf)
			d := decide(pf, c.policy)
			if d.Mode != c.mode || d.Mechanism != c.mech {
				t.Errorf("%s (%q), want %s (%q); reasons %q", d.Mode, d.Mechanism, c.mode, c.mech, d.Reasons)
			}
			if d.Mode != Direct && len(d.Fixes) == 0 && c.name != "path unknown" {
				t.Errorf("%s without a fix: %q", d.Mode, d.Reasons)
			}
			all := strings.Join(append(append([]string{}, d.Reasons...), d.Fixes...), "\n")
			for _, w := range c.want {
				if !strings.Contains(all, w) {
					t.Errorf("%q not in\n%s", w, all)
				}
			}
			// Pure: the same facts give the same decision.
			if again := decide(pf, c.policy); fmt.Sprint(again) != fmt.Sprint(d) {
				t.Errorf("not deterministic: %v then %v", d, again)
			}
		})
	}
}

// noVerbs is the libibverbs check of a node without rdma-core.
var noVerbs = missing("libibverbs.so.1 not found (rdma-core's libibverbs is not installed)")

// TestDecideLibIBVerbs checks that only a missing libibverbs, and only on a
// node with RDMA devices, takes every GPU's RDMA away.
func TestDecideLibIBVerbs(t *testing.T) {
	base := collectFixture(t, "dgx")
	cases := []struct {
		name   string
		verbs  Check
		noNICs bool
		mode   Mode
		in     []string // among the reasons and fixes of every GPU
		out    []string // among none of them
	}{
		{"present", available("libibverbs.so.1 at /usr/lib64/libibverbs.so.1"), false, Direct, nil, []string{"libibverbs", fixVerbs}},
		{"missing", noVerbs, false, Unavailable, []string{"libibverbs: " + noVerbs.Detail, fixVerbs}, nil},
		{"unknown", Check{Detail: "no libibverbs.so.1 under the root and no snapshot facts about it"}, false, Direct, []string{"could not tell whether libibverbs is installed"}, []string{fixVerbs}},
		{"missing without NICs", noVerbs, true, Unavailable, []string{"no RDMA device", "install an RDMA NIC"}, []string{fixVerbs}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := *base
			f.Verbs = c.verbs
			if c.noNICs {
				f.NICs, f.Pairs, f.RDMA = nil, nil, missing("no /sys/class/infiniband")
			}
			for _, g := range f.GPUs {
				d := DecideGPU(&f, g.Index, defaultPolicy())
				if d.Mode != c.mode {
					t.Errorf("GPU%d: %s, want %s; reasons %q", g.Index, d.Mode, c.mode, d.Reasons)
				}
				all := strings.Join(append(append([]string{}, d.Reasons...), d.Fixes...), "\n")
				for _, w := range c.in {
					if !strings.Contains(all, w) {
						t.Errorf("GPU%d: %q not in\n%s", g.Index, w, all)
					}
				}
				for _, w := range c.out {
					if strings.Contains(all, w) {
						t.Errorf("GPU%d: %q in\n%s", g.Index, w, all)
					}
				}
			}
		})
	}
}

func TestDecideGPUPrefersDirectAndNear(t *testing.T) {
	f := collectFixture(t, "dgx")
	// Policy PIX: GPU1 is PXB from mlx5_0 and SYS from mlx5_1, so it gets a
	// proxy through the nearer NIC.
	d := DecideGPU(f, 1, Policy{Level: PathPIX})
	if d.Mode != Proxy || d.NIC != "mlx5_0" || d.PathType != PathPXB {
		t.Fatalf("%+v", d)
	}
	if d := DecideGPU(f, 9, defaultPolicy()); d.Mode != Unavailable {
		t.Fatalf("missing GPU: %+v", d)
	}
}
