package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"os"
	"strings"
	"testing"
)

// runBench runs the program in-process and returns its exit status and
// output.
func runBench(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// addScenario registers a scenario for one test.
func addScenario(t *testing.T, s Scenario) {
	t.Helper()
	register(s)
	t.Cleanup(func() { delete(scenarios, s.Name) })
}

// parseLines parses -json output, checking that every line is one object
// with the keys every result must have.
func parseLines(t *testing.T, out string) []Result {
	t.Helper()
	required := []string{"scenario", "case", "size_bytes", "value", "unit", "baseline", "ratio"}
	var rs []Result
	for i, line := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("line %d %q is not JSON: %v", i+1, line, err)
		}
		for _, k := range required {
			if _, ok := m[k]; !ok {
				t.Fatalf("line %d %q lacks %q", i+1, line, k)
			}
		}
		var r Result
		dec := json.NewDecoder(strings.NewReader(line))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&r); err != nil {
			t.Fatalf("line %d %q: %v", i+1, line, err)
		}
		rs = append(rs, r)
	}
	return rs
}

func TestMemcpyQuickJSON(t *testing.T) {
	code, out, errOut := runBench(t, "-quick", "-json", "-scenario", "memcpy")
	if code != exitOK {
		t.Fatalf("exit %d, stderr:\n%s", code, errOut)
	}
	rs := parseLines(t, out)
	want := sweepSizes(memcpyMinSize, quickMaxSize)
	if len(rs) != 2*len(want) {
		t.Fatalf("%d results, want %d (two cases at %v)", len(rs), 2*len(want), want)
	}
	seen := map[string]map[int64]Result{}
	for _, r := range rs {
		if r.Scenario != "memcpy" || r.Unit != "GB/s" {
			t.Errorf("result %+v: want scenario memcpy in GB/s", r)
		}
		// A single thread copying memory moves between a tenth of a GB and
		// a few hundred GB per second on anything this runs on.
		if !(r.Value > 0.1 && r.Value < 1000) {
			t.Errorf("%s at %d: %v GB/s is not a plausible copy rate", r.Case, r.SizeBytes, r.Value)
		}
		if r.Note == "" || !strings.Contains(r.Note, "huge pages") {
			t.Errorf("%s: note %q does not say how the pages were backed", r.Case, r.Note)
		}
		switch r.Case {
		case "memcpy-4k":
			if r.Baseline != 0 || r.Ratio != 0 || r.BaselineName != "" {
				t.Errorf("memcpy-4k has a baseline: %+v", r)
			}
		case "memcpy-thp":
			base, ok := seen["memcpy-4k"][r.SizeBytes]
			if !ok {
				t.Fatalf("memcpy-thp at %d before memcpy-4k", r.SizeBytes)
			}
			if r.BaselineName != "memcpy-4k" || r.Baseline != base.Value {
				t.Errorf("memcpy-thp baseline %s %v, want memcpy-4k %v", r.BaselineName, r.Baseline, base.Value)
			}
			if math.Abs(r.Ratio-r.Value/r.Baseline) > 1e-9 {
				t.Errorf("ratio %v, want %v", r.Ratio, r.Value/r.Baseline)
			}
		default:
			t.Errorf("unexpected case %q", r.Case)
		}
		if seen[r.Case] == nil {
			seen[r.Case] = map[int64]Result{}
		}
		seen[r.Case][r.SizeBytes] = r
	}
	for _, c := range []string{"memcpy-4k", "memcpy-thp"} {
		for _, size := range want {
			if _, ok := seen[c][size]; !ok {
				t.Errorf("no %s result at %d bytes", c, size)
			}
		}
	}
}

