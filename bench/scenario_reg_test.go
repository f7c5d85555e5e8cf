package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/ibverbs"
)

// TestRegScenario runs the reg scenario quickly: without an RDMA device it
// must say why in a note and measure nothing; with one, every figure must
// be positive and the pool must register less than once per tensor.
func TestRegScenario(t *testing.T) {
	var rs []Result
	env := &Env{Quick: true, Reps: 1, MaxSize: 64 << 10, Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Emit: func(r Result) { rs = append(rs, r) }}
	if err := runReg(context.Background(), env); err != nil {
		t.Fatal(err)
	}
	_, devErr := ibverbs.New().Devices()
	if devErr != nil {
		if len(rs) != 1 || rs[0].Case != "skipped" || !strings.Contains(rs[0].Note, "no device") {
			t.Fatalf("without a device: %+v", rs)
		}
		if !errors.Is(devErr, verbsio.ErrNoDevice) {
			t.Fatalf("Devices: %v", devErr)
		}
		return
	}
	seen := map[string]bool{}
	for _, r := range rs {
		if err := checkResult(r); err != nil {
			t.Error(err)
		}
		if !(r.Value > 0) {
			t.Errorf("%s/%s: value %v", r.Case, formatSize(r.SizeBytes), r.Value)
		}
		if r.Case == "pool-registered-once" && !strings.Contains(r.Note, "per tensor") {
			t.Errorf("pool case without its registration count: %q", r.Note)
		}
		seen[r.Case] = true
	}
	for _, c := range []string{"ibv_reg_mr-per-tensor", "pool-registered-once", "crossings-per-write-chain16"} {
		if !seen[c] {
			t.Errorf("no %s result in %+v", c, rs)
		}
	}
}

// perftestSample is ib_write_bw's client report as perftest 4.5 prints it.
const perftestSample = `---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF		Device         : rxe0
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 65536      5000             55.01              41.46  		   0.000663
---------------------------------------------------------------------------------------
`

func TestParsePerftestBW(t *testing.T) {
	v, err := parsePerftestBW([]byte(perftestSample))
	if err != nil || v != 41.46 {
		t.Fatalf("parsePerftestBW = %v, %v", v, err)
	}
	for _, bad := range []string{"", "no report here", strings.Replace(perftestSample, "41.46", "x", 1)} {
		if _, err := parsePerftestBW([]byte(bad)); err == nil {
			t.Errorf("parsed %q", bad)
		}
	}
	if n := perftestIters(1<<20, true); n < 5 || n > 5000 {
		t.Errorf("perftestIters = %d", n)
	}
}

// FuzzParsePerftestBW feeds the report parser arbitrary text: it must
// return a non-negative figure or an error, never panic.
func FuzzParsePerftestBW(f *testing.F) {
	f.Add([]byte(perftestSample))
	f.Add([]byte(" #bytes BW average[MB/sec]\n 1\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := parsePerftestBW(b)
		if err == nil && !(v >= 0) {
			t.Fatalf("figure %v without an error", v)
		}
	})
}

func TestPerftestBaselineNeedsIbverbs(t *testing.T) {
	dev, err := verbsio.Open("tcp", verbsio.DefaultConfig())
	if err != nil {
		t.Skipf("skipping: no tcp device to hand the ib_write_bw baseline: %v", err)
	}
	defer dev.Close()
	if _, err := perftestBaseline(dev, true); !errors.Is(err, verbsio.ErrNotSupported) {
		t.Fatalf("perftestBaseline of a tcp device: %v", err)
	}
}
