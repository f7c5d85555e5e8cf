package adaptspin

import (
	"slices"
	"testing"
	"time"
)

// Pause sleeps at least what it is asked; under a millisecond, it does not
// wait for a Go timer (the test logs both medians: on an idle host the
// timer's is about 1.1 ms, Pause's tens of microseconds).
func TestPause(t *testing.T) {
	Pause(0)
	Pause(-time.Second)
	med := func(f func()) time.Duration {
		ds := make([]time.Duration, 21)
		for i := range ds {
			start := time.Now()
			f()
			ds[i] = time.Since(start)
		}
		slices.Sort(ds)
		return ds[len(ds)/2]
	}
	p := med(func() { Pause(20 * time.Microsecond) })
	s := med(func() { time.Sleep(20 * time.Microsecond) })
	t.Logf("20us: Pause %v, time.Sleep %v (medians of 21)", p, s)
	if p < 20*time.Microsecond {
		t.Fatalf("Pause(20us) took %v", p)
	}
	if d := med(func() { Pause(2 * time.Millisecond) }); d < 2*time.Millisecond {
		t.Fatalf("Pause(2ms) took %v", d)
	}
}
