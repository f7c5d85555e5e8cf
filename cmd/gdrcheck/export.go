package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/gdrlink/gdrlink/gdr"
)

// Names of the files --nfd and --textfile write in their directories.
const (
	nfdFile      = "gdrcheck"
	textfileFile = "gdrcheck.prom"
	// labelPrefix is the namespace of every node label. A name with its own
	// namespace is used as is by NFD's local source; one without would get
	// feature.node.kubernetes.io/.
	labelPrefix = "gdrlink.io/"
)

// nodeFacts are the facts about the node that --nfd and --textfile export,
// taken from the report so that they describe the node the report describes.
type nodeFacts struct {
	verdict string
	exit    int
	// ready: the node has GPUs and every one can use GPUDirect RDMA.
	ready bool
	gpus  []gpuFact
	// verbs: rdma-core's libibverbs.so.1 is installed; nil when gdrcheck
	// could not tell.
	verbs *bool
	// peerMem is "nvidia_peermem", "nv_peer_mem", "none" or "unknown".
	peerMem string
	// modules are the peer-memory modules and whether each is loaded;
	// nil when /proc/modules could not be read.
	modules map[string]bool
	// dmaBuf is nil when gdrcheck could not tell.
	dmaBuf *bool
	nics   []nicFact
	// jobAuth is JobAuth's mode: "key", "loopback-only", "insecure",
	// "error".
	jobAuth string
}

type gpuFact struct {
	index int
	busID string
	mode  string // "direct", "proxy", "unavailable"
	nic   string
}

type nicFact struct {
	name   string
	active bool
}

var peerMemModules = []string{"nvidia_peermem", "nv_peer_mem"}

func nodeFactsOf(r *Report) nodeFacts {
	n := nodeFacts{verdict: r.Verdict, exit: r.ExitCode, jobAuth: r.JobAuth.Mode}
	direct := 0
	for _, d := range r.Decisions {
		g := gpuFact{index: d.GPU, mode: d.Mode.String(), nic: d.NIC}
		if gf := gpuOf(r.Facts, d.GPU); gf != nil {
			g.busID = gf.PCIBusID
		}
		if d.Mode == gdr.Direct {
			direct++
		}
		n.gpus = append(n.gpus, g)
	}
	n.ready = len(n.gpus) > 0 && direct == len(n.gpus) && r.ExitCode == exitReady
	n.verbs = known(r.Verbs)
	switch r.PeerMem.Status {
	case gdr.StatusAvailable:
		n.peerMem = "unknown"
		for _, m := range peerMemModules {
			if strings.HasPrefix(r.PeerMem.Detail, m+" ") {
				n.peerMem = m
			}
		}
	case gdr.StatusNotSupported:
		n.peerMem = "none"
	default:
		n.peerMem = "unknown"
	}
	if r.PeerMem.Status != gdr.StatusUnknown {
		n.modules = map[string]bool{}
		for _, m := range r.Modules {
			for _, p := range peerMemModules {
				if m.Name == p {
					n.modules[p] = m.Loaded
				}
			}
		}
	}
	n.dmaBuf = known(r.DMABuf)
	for i := range r.NICs {
		n.nics = append(n.nics, nicFact{name: r.NICs[i].Name, active: activePort(&r.NICs[i]) != nil})
	}
	return n
}

// known is whether a check found what it looked for, nil when it could not
// tell.
func known(c gdr.Check) *bool {
	switch c.Status {
	case gdr.StatusAvailable, gdr.StatusNotSupported:
		ok := c.Status == gdr.StatusAvailable
		return &ok
	}
	return nil
}

// triLabel is "true", "false" or, for nil, "unknown".
func triLabel(b *bool) string {
	if b == nil {
		return "unknown"
	}
	return boolLabel(*b)
}

// labelValue makes s a valid Kubernetes label value: at most 63
// characters of [A-Za-z0-9._-], beginning and ending with a letter or
// digit. Any other character becomes '_'; "" stays "" (a valid, empty
// value).
func labelValue(s string) string {
	b := []byte(s)
	for i, c := range b {
		if !labelChar(c) {
			b[i] = '_'
		}
	}
	s = strings.TrimFunc(string(b), func(r rune) bool { return !alnum(byte(r)) })
	if len(s) > 63 {
		s = strings.TrimRightFunc(s[:63], func(r rune) bool { return !alnum(byte(r)) })
	}
	return s
}

// labelName makes s a valid name part of a label key (the part after the
// prefix), by the same rules as a value but never empty.
func labelName(s string) string {
	if v := labelValue(s); v != "" {
		return v
	}
	return "unnamed"
}

func alnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

func labelChar(c byte) bool { return alnum(c) || c == '-' || c == '_' || c == '.' }

func boolLabel(b bool) string { return strconv.FormatBool(b) }

