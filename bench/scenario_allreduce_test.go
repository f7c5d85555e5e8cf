package main

import (
	"fmt"
	"math"
	"os"
	"strings"
	"testing"
)

// TestAllReduceScenarioQuick runs the scenario on 2 and 3 processes of
// this test binary: every size has its bandwidth, and bytes on the wire
// close to the ring's least, 2(W-1)/W × size; the MPI baseline is there
// or its absence said.
func TestAllReduceScenarioQuick(t *testing.T) {
	code, out, errOut := runBench(t, "-quick", "-json", "-reps", "1", "-max-size", "64KiB", "-scenario", "allreduce")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	rs := parseLines(t, out)
	bw, wire := 0, 0
	for _, r := range rs {
		switch {
		case strings.HasPrefix(r.Case, "ring/onnode/"):
			bw++
			if !(r.Value > 0) || r.Unit != "GB/s" {
				t.Errorf("%s %d: %v %s", r.Case, r.SizeBytes, r.Value, r.Unit)
			}
			if r.Baseline == 0 && !strings.Contains(r.Note, "no baseline") {
				t.Errorf("%s %d: no baseline, and the note does not say why: %q", r.Case, r.SizeBytes, r.Note)
			}
		case strings.HasPrefix(r.Case, "wire/onnode/"):
			wire++
			w := 2.0
			if strings.HasSuffix(r.Case, "/3w") {
				w = 3
			}
			least := 2 * (w - 1) / w * float64(r.SizeBytes)
			if math.Abs(r.Value-least) > 64 {
				t.Errorf("%s %d: %v bytes on the wire, want about %v", r.Case, r.SizeBytes, r.Value, least)
			}
		}
	}
	if n := len(sweepSizes(allReduceMinSize, 64<<10)); bw != 2*n || wire != 2*n {
		t.Errorf("%d bandwidth and %d wire results, want %d each", bw, wire, 2*n)
	}
}

// TestAllReduceScenarioSwitchML runs the scenario with the switchml rows
// on 2 processes: every size has a switchml figure with the ring of the
// same run as its baseline (ratio = switchml / ring), and each worker
// took in exactly S bytes of results and sent S bytes plus whole 4 KiB
// messages resent after a timeout (none when no worker is 50 ms late:
// the run logs how many).
func TestAllReduceScenarioSwitchML(t *testing.T) {
	code, out, errOut := runBench(t, "-quick", "-json", "-reps", "1", "-max-size", "64KiB", "-scenario", "allreduce",
		"-set", "allreduce.switchml=on", "-set", "allreduce.workers=2", "-set", "allreduce.mpi=off")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	rs := parseLines(t, out)
	n := len(sweepSizes(allReduceMinSize, 64<<10))
	bw, sent, recv, ring := 0, 0, 0, 0
	for _, r := range rs {
		switch r.Case {
		case "ring/onnode/2w":
			ring++
		case "switchml/2w":
			bw++
			if !(r.Value > 0) || r.Unit != "GB/s" || !(r.Baseline > 0) || r.BaselineName != "ring/onnode" ||
				math.Abs(r.Ratio-r.Value/r.Baseline) > 1e-9*r.Ratio {
				t.Errorf("%s %d: %v %s against %v (%s), ratio %v", r.Case, r.SizeBytes, r.Value, r.Unit, r.Baseline, r.BaselineName, r.Ratio)
			}
		case "wire/switchml/2w":
			sent++
			extra := int64(r.Value) - r.SizeBytes
			if r.Unit != "B" || extra < 0 || extra%4096 != 0 {
				t.Errorf("%s %d: %v bytes sent, want the size plus whole 4 KiB messages", r.Case, r.SizeBytes, r.Value)
			}
			if extra > 0 {
				t.Logf("%s %d: %d messages resent", r.Case, r.SizeBytes, extra/4096)
			}
		case "wire-in/switchml/2w":
			recv++
			if r.Unit != "B" || int64(r.Value) != r.SizeBytes {
				t.Errorf("%s %d: %v bytes received, want the size", r.Case, r.SizeBytes, r.Value)
			}
		}
	}
	if bw != n || sent != n || recv != n || ring != n {
		t.Errorf("%d switchml, %d sent, %d received and %d ring results, want %d each", bw, sent, recv, ring, n)
	}
}

