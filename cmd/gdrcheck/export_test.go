package main

import (
	"bufio"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

var (
	labelKeyRE   = regexp.MustCompile(`^gdrlink\.io/[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$`)
	labelValueRE = regexp.MustCompile(`^([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?$`)
)

// checkFeatures checks a feature file against NFD's local source format and
// Kubernetes' label rules and returns its labels.
func checkFeatures(t *testing.T, text string) map[string]string {
	t.Helper()
	labels := map[string]string{}
	for i, line := range strings.Split(strings.TrimSuffix(text, "\n"), "\n") {
		if strings.HasPrefix(line, "#") {
			if i != 0 || !strings.HasPrefix(line, "# +expiry-time=") {
				t.Errorf("line %d: unexpected comment %q", i+1, line)
			}
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok || !labelKeyRE.MatchString(k) || !labelValueRE.MatchString(v) {
			t.Errorf("line %d: %q is not a valid label", i+1, line)
		}
		if _, dup := labels[k]; dup {
			t.Errorf("line %d: %s twice", i+1, k)
		}
		labels[k] = v
	}
	return labels
}

var (
	promNameRE   = regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*$`)
	promSampleRE = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (-?[0-9]+(\.[0-9]+)?)$`)
	promLabelRE  = regexp.MustCompile(`^([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)`)
)

type promSample struct {
	name   string
	labels map[string]string
	value  float64
}

// parseProm parses the text exposition format back, as strictly as the
// subset gdrcheck writes: HELP and TYPE before the samples of each metric,
// every metric a gauge, no sample without its TYPE.
func parseProm(t *testing.T, text string) []promSample {
	t.Helper()
	typed := map[string]bool{}
	helped := map[string]bool{}
	var out []promSample
	sc := bufio.NewScanner(strings.NewReader(text))
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if f := strings.SplitN(line, " ", 4); len(f) >= 3 && f[0] == "#" {
			if !promNameRE.MatchString(f[2]) {
				t.Errorf("line %d: bad metric name %q", n, f[2])
			}
			switch f[1] {
			case "HELP":
				helped[f[2]] = true
			case "TYPE":
				if len(f) != 4 || f[3] != "gauge" || !helped[f[2]] || typed[f[2]] {
					t.Errorf("line %d: %q", n, line)
				}
				typed[f[2]] = true
			default:
				t.Errorf("line %d: %q", n, line)
			}
			continue
		}
		m := promSampleRE.FindStringSubmatch(line)
		if m == nil {
			t.Errorf("line %d: not a sample: %q", n, line)
			continue
		}
		if !typed[m[1]] {
			t.Errorf("line %d: %s has no TYPE", n, m[1])
		}
		s := promSample{name: m[1], labels: map[string]string{}}
		s.value, _ = strconv.ParseFloat(m[4], 64)
		for rest := m[3]; rest != ""; {
			l := promLabelRE.FindStringSubmatch(rest)
			if l == nil {
				t.Errorf("line %d: bad labels %q", n, rest)
				break
			}
			v := strings.NewReplacer(`\\`, `\`, `\"`, `"`, `\n`, "\n").Replace(l[2])
			s.labels[l[1]] = v
			rest = rest[len(l[0]):]
		}
		out = append(out, s)
	}
	return out
}

func value(samples []promSample, name string, labels ...string) (float64, bool) {
next:
	for _, s := range samples {
		if s.name != name {
			continue
		}
		for i := 0; i < len(labels); i += 2 {
			if s.labels[labels[i]] != labels[i+1] {
				continue next
			}
		}
		return s.value, true
	}
	return 0, false
}

func TestExportLayouts(t *testing.T) {
	t.Setenv("GDRLINK_NET_GDR_LEVEL", "")
	for name, code := range layouts {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			root := "testdata/nodes/" + name
			_, errs, got := runArgs(t, "--root", root, "--json", "--nfd", dir, "--textfile", dir)
			if got != code {
				t.Fatalf("exit %d, want %d; stderr %s", got, code, errs)
			}
			nfd, err := os.ReadFile(filepath.Join(dir, nfdFile))
			if err != nil {
				t.Fatal(err)
			}
			prom, err := os.ReadFile(filepath.Join(dir, textfileFile))
			if err != nil {
				t.Fatal(err)
			}
			if ents, _ := os.ReadDir(dir); len(ents) != 2 {
				t.Errorf("%d files in the directory, want 2", len(ents))
			}
			golden(t, name+".nfd", string(nfd))
			golden(t, name+".prom", string(prom))

			labels := checkFeatures(t, string(nfd))
			samples := parseProm(t, string(prom))
			ready := labels["gdrlink.io/gpudirect.ready"] == "true"
			if v, ok := value(samples, "gdrlink_gpudirect_ready"); !ok || (v == 1) != ready {
				t.Errorf("gdrlink_gpudirect_ready %v (%v), label %v", v, ok, ready)
			}
			if ready && code != exitReady {
				t.Errorf("ready with exit %d", code)
			}
			if v, _ := value(samples, "gdrlink_check_exit_code"); int(v) != code {
				t.Errorf("gdrlink_check_exit_code %v, want %d", v, code)
			}
			gpus, _ := value(samples, "gdrlink_gpus")
			if labels["gdrlink.io/gpu.count"] != strconv.Itoa(int(gpus)) {
				t.Errorf("gpu.count %s, gdrlink_gpus %v", labels["gdrlink.io/gpu.count"], gpus)
			}
			for i := 0; i < int(gpus); i++ {
				mode := labels["gdrlink.io/gpu-"+strconv.Itoa(i)+".mode"]
				v, ok := value(samples, "gdrlink_gpu_direct", "gpu", strconv.Itoa(i), "mode", mode)
				if !ok || (v == 1) != (mode == "direct") {
					t.Errorf("GPU %d: label mode %q, metric %v (%v)", i, mode, v, ok)
				}
			}
			nics, _ := value(samples, "gdrlink_rdma_devices")
			if labels["gdrlink.io/rdma.count"] != strconv.Itoa(int(nics)) {
				t.Errorf("rdma.count %s, gdrlink_rdma_devices %v", labels["gdrlink.io/rdma.count"], nics)
			}
			switch pm := labels["gdrlink.io/peermem"]; pm {
			case "nvidia_peermem", "nv_peer_mem":
				if v, _ := value(samples, "gdrlink_peer_memory_module_loaded", "module", pm); v != 1 {
					t.Errorf("peermem %s but the metric says %v", pm, v)
				}
			case "none":
				for _, m := range peerMemModules {
					if v, ok := value(samples, "gdrlink_peer_memory_module_loaded", "module", m); !ok || v != 0 {
						t.Errorf("peermem none but %s is %v (%v)", m, v, ok)
					}
				}
			case "unknown":
			default:
				t.Errorf("peermem %q", pm)
			}
			for label, metric := range map[string]string{"dmabuf": "gdrlink_dmabuf_supported", "libibverbs": "gdrlink_libibverbs_installed"} {
				l, ok := labels["gdrlink.io/"+label]
				want, known := map[string]string{"true": "1", "false": "0", "unknown": ""}[l]
				if !ok || !known {
					t.Errorf("%s label %q (%v)", label, l, ok)
				}
				v, ok := value(samples, metric)
				if want == "" && ok || want != "" && (!ok || strconv.Itoa(int(v)) != want) {
					t.Errorf("%s label %q, %s %v (%v)", label, l, metric, v, ok)
				}
			}
		})
	}
}

func TestNFDExpiry(t *testing.T) {
	t.Setenv("GDRLINK_NET_GDR_LEVEL", "")
	old := now
	now = func() time.Time { return time.Date(2026, 1, 2, 3, 4, 5, 0, time.FixedZone("x", 3600)) }
	t.Cleanup(func() { now = old })
	dir := t.TempDir()
	// The human report, with --selftest off, is unaffected by the export.
	if _, errs, code := runArgs(t, "--root", "testdata/nodes/cloud-vm", "--color", "never", "--nfd", dir, "--nfd-expiry", "2h"); code != exitDegraded {
		t.Fatalf("exit %d: %s", code, errs)
	}
	b, err := os.ReadFile(filepath.Join(dir, nfdFile))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(b), "# +expiry-time=2026-01-02T04:04:05Z\ngdrlink.io/") {
		t.Fatalf("feature file:\n%s", b)
	}
	checkFeatures(t, string(b))
}

func TestLabelValue(t *testing.T) {
	long := strings.Repeat("a", 70)
	for _, tc := range []struct{ in, want string }{
		{"", ""},
		{"ready", "ready"},
		{"not-ready", "not-ready"},
		{"0000:1a:00.0", "0000_1a_00.0"},
		{"mlx5_0", "mlx5_0"},
		{"-x-", "x"},
		{"_.-", ""},
		{"a b/c", "a_b_c"},
		{"ünï", "n"},
		{long, long[:63]},
		{strings.Repeat("a", 62) + "-b", strings.Repeat("a", 62)},
		{"NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3"},
		{"v\n1", "v_1"},
	} {
		got := labelValue(tc.in)
		if got != tc.want {
			t.Errorf("labelValue(%q) = %q, want %q", tc.in, got, tc.want)
		}
		if !labelValueRE.MatchString(got) {
			t.Errorf("labelValue(%q) = %q is not a label value", tc.in, got)
		}
	}
	if got := labelName("..."); got != "unnamed" {
		t.Errorf("labelName(...) = %q", got)
	}
}

func FuzzLabelValue(f *testing.F) {
	f.Add("0000:1a:00.0")
	f.Add("-_.")
	f.Fuzz(func(t *testing.T, s string) {
		if v := labelValue(s); !labelValueRE.MatchString(v) {
			t.Fatalf("labelValue(%q) = %q", s, v)
		}
	})
}

func TestPromEscape(t *testing.T) {
	n := nodeFacts{verdict: "ready", gpus: []gpuFact{{index: 0, busID: `a"b\c` + "\nd", mode: "direct"}}}
	s := parseProm(t, string(promText(n)))
	if _, ok := value(s, "gdrlink_gpu_direct", "bus_id", `a"b\c`+"\nd"); !ok {
		t.Fatalf("escaped label did not parse back:\n%s", promText(n))
	}
}

// TestWriteAtomicKeepsOld: a write that fails leaves the old file as it was
// and no temporary file behind.
func TestWriteAtomicKeepsOld(t *testing.T) {
	t.Run("sync fails", func(t *testing.T) {
		dir := t.TempDir()
		p := filepath.Join(dir, textfileFile)
		if err := os.WriteFile(p, []byte("old\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		old := syncFile
		syncFile = func(*os.File) error { return errors.New("injected") }
		t.Cleanup(func() { syncFile = old })
		_, errs, code := runArgs(t, "--root", "testdata/nodes/dgx", "--json", "--textfile", dir)
		if code != exitNotReady || !strings.Contains(errs, "--textfile: injected") {
			t.Fatalf("exit %d, stderr %q", code, errs)
		}
		assertOnly(t, dir, textfileFile, "old\n")
	})
	t.Run("target is a directory", func(t *testing.T) {
		dir := t.TempDir()
		p := filepath.Join(dir, nfdFile)
		if err := os.MkdirAll(filepath.Join(p, "keep"), 0o755); err != nil {
			t.Fatal(err)
		}
		_, errs, code := runArgs(t, "--root", "testdata/nodes/dgx", "--nfd", dir)
		if code != exitNotReady || !strings.Contains(errs, "--nfd:") {
			t.Fatalf("exit %d, stderr %q", code, errs)
		}
		if _, err := os.Stat(filepath.Join(p, "keep")); err != nil {
			t.Fatal(err)
		}
		if ents, _ := os.ReadDir(dir); len(ents) != 1 {
			t.Fatalf("%d entries left, want 1", len(ents))
		}
	})
	t.Run("directory not writable", func(t *testing.T) {
		if os.Geteuid() == 0 {
			t.Skip("root writes to a read-only directory; the other cases cover the failure")
		}
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, nfdFile), []byte("old\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(dir, 0o555); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Chmod(dir, 0o755) })
		if _, errs, code := runArgs(t, "--root", "testdata/nodes/dgx", "--nfd", dir); code != exitNotReady || errs == "" {
			t.Fatalf("exit %d, stderr %q", code, errs)
		}
		assertOnly(t, dir, nfdFile, "old\n")
	})
	t.Run("no directory", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "missing")
		if _, errs, code := runArgs(t, "--root", "testdata/nodes/dgx", "--textfile", dir); code != exitNotReady || errs == "" {
			t.Fatalf("exit %d, stderr %q", code, errs)
		}
	})
	t.Run("replaces", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, nfdFile), []byte("old\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := writeAtomic(dir, nfdFile, []byte("new\n")); err != nil {
			t.Fatal(err)
		}
		assertOnly(t, dir, nfdFile, "new\n")
		if fi, err := os.Stat(filepath.Join(dir, nfdFile)); err != nil || fi.Mode().Perm() != 0o644 {
			t.Fatalf("%v %v", fi.Mode(), err)
		}
	})
}

// assertOnly checks that dir holds just name, with the content.
func assertOnly(t *testing.T, dir, name, content string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != name {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("directory holds %v, want only %s", names, name)
	}
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil || string(b) != content {
		t.Fatalf("%s is %q (%v), want %q", name, b, err, content)
	}
}
