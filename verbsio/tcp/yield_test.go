package tcp

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/verbsio"
)

// TestWaitYields: with Config.Yield a Wait gives up its CPU between the
// polls of its spin (sched_yield), without it not once; either way it
// ends with its context.
func TestWaitYields(t *testing.T) {
	for _, yield := range []bool{false, true} {
		dev, err := OpenDevice(verbsio.Config{Yield: yield}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = dev.Close() })
		q, err := dev.CreateCQ(16)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = q.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		var c [4]verbsio.Completion
		k, err := q.Wait(ctx, c[:])
		cancel()
		if k != 0 || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Yield %v: Wait on nothing gave %d, %v", yield, k, err)
		}
		got := q.(*cq).spin.Stats().Yields
		if yield && got == 0 || !yield && got != 0 {
			t.Errorf("Config.Yield %v: the Wait yielded its CPU %d times", yield, got)
		}
		t.Logf("Config.Yield %v: %d yields in a Wait on nothing", yield, got)
	}
}

// TestYieldingWaitPollsLong: a Wait that yields its CPU keeps polling past
// its queue's own budget (it has not gone to sleep after half its long
// poll, adaptspin.LongFactor times Options.Spin); one that does not yield
// sleeps after its budget.
func TestYieldingWaitPollsLong(t *testing.T) {
	const spin = 200 * time.Microsecond
	for _, yield := range []bool{true, false} {
		dev, err := OpenDevice(verbsio.Config{Yield: yield}, Options{Spin: spin})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = dev.Close() })
		q, err := dev.CreateCQ(16)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = q.Close() })
		c := q.(*cq)
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
			slept = c.sleepers.Load() > 0
		}
		switch {
		case yield && slept:
			t.Errorf("a yielding wait went to sleep within half its long poll (%s)", adaptspin.LongFactor*spin/2)
		case !yield && !slept:
			t.Errorf("a wait that does not yield still polled a second after its budget of %s", spin)
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("yield %v: Wait returned %v at its context's end", yield, err)
		}
	}
}
