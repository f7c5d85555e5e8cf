package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func writeReport(t *testing.T, dir, name string, r report) string {
	t.Helper()
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, append(b, '\n'), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestRowOutcomes(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		name       string
		recv, send *report
		want       string
	}{
		{"clean", &report{Role: "recv", Steps: 4, Verified: 4}, &report{Role: "send", Steps: 4}, "ok"},
		{"corrupt", &report{Role: "recv", Steps: 4, Verified: 3, Corrupt: 1}, &report{Role: "send", Steps: 4}, "CORRUPT ACCEPTED"},
		{"failed", &report{Role: "recv", Steps: 2, Verified: 2, Err: "peer lost", ErrAt: 3_000_000_000}, &report{Role: "send", Steps: 4}, "failed"},
		{"killed", &report{Role: "recv", Steps: 4, Verified: 4}, nil, "ok, sender gone"},
		{"norecv", nil, &report{Role: "send", Steps: 4}, "no report"},
	}
	for _, c := range cases {
		rp, sp := filepath.Join(dir, c.name+".recv"), filepath.Join(dir, c.name+".send")
		if c.recv != nil {
			writeReport(t, dir, c.name+".recv", *c.recv)
		}
		if c.send != nil {
			writeReport(t, dir, c.name+".send", *c.send)
		}
		var out bytes.Buffer
		if err := printRow(&out, c.name, 1_000_000_000, []string{rp, sp}); err != nil {
			t.Fatal(err)
		}
		fields := strings.Fields(out.String())
		if len(fields) < 2 || !strings.HasPrefix(strings.Join(fields[1:], " "), c.want) {
			t.Errorf("%s: row %q, want outcome %q", c.name, out.String(), c.want)
		}
	}
	var out bytes.Buffer
	if err := printRow(&out, "x", 0, []string{"a"}); err == nil {
		t.Error("printRow with one report: no error")
	}
}

func TestFillDiffersPerStep(t *testing.T) {
	a, b := make([]byte, 4096), make([]byte, 4096)
	fill(a, 1)
	fill(b, 2)
	if bytes.Equal(a, b) {
		t.Fatal("steps 1 and 2 have the same content: a stale tensor would pass")
	}
	c := make([]byte, 4096)
	fill(c, 1)
	if !bytes.Equal(a, c) {
		t.Fatal("fill is not deterministic")
	}
}

// TestMatrixBaseline runs the script's clean cell: two namespaces, the
// whole stream verified, nothing left behind. It needs root and the tools
// the script names.
func TestMatrixBaseline(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the matrix starts two processes in two network namespaces")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: network namespaces, tc, nftables")
	}
	out, err := exec.Command("../../scripts/fault-matrix.sh", "baseline").CombinedOutput()
	if err != nil {
		t.Fatalf("fault-matrix.sh baseline: %v\n%s", err, out)
	}
	if s := string(out); strings.Contains(s, "SKIP fault-matrix:") {
		t.Skip(strings.TrimSpace(s))
	}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) > 0 && f[0] == "baseline" {
			if f[1] != "ok" || !strings.Contains(line, "400/400") || !strings.Contains(line, "+0/+0") {
				t.Fatalf("baseline row: %q\n%s", line, out)
			}
			return
		}
	}
	t.Fatalf("no baseline row:\n%s", out)
}
