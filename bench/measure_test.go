package main

import (
	"errors"
	"math"
	"slices"
	"testing"
	"time"
)

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		xs   []float64
		want float64
	}{
		{[]float64{3}, 3},
		{[]float64{5, 1, 3}, 3},
		{[]float64{4, 1, 3, 2}, 2.5},
		{[]float64{2, 2, 9, 2}, 2},
		{[]float64{-1, 10}, 4.5},
	} {
		in := slices.Clone(tc.xs)
		if got := median(in); got != tc.want {
			t.Errorf("median(%v) = %v, want %v", tc.xs, got, tc.want)
		}
		if !slices.Equal(in, tc.xs) {
			t.Errorf("median reordered its input: %v", in)
		}
	}
	if !math.IsNaN(median(nil)) {
		t.Error("median of nothing is not NaN")
	}
	if got := medianDuration([]time.Duration{3, 1, 2}); got != 2 {
		t.Errorf("medianDuration = %v", got)
	}
}

func TestRatio(t *testing.T) {
	for _, tc := range []struct {
		unit            string
		value, baseline float64
		want            float64
	}{
		{"GB/s", 6, 3, 2},
		{"MB/s", 1, 4, 0.25},
		{"Mop/s", 3, 3, 1},
		{"ns", 50, 100, 2},
		{"us", 200, 100, 0.5},
		{"µs", 10, 10, 1},
		{"ms", 1, 4, 4},
		{"s", 2, 1, 0.5},
		{"ns/op", 25, 100, 4},
		{"us/op", 100, 25, 0.25},
		{"GB/s", 6, 0, 0},
		{"GB/s", 0, 3, 0},
		{"ns", 0, 3, 0},
		{"ns", 5, -1, 0},
		{"GB/s", math.NaN(), 3, 0},
		{"GB/s", math.Inf(1), 3, 0},
		{"bytes", 5, 3, 0},
		{"", 5, 3, 0},
	} {
		if got := ratio(tc.unit, tc.value, tc.baseline); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("ratio(%q, %v, %v) = %v, want %v", tc.unit, tc.value, tc.baseline, got, tc.want)
		}
	}
}

func TestNewResult(t *testing.T) {
	r := newResult("sc", "case", 4096, 12, "us", 24, "grpc")
	want := Result{Scenario: "sc", Case: "case", SizeBytes: 4096, Value: 12, Unit: "us", Baseline: 24, Ratio: 2, BaselineName: "grpc"}
	if r != want {
		t.Fatalf("newResult = %+v, want %+v", r, want)
	}
	if err := checkResult(r); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []Result{
		{Case: "c", Unit: "GB/s"},
		{Scenario: "s", Unit: "GB/s"},
		{Scenario: "s", Case: "c"},
		{Scenario: "s", Case: "c", Unit: "GB/s", SizeBytes: -1},
		{Scenario: "s", Case: "c", Unit: "GB/s", Value: math.Inf(-1)},
		{Scenario: "s", Case: "c", Unit: "GB/s", Baseline: math.NaN()},
	} {
		if checkResult(bad) == nil {
			t.Errorf("checkResult(%+v) accepted it", bad)
		}
	}
}

func TestRateGBs(t *testing.T) {
	if got := rateGBs(1e9, time.Second); got != 1 {
		t.Errorf("1e9 bytes in 1s = %v GB/s", got)
	}
	if got := rateGBs(256<<20, 20*time.Millisecond); math.Abs(got-13.4217728) > 1e-9 {
		t.Errorf("256 MiB in 20ms = %v GB/s", got)
	}
	if got := rateGBs(100, 0); got != 0 {
		t.Errorf("rate over no time = %v", got)
	}
}

func TestSweepSizes(t *testing.T) {
	for _, tc := range []struct {
		lo, hi int64
		want   []int64
	}{
		{64 << 10, 256 << 10, []int64{64 << 10, 128 << 10, 256 << 10}},
		{1000, 5000, []int64{1024, 2048, 4096}},
		{0, 4, []int64{1, 2, 4}},
		{-5, 1, []int64{1}},
		{8, 4, nil},
		{5, 7, nil},
	} {
		if got := sweepSizes(tc.lo, tc.hi); !slices.Equal(got, tc.want) {
			t.Errorf("sweepSizes(%d, %d) = %v, want %v", tc.lo, tc.hi, got, tc.want)
		}
	}
	if got := sweepSizes(64<<10, 256<<20); len(got) != 13 || got[12] != 256<<20 {
		t.Errorf("64KiB..256MiB = %v", got)
	}
	if got := sweepSizes(1<<61, math.MaxInt64); !slices.Equal(got, []int64{1 << 61, 1 << 62}) {
		t.Errorf("top of the range = %v", got)
	}
}

