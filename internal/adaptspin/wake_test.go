package adaptspin

import (
	"testing"
	"time"
)

// A probe measures a wake-up of the network poller: more than nothing,
// less than the test's patience, and seeded into a policy it sets the cap
// to sixteen of it within the bounds.
func TestProbeWake(t *testing.T) {
	d, err := ProbeWake(5)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("wake-up through the network poller: %v (median of 5)", d)
	if d <= 0 || d > time.Second {
		t.Fatalf("probed wake-up %v, want within (0, 1s]", d)
	}
	p := New(Bounds{Max: time.Hour, Min: time.Nanosecond})
	p.Woke(d)
	if got, want := p.Budget(), 16*d; got != want {
		t.Fatalf("budget %v after a wake-up of %v, want the cap of sixteen, %v", got, d, want)
	}
	if _, err := ProbeWake(0); err == nil {
		t.Fatal("ProbeWake(0) did not fail")
	}
}