func TestParseMPIAllReduce(t *testing.T) {
	got, err := parseMPIAllReduce([]byte("4096 0.000010 0.000030 0.000020\n8192 0.1 0.2 0.3\n"), 3)
	if err != nil || got[4096] != 0.00002 || got[8192] != 0.2 || len(got) != 2 {
		t.Fatalf("%v, %v", got, err)
	}
	for _, bad := range []string{"4096 0.1 0.2\n", "x 1 2 3\n", "4096 1 2 -3\n", "4096 1 2 NaN\n", "4096 1 2 Inf\n", "-5 1 2 3\n"} {
		if _, err := parseMPIAllReduce([]byte(bad), 3); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// FuzzParseMPIAllReduce: the baseline's output parses to positive times or
// an error, never a panic.
func FuzzParseMPIAllReduce(f *testing.F) {
	f.Add([]byte("4096 0.000010 0.000030 0.000020\n"), 3)
	f.Add([]byte("1 1e-9\n2 Inf\n"), 1)
	f.Fuzz(func(t *testing.T, b []byte, reps int) {
		if reps < 1 || reps > 64 {
			return
		}
		m, err := parseMPIAllReduce(b, reps)
		if err != nil {
			return
		}
		for size, s := range m {
			if size <= 0 || !(s > 0) || math.IsInf(s, 0) {
				t.Fatalf("size %d: %v seconds", size, s)
			}
		}
	})
}

// TestAllReduceScenarioSwitchMLVerbs: -set allreduce.switchml=verbs. With
// GDRLINK_TEST_ROCE_VETH=1 (the Soft-RoCE guest of make test-rdma, as
// root) it runs the verbs workers through an aggregator process in a
// namespace on 2 processes: every size has a switchml-verbs figure over
// switchml/verbs with the ring of the same run as baseline, and each
// worker took in exactly S bytes. Elsewhere the scenario fails and says
// that it needs a Soft-RoCE device. A mode it does not know is a usage
// error (the scenario fails and names the modes).
func TestAllReduceScenarioSwitchMLVerbs(t *testing.T) {
	code, _, errOut := runBench(t, "-quick", "-scenario", "allreduce", "-set", "allreduce.switchml=rdma")
	if code != exitFailed || !strings.Contains(errOut, "want on, udp, verbs or off") {
		t.Errorf("allreduce.switchml=rdma: exit %d: %s", code, errOut)
	}
	args := []string{"-quick", "-json", "-reps", "1", "-max-size", "16KiB", "-scenario", "allreduce",
		"-set", "allreduce.switchml=verbs", "-set", "allreduce.workers=2", "-set", "allreduce.mpi=off"}
	if os.Getenv("GDRLINK_TEST_ROCE_VETH") != "1" {
		code, _, errOut := runBench(t, args...)
		if code != exitFailed || !strings.Contains(errOut, "needs a Soft-RoCE device") {
			t.Errorf("without a Soft-RoCE device: exit %d: %s", code, errOut)
		}
		t.Logf("without GDRLINK_TEST_ROCE_VETH=1 (no Soft-RoCE here), the refusal only: %s", strings.TrimSpace(errOut))
		return
	}
	code, out, errOut := runBench(t, args...)
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	n := len(sweepSizes(allReduceMinSize, 16<<10))
	rows, in := 0, 0
	for _, r := range parseLines(t, out) {
		switch {
		case strings.HasPrefix(r.Case, "switchml-verbs/"):
			rows++
			if !(r.Value > 0) || r.BaselineName != "ring/onnode" || !strings.Contains(r.Note, "switchml/verbs") {
				t.Errorf("%s %d: %v against %q, note %q", r.Case, r.SizeBytes, r.Value, r.BaselineName, r.Note)
			}
		case strings.HasPrefix(r.Case, "wire-in/switchml-verbs/"):
			in++
			if r.Value != float64(r.SizeBytes) {
				t.Errorf("%s %d: took in %v bytes, want the size", r.Case, r.SizeBytes, r.Value)
			}
		}
	}
	if rows != n || in != n {
		t.Errorf("%d switchml-verbs and %d wire-in rows, want %d each", rows, in, n)
	}
}

// TestRoundMedians checks how rounds combine: each size's time is the
// median over the rounds, its other fields the first round's, and a
// round's ratio is MPI's time over the ring's in that same round, only
// for rounds that have both.
func TestRoundMedians(t *testing.T) {
	runs := [][]allReduceRow{
		{{Size: 4096, Seconds: 3, Links: "onnode"}, {Size: 8192, Seconds: 10}},
		{{Size: 4096, Seconds: 1, Links: "tcp"}, {Size: 8192, Seconds: 20}},
		{{Size: 4096, Seconds: 2}},
	}
	got := roundMedians(runs)
	if len(got) != 2 || got[0].Seconds != 2 || got[0].Links != "onnode" || got[1].Seconds != 15 {
		t.Fatalf("roundMedians = %+v, want 4096 at 2 s over onnode and 8192 at 15 s", got)
	}
	base := []map[int64]float64{{4096: 6, 8192: 5}, {4096: 1}}
	if r := pairedRatios(runs, base, 4096); len(r) != 2 || r[0] != 2 || r[1] != 1 {
		t.Errorf("pairedRatios(4096) = %v, want [2 1] (the third round has no MPI job)", r)
	}
	if r := pairedRatios(runs, base, 8192); len(r) != 1 || r[0] != 0.5 {
		t.Errorf("pairedRatios(8192) = %v, want [0.5] (the second MPI job has no 8192)", r)
	}
	if m := roundMedian(base, 4096); m != 3.5 {
		t.Errorf("roundMedian(4096) = %v, want 3.5", m)
	}
	if m := roundMedian(base, 1<<20); m != 0 {
		t.Errorf("roundMedian of a size no round has = %v, want 0", m)
	}
	if s := formatRatios([]float64{0.814, 1.2}); s != "0.81, 1.20" {
		t.Errorf("formatRatios = %q", s)
	}
}

// TestAllReduceScenarioRounds runs two rounds on 2 processes: one row per
// size (not one per round), whose note says how the rounds were combined;
// with Open MPI present, the ratio is the median of the two rounds' own,
// both printed in the note. A round count below 1 fails the run.
func TestAllReduceScenarioRounds(t *testing.T) {
	code, out, errOut := runBench(t, "-quick", "-json", "-reps", "1", "-max-size", "8KiB", "-scenario", "allreduce",
		"-set", "allreduce.workers=2", "-set", "allreduce.rounds=2")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	rows := 0
	for _, r := range parseLines(t, out) {
		if !strings.HasPrefix(r.Case, "ring/onnode/") {
			continue
		}
		rows++
		if !strings.Contains(r.Note, "2 rounds") {
			t.Errorf("%s %d: note does not say the rounds: %q", r.Case, r.SizeBytes, r.Note)
		}
		if r.Baseline == 0 {
			if !strings.Contains(r.Note, "no baseline") {
				t.Errorf("%s %d: no baseline, and the note does not say why: %q", r.Case, r.SizeBytes, r.Note)
			}
			continue
		}
		i := strings.Index(r.Note, "rounds' own ratios (")
		if i < 0 {
			t.Fatalf("%s %d: baseline but no paired ratios in the note: %q", r.Case, r.SizeBytes, r.Note)
		}
		var a, b float64
		if _, err := fmt.Sscanf(r.Note[i+len("rounds' own ratios ("):], "%f, %f)", &a, &b); err != nil {
			t.Fatalf("%s %d: ratios in %q: %v", r.Case, r.SizeBytes, r.Note, err)
		}
		if want := (a + b) / 2; math.Abs(r.Ratio-want) > 0.01 {
			t.Errorf("%s %d: ratio %v, want the median of %v and %v", r.Case, r.SizeBytes, r.Ratio, a, b)
		}
	}
	if n := len(sweepSizes(allReduceMinSize, 8<<10)); rows != n {
		t.Errorf("%d ring rows, want %d (one per size)", rows, n)
	}
	if code, _, errOut := runBench(t, "-quick", "-scenario", "allreduce", "-set", "allreduce.rounds=0"); code == exitOK || !strings.Contains(errOut, "allreduce.rounds=0") {
		t.Errorf("allreduce.rounds=0: exit %d, stderr %q; want a failure naming the setting", code, errOut)
	}
}
