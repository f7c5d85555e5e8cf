package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/gdrlink/gdrlink/tensor"
)

// TestMetrics: rank 0 sends 15 tensors (12 with bytes, 3 empty) to rank
// 1, which receives them and one key never sent; rank 1's /metrics, read
// over HTTP, counts each transfer by path with its bytes, the timeout, the
// connection and the protocol's requests, and a registry of the caller's
// gathers the same from Collector. Each Send comes before its Recv, so
// (on onnode) those of up to 4 KiB go eagerly: no request, no write.
func TestMetrics(t *testing.T) {
	gs := joinPair(t, WithMetricsAddr("127.0.0.1:0"))
	defer func() {
		for r, g := range gs {
			if err := g.Close(); err != nil {
				t.Errorf("rank %d Close: %v", r, err)
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const full, empty = 12, 3
	onnode := false // the connection is made by the first Send
	var wantBytes, eagerBytes int64
	eager := 0
	for i := range full + empty {
		n := int64(100 * (i + 1))
		if i >= full {
			n = 0
		}
		src, err := gs[0].NewTensor(tensor.Float32, n)
		if err != nil {
			t.Fatal(err)
		}
		wantBytes += src.Meta().ByteSize
		if err := gs[0].Send(1, "w", int64(i), src); err != nil {
			t.Fatal(err)
		}
		got, tr, err := gs[1].Recv(ctx, 0, "w", int64(i))
		if err != nil {
			t.Fatal(err)
		}
		got.Release()
		onnode = tr.Provider == "onnode"
		want := "direct"
		switch {
		case n == 0:
			want = "none"
		case onnode && 4*n <= 4096:
			want = "eager"
			eager++
			eagerBytes += 4 * n
		}
		if tr.Path.String() != want {
			t.Errorf("step %d: path %s, want %s", i, tr.Path, want)
		}
	}
	if onnode && eager != 10 {
		t.Errorf("%d tensors went eagerly on onnode, want the 10 of up to 4 KiB", eager)
	}
	short, cancelShort := context.WithTimeout(ctx, 50*time.Millisecond)
	_, _, err := gs[1].Recv(short, 0, "never", 0)
	cancelShort()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Recv of a key never sent: %v, want a timeout", err)
	}

	addr := gs[1].metricsAddr()
	if addr == nil {
		t.Fatal("rank 1 serves no metrics")
	}
	resp, err := http.Get(fmt.Sprintf("http://%s/metrics", addr))
	if err != nil {
		t.Fatal(err)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatalf("parsing /metrics: %v", err)
	}
	prov := gs[1].Stats().Connections
	if len(prov) != 1 {
		t.Fatalf("connections %v, want one", prov)
	}
	var provider string
	for provider = range prov {
	}
	check := func(name string, labels map[string]string, want float64) {
		t.Helper()
		if got, ok := value(fams[name], labels); !ok || got != want {
			t.Errorf("%s%v = %v (found %v), want %v", name, labels, got, ok, want)
		}
	}
	direct := map[string]string{"path": "direct", "provider": provider}
	none := map[string]string{"path": "none", "provider": provider}
	check("gdrlink_transfers_total", direct, float64(full-eager))
	check("gdrlink_transfers_total", none, empty)
	check("gdrlink_transfer_bytes_total", direct, float64(wantBytes-eagerBytes))
	check("gdrlink_transfer_bytes_total", none, 0)
	check("gdrlink_transfer_duration_seconds", direct, float64(full-eager)) // the sample count
	if eager > 0 {
		ea := map[string]string{"path": "eager", "provider": provider}
		check("gdrlink_transfers_total", ea, float64(eager))
		check("gdrlink_transfer_bytes_total", ea, float64(eagerBytes))
	}
	check("gdrlink_errors_total", map[string]string{"kind": "timeout"}, 1)
	check("gdrlink_errors_total", map[string]string{"kind": "peer_lost"}, 0)
	check("gdrlink_connections", map[string]string{"provider": provider}, 1)
	// A Recv sends a request unless its tensor came eagerly before it did
	// (one that crossed the EAGER counts).
	if got, ok := value(fams["gdrlink_protocol_requests_total"], nil); !ok || got < float64(full+empty+1-eager) || got > full+empty+1 {
		t.Errorf("gdrlink_protocol_requests_total = %v (found %v), want %d..%d", got, ok, full+empty+1-eager, full+empty+1)
	}
	check("gdrlink_protocol_checksum_failures_total", nil, 0)
	check("gdrlink_protocol_checksum_retries_total", nil, 0)
	for _, name := range []string{"gdrlink_protocol_rerequests_total", "gdrlink_protocol_meta_responses_total",
		"gdrlink_protocol_keepalives_total", "gdrlink_pool_in_use_bytes", "gdrlink_pool_reserved_bytes",
		"gdrlink_pool_arenas", "gdrlink_pool_fragmentation_ratio"} {
		if _, ok := value(fams[name], nil); !ok {
			t.Errorf("%s missing from /metrics", name)
		}
	}
	if _, ok := value(fams["gdrlink_protocol_writes_total"], map[string]string{"direction": "in"}); !ok {
		t.Error("gdrlink_protocol_writes_total{direction=in} missing from /metrics")
	}
	if v, _ := value(fams["gdrlink_pool_reserved_bytes"], nil); v <= 0 {
		t.Errorf("gdrlink_pool_reserved_bytes = %v, want the pool's arenas", v)
	}

	// The sender counted no transfers; a registry of the caller's gathers
	// the same families from Collector.
	reg := prometheus.NewRegistry()
	if err := reg.Register(gs[0].Collector()); err != nil {
		t.Fatal(err)
	}
	got, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*dto.MetricFamily{}
	for _, f := range got {
		byName[f.GetName()] = f
	}
	if _, ok := value(byName["gdrlink_transfers_total"], nil); ok {
		t.Error("rank 0 counted transfers it only sent")
	}
	if v, ok := value(byName["gdrlink_protocol_writes_total"], map[string]string{"direction": "out"}); !ok || v != float64(full-eager) {
		t.Errorf("rank 0 gdrlink_protocol_writes_total{direction=out} = %v, want %d", v, full-eager)
	}
}

// value is the value of the metric of f whose labels include labels
// (a histogram's sample count), and whether there is one.
func value(f *dto.MetricFamily, labels map[string]string) (float64, bool) {
	if f == nil {
		return 0, false
	}
next:
	for _, m := range f.GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		for k, v := range labels {
			if have[k] != v {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.GetCounter().GetValue(), true
		case m.Gauge != nil:
			return m.GetGauge().GetValue(), true
		case m.Histogram != nil:
			return float64(m.GetHistogram().GetSampleCount()), true
		}
	}
	return 0, false
}

// TestErrorKind: each sentinel has its kind, wrapped or not.
func TestErrorKind(t *testing.T) {
	for _, k := range errorKinds {
		if got := errorKind(fmt.Errorf("gdrlink: rank 1: %w", k.err)); got != k.kind {
			t.Errorf("%v: kind %s, want %s", k.err, got, k.kind)
		}
	}
	if got := errorKind(errors.New("something")); got != "other" {
		t.Errorf("unknown error: kind %s, want other", got)
	}
}

// TestMetricsNoAllocs: counting a transfer whose path, provider and device
// were seen before allocates nothing.
func TestMetricsNoAllocs(t *testing.T) {
	m := newMetrics(nil)
	tr := Transfer{Path: 1, Provider: "tcp", Device: "lo", Bytes: 4096, Took: 30 * time.Microsecond}
	m.recv(tr, nil)
	if n := testing.AllocsPerRun(100, func() { m.recv(tr, nil) }); n != 0 {
		t.Errorf("counting a transfer: %v allocations, want 0", n)
	}
}

// scrape reads http://addr/metrics and sums its samples by name and the
// labels other than provider and device (a histogram by its count).
func scrape(addr string) (map[string]float64, error) {
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
	out := map[string]float64{}
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				if l.GetName() != "provider" && l.GetName() != "device" {
					ls = append(ls, l.GetName()+"="+l.GetValue())
				}
			}
			v, _ := value(&dto.MetricFamily{Metric: []*dto.Metric{m}}, nil)
			out[name+"{"+strings.Join(ls, ",")+"}"] += v
		}
	}
	return out, nil
}

