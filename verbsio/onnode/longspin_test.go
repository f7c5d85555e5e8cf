package onnode

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/verbsio"
)

// A Wait where polls yield keeps polling past the queue's own budget (it
// has not gone to sleep well after 4 budgets), and still returns at its
// context's end; one that does not yield sleeps.
func TestYieldingWaitPollsLong(t *testing.T) {
	const spin = 200 * time.Microsecond
	for _, yield := range []bool{true, false} {
		n, err := newNodeConfig(verbsio.Config{Yield: yield}, Options{Spin: spin})
		if err != nil {
			t.Fatal(err)
		}
		c := n.rcq.(*cq)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		done := make(chan error, 1)
		go func() {
			var out [1]verbsio.Completion
			_, err := c.Wait(ctx, out[:])
			done <- err
		}()
		// Up to 4 budgets in: polling (the goroutine may not have run yet).
		time.Sleep(4 * spin)
		deadline := time.Now().Add(time.Second)
		slept := false
		for time.Now().Before(deadline) && !slept {
			slept = c.sleepers.Load() > 0
			if !slept {
				time.Sleep(spin)
			}
			if yield && time.Since(deadline.Add(-time.Second)) > adaptspin.LongFactor*spin/2 {
				break
			}
		}
		switch {
		case yield && slept:
			t.Errorf("a yielding wait went to sleep within half its long poll (%s)", adaptspin.LongFactor*spin/2)
		case !yield && !slept:
			t.Errorf("a wait that does not yield still polled a second after its budget of %s", spin)
		}
		cancel()
		if err := <-done; !errors.Is(err, verbsio.ErrTimeout) {
			t.Errorf("yield %v: Wait returned %v at its context's end, want ErrTimeout", yield, err)
		}
		n.close()
	}
}
