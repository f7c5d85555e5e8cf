package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

var update = flag.Bool("update", false, "rewrite the golden reports under testdata/golden")

// layouts are the fixture trees (testdata/nodes links to gdr's) and the exit
// code each must give.
var layouts = map[string]int{
	"dgx":        exitReady,
	"two-socket": exitDegraded,
	"cloud-vm":   exitDegraded,
	"no-gpu":     exitReady,
	"no-rdma":    exitNotReady,
	"broken":     exitNotReady,
}

// runArgs runs gdrcheck in an empty environment (no job key: mode
// loopback-only), so that reports do not depend on the one of the test.
func runArgs(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	return runEnv(t, func(string) string { return "" }, args...)
}

// runEnv runs gdrcheck with the environment getenv.
func runEnv(t *testing.T, getenv func(string) string, args ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), args, getenv, &out, &errb)
	return out.String(), errb.String(), code
}

func compileSchema(t *testing.T) *jsonschema.Schema {
	t.Helper()
	b, err := os.ReadFile("schema.json")
	if err != nil {
		t.Fatal(err)
	}
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	if err := c.AddResource("schema.json", doc); err != nil {
		t.Fatal(err)
	}
	s, err := c.Compile("schema.json")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func validate(t *testing.T, s *jsonschema.Schema, out string) {
	t.Helper()
	inst, err := jsonschema.UnmarshalJSON(strings.NewReader(out))
	if err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, out)
	}
	if err := s.Validate(inst); err != nil {
		t.Fatalf("output does not match schema.json: %v", err)
	}
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	p := filepath.Join("testdata", "golden", name)
	if *update {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(p)
	if err != nil {
		t.Fatalf("%v (go test ./cmd/gdrcheck -update writes it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from the golden file (go test ./cmd/gdrcheck -update rewrites it):\n%s", name, diff(string(want), got))
	}
}

// diff shows the first differing lines.
func diff(a, b string) string {
	al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
	for i := 0; i < len(al) || i < len(bl); i++ {
		var x, y string
		if i < len(al) {
			x = al[i]
		}
		if i < len(bl) {
			y = bl[i]
		}
		if x != y {
			return "line " + itoa(i+1) + ":\n- " + x + "\n+ " + y
		}
	}
	return ""
}

func itoa(i int) string { b, _ := json.Marshal(i); return string(b) }

func TestGoldenLayouts(t *testing.T) {
	t.Setenv("GDRLINK_NET_GDR_LEVEL", "")
	schema := compileSchema(t)
	for name, code := range layouts {
		t.Run(name, func(t *testing.T) {
			root := "testdata/nodes/" + name
			out, errs, got := runArgs(t, "--root", root, "--color", "never")
			if got != code {
				t.Errorf("human: exit %d, want %d; stderr %s", got, code, errs)
			}
			golden(t, name+".txt", out)
			js, errs, got := runArgs(t, "--root", root, "--json")
			if got != code {
				t.Errorf("json: exit %d, want %d; stderr %s", got, code, errs)
			}
			validate(t, schema, js)
			golden(t, name+".json", js)
			var r struct {
				ExitCode int    `json:"exit_code"`
				Verdict  string `json:"verdict"`
			}
			if err := json.Unmarshal([]byte(js), &r); err != nil || r.ExitCode != code {
				t.Errorf("JSON exit_code %d (%v), want %d", r.ExitCode, err, code)
			}
		})
	}
}

