package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/gpusim"
	"github.com/gdrlink/gdrlink/internal/cuda/cudatest"
	"github.com/gdrlink/gdrlink/internal/nvml"
	"github.com/gdrlink/gdrlink/proxy"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
)

// gather collects c through a registry of its own, by family name.
func gather(t *testing.T, c prometheus.Collector) map[string]*dto.MetricFamily {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatal(err)
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, f := range fams {
		out[f.GetName()] = f
	}
	return out
}

// scrapeFamilies reads http://addr/metrics, by family name.
func scrapeFamilies(addr string) (map[string]*dto.MetricFamily, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, fmt.Errorf("scraping: %w", err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("parsing /metrics: %w", err)
	}
	return fams, nil
}

// statsCollector sends what the group's collector makes of a given Stats.
type statsCollector struct {
	m *metrics
	s Stats
}

func (c statsCollector) Describe(ch chan<- *prometheus.Desc) { c.m.Describe(ch) }
func (c statsCollector) Collect(ch chan<- prometheus.Metric) { c.m.collectStats(ch, c.s) }

// TestMetricsFromStats: credit stalls, retransmits and registrations each
// come from their own field of Stats; a provider that cannot count
// retransmits has no series.
func TestMetricsFromStats(t *testing.T) {
	s := Stats{
		Connections:   map[string]int{"tcp": 1, "onnode": 2},
		Protocol:      rendezvous.Stats{CreditStalls: 7, Keepalives: 3},
		Retransmits:   map[string]uint64{"tcp": 5},
		Registrations: 6,
	}
	fams := gather(t, statsCollector{newMetrics(nil), s})
	check := func(name string, labels map[string]string, want float64) {
		t.Helper()
		if got, ok := value(fams[name], labels); !ok || got != want {
			t.Errorf("%s%v = %v (found %v), want %v", name, labels, got, ok, want)
		}
	}
	check("gdrlink_protocol_credit_stalls_total", nil, 7)
	check("gdrlink_protocol_keepalives_total", nil, 3)
	check("gdrlink_transport_retransmits_total", map[string]string{"provider": "tcp"}, 5)
	check("gdrlink_pool_registrations", nil, 6)
	if f := fams["gdrlink_transport_retransmits_total"]; len(f.GetMetric()) != 1 {
		t.Errorf("gdrlink_transport_retransmits_total has %d series, want tcp's alone", len(f.GetMetric()))
	}
	if got := fams["gdrlink_transport_retransmits_total"].GetType(); got != dto.MetricType_COUNTER {
		t.Errorf("gdrlink_transport_retransmits_total is a %v, want a counter", got)
	}
}

// busGPU is a simulated GPU that says it sits at a PCI address.
type busGPU struct {
	gpusim.Device
	bus string
}

func (b busGPU) Info() proxy.DeviceInfo {
	i := b.Device.Info()
	i.PCIBusID = b.bus
	return i
}

// withFakeGPU joins with GPU 0 a simulated GPU at PCI address bus (none
// when ""), whose BAR1 bar1 reads in place of NVML.
func withFakeGPU(bus string, bar1 func(string) (int64, int64, error)) Option {
	return func(c *config) error {
		c.gpu = 0
		c.openGPU = func(int) (proxy.Device, alloc.Visitor, error) {
			d := gpusim.New(gpusim.Config{})
			return busGPU{d, bus}, d.HostRegisterVisitor(), nil
		}
		c.bar1 = bar1
		return nil
	}
}

// withBAR1 reads BAR1 with bar1 in place of NVML.
func withBAR1(bar1 func(string) (int64, int64, error)) Option {
	return func(c *config) error { c.bar1 = bar1; return nil }
}

