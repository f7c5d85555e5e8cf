package main

import (
	"bufio"
	"encoding/json"
	"strings"
	"testing"
)

// The scenario runs for real, quick and small: a peer process per provider
// (this test binary re-executed), the memcpy and raw TCP baselines, UCX
// left out (TestUCXBaseline runs it).
func TestXferScenarioQuick(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a peer process per provider")
	}
	code, out, errOut := runBench(t, "-quick", "-reps", "1", "-json", "-max-size", "64KiB", "-scenario", "xfer",
		"-set", "xfer.ucx=off", "-set", "xfer.providers=onnode,tcp")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	seen := map[string]int{}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		var r Result
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("%q: %v", sc.Text(), err)
		}
		if r.Scenario != "xfer" || r.Value <= 0 {
			t.Errorf("result without a measured value: %+v", r)
		}
		if strings.HasPrefix(r.Case, "bw/") && (r.Unit != "GB/s" || r.Baseline <= 0 || r.BaselineName == "") {
			t.Errorf("bandwidth result without its baseline: %+v", r)
		}
		if strings.HasPrefix(r.Case, "lat/") && (r.Unit != "us" || (r.SizeBytes != 8 && r.SizeBytes != 4096)) {
			t.Errorf("latency result %+v", r)
		}
		seen[r.Case]++
	}
	for c, n := range map[string]int{"bw/onnode-shm": 3, "bw/onnode-vm": 3, "bw/tcp": 3, "lat/onnode": 2, "lat/tcp": 2} {
		if seen[c] != n {
			t.Errorf("%d %s results, want %d; output:\n%s", seen[c], c, n, out)
		}
	}
}
