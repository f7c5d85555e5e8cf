package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/collective"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/verbsio"
)

// durationBuckets are the transfer latency buckets: 10µs to about 10s,
// ×4 apart.
var durationBuckets = prometheus.ExponentialBuckets(10e-6, 4, 11)

// errorKinds are the values of the kind label of gdrlink_errors_total,
// each with the sentinel it stands for, first match wins; other is the
// rest.
var errorKinds = []struct {
	kind string
	err  error
}{
	{"closed", ErrClosed},
	{"timeout", context.DeadlineExceeded},
	{"cancelled", context.Canceled},
	{"cancelled", rendezvous.ErrCancelled},
	{"peer_lost", verbsio.ErrPeerLost},
	{"remote_access", verbsio.ErrRemoteAccess},
	{"remote", rendezvous.ErrRemote},
	{"checksum", rendezvous.ErrChecksum},
	{"pool_exhausted", alloc.ErrPoolExhausted},
}

// errorKind names err's kind for gdrlink_errors_total.
func errorKind(err error) string {
	for _, k := range errorKinds {
		if errors.Is(err, k.err) {
			return k.kind
		}
	}
	return "other"
}

// series are the transfer counters of one path, provider and device.
type series struct {
	transfers, bytes prometheus.Counter
	took             prometheus.Observer
}

// seriesKey is what the transfer counters are labelled by.
type seriesKey struct {
	path             rendezvous.Path
	provider, device string
}

// metrics is a group's Prometheus collector: the transfer and error
// counters Recv keeps, and the group's Stats and its GPU's BAR1 (from NVML)
// read at each scrape.
type metrics struct {
	g *Group

	transfers *prometheus.CounterVec
	bytes     *prometheus.CounterVec
	took      *prometheus.HistogramVec
	errs      *prometheus.CounterVec

	collectives, collectiveBytes *prometheus.CounterVec
	// collectiveRecovery counts the messages collectives sent again and
	// the stale replies they dropped (switchml's loss recovery).
	collectiveRecovery *prometheus.CounterVec
	collectiveTook     *prometheus.HistogramVec

	mu     sync.RWMutex
	series map[seriesKey]*series

	connections, requests, reRequests, metaResponses, writes,
	checksumFailures, checksumRetries, keepalives, creditStalls, retransmits, failovers, rejoins, poolInUse,
	poolReserved, poolArenas, poolFragmentation, registrations, bar1Used,
	bar1Total *prometheus.Desc
}

