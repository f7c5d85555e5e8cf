package main

import (
	"context"
	"errors"
	"math"
	"os"
	"testing"
	"time"
)

const ucxSample = `+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |       overhead (usec)        |   bandwidth (MB/s)    |  message rate (msg/s) |
ucx.batch,iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr
a,2000,0.090,55.959,55.959,69.81,69.81,17870,17870
b, 100,0.070,680.351,680.351,1469.83,1469.83,1470,1470
[1795316222.254764] [vm:21103:0] perftest.c:1 UCX  WARN something, 1, 2, 3, 4, 5, 6, 7, 8
`

func TestParseUCXOutput(t *testing.T) {
	rows, err := parseUCXOutput([]byte(ucxSample))
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 2 {
		t.Fatalf("rows %+v", rows)
	}
	b := rows["b"]
	if b.Iters != 100 || b.MedianLatU != 0.07 || b.AvgLatU != 680.351 || b.AvgBWMiBs != 1469.83 {
		t.Fatalf("row b %+v", b)
	}
	if got, want := b.GBs(), 1469.83*1048576/1e9; math.Abs(got-want) > 1e-9 {
		t.Fatalf("GB/s %v, want %v", got, want)
	}
	for name, in := range map[string]string{
		"no header":   "a,1,2,3,4,5,6,7,8\n",
		"bad number":  "x,iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\na,1,2,x,4,5,6,7,8\n",
		"odd columns": "x,iterations,p50,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n",
		"negative":    "x,iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\na,1,2,-3,4,5,6,7,8\n",
	} {
		if _, err := parseUCXOutput([]byte(in)); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

// FuzzParseUCXOutput: any output parses to finite, non-negative rows or
// fails; never a panic.
func FuzzParseUCXOutput(f *testing.F) {
	f.Add([]byte(ucxSample))
	f.Add([]byte("b,iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n,1,2,3,4,5,6,7,8\n"))
	f.Fuzz(func(t *testing.T, out []byte) {
		rows, err := parseUCXOutput(out)
		if err != nil {
			return
		}
		for k, r := range rows {
			for _, v := range []float64{r.MedianLatU, r.AvgLatU, r.AvgBWMiBs} {
				if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) {
					t.Fatalf("row %q: %+v", k, r)
				}
			}
		}
	})
}

// TestUCXBaseline runs ucx_perftest for real on loopback, small: it skips
// when ucx-utils is not installed (unless GDRLINK_REQUIRE_UCX=1).
func TestUCXBaseline(t *testing.T) {
	if testing.Short() {
		t.Skip("starts ucx_perftest processes")
	}
	ctx := context.Background()
	if err := ucxAvailable(ctx); err != nil {
		if os.Getenv("GDRLINK_REQUIRE_UCX") == "1" {
			t.Fatal(err)
		}
		t.Skipf("no UCX baseline here: %v", err)
	}
	tests := []ucxTest{
		{Label: "bw", Test: "tag_bw", Size: 65536, Iters: 50},
		{Label: "lat", Test: "tag_lat", Size: 8, Iters: 200},
	}
	// UCX's tcp transport now and then loses a run of a batch (no row for
	// it, seen about once in five `make test` runs on this machine; the
	// xfer scenario tries a case up to three times for the same reason),
	// so a batch missing a row is run again, up to three times in all.
	var rows map[string]ucxRow
	for try := 1; ; try++ {
		var err error
		if rows, err = runUCX(ctx, "tcp", tests, 2*time.Minute); err != nil {
			t.Fatal(err)
		}
		_, bw := rows["bw"]
		_, lat := rows["lat"]
		if bw && lat || try == 3 {
			break
		}
		t.Logf("try %d: ucx_perftest gave rows %+v, want bw and lat: running the batch again", try, rows)
	}
	if rows["bw"].GBs() <= 0 || rows["lat"].MedianLatU <= 0 || rows["bw"].Iters != 50 {
		t.Fatalf("rows %+v", rows)
	}
	// A deadline that cannot be met ends the run with an error, no hang.
	start := time.Now()
	if _, err := runUCX(ctx, "tcp", []ucxTest{{Label: "long", Test: "tag_lat", Size: 8, Iters: 1 << 30}}, 500*time.Millisecond); err == nil {
		t.Fatal("a run past its deadline succeeded")
	} else if !errors.Is(err, context.DeadlineExceeded) {
		t.Logf("run past its deadline: %v", err)
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Fatalf("a run with a 500ms deadline took %v", d)
	}
}