// TestThisNode runs the checker on this machine: whatever it has, the
// report must follow the schema and the exit code must match the verdict.
// It reads the job key settings from the test's own environment, as main
// does.
func TestThisNode(t *testing.T) {
	schema := compileSchema(t)
	js, errs, code := runEnv(t, os.Getenv, "--json")
	validate(t, schema, js)
	var r struct {
		ExitCode int    `json:"exit_code"`
		Verdict  string `json:"verdict"`
		Summary  string `json:"summary"`
	}
	if err := json.Unmarshal([]byte(js), &r); err != nil {
		t.Fatal(err)
	}
	if r.ExitCode != code {
		t.Fatalf("exit %d but the report says %d (%s); stderr %s", code, r.ExitCode, r.Summary, errs)
	}
	if want := map[string]int{"ready": 0, "degraded": 1, "not-ready": 2}[r.Verdict]; want != code {
		t.Fatalf("verdict %s with exit %d", r.Verdict, code)
	}
	var facts struct {
		GPUs []json.RawMessage `json:"gpus"`
		NICs []json.RawMessage `json:"nics"`
	}
	if err := json.Unmarshal([]byte(js), &facts); err != nil {
		t.Fatal(err)
	}
	if os.Getenv("GDRLINK_REQUIRE_GPU") == "1" && len(facts.GPUs) == 0 {
		t.Error("GDRLINK_REQUIRE_GPU=1 but gdrcheck found no GPU")
	}
	if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" {
		active := false
		for _, n := range facts.NICs {
			var nic struct {
				Name  string `json:"name"`
				Ports []struct {
					State string `json:"state"`
					GIDs  []struct {
						Type string `json:"type"`
					} `json:"gids"`
				} `json:"ports"`
			}
			if err := json.Unmarshal(n, &nic); err != nil {
				t.Fatal(err)
			}
			for _, p := range nic.Ports {
				t.Logf("%s: port %s, %d GIDs", nic.Name, p.State, len(p.GIDs))
				active = active || p.State == "ACTIVE" && len(p.GIDs) > 0
			}
		}
		if !active {
			t.Error("GDRLINK_REQUIRE_RDMA=1 but gdrcheck found no RDMA device with an active port and a GID")
		}
	}
	human, _, hcode := runEnv(t, os.Getenv)
	if hcode != code || !strings.Contains(human, "Verdict:") || strings.Contains(human, "\x1b[") {
		t.Fatalf("human report: exit %d, colored or without verdict:\n%s", hcode, human)
	}
	t.Logf("this node: %s (exit %d): %s", r.Verdict, code, r.Summary)
	if os.Getenv("GDRLINK_REQUIRE_RDMA") == "1" || os.Getenv("GDRLINK_REQUIRE_GPU") == "1" {
		t.Logf("the report on this node:\n%s", human)
	}
}

func TestFiltersAndPolicy(t *testing.T) {
	t.Setenv("GDRLINK_NET_GDR_LEVEL", "")
	out, _, code := runArgs(t, "--root", "testdata/nodes/dgx", "--gpu", "2", "--nic", "mlx5_1", "--color", "never")
	if code != exitReady || !strings.Contains(out, "GPU2: DIRECT through mlx5_1 (PIX") || strings.Contains(out, "GPU0:") || strings.Contains(out, "mlx5_0") {
		t.Fatalf("filtered report (exit %d):\n%s", code, out)
	}
	out, _, code = runArgs(t, "--root", "testdata/nodes/dgx", "--gpu", "0000:1e:00.0", "--nic", "mlx5_1", "--color", "never")
	if code != exitDegraded || !strings.Contains(out, "GPU1: PROXY through mlx5_1 (SYS)") {
		t.Fatalf("GPU1 with the other socket's NIC (exit %d):\n%s", code, out)
	}
	// The policy: by option, by environment, with NCCL's integers.
	if _, _, code := runArgs(t, "--root", "testdata/nodes/two-socket", "--level", "SYS"); code != exitReady {
		t.Fatalf("two-socket with --level SYS: exit %d, want 0", code)
	}
	t.Setenv("GDRLINK_NET_GDR_LEVEL", "4")
	if out, _, code := runArgs(t, "--root", "testdata/nodes/two-socket", "--color", "never"); code != exitReady || !strings.Contains(out, "env GDRLINK_NET_GDR_LEVEL") {
		t.Fatalf("two-socket with GDRLINK_NET_GDR_LEVEL=4: exit %d\n%s", code, out)
	}
	t.Setenv("GDRLINK_NET_GDR_LEVEL", "")
	for _, bad := range [][]string{
		{"--root", "testdata/nodes/dgx", "--gpu", "7"},
		{"--root", "testdata/nodes/dgx", "--nic", "mlx9"},
		{"--root", "testdata/nodes/dgx", "--level", "FAR"},
		{"--root", "testdata/nodes/does-not-exist"},
		{"--bogus"},
		{"extra"},
	} {
		if _, errs, code := runArgs(t, bad...); code != exitNotReady || errs == "" {
			t.Errorf("%v: exit %d, stderr %q; want 2 with a message", bad, code, errs)
		}
	}
	if _, _, code := runArgs(t, "--color", "always", "--root", "testdata/nodes/broken"); code != exitNotReady {
		t.Fatalf("colored: exit %d", code)
	}
	out, _, _ = runArgs(t, "--color", "always", "--root", "testdata/nodes/broken")
	if !strings.Contains(out, "\x1b[1;31mUNAVAILABLE\x1b[0m") {
		t.Fatal("--color always did not color")
	}
}