func newMetrics(g *Group) *metrics {
	tl := []string{"path", "provider", "device"}
	m := &metrics{
		g: g,
		transfers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gdrlink_transfers_total", Help: "Tensors received, by path, provider and device.",
		}, tl),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gdrlink_transfer_bytes_total", Help: "Tensor bytes received, by path, provider and device.",
		}, tl),
		took: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "gdrlink_transfer_duration_seconds", Help: "Time from a tensor's request to its arrival, by path, provider and device.",
			Buckets: durationBuckets,
		}, tl),
		errs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gdrlink_errors_total", Help: "Receives that failed, by kind of error.",
		}, []string{"kind"}),
		series: map[seriesKey]*series{},
		collectives: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gdrlink_collectives_total", Help: "Collective calls (allreduce, broadcast, allgather), by backend and result (ok, error).",
		}, []string{"op", "backend", "result"}),
		collectiveBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gdrlink_collective_bytes_total", Help: "Bytes collectives put on the wire (out) and took in (in), by op and backend.",
		}, []string{"op", "backend", "direction"}),
		collectiveRecovery: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gdrlink_collective_recovery_total", Help: "Messages collectives sent again after a timeout (resent) and replies they dropped as stale or corrupted (stale), by op and backend.",
		}, []string{"op", "backend", "kind"}),
		collectiveTook: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "gdrlink_collective_duration_seconds", Help: "Time of successful collective calls, by op and backend.",
			Buckets: durationBuckets,
		}, []string{"op", "backend"}),

		connections:       prometheus.NewDesc("gdrlink_connections", "Peers connected, by provider.", []string{"provider"}, nil),
		requests:          prometheus.NewDesc("gdrlink_protocol_requests_total", "TENSOR_REQUESTs sent, over every connection.", nil, nil),
		reRequests:        prometheus.NewDesc("gdrlink_protocol_rerequests_total", "TENSOR_RE_REQUESTs sent, over every connection.", nil, nil),
		metaResponses:     prometheus.NewDesc("gdrlink_protocol_meta_responses_total", "META_DATA_RESPONSEs received that asked for a re-request, over every connection.", nil, nil),
		writes:            prometheus.NewDesc("gdrlink_protocol_writes_total", "Writes with immediate completed here (in) and posted (out), over every connection.", []string{"direction"}, nil),
		checksumFailures:  prometheus.NewDesc("gdrlink_protocol_checksum_failures_total", "Arrivals that failed checksum verification, over every connection.", nil, nil),
		checksumRetries:   prometheus.NewDesc("gdrlink_protocol_checksum_retries_total", "Tensors that failed checksum verification and were asked for again, over every connection.", nil, nil),
		keepalives:        prometheus.NewDesc("gdrlink_protocol_keepalives_total", "Keepalive frames sent to silent peers, over every connection.", nil, nil),
		failovers:         prometheus.NewDesc("gdrlink_failovers_total", "Connections that failed with the peer alive and were made again (on another provider where one is shared).", nil, nil),
		rejoins:           prometheus.NewDesc("gdrlink_peer_rejoins_total", "Peers that restarted as new processes and rejoined the job.", nil, nil),
		creditStalls:      prometheus.NewDesc("gdrlink_protocol_credit_stalls_total", "Times queued control messages or writes had to wait for the peer's credits, over every connection.", nil, nil),
		retransmits:       prometheus.NewDesc("gdrlink_transport_retransmits_total", "Segments the transport retransmitted, by provider (tcp: the kernel's TCP_INFO).", []string{"provider"}, nil),
		poolInUse:         prometheus.NewDesc("gdrlink_pool_in_use_bytes", "Bytes of the tensor pool's allocated blocks.", nil, nil),
		poolReserved:      prometheus.NewDesc("gdrlink_pool_reserved_bytes", "Bytes of the tensor pool's arenas.", nil, nil),
		poolArenas:        prometheus.NewDesc("gdrlink_pool_arenas", "Arenas of the tensor pool.", nil, nil),
		poolFragmentation: prometheus.NewDesc("gdrlink_pool_fragmentation_ratio", "1 - largest free chunk / free bytes of the tensor pool.", nil, nil),
		registrations:     prometheus.NewDesc("gdrlink_pool_registrations", "Arena registrations held with the providers: each arena of the pools once per provider.", nil, nil),
		bar1Used:          prometheus.NewDesc("gdrlink_gpu_bar1_used_bytes", "Bytes of the GPU's BAR1 aperture in use (NVML), by PCI address.", []string{"gpu"}, nil),
		bar1Total:         prometheus.NewDesc("gdrlink_gpu_bar1_total_bytes", "Bytes of the GPU's BAR1 aperture (NVML), by PCI address.", []string{"gpu"}, nil),
	}
	for _, k := range errorKinds {
		m.errs.WithLabelValues(k.kind)
	}
	m.errs.WithLabelValues("other")
	return m
}

// collective counts one collective call.
func (m *metrics) collective(op, backend string, rep collective.Report, err error) {
	result := "ok"
	if err != nil {
		result = "error"
	}
	m.collectives.WithLabelValues(op, backend, result).Inc()
	m.collectiveBytes.WithLabelValues(op, backend, "out").Add(float64(rep.Sent))
	m.collectiveBytes.WithLabelValues(op, backend, "in").Add(float64(rep.Received))
	m.collectiveRecovery.WithLabelValues(op, backend, "resent").Add(float64(rep.Resent))
	m.collectiveRecovery.WithLabelValues(op, backend, "stale").Add(float64(rep.StaleReplies))
	if err == nil {
		m.collectiveTook.WithLabelValues(op, backend).Observe(rep.Took.Seconds())
	}
}

// recv counts what one Recv did.
func (m *metrics) recv(tr Transfer, err error) {
	if err != nil {
		m.errs.WithLabelValues(errorKind(err)).Inc()
		return
	}
	k := seriesKey{tr.Path, tr.Provider, tr.Device}
	m.mu.RLock()
	s := m.series[k]
	m.mu.RUnlock()
	if s == nil {
		s = m.newSeries(k)
	}
	s.transfers.Inc()
	s.bytes.Add(float64(tr.Bytes))
	s.took.Observe(tr.Took.Seconds())
}

func (m *metrics) newSeries(k seriesKey) *series {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s := m.series[k]; s != nil {
		return s
	}
	lv := []string{k.path.String(), k.provider, k.device}
	s := &series{transfers: m.transfers.WithLabelValues(lv...), bytes: m.bytes.WithLabelValues(lv...), took: m.took.WithLabelValues(lv...)}
	m.series[k] = s
	return s
}

