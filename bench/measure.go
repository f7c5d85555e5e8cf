package main

import (
	"fmt"
	"math"
	"math/bits"
	"slices"
	"strings"
	"time"
)

// quickMaxSize caps sweeps in -quick mode.
const quickMaxSize = 1 << 20

// median is the middle of xs (the mean of the two middle values for an even
// count), NaN for none. xs is not modified.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	m := len(s) / 2
	if len(s)%2 == 1 {
		return s[m]
	}
	return (s[m-1] + s[m]) / 2
}

// medianDuration is median for durations.
func medianDuration(ds []time.Duration) time.Duration {
	xs := make([]float64, len(ds))
	for i, d := range ds {
		xs[i] = float64(d)
	}
	return time.Duration(median(xs))
}

// timeIt runs fn once untimed (to warm caches, fault in pages and finish
// lazy setup), then reps times, each timed on its own, and returns the
// median time of one run. The first error stops it. reps < 1 counts as 1.
func timeIt(reps int, fn func() error) (time.Duration, error) {
	return timeEach(reps, 1, fn)
}

// timeEach is timeIt for operations too short to time one by one: each of
// the reps timed runs calls fn iters times in a row, and the result is the
// median time of one call. iters < 1 counts as 1.
func timeEach(reps, iters int, fn func() error) (time.Duration, error) {
	reps, iters = max(reps, 1), max(iters, 1)
	if err := fn(); err != nil {
		return 0, err
	}
	ds := make([]time.Duration, reps)
	for r := range ds {
		start := time.Now()
		for range iters {
			if err := fn(); err != nil {
				return 0, err
			}
		}
		ds[r] = time.Since(start) / time.Duration(iters)
	}
	return medianDuration(ds), nil
}

// timeEachCall is timeEach that also times every call of the timed runs on
// its own and returns those reps·iters durations, sorted: the distribution
// that timeEach's mean per call hides (a few calls of a hundred times the
// typical one move a mean of hundreds).
func timeEachCall(reps, iters int, fn func() error) (time.Duration, []time.Duration, error) {
	reps, iters = max(reps, 1), max(iters, 1)
	calls := make([]time.Duration, 0, reps*iters)
	d, err := timeEach(reps, iters, func() error {
		start := time.Now()
		err := fn()
		calls = append(calls, time.Since(start))
		return err
	})
	if err != nil {
		return 0, nil, err
	}
	calls = calls[1:] // the untimed warm-up's
	slices.Sort(calls)
	return d, calls, nil
}

// quantile is the q-quantile (0 to 1) of sorted durations, 0 for none.
func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[int(q*float64(len(sorted)-1)+0.5)]
}

// rateGBs is a rate in GB/s (decimal: 1e9 bytes per second) of bytes moved
// in d; 0 when d is not positive, so a result never holds an infinity.
func rateGBs(bytes int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(bytes) / d.Seconds() / 1e9
}

// sweepSizes lists the powers of two from the smallest one at or above lo
// up to hi, ascending; none when hi < lo. lo < 1 counts as 1.
func sweepSizes(lo, hi int64) []int64 {
	lo = max(lo, 1)
	if hi < lo {
		return nil
	}
	s := int64(1) << (63 - bits.LeadingZeros64(uint64(lo)))
	if s < lo {
		s <<= 1
	}
	var out []int64
	for ; s > 0 && s <= hi; s <<= 1 {
		out = append(out, s)
	}
	return out
}

// sizes is sweepSizes for a scenario's own range, capped by -max-size and,
// in -quick mode, by quickMaxSize. A cap below lo leaves lo alone (rounded
// up to a power of two), so a scenario always measures something.
func (e *Env) sizes(lo, hi int64) []int64 {
	if e.MaxSize > 0 && e.MaxSize < hi {
		hi = e.MaxSize
	}
	if e.Quick && hi > quickMaxSize {
		hi = quickMaxSize
	}
	if out := sweepSizes(lo, hi); len(out) > 0 {
		return out
	}
	return sweepSizes(lo, math.MaxInt64)[:1]
}

// unitKind says how to compare figures of a unit.
type unitKind int

const (
	unitOther unitKind = iota // no rule: no ratio
	unitRate                  // higher is better: ratio value/baseline
	unitTime                  // lower is better: ratio baseline/value
)

// kindOf classifies a unit: anything per second ("GB/s", "Mop/s") is a
// rate; "ns", "us", "µs", "ms", "s" and the same per operation ("ns/op")
// are times.
func kindOf(unit string) unitKind {
	if strings.HasSuffix(unit, "/s") {
		return unitRate
	}
	switch strings.TrimSuffix(unit, "/op") {
	case "ns", "us", "µs", "ms", "s":
		return unitTime
	}
	return unitOther
}

// ratio compares value with a baseline in the same unit so that above 1
// always means better than the baseline: value/baseline for rates,
// baseline/value for times. It is 0 when there is no baseline, when either
// figure is not positive and finite, or when the unit has no rule.
func ratio(unit string, value, baseline float64) float64 {
	ok := func(x float64) bool { return x > 0 && !math.IsInf(x, 0) && !math.IsNaN(x) }
	if !ok(value) || !ok(baseline) {
		return 0
	}
	switch kindOf(unit) {
	case unitRate:
		return value / baseline
	case unitTime:
		return baseline / value
	}
	return 0
}

// newResult builds a Result with Ratio filled in by ratio. Pass baseline 0
// and baselineName "" for a case without a baseline.
func newResult(scenario, caseName string, size int64, value float64, unit string, baseline float64, baselineName string) Result {
	return Result{
		Scenario:     scenario,
		Case:         caseName,
		SizeBytes:    size,
		Value:        value,
		Unit:         unit,
		Baseline:     baseline,
		Ratio:        ratio(unit, value, baseline),
		BaselineName: baselineName,
	}
}

// checkResult rejects results that cannot be printed or compared: a missing
// scenario, case or unit, a negative size, or a non-finite figure.
func checkResult(r Result) error {
	finite := func(x float64) bool { return !math.IsInf(x, 0) && !math.IsNaN(x) }
	switch {
	case r.Scenario == "" || r.Case == "" || r.Unit == "":
		return fmt.Errorf("result without scenario, case or unit: %+v", r)
	case r.SizeBytes < 0:
		return fmt.Errorf("result %s/%s with negative size %d", r.Scenario, r.Case, r.SizeBytes)
	case !finite(r.Value) || !finite(r.Baseline) || !finite(r.Ratio):
		return fmt.Errorf("result %s/%s at %d bytes is not finite: value %v baseline %v ratio %v", r.Scenario, r.Case, r.SizeBytes, r.Value, r.Baseline, r.Ratio)
	}
	return nil
}
