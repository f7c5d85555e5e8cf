package main

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio/ibverbs"
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

// TestXferIbverbs runs the scenario on the ibverbs provider alone. Without
// a device it must say so in a skipped result's note (and fail, since no
// provider ran); with one, every bandwidth figure must stand next to
// ib_write_bw's measured on the same device and every latency figure next
// to ib_write_lat's, or say why it does not.
func TestXferIbverbs(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a peer process and ib_write_bw")
	}
	code, out, errOut := runBench(t, "-quick", "-reps", "1", "-json", "-max-size", "64KiB", "-scenario", "xfer",
		"-set", "xfer.ucx=off", "-set", "xfer.providers=ibverbs")
	var rs []Result
	if strings.TrimSpace(out) != "" {
		rs = parseLines(t, out)
	}
	if _, devErr := ibverbs.New().Devices(); devErr != nil {
		if os.Getenv(requireRDMAEnv) == "1" {
			t.Fatalf("%s=1 but no RDMA device: %v", requireRDMAEnv, devErr)
		}
		if code != exitFailed || !strings.Contains(errOut, "no provider could run") {
			t.Errorf("without a device: exit %d, stderr %s", code, errOut)
		}
		if len(rs) != 1 || rs[0].Case != "skipped/ibverbs" || !strings.Contains(rs[0].Note, "not measured") || !strings.Contains(rs[0].Note, devErr.Error()) {
			t.Fatalf("without a device, want one skipped/ibverbs result saying why (%v); got %+v", devErr, rs)
		}
		t.Logf("skipped, as it should be: %s", rs[0].Note)
		return
	}
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	_, perftestErr := exec.LookPath("ib_write_bw")
	_, latErr := exec.LookPath("ib_write_lat")
	seen := map[string]int{}
	for _, r := range rs {
		seen[r.Case]++
		if r.Case == "lat/ibverbs" {
			switch {
			case latErr != nil:
				if r.Baseline != 0 || !strings.Contains(r.Note, "no ib_write_lat baseline") {
					t.Errorf("without ib_write_lat: %+v", r)
				}
			case r.BaselineName != "ib_write_lat" || !(r.Baseline > 0) || !(r.Ratio > 0) || !strings.Contains(r.Note, "ib_write_lat -d") || !strings.Contains(r.Note, "t_typical"):
				t.Errorf("latency result without its ib_write_lat baseline: %+v", r)
			default:
				t.Logf("lat %s: %.2f us one-way, ib_write_lat %.2f us, ratio %.2f", formatSize(r.SizeBytes), r.Value, r.Baseline, r.Ratio)
			}
			continue
		}
		if r.Case != "bw/ibverbs" {
			continue
		}
		if perftestErr != nil {
			if r.Baseline != 0 || !strings.Contains(r.Note, "no ib_write_bw baseline") {
				t.Errorf("without perftest: %+v", r)
			}
			continue
		}
		if r.BaselineName != "ib_write_bw" || !(r.Baseline > 0) || !(r.Ratio > 0) || !strings.Contains(r.Note, "ib_write_bw -d") {
			t.Errorf("bandwidth result without its ib_write_bw baseline: %+v", r)
		}
		t.Logf("%s: %.4f GB/s, ib_write_bw %.4f GB/s, ratio %.2f", formatSize(r.SizeBytes), r.Value, r.Baseline, r.Ratio)
	}
	// -quick keeps the first, middle and last of 4, 8, 16, 32 and 64 KiB.
	if seen["bw/ibverbs"] != 3 || seen["lat/ibverbs"] != 2 {
		t.Errorf("results %v, want 3 bw/ibverbs and 2 lat/ibverbs", seen)
	}
}

// TestTimePair checks that a baseline timing itself is taken at its word,
// and that both sides run once untimed and reps times timed.
func TestTimePair(t *testing.T) {
	var na, nb int
	a := wallTime(func() error { na++; return nil })
	b := func() (time.Duration, error) { nb++; return time.Duration(nb) * time.Second, nil }
	da, db, err := timePair(4, a, b)
	if err != nil {
		t.Fatal(err)
	}
	if na != 5 || nb != 5 {
		t.Errorf("runs %d and %d, want 5 each", na, nb)
	}
	// The timed runs of b said 2..5 s: their median is 3.5 s.
	if db != 3500*time.Millisecond || da <= 0 || da > time.Second {
		t.Errorf("times %v and %v", da, db)
	}
	if _, db, err := timePair(2, a, nil); err != nil || db != 0 {
		t.Errorf("without a baseline: %v, %v", db, err)
	}
}
