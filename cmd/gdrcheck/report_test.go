package main

import (
	"context"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/gdr"
)

// TestReportNoGPU checks the verdict of a node without GPUs: its RDMA is
// usable only with an active port and libibverbs installed.
func TestReportNoGPU(t *testing.T) {
	noVerbs := gdr.Check{Status: gdr.StatusNotSupported, Detail: "libibverbs.so.1 not found (rdma-core's libibverbs is not installed)"}
	cases := []struct {
		name     string
		verbs    gdr.Check
		portDown bool
		verdict  string
		code     int
		summary  []string
	}{
		{"libibverbs present", gdr.Check{Status: gdr.StatusAvailable, Detail: "libibverbs.so.1 at /usr/lib64/libibverbs.so.1"}, false, "ready", exitReady, []string{"1 RDMA device(s) with an active port: host-memory RDMA only"}},
		{"libibverbs unknown", gdr.Check{Detail: "no libibverbs.so.1 under the root"}, false, "ready", exitReady, []string{"host-memory RDMA only"}},
		{"libibverbs missing", noVerbs, false, "not-ready", exitNotReady, []string{"RDMA is unusable (libibverbs: " + noVerbs.Detail + ")"}},
		{"libibverbs missing, port down", noVerbs, true, "not-ready", exitNotReady, []string{"RDMA is unusable (no RDMA device has an active port; libibverbs: " + noVerbs.Detail + ")"}},
		{"port down", gdr.Check{Status: gdr.StatusAvailable}, true, "not-ready", exitNotReady, []string{"RDMA is unusable (no RDMA device has an active port)"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f, err := gdr.Collect(context.Background(), gdr.CollectOptions{Root: "testdata/nodes/no-gpu"})
			if err != nil {
				t.Fatal(err)
			}
			f.Verbs = c.verbs
			if c.portDown {
				f.NICs[0].Ports[0].State = "DOWN"
			}
			r := buildReport(f, nil, gdr.Policy{Level: gdr.PathPXB}, "no-gpu")
			if r.Verdict != c.verdict || r.ExitCode != c.code {
				t.Errorf("%s (exit %d), want %s (exit %d): %s", r.Verdict, r.ExitCode, c.verdict, c.code, r.Summary)
			}
			for _, s := range c.summary {
				if !strings.Contains(r.Summary, s) {
					t.Errorf("summary %q lacks %q", r.Summary, s)
				}
			}
		})
	}
}