// nfdFeatures is the feature file of NFD's local source: one name=value a
// line, preceded by an expiry header when expiry is not zero.
func nfdFeatures(n nodeFacts, expiry time.Time) []byte {
	var b strings.Builder
	if !expiry.IsZero() {
		fmt.Fprintf(&b, "# +expiry-time=%s\n", expiry.UTC().Format(time.RFC3339))
	}
	label := func(name, value string) {
		fmt.Fprintf(&b, "%s%s=%s\n", labelPrefix, labelName(name), labelValue(value))
	}
	label("gpudirect.ready", boolLabel(n.ready))
	label("gpudirect.verdict", n.verdict)
	label("gpu.count", strconv.Itoa(len(n.gpus)))
	for _, g := range n.gpus {
		i := strconv.Itoa(g.index)
		label("gpu-"+i+".mode", g.mode)
		if g.busID != "" {
			label("gpu-"+i+".bus-id", g.busID)
		}
		if g.nic != "" {
			label("gpu-"+i+".nic", g.nic)
		}
	}
	label("libibverbs", triLabel(n.verbs))
	label("peermem", n.peerMem)
	label("dmabuf", triLabel(n.dmaBuf))
	label("rdma.count", strconv.Itoa(len(n.nics)))
	for _, c := range n.nics {
		label("rdma-"+labelName(c.name), boolLabel(c.active))
	}
	if n.jobAuth != "" {
		label("job-auth", n.jobAuth)
	}
	return []byte(b.String())
}

// promText is the facts in the Prometheus text exposition format, for
// node_exporter's textfile collector.
func promText(n nodeFacts) []byte {
	var b strings.Builder
	metric := func(name, help string) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s gauge\n", name, help, name)
	}
	sample := func(name string, value int, labels ...string) {
		b.WriteString(name)
		if len(labels) > 0 {
			b.WriteByte('{')
			for i := 0; i < len(labels); i += 2 {
				if i > 0 {
					b.WriteByte(',')
				}
				fmt.Fprintf(&b, "%s=\"%s\"", labels[i], promEscape(labels[i+1]))
			}
			b.WriteByte('}')
		}
		fmt.Fprintf(&b, " %d\n", value)
	}
	bit := func(v bool) int {
		if v {
			return 1
		}
		return 0
	}
	metric("gdrlink_gpudirect_ready", "1 when the node has GPUs and every one can use GPUDirect RDMA.")
	sample("gdrlink_gpudirect_ready", bit(n.ready))
	metric("gdrlink_check_exit_code", "gdrcheck's exit status: 0 ready, 1 degraded, 2 not ready.")
	sample("gdrlink_check_exit_code", n.exit)
	metric("gdrlink_gpus", "GPUs gdrcheck found.")
	sample("gdrlink_gpus", len(n.gpus))
	if len(n.gpus) > 0 {
		metric("gdrlink_gpu_direct", "1 when the GPU can use GPUDirect RDMA, 0 when it goes through a CPU proxy or has no RDMA path (label mode).")
		for _, g := range n.gpus {
			sample("gdrlink_gpu_direct", bit(g.mode == gdr.Direct.String()), "gpu", strconv.Itoa(g.index), "bus_id", g.busID, "mode", g.mode, "nic", g.nic)
		}
	}
	if n.verbs != nil {
		metric("gdrlink_libibverbs_installed", "1 when rdma-core's libibverbs.so.1 is installed, which every RDMA transfer needs; absent when gdrcheck could not tell.")
		sample("gdrlink_libibverbs_installed", bit(*n.verbs))
	}
	if n.modules != nil {
		metric("gdrlink_peer_memory_module_loaded", "1 when the peer-memory kernel module is loaded.")
		for _, m := range peerMemModules {
			sample("gdrlink_peer_memory_module_loaded", bit(n.modules[m]), "module", m)
		}
	}
	if n.dmaBuf != nil {
		metric("gdrlink_dmabuf_supported", "1 when kernel and rdma-core support dma-buf registration; absent when gdrcheck could not tell.")
		sample("gdrlink_dmabuf_supported", bit(*n.dmaBuf))
	}
	metric("gdrlink_rdma_devices", "RDMA devices gdrcheck found.")
	sample("gdrlink_rdma_devices", len(n.nics))
	if len(n.nics) > 0 {
		metric("gdrlink_rdma_device_active", "1 when the RDMA device has an active port.")
		names := make([]nicFact, len(n.nics))
		copy(names, n.nics)
		sort.Slice(names, func(i, j int) bool { return names[i].name < names[j].name })
		for _, c := range names {
			sample("gdrlink_rdma_device_active", bit(c.active), "device", c.name)
		}
	}
	if n.jobAuth != "" {
		metric("gdrlink_job_auth_info", "How gdrlink jobs with gdrcheck's environment authenticate connections (label mode: key, loopback-only, insecure, error); always 1.")
		sample("gdrlink_job_auth_info", 1, "mode", n.jobAuth)
	}
	return []byte(b.String())
}

// promEscape escapes a label value: backslash, double quote and newline.
func promEscape(s string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace(s)
}

// syncFile is (*os.File).Sync; tests make it fail.
var syncFile = (*os.File).Sync

// writeAtomic replaces dir/name with data: it writes a hidden temporary
// file in dir (node_exporter reads only *.prom, NFD's local source skips
// hidden files), syncs it and
// renames it over name, so readers see the old file or the new one, never
// a part. On failure the old file is left as it was.
func writeAtomic(dir, name string, data []byte) (err error) {
	f, err := os.CreateTemp(dir, "."+name+".tmp*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if _, err = f.Write(data); err != nil {
		return err
	}
	if err = f.Chmod(0o644); err != nil {
		return err
	}
	if err = syncFile(f); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	final := filepath.Join(dir, name)
	if err = os.Rename(tmp, final); err != nil {
		return err
	}
	// Make the rename itself durable; a directory that cannot be synced
	// (some file systems) still has the new file.
	if d, derr := os.Open(dir); derr == nil {
		d.Sync()
		d.Close()
	}
	return nil
}
