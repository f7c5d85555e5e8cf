package collective

import (
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A lane waiting for events that many goroutines deliver at once, and that
// it also delivers to itself, misses none: it sees each one and finishes.
func TestLaneMissesNoResume(t *testing.T) {
	const senders, each = 8, 500
	x := &run{r: &Ring{}, lanes: 2}
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
	x := &run{r: &Ring{}, lanes: 1}
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

// A call's lanes run on the coroutines of the Ring's finished calls (so a
// call starts no goroutine per lane and grows no fresh stack), each
// running the new call's body, not the old one's; Close ends those kept.
func TestLanesReuseCoroutines(t *testing.T) {
	r := &Ring{}
	call := func(lanes int) ([]*coroutine, []int) {
		x := &run{r: r, lanes: lanes}
		ran := make([]int, lanes)
		var ok atomic.Bool
		x.startLanes(func(k int) error {
			x.co[k].await(ok.Load) // one wait, so the lane runs twice
			ran[k] = 100*lanes + k
			return nil
		})
		ok.Store(true)
		for _, l := range x.co {
			go l.resume()
		}
		done := make(chan struct{})
		go func() { x.ended.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatalf("a call of %d lanes did not finish", lanes)
		}
		cos := make([]*coroutine, lanes)
		for k, l := range x.co {
			cos[k] = l.co
		}
		x.releaseLanes()
		return cos, ran
	}
	first, ran := call(2)
	if ran[0] != 200 || ran[1] != 201 {
		t.Fatalf("first call ran %v, want [200 201]", ran)
	}
	second, ran := call(3)
	if ran[0] != 300 || ran[1] != 301 || ran[2] != 302 {
		t.Fatalf("second call ran %v, want [300 301 302]: a kept coroutine ran an old body", ran)
	}
	reused := 0
	for _, c := range second {
		if c == first[0] || c == first[1] {
			reused++
		}
	}
	if reused != 2 {
		t.Fatalf("second call of 3 lanes reused %d of the first call's 2 coroutines", reused)
	}
	before := runtime.NumGoroutine()
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before-3 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before-3 {
		t.Fatalf("%d goroutines after Close, %d before: Close left the 3 kept coroutines", n, before)
	}
	// A call after Close still runs, and ends its coroutines when it
	// returns.
	before = runtime.NumGoroutine()
	if _, ran = call(1); ran[0] != 100 {
		t.Fatalf("call after Close ran %v, want [100]", ran)
	}
	deadline = time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before {
		t.Fatalf("%d goroutines after a call on a closed Ring, %d before", n, before)
	}
}
