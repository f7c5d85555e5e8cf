package main

import (
	"strings"
	"testing"
)

func TestProxyQuickSimulated(t *testing.T) {
	code, out, errOut := runBench(t, "-quick", "-json", "-scenario", "proxy", "-set", "proxy.device=sim", "-set", "proxy.chunk=256KiB")
	if code != exitOK {
		t.Fatalf("exit %d, stderr:\n%s", code, errOut)
	}
	rs := parseLines(t, out)
	cases := map[string]int{}
	for _, r := range rs {
		cases[r.Case]++
		if !strings.Contains(r.Note, "SIMULATED") {
			t.Errorf("%s/%d: note %q does not say the GPU is simulated", r.Case, r.SizeBytes, r.Note)
		}
		if !(r.Value > 0) || !(r.Baseline > 0) || !(r.Ratio > 0) {
			t.Errorf("%s/%d: value %v baseline %v ratio %v", r.Case, r.SizeBytes, r.Value, r.Baseline, r.Ratio)
		}
	}
	if cases["htod-proxy"] == 0 || cases["recv-pipelined"] != 1 || cases["recv-unpipelined"] != 1 {
		t.Fatalf("cases %v", cases)
	}
}

func TestProxySettings(t *testing.T) {
	for _, set := range []string{"proxy.sim-copy-bw=fast", "proxy.sim-net-bw=-1", "proxy.chunk=0"} {
		code, _, errOut := runBench(t, "-quick", "-scenario", "proxy", "-set", "proxy.device=sim", "-set", set)
		if code != exitFailed || !strings.Contains(errOut, strings.SplitN(set, "=", 2)[0]) {
			t.Errorf("-set %s: exit %d, %s", set, code, errOut)
		}
	}
}