// checkPairMetrics checks what rank 1 of the pair job scraped from its own
// /metrics against what rank 0 sent.
func checkPairMetrics(t *testing.T, got map[string]float64) {
	t.Helper()
	var direct, none, bytes float64
	for _, it := range pairItems {
		m, err := tensor.MetaFor(it.dt, tensor.Shape(it.shape))
		if err != nil {
			t.Fatal(err)
		}
		if m.ByteSize == 0 {
			none += pairSteps
			continue
		}
		direct += pairSteps
		bytes += pairSteps * float64(m.ByteSize)
	}
	want := map[string]float64{
		"gdrlink_transfers_total{path=direct}":           direct,
		"gdrlink_transfers_total{path=none}":             none,
		"gdrlink_transfer_bytes_total{path=direct}":      bytes,
		"gdrlink_transfer_bytes_total{path=none}":        0,
		"gdrlink_transfer_duration_seconds{path=direct}": direct,
		"gdrlink_errors_total{kind=timeout}":             0,
		"gdrlink_errors_total{kind=peer_lost}":           0,
		"gdrlink_errors_total{kind=other}":               0,
		"gdrlink_connections{}":                          1,
		"gdrlink_protocol_requests_total{}":              direct + none,
		"gdrlink_protocol_checksum_failures_total{}":     0,
		"gdrlink_protocol_writes_total{direction=out}":   0,
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("rank 1 scraped %s = %v (present %v), want %v", k, g, ok, v)
		}
	}
	if got["gdrlink_pool_reserved_bytes{}"] <= 0 {
		t.Errorf("rank 1 scraped gdrlink_pool_reserved_bytes = %v, want the pool's arenas", got["gdrlink_pool_reserved_bytes{}"])
	}
}