func TestMemcpyMaxSizeAndSVG(t *testing.T) {
	dir := t.TempDir()
	code, out, errOut := runBench(t, "-quick", "-reps", "1", "-max-size", "128KiB", "-scenario", "memcpy", "-svg", dir)
	if code != exitOK {
		t.Fatalf("exit %d, stderr:\n%s", code, errOut)
	}
	for _, want := range []string{"SCENARIO", "memcpy-4k", "memcpy-thp", "64 KiB", "128 KiB", "note (memcpy-thp)"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "256 KiB") {
		t.Errorf("-max-size 128KiB still measured 256 KiB:\n%s", out)
	}
	texts := readSVG(t, dir+"/memcpy-bandwidth.svg")
	for _, want := range []string{"memcpy-4k", "memcpy-thp", "64KiB", "128KiB"} {
		if !slicesContain(texts, want) {
			t.Errorf("SVG texts %q lack %q", texts, want)
		}
	}
}

func TestTableAligned(t *testing.T) {
	addScenario(t, Scenario{Name: "t-table", Doc: "fake", Run: func(ctx context.Context, env *Env) error {
		env.Emit(newResult("t-table", "a", 1<<20, 3.5, "GB/s", 7, "memcpy"))
		env.Emit(newResult("t-table", "a-much-longer-case", 64<<10, 1234567.8, "ns", 0, ""))
		return nil
	}})
	code, out, errOut := runBench(t, "-scenario", "t-table")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 4 {
		t.Fatalf("want a header, two rows and the ratio legend:\n%s", out)
	}
	if lines[3] != ratioLegend {
		t.Errorf("no ratio legend after the table: %q", lines[3])
	}
	col := strings.Index(lines[0], "SIZE")
	if strings.Index(lines[1], "1.0 MiB") != col || strings.Index(lines[2], "64 KiB") != col {
		t.Errorf("SIZE column not aligned:\n%s", out)
	}
	col = strings.Index(lines[0], "RATIO")
	if strings.Index(lines[1], "0.50x") != col {
		t.Errorf("RATIO column not aligned or wrong:\n%s", out)
	}
	if !strings.Contains(lines[2], "1,234,568") {
		t.Errorf("large figure not grouped: %q", lines[2])
	}
}

func TestFailingScenarioDoesNotStopOthers(t *testing.T) {
	ok := func(ctx context.Context, env *Env) error {
		env.Emit(newResult("", "c", 4096, 1, "GB/s", 0, ""))
		return nil
	}
	addScenario(t, Scenario{Name: "t-fail", Run: func(ctx context.Context, env *Env) error { return errors.New("no device here") }})
	addScenario(t, Scenario{Name: "t-panic", Run: func(ctx context.Context, env *Env) error { panic("boom") }})
	addScenario(t, Scenario{Name: "t-nan", Run: func(ctx context.Context, env *Env) error {
		env.Emit(newResult("t-nan", "c", 1, math.NaN(), "GB/s", 0, ""))
		return nil
	}})
	addScenario(t, Scenario{Name: "t-misnamed", Run: func(ctx context.Context, env *Env) error {
		env.Emit(newResult("t-other", "c", 1, 1, "GB/s", 0, ""))
		return nil
	}})
	addScenario(t, Scenario{Name: "t-ok", Run: ok})
	code, out, errOut := runBench(t, "-json", "-scenario", "t-fail,t-panic,t-nan,t-misnamed,t-ok")
	if code != exitFailed {
		t.Fatalf("exit %d, want %d", code, exitFailed)
	}
	for _, want := range []string{"t-fail failed: no device here", "t-panic failed: panic: boom", "t-nan failed", "not finite", `result of scenario "t-other" emitted by "t-misnamed"`} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
	rs := parseLines(t, out)
	if len(rs) != 1 || rs[0].Scenario != "t-ok" {
		t.Fatalf("results %+v, want the one of t-ok (scenario filled in)", rs)
	}
}