// Describe sends the descriptions of every metric.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	m.transfers.Describe(ch)
	m.bytes.Describe(ch)
	m.took.Describe(ch)
	m.errs.Describe(ch)
	m.collectives.Describe(ch)
	m.collectiveBytes.Describe(ch)
	m.collectiveRecovery.Describe(ch)
	m.collectiveTook.Describe(ch)
	for _, d := range []*prometheus.Desc{m.connections, m.requests, m.reRequests, m.metaResponses, m.writes,
		m.checksumFailures, m.checksumRetries, m.keepalives, m.creditStalls, m.retransmits, m.failovers, m.rejoins, m.poolInUse, m.poolReserved, m.poolArenas,
		m.poolFragmentation, m.registrations, m.bar1Used, m.bar1Total} {
		ch <- d
	}
}

// Collect sends the counters, the group's Stats as of now and the BAR1
// aperture of its GPU.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	m.transfers.Collect(ch)
	m.bytes.Collect(ch)
	m.took.Collect(ch)
	m.errs.Collect(ch)
	m.collectives.Collect(ch)
	m.collectiveBytes.Collect(ch)
	m.collectiveRecovery.Collect(ch)
	m.collectiveTook.Collect(ch)
	m.collectStats(ch, m.g.Stats())
	// Absent, not zero, without a GPU or without NVML.
	if bus, used, total, ok := m.g.bar1(); ok {
		ch <- prometheus.MustNewConstMetric(m.bar1Used, prometheus.GaugeValue, float64(used), bus)
		ch <- prometheus.MustNewConstMetric(m.bar1Total, prometheus.GaugeValue, float64(total), bus)
	}
}

// collectStats sends the metrics read from a group's Stats.
func (m *metrics) collectStats(ch chan<- prometheus.Metric, s Stats) {
	for prov, n := range s.Connections {
		ch <- prometheus.MustNewConstMetric(m.connections, prometheus.GaugeValue, float64(n), prov)
	}
	counter := func(d *prometheus.Desc, v uint64, lv ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), lv...)
	}
	p := s.Protocol
	counter(m.requests, p.Requests)
	counter(m.reRequests, p.ReRequests)
	counter(m.metaResponses, p.MetaResponses)
	counter(m.writes, p.WritesIn, "in")
	counter(m.writes, p.WritesOut, "out")
	counter(m.checksumFailures, p.ChecksumFailures)
	counter(m.checksumRetries, p.ChecksumRetries)
	counter(m.keepalives, p.Keepalives)
	counter(m.creditStalls, p.CreditStalls)
	counter(m.failovers, uint64(s.Failovers))
	counter(m.rejoins, uint64(s.Rejoins))
	for _, prov := range builtin {
		if n, ok := s.Retransmits[prov]; ok {
			counter(m.retransmits, n, prov)
		}
	}
	gauge := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
	}
	gauge(m.poolInUse, float64(s.Pool.InUse))
	gauge(m.poolReserved, float64(s.Pool.Reserved))
	gauge(m.poolArenas, float64(s.Pool.Arenas))
	gauge(m.poolFragmentation, s.Pool.Fragmentation)
	gauge(m.registrations, float64(s.Registrations))
}

// Collector is the group's Prometheus collector, to register in a
// registry of the caller's: what this rank received (gdrlink_transfers_total,
// gdrlink_transfer_bytes_total and gdrlink_transfer_duration_seconds by
// path, provider and device; gdrlink_errors_total by kind), its
// connections, protocol counters, transport retransmits, tensor pool and
// its registrations, and the BAR1 aperture of its GPU. The README lists
// every metric. WithMetricsAddr serves the same on its own.
func (g *Group) Collector() prometheus.Collector { return g.metrics }

// metricsServer serves /metrics from a registry holding the group's
// collector alone.
type metricsServer struct {
	ln  net.Listener
	srv *http.Server
	wg  sync.WaitGroup
}

func (g *Group) serveMetrics(addr string) (*metricsServer, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(g.metrics); err != nil {
		return nil, fmt.Errorf("metrics registry: %w", err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics address: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	s := &metricsServer{ln: ln, srv: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			g.log.Warn("gdrlink: metrics server stopped", "addr", ln.Addr().String(), "err", err)
		}
	}()
	g.log.Info("gdrlink: serving metrics", "addr", ln.Addr().String())
	return s, nil
}

// close stops the server and waits for it.
func (s *metricsServer) close() error {
	err := s.srv.Close()
	s.wg.Wait()
	if err != nil {
		return fmt.Errorf("gdrlink: metrics server: %w", err)
	}
	return nil
}

// metricsAddr is where the group serves /metrics, nil when it does not.
func (g *Group) metricsAddr() net.Addr {
	if g.metricsSrv == nil {
		return nil
	}
	return g.metricsSrv.ln.Addr()
}
