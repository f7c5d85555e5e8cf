package tcp

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/spintest"
	"github.com/gdrlink/gdrlink/verbsio"
)

// TestWaitYields: with Config.Yield a Wait gives up its CPU between the
// polls of its spin (sched_yield), without it not once; either way it
// ends with its context.
func TestWaitYields(t *testing.T) {
	for _, yield := range []bool{false, true} {
		q := openCQ(t, yield, 0)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		var c [4]verbsio.Completion
		k, err := q.Wait(ctx, c[:])
		cancel()
		if k != 0 || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Yield %v: Wait on nothing gave %d, %v", yield, k, err)
		}
		got := q.spin.Stats().Yields
		if yield && got == 0 || !yield && got != 0 {
			t.Errorf("Config.Yield %v: the Wait yielded its CPU %d times", yield, got)
		}
		t.Logf("Config.Yield %v: %d yields in a Wait on nothing", yield, got)
	}
}

// TestYieldingWaitPollsLong: a Wait where polls yield keeps polling past
// its queue's own budget, and one that does not yield sleeps
// (spintest.LongPolls).
func TestYieldingWaitPollsLong(t *testing.T) {
	spintest.LongPolls(t, func(t *testing.T, yield bool, spin time.Duration) (verbsio.CompletionQueue, func() bool) {
		c := openCQ(t, yield, spin)
		return c, func() bool { return c.sleepers.Load() > 0 }
	})
}

// openCQ opens a device with Config.Yield set to yield and Options.Spin to
// spin (0: the default), and a completion queue of it; both close when t
// ends.
func openCQ(t *testing.T, yield bool, spin time.Duration) *cq {
	t.Helper()
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
	return q.(*cq)
}