func TestSetArgsReachScenario(t *testing.T) {
	var got map[string]string
	var env Env
	addScenario(t, Scenario{Name: "t-args", Run: func(ctx context.Context, e *Env) error {
		got, env = e.Args, *e
		e.Emit(newResult("t-args", "c", 1, 1, "GB/s", 0, ""))
		return nil
	}})
	code, _, errOut := runBench(t, "-scenario", "t-args", "-set", "a=1", "-set", "b=x=y", "-quick", "-max-size", "1 MB")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if got["a"] != "1" || got["b"] != "x=y" || len(got) != 2 {
		t.Errorf("Args = %v", got)
	}
	if !env.Quick || env.Reps != quickReps || env.MaxSize != 1000000 || env.Log == nil {
		t.Errorf("Env = %+v", env)
	}
}

func TestUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		{"-scenario", "no-such-scenario"},
		{"-scenario", ","},
		{"-reps", "0"},
		{"-max-size", "lots"},
		{"-set", "novalue"},
		{"-set", "=v"},
		{"-nosuchflag"},
		{"stray"},
	} {
		code, out, errOut := runBench(t, args...)
		if code != exitUsage || out != "" || errOut == "" {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want %d with a message", args, code, out, errOut, exitUsage)
		}
	}
}

func TestList(t *testing.T) {
	code, out, _ := runBench(t, "-list")
	if code != exitOK || !strings.Contains(out, "memcpy") || !strings.Contains(out, "memcpy-bandwidth.svg") {
		t.Fatalf("exit %d, -list printed:\n%s", code, out)
	}
}

func TestSelectScenarios(t *testing.T) {
	addScenario(t, Scenario{Name: "t-b"})
	addScenario(t, Scenario{Name: "t-a"})
	got, err := selectScenarios(" t-b , t-a,t-b,")
	if err != nil || strings.Join(got, ",") != "t-b,t-a" {
		t.Fatalf("selectScenarios = %v, %v", got, err)
	}
	all, err := selectScenarios("all")
	if err != nil || len(all) != len(scenarios) {
		t.Fatalf("all = %v, %v", all, err)
	}
}

func slicesContain(xs []string, want string) bool {
	for _, x := range xs {
		if strings.Contains(x, want) {
			return true
		}
	}
	return false
}

// TestRunChild: the environment variable of a scenario's child role runs
// that role from main (with the variable's value, exiting with its
// status), none runs nothing, and two at once are refused; the
// scenarios that re-execute the binary declare their roles.
func TestRunChild(t *testing.T) {
	const env = "GDRLINK_BENCH_TEST_CHILD"
	var got string
	register(Scenario{Name: "test-child", Child: &Child{Env: env, Run: func(v string) int { got = v; return 7 }}})
	t.Cleanup(func() { delete(scenarios, "test-child") })
	vars := map[string]string{}
	getenv := func(k string) string { return vars[k] }
	if code, ok := runChild(getenv); ok {
		t.Fatalf("no role set: ran one (status %d)", code)
	}
	vars[env] = "peer-arg"
	if code, ok := runChild(getenv); !ok || code != 7 || got != "peer-arg" {
		t.Fatalf("role set: status %d, ran %v, value %q; want 7, true, peer-arg", code, ok, got)
	}
	vars[allReduceRankEnv] = "1"
	if code, ok := runChild(getenv); !ok || code != exitUsage {
		t.Fatalf("two roles set: status %d, ran %v; want %d, true", code, ok, exitUsage)
	}
	for name, want := range map[string]string{"allreduce": allReduceRankEnv, "tensor": tensorPeerEnv, "xfer": xferPeerEnv, "ipc": ipcPeerEnv} {
		if c := scenarios[name].Child; c == nil || c.Env != want {
			t.Errorf("scenario %s: child role %+v, want one run by %s", name, c, want)
		}
	}
}

// TestMain runs a child role as main does: the scenarios' tests
// re-execute this test binary as their peers and ranks.
func TestMain(m *testing.M) {
	if code, ok := runChild(os.Getenv); ok {
		os.Exit(code)
	}
	os.Exit(m.Run())
}
