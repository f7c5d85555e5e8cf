package worker

import (
	"slices"
	"testing"
	"time"
)

// TestResendTimer: the learned timeout follows RFC 6298's estimator
// within its bounds, backs off after timeouts at most once per timeout's
// length until the next sample, and a message's waits double from it.
func TestResendTimer(t *testing.T) {
	ms := time.Millisecond
	r := resendTimer{initial: 50 * ms, min: ms, max: 400 * ms}
	if got := r.timeout(); got != 50*ms {
		t.Fatalf("before any round trip: %v, want the initial 50ms", got)
	}
	if got := r.wait(2); got != 200*ms {
		t.Fatalf("third send before any round trip: %v, want 200ms", got)
	}
	r.sample(4 * ms) // srtt 4ms, rttvar 2ms
	if got := r.timeout(); got != 12*ms {
		t.Fatalf("after one round trip of 4ms: %v, want 4ms + 4 x 2ms = 12ms", got)
	}
	r.sample(12 * ms) // rttvar 2 + (8-2)/4 = 3.5ms, srtt 4 + 8/8 = 5ms
	if got := r.timeout(); got != 19*ms {
		t.Fatalf("after 4ms and 12ms: %v, want 5ms + 4 x 3.5ms = 19ms", got)
	}

	// Timeouts: one backoff per timeout's length, whatever the number of
	// queue pairs that time out together.
	now := time.Now()
	for range 8 {
		r.timedOut(now)
	}
	if got := r.timeout(); got != 38*ms {
		t.Fatalf("after 8 timeouts at once: %v, want 2 x 19ms", got)
	}
	r.timedOut(now.Add(20 * ms))
	if got := r.timeout(); got != 38*ms {
		t.Fatalf("another timeout 20ms later: %v, want still 38ms (less than a timeout since the backoff)", got)
	}
	r.timedOut(now.Add(40 * ms))
	r.timedOut(now.Add(120 * ms))
	r.timedOut(now.Add(300 * ms))
	if got := r.timeout(); got != 304*ms {
		t.Fatalf("after backoffs at 0, 40, 120 and 300ms: %v, want 16 x 19ms", got)
	}
	r.timedOut(now.Add(700 * ms))
	if got := r.timeout(); got != 400*ms {
		t.Fatalf("backed off again: %v, want the ceiling 400ms", got)
	}
	r.sample(5 * ms) // rttvar 3.5 + (0-3.5)/4 = 2.625ms, srtt 5ms
	if got := r.timeout(); got != 15500*time.Microsecond {
		t.Fatalf("a sample after the backoffs: %v, want 5ms + 4 x 2.625ms = 15.5ms", got)
	}

	for range 200 {
		r.sample(100 * time.Microsecond)
	}
	if got := r.timeout(); got != ms {
		t.Fatalf("after steady 100us round trips: %v, want the floor 1ms", got)
	}
	if got := r.wait(3); got != 8*ms {
		t.Fatalf("fourth send: %v, want 8 x 1ms", got)
	}
	if got := r.wait(40); got != 400*ms {
		t.Fatalf("41st send: %v, want the ceiling 400ms", got)
	}
	for range 200 {
		r.sample(5 * time.Second)
	}
	if got := r.timeout(); got != 400*ms {
		t.Fatalf("after steady 5s round trips: %v, want the ceiling 400ms", got)
	}
	if r.samples != 403 {
		t.Fatalf("%d samples counted, want 403", r.samples)
	}
}

// TestTimeoutDefaults: the UDP transport learns its timeout between 1 ms
// and the configured one; the verbs transport starts from the configured
// one and backs off to DefaultVerbsBackoff of them (see New); a configured
// floor is kept either way.
func TestTimeoutDefaults(t *testing.T) {
	udp := Config{}.withDefaults()
	if udp.Timeout != DefaultTimeout || udp.MinTimeout != DefaultMinTimeout || udp.MaxTimeout != DefaultTimeout || udp.GiveUp != DefaultGiveUp {
		t.Errorf("udp defaults: timeout %v in [%v, %v], give up after %v", udp.Timeout, udp.MinTimeout, udp.MaxTimeout, udp.GiveUp)
	}
	verbs := Config{Verbs: &Verbs{Device: "rxe0"}, Timeout: 80 * time.Millisecond}.withDefaults()
	if verbs.MinTimeout != 80*time.Millisecond || verbs.MaxTimeout != 640*time.Millisecond {
		t.Errorf("verbs defaults: timeout in [%v, %v], want [80ms, 640ms]", verbs.MinTimeout, verbs.MaxTimeout)
	}
	r := resendTimer{initial: verbs.Timeout, min: verbs.MinTimeout, max: verbs.MaxTimeout}
	var waits []time.Duration
	for try := range 5 {
		waits = append(waits, r.wait(try))
	}
	const ms = time.Millisecond
	if want := []time.Duration{80 * ms, 160 * ms, 320 * ms, 640 * ms, 640 * ms}; !slices.Equal(waits, want) {
		t.Errorf("verbs waits after each send of a message: %v, want %v", waits, want)
	}
	set := Config{Verbs: &Verbs{Device: "rxe0"}, MinTimeout: 5 * time.Millisecond}.withDefaults()
	if set.MinTimeout != 5*time.Millisecond {
		t.Errorf("verbs with a floor of 5ms: %v", set.MinTimeout)
	}
}