func TestEnvSizes(t *testing.T) {
	for _, tc := range []struct {
		env  Env
		want []int64
	}{
		{Env{}, sweepSizes(64<<10, 256<<20)},
		{Env{Quick: true}, sweepSizes(64<<10, quickMaxSize)},
		{Env{MaxSize: 300 << 10}, []int64{64 << 10, 128 << 10, 256 << 10}},
		{Env{MaxSize: 1 << 40}, sweepSizes(64<<10, 256<<20)},
		{Env{MaxSize: 1000}, []int64{64 << 10}},
	} {
		if got := tc.env.sizes(64<<10, 256<<20); !slices.Equal(got, tc.want) {
			t.Errorf("%+v: sizes = %v, want %v", tc.env, got, tc.want)
		}
	}
	if got := (&Env{MaxSize: 10}).sizes(1000, 5000); !slices.Equal(got, []int64{1024}) {
		t.Errorf("cap below a non-power-of-two minimum = %v", got)
	}
}

func TestTimeIt(t *testing.T) {
	calls := 0
	d, err := timeIt(4, func() error { calls++; time.Sleep(time.Millisecond); return nil })
	if err != nil || calls != 5 {
		t.Fatalf("timeIt: %d calls, %v; want 1 warm-up + 4", calls, err)
	}
	if d < time.Millisecond {
		t.Errorf("median %v is shorter than the sleep", d)
	}
	calls = 0
	if _, err := timeEach(3, 10, func() error { calls++; return nil }); err != nil || calls != 31 {
		t.Fatalf("timeEach: %d calls, %v; want 31", calls, err)
	}
	calls = 0
	d, each, err := timeEachCall(2, 5, func() error {
		calls++
		if calls == 4 {
			time.Sleep(20 * time.Millisecond) // one slow call moves the mean, not the median
		}
		return nil
	})
	if err != nil || calls != 11 || len(each) != 10 {
		t.Fatalf("timeEachCall: %d calls, %d timed, %v; want 11 and 10", calls, len(each), err)
	}
	if !slices.IsSorted(each) || each[9] < 20*time.Millisecond || quantile(each, 0.5) >= time.Millisecond {
		t.Errorf("timeEachCall's calls %v: want sorted, the slow one last, a fast median", each)
	}
	if d < 2*time.Millisecond { // the median of the two runs' means: (20 ms/5 + ~0)/2
		t.Errorf("timeEachCall mean per call %v, want the slow call in it", d)
	}
	if quantile(nil, 0.5) != 0 || quantile(each, 0) != each[0] || quantile(each, 1) != each[9] {
		t.Errorf("quantile ends wrong")
	}
	boom := errors.New("boom")
	calls = 0
	if _, err := timeIt(5, func() error {
		calls++
		if calls == 3 {
			return boom
		}
		return nil
	}); !errors.Is(err, boom) || calls != 3 {
		t.Fatalf("error: %v after %d calls", err, calls)
	}
	calls = 0
	if _, err := timeIt(0, func() error { calls++; return nil }); err != nil || calls != 2 {
		t.Fatalf("reps 0: %d calls, %v", calls, err)
	}
}

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"64MiB", 64 << 20, true},
		{"64 MiB", 64 << 20, true},
		{"1GB", 1e9, true},
		{"4096", 4096, true},
		{"256k", 256000, true},
		{"0", 0, true},
		{"lots", 0, false},
		{"-1MiB", 0, false},
		{"", 0, false},
		{"10EiB", 0, false},
	} {
		got, err := parseSize(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("parseSize(%q) = %d, %v; want %d ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestFormatFigure(t *testing.T) {
	for v, want := range map[float64]string{0: "0", 12.3456: "12.35", 12: "12", 999.5: "999.5", 1234567.8: "1,234,568", 0.0123456: "0.0123", -5.5: "-5.5"} {
		if got := formatFigure(v); got != want {
			t.Errorf("formatFigure(%v) = %q, want %q", v, got, want)
		}
	}
	if formatSize(64<<10) != "64 KiB" || formatSize(0) != "0 B" {
		t.Errorf("formatSize: %q %q", formatSize(64<<10), formatSize(0))
	}
}
