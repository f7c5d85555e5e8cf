package onnode

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
)

// enterWait gives long polls only where polls yield, the spin bound is
// not 0 and the waits in progress are at most GOMAXPROCS.
func TestEnterWaitLongPolls(t *testing.T) {
	d := &device{opts: Options{Spin: 200 * time.Microsecond}}
	long := yieldSpinFactor * d.opts.Spin
	if got := d.enterWait(false); got != 0 {
		t.Fatalf("wait without yielding polls %s long, want its own budget", got)
	}
	d.leaveWait()
	procs := runtime.GOMAXPROCS(0)
	for i := range procs {
		if got := d.enterWait(true); got != long {
			t.Fatalf("wait %d of %d (GOMAXPROCS %d) polls %s, want %s", i+1, procs, procs, got, long)
		}
	}
	if got := d.enterWait(true); got != 0 {
		t.Fatalf("wait %d with GOMAXPROCS %d polls %s long, want its own budget", procs+1, procs, got)
	}
	for range procs + 1 {
		d.leaveWait()
	}
	if n := d.waits.Load(); n != 0 {
		t.Fatalf("%d waits counted after all left", n)
	}
	if got := d.enterWait(true); got != long {
		t.Fatalf("after the others left, a wait polls %s, want %s", got, long)
	}
	d.leaveWait()
	off := &device{opts: Options{Spin: 0}}
	if got := off.enterWait(true); got != 0 {
		t.Fatalf("GDRLINK_ONNODE_SPIN=0: a wait polls %s, want never", got)
	}
	off.leaveWait()
}

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
			if yield && time.Since(deadline.Add(-time.Second)) > yieldSpinFactor*spin/2 {
				break
			}
		}
		switch {
		case yield && slept:
			t.Errorf("a yielding wait went to sleep within half its long poll (%s)", yieldSpinFactor*spin/2)
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
