package collective

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A lane waiting for events that many goroutines deliver at once, and that
// it also delivers to itself, misses none: it sees each one and finishes.
func TestLaneMissesNoResume(t *testing.T) {
	const senders, each = 8, 500
	x := &run{lanes: 2}
	var got atomic.Int64
	seen := make([]int64, x.lanes)
	x.startLanes(func(k int) error {
		for i := int64(1); i <= senders*each; i++ {
			if i%7 == 0 {
				x.co[k].resume() // from inside the lane itself: runs nothing
			}
			x.co[k].await(func() bool { return got.Load() >= i })
			seen[k] = i
		}
		return nil
	})
	var wg sync.WaitGroup
	for range senders {
		wg.Go(func() {
			for range each {
				got.Add(1)
				for _, l := range x.co {
					l.resume()
				}
			}
		})
	}
	wg.Wait()
	done := make(chan struct{})
	go func() { x.ended.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatalf("lanes stuck at events %v of %d: a resume was lost", seen, senders*each)
	}
	for k, s := range seen {
		if s != senders*each {
			t.Fatalf("lane %d finished at event %d of %d", k, s, senders*each)
		}
	}
}

// What is delivered while the lane runs (a callback run by a call the lane
// makes, between its look and its wait) is not lost: the goroutine that
// runs the lane looks again before it lets go.
func TestLaneSeesWhatCameWhileItRan(t *testing.T) {
	x := &run{lanes: 1}
	var got int
	x.startLanes(func(k int) error {
		for i := 1; i <= 100; i++ {
			x.co[k].await(func() bool {
				if got < i {
					got++            // delivered...
					x.co[k].resume() // ...and resumed, while the lane runs
					return false
				}
				return true
			})
		}
		return nil
	})
	done := make(chan struct{})
	go func() { x.ended.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatalf("the lane waits at event %d of 100: a resume while it ran was lost", got)
	}
}
