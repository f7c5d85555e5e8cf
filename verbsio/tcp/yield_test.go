package tcp

import (
	"context"
	"errors"
	"testing"
	"time"

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
