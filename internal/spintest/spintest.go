// Package spintest checks, for any provider, how long a completion queue's
// Wait polls before it sleeps where polls yield the CPU (the long polls of
// adaptspin.LongFactor) and where they do not.
package spintest

import (
	"context"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Opener makes a completion queue of a device opened with Config.Yield
// set to yield and a spin bound of spin; asleep reports whether a Wait on
// it sleeps now. The queue and its device are closed when t ends.
type Opener func(t *testing.T, yield bool, spin time.Duration) (q verbsio.CompletionQueue, asleep func() bool)

// LongPolls checks that a Wait on nothing that yields its CPU is still
// polling after half its long poll (adaptspin.LongFactor times spin),
// that one that does not yield sleeps within a second of its budget, and
// that both end, with an error, at their context's end.
func LongPolls(t *testing.T, open Opener) {
	t.Helper()
	const spin = 200 * time.Microsecond
	for _, yield := range []bool{true, false} {
		q, asleep := open(t, yield, spin)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		done := make(chan error, 1)
		go func() {
			var out [1]verbsio.Completion
			_, err := q.Wait(ctx, out[:])
			done <- err
		}()
		start := time.Now()
		slept := false
		for !slept && time.Since(start) < time.Second {
			if yield && time.Since(start) > adaptspin.LongFactor*spin/2 {
				break
			}
			time.Sleep(spin)
			slept = asleep()
		}
		switch {
		case yield && slept:
			t.Errorf("a yielding wait went to sleep within half its long poll (%s)", adaptspin.LongFactor*spin/2)
		case !yield && !slept:
			t.Errorf("a wait that does not yield still polled a second after its budget of %s", spin)
		}
		cancel()
		if err := <-done; err == nil {
			t.Errorf("yield %v: Wait returned no error at its context's end", yield)
		}
	}
}