// TestMetricsRetransmitsTCP: a pair connected over tcp reads its
// connections' retransmits (zero or more), and /metrics has them with
// provider="tcp", beside the protocol's credit stalls.
func TestMetricsRetransmitsTCP(t *testing.T) {
	gs := joinPair(t, WithProvider("tcp"), WithMetricsAddr("127.0.0.1:0"))
	defer func() {
		for r, g := range gs {
			if err := g.Close(); err != nil {
				t.Errorf("rank %d Close: %v", r, err)
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	src, err := gs[0].NewTensor(tensor.Float32, 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	if err := gs[0].Send(1, "w", 0, src); err != nil {
		t.Fatal(err)
	}
	got, tr, err := gs[1].Recv(ctx, 0, "w", 0)
	if err != nil {
		t.Fatal(err)
	}
	got.Release()
	if tr.Provider != "tcp" {
		t.Fatalf("received over %s, want tcp", tr.Provider)
	}
	for r, g := range gs {
		st := g.Stats()
		n, ok := st.Retransmits["tcp"]
		if !ok || len(st.Retransmits) != 1 {
			t.Errorf("rank %d: retransmits %v, want tcp's", r, st.Retransmits)
		}
		t.Logf("rank %d: %d tcp segments retransmitted", r, n)
	}
	fams, err := scrapeFamilies(gs[1].metricsAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := value(fams["gdrlink_transport_retransmits_total"], map[string]string{"provider": "tcp"}); !ok || v < 0 {
		t.Errorf("gdrlink_transport_retransmits_total{provider=tcp} = %v (found %v), want a count", v, ok)
	}
	if v, ok := value(fams["gdrlink_protocol_credit_stalls_total"], nil); !ok || v != float64(gs[1].Stats().Protocol.CreditStalls) {
		t.Errorf("gdrlink_protocol_credit_stalls_total = %v (found %v), want the connection's %d", v, ok, gs[1].Stats().Protocol.CreditStalls)
	}
	for _, name := range []string{"gdrlink_gpu_bar1_used_bytes", "gdrlink_gpu_bar1_total_bytes"} {
		if _, ok := fams[name]; ok {
			t.Errorf("%s in /metrics of a group without a GPU", name)
		}
	}
}

// TestMetricsRegistrations: every arena of the pool and of the pinned
// proxy pool is registered once with each provider the group opened, and
// the gauge says how many registrations that is, as the pools grow.
func TestMetricsRegistrations(t *testing.T) {
	gs := joinPair(t, withFakeGPU("", nil))
	defer func() {
		for r, g := range gs {
			if err := g.Close(); err != nil {
				t.Errorf("rank %d Close: %v", r, err)
			}
		}
	}()
	g := gs[0]
	if len(g.devs) == 0 {
		t.Fatal("no provider opened for a pair")
	}
	check := func(when string) {
		t.Helper()
		arenas := g.pool.Stats().Arenas + g.gpu.pinned.Stats().Arenas
		want := arenas * len(g.devs)
		t.Logf("%s: %d arenas × %d providers %v", when, arenas, len(g.devs), g.providerNames())
		if got := g.Stats().Registrations; got != want {
			t.Errorf("%s: Stats().Registrations = %d, want %d arenas × %d providers %v", when, got, arenas, len(g.devs), g.providerNames())
		}
		fams := gather(t, g.Collector())
		if v, ok := value(fams["gdrlink_pool_registrations"], nil); !ok || v != float64(want) {
			t.Errorf("%s: gdrlink_pool_registrations = %v (found %v), want %d arenas × %d providers %v", when, v, ok, arenas, len(g.devs), g.providerNames())
		}
		if f := fams["gdrlink_transport_retransmits_total"]; g.devs["tcp"] != nil && len(f.GetMetric()) != 1 {
			t.Errorf("%s: %d series of gdrlink_transport_retransmits_total, want tcp's alone (providers %v)", when, len(f.GetMetric()), g.providerNames())
		}
		if _, ok := fams["gdrlink_gpu_bar1_used_bytes"]; ok {
			t.Errorf("%s: BAR1 of a GPU with no PCI address", when)
		}
	}
	check("after Join")
	var held []*tensor.Tensor
	defer func() {
		for _, tn := range held {
			tn.Release()
		}
	}()
	for _, n := range []int64{1 << 10, 8 << 20, 64 << 20} {
		for _, dev := range []tensor.Device{tensor.Host, {Kind: tensor.PinnedHost}} {
			tn, err := g.NewTensorOn(dev, tensor.Uint8, n)
			if err != nil {
				t.Fatal(err)
			}
			held = append(held, tn)
		}
	}
	if g.pool.Stats().Arenas == 0 || g.gpu.pinned.Stats().Arenas == 0 {
		t.Fatalf("pools of %d and %d arenas after allocating", g.pool.Stats().Arenas, g.gpu.pinned.Stats().Arenas)
	}
	check(fmt.Sprintf("with %d+%d arenas", g.pool.Stats().Arenas, g.gpu.pinned.Stats().Arenas))
}

// TestMetricsBAR1: a group on a GPU with a PCI address reports its BAR1
// from NVML; without a GPU, without an address or without NVML the BAR1
// metrics are absent, not zero. NVML is faked (the bar1 field of the
// config: there is no seam below it), the GPU simulated, or the stand-in
// CUDA driver.
func TestMetricsBAR1(t *testing.T) {
	const bus = "0000:3b:00.0"
	const total, free = 256 << 20, 40 << 20
	var calls atomic.Int32
	var asked atomic.Value
	fake := func(b string) (int64, int64, error) {
		calls.Add(1)
		asked.Store(b)
		return free, total, nil
	}
	noNVML := func(string) (int64, int64, error) {
		return 0, 0, errors.New("no NVML in this test")
	}
	join := func(t *testing.T, opts ...Option) map[string]*dto.MetricFamily {
		t.Helper()
		g, err := Join(context.Background(), append([]Option{WithRank(0, 1)}, opts...)...)
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := g.Close(); err != nil {
				t.Error(err)
			}
		}()
		return gather(t, g.Collector())
	}
	present := func(t *testing.T, fams map[string]*dto.MetricFamily, bus string) {
		t.Helper()
		gpu := map[string]string{"gpu": bus}
		if v, ok := value(fams["gdrlink_gpu_bar1_used_bytes"], gpu); !ok || v != total-free {
			t.Errorf("gdrlink_gpu_bar1_used_bytes%v = %v (found %v), want %d", gpu, v, ok, total-free)
		}
		if v, ok := value(fams["gdrlink_gpu_bar1_total_bytes"], gpu); !ok || v != total {
			t.Errorf("gdrlink_gpu_bar1_total_bytes%v = %v (found %v), want %d", gpu, v, ok, total)
		}
		if got, _ := asked.Load().(string); got != bus {
			t.Errorf("NVML asked about %q, want %q", got, bus)
		}
	}
	absent := func(t *testing.T, fams map[string]*dto.MetricFamily) {
		t.Helper()
		for _, name := range []string{"gdrlink_gpu_bar1_used_bytes", "gdrlink_gpu_bar1_total_bytes"} {
			if f, ok := fams[name]; ok {
				t.Errorf("%s present: %v", name, f)
			}
		}
		if _, ok := fams["gdrlink_pool_arenas"]; !ok {
			t.Error("gdrlink_pool_arenas missing: nothing was gathered")
		}
	}
	t.Run("simulated-gpu", func(t *testing.T) {
		present(t, join(t, withFakeGPU(bus, fake)), bus)
	})
	t.Run("no-gpu", func(t *testing.T) {
		absent(t, join(t, withBAR1(fake)))
	})
	t.Run("no-nvml", func(t *testing.T) {
		absent(t, join(t, withFakeGPU(bus, noNVML)))
	})
	t.Run("no-pci-address", func(t *testing.T) {
		before := calls.Load()
		absent(t, join(t, withFakeGPU("", fake)))
		if calls.Load() != before {
			t.Error("NVML asked about a GPU with no PCI address")
		}
	})
	// A real GPU with the real NVML, where there is one.
	t.Run("real-gpu", func(t *testing.T) {
		g, err := Join(context.Background(), WithRank(0, 1), WithGPU(0))
		if err != nil {
			if cudatest.Required() {
				t.Fatalf("GDRLINK_REQUIRE_GPU=1, but WithGPU(0) failed: %v", err)
			}
			t.Skipf("no GPU here: %v", err)
		}
		defer g.Close()
		fams := gather(t, g.Collector())
		bus := g.gpu.dev.Info().PCIBusID
		if _, err := nvml.GPUs(""); err != nil {
			t.Logf("no NVML (%v): BAR1 must be absent", err)
			absent(t, fams)
			return
		}
		gpu := map[string]string{"gpu": bus}
		used, ok1 := value(fams["gdrlink_gpu_bar1_used_bytes"], gpu)
		all, ok2 := value(fams["gdrlink_gpu_bar1_total_bytes"], gpu)
		if !ok1 || !ok2 || all <= 0 || used < 0 || used > all {
			t.Errorf("BAR1 of GPU %s: %v used (found %v) of %v (found %v)", bus, used, ok1, all, ok2)
		}
		t.Logf("GPU %s: BAR1 %v of %v bytes in use", bus, used, all)
	})
	// The real CUDA path, on the stand-in driver: the address comes from
	// cuDeviceGetPCIBusId (GPU 0 of the stand-in is at 0000:3b:00.0).
	t.Run("stand-in-cuda", func(t *testing.T) {
		t.Setenv("GDRLINK_LIBCUDA", cudatest.StandIn(t))
		present(t, join(t, WithGPU(0), withBAR1(fake)), bus)
		// And with the real NVML reader: absent where NVML is missing (or
		// knows no GPU at that address), else consistent.
		fams := join(t, WithGPU(0))
		if _, ok := fams["gdrlink_gpu_bar1_total_bytes"]; !ok {
			t.Log("no BAR1 from NVML here")
			absent(t, fams)
			return
		}
		gpu := map[string]string{"gpu": bus}
		used, _ := value(fams["gdrlink_gpu_bar1_used_bytes"], gpu)
		all, _ := value(fams["gdrlink_gpu_bar1_total_bytes"], gpu)
		if all <= 0 || used < 0 || used > all {
			t.Errorf("NVML's BAR1 at %s: %v used of %v", bus, used, all)
		}
	})
}
