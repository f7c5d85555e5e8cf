package main

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/internal/cuda"
	"github.com/gdrlink/gdrlink/proxy"
)

// TestIPCQuick runs the ipc scenario in both modes with a second process
// pulling, and checks every row: both baselines per size and mode, positive
// figures, the ratio's direction, and a note that says which mode it is
// (the analogs say they are not a GPU measurement; with a CUDA driver the
// real-GPU rows come first).
func TestIPCQuick(t *testing.T) {
	code, out, errOut := runBench(t, "-quick", "-json", "-reps", "3", "-max-size", "1MiB", "-scenario", "ipc")
	if code != exitOK {
		t.Fatalf("exit %d, stderr:\n%s", code, errOut)
	}
	rs := parseLines(t, out)
	cases := map[string]int{}
	for _, r := range rs {
		cases[r.Case]++
		mode := r.Case[strings.LastIndex(r.Case, "/")+1:]
		want := map[string]string{"cpu": "CPU ANALOG", "sim": "SIMULATED GPU", "cuda": "REAL GPU"}[mode]
		if want == "" || !strings.Contains(r.Note, want) || !strings.Contains(r.Note, "second process") {
			t.Errorf("%s/%d: note %q does not say %q", r.Case, r.SizeBytes, r.Note, want)
		}
		if r.Unit != "GB/s" || !(r.Value > 0) || !(r.Baseline > 0) {
			t.Errorf("%s/%d: value %v %s baseline %v", r.Case, r.SizeBytes, r.Value, r.Unit, r.Baseline)
		}
		if got := r.Value / r.Baseline; got/r.Ratio < 0.999 || got/r.Ratio > 1.001 {
			t.Errorf("%s/%d: ratio %v, want pull/baseline %v", r.Case, r.SizeBytes, r.Ratio, got)
		}
	}
	// 4 KiB..1 MiB is 9 sizes.
	for _, c := range []string{"pull-vs-inprocess/cpu", "pull-vs-staged/cpu", "pull-vs-inprocess/sim", "pull-vs-staged/sim"} {
		if cases[c] != 9 {
			t.Errorf("case %s has %d rows, want 9 (all: %v)", c, cases[c], cases)
		}
	}
}

func TestIPCModeSetting(t *testing.T) {
	code, _, errOut := runBench(t, "-quick", "-scenario", "ipc", "-set", "ipc.mode=gpu-please")
	if code != exitFailed || !strings.Contains(errOut, "ipc.mode") {
		t.Errorf("exit %d, %s", code, errOut)
	}
}

// TestIPCRealGPU runs the ipc scenario's real-GPU mode on a small sweep:
// a second process opens the legacy CUDA IPC handle and pulls with
// cuMemcpyDtoDAsync; the bytes are checked on the first pull of each size.
func TestIPCRealGPU(t *testing.T) {
	cd, err := proxy.NewCUDADevice(0)
	if err != nil {
		if os.Getenv("GDRLINK_REQUIRE_GPU") == "1" || !errors.Is(err, cuda.ErrNoDriver) {
			t.Fatalf("no CUDA device 0: %v", err)
		}
		t.Skipf("no CUDA driver: %v", err)
	}
	cd.Close()
	code, out, errOut := runBench(t, "-json", "-reps", "3", "-max-size", "16MiB", "-scenario", "ipc", "-set", "ipc.mode=cuda")
	if code != exitOK {
		t.Fatalf("exit %d, stderr:\n%s", code, errOut)
	}
	rs := parseLines(t, out)
	if len(rs) != 2*13 { // 4 KiB..16 MiB, two baselines
		t.Fatalf("%d results, want 26", len(rs))
	}
	for _, r := range rs {
		if !strings.HasSuffix(r.Case, "/cuda") || !strings.Contains(r.Note, "REAL GPU") || !(r.Value > 0) || !(r.Baseline > 0) {
			t.Errorf("result %+v", r)
		}
	}
}
