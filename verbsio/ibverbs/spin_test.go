package ibverbs

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/verbsio"
)

// fakeWaiter is a completion queue whose one completion is due at a given
// time; its channel raises the event when it is due.
type fakeWaiter struct {
	due         time.Time
	polls, arms int
	slept       bool
}

func (f *fakeWaiter) Poll(out []verbsio.Completion) (int, error) {
	f.polls++
	if time.Now().Before(f.due) {
		return 0, nil
	}
	out[0] = verbsio.Completion{WRID: 1}
	return 1, nil
}

func (f *fakeWaiter) Arm() error { f.arms++; return nil }

func (f *fakeWaiter) WaitEvent(ctx context.Context) error {
	f.slept = true
	select {
	case <-time.After(time.Until(f.due)):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// The ibverbs Wait polls as its spin policy says and teaches it: answers
// that come while it polls keep it polling, answers that come much later
// than its cap make it sleep at once.
func TestSpinWaitLearns(t *testing.T) {
	p := adaptspin.New(adaptspin.Bounds{Max: 200 * time.Microsecond, Min: 2 * time.Microsecond})
	out := make([]verbsio.Completion, 1)
	wait := func(after time.Duration) *fakeWaiter {
		f := &fakeWaiter{due: time.Now().Add(after)}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if n, err := spinWait(ctx, p, f, out); n != 1 || err != nil {
			t.Fatalf("spinWait: %d, %v", n, err)
		}
		return f
	}
	// A completion already there: one poll, no sleep.
	if f := wait(0); f.polls != 1 || f.arms != 0 {
		t.Fatalf("a ready completion took %d polls and %d arms", f.polls, f.arms)
	}
	// Answers 20 us out come while it polls (a ping-pong); a loaded host
	// may stall a few of them past the cap.
	slept := 0
	for range 20 {
		if f := wait(20 * time.Microsecond); f.slept {
			slept++
		}
	}
	if slept > 5 {
		t.Fatalf("slept through %d of 20 answers 20 us out with a 200 us cap", slept)
	}
	if b := p.Stats().Budget; b < 40*time.Microsecond {
		t.Fatalf("budget %v after answers 20 us out, want at least twice that", b)
	}
	// Answers 20 ms out: it learns to sleep at once (but for the one
	// wait in 16 that polls for the cap).
	for range 20 {
		wait(20 * time.Millisecond)
	}
	if b := p.Stats().Budget; b != 2*time.Microsecond {
		t.Fatalf("budget %v after answers 20 ms out, want Min 2us", b)
	}
	if f := wait(5 * time.Millisecond); !f.slept || f.arms == 0 {
		t.Fatal("a late answer did not sleep on the channel")
	}
}

// A Wait with no spin (WithSpin(0)) sleeps at once; an expired context
// ends it with ErrTimeout.
func TestSpinWaitNoSpinAndTimeout(t *testing.T) {
	p := adaptspin.New(adaptspin.Bounds{})
	// Due well after the first poll, even on an emulated CPU.
	f := &fakeWaiter{due: time.Now().Add(100 * time.Millisecond)}
	out := make([]verbsio.Completion, 1)
	if n, err := spinWait(context.Background(), p, f, out); n != 1 || err != nil || f.polls > 3 || !f.slept {
		t.Fatalf("no-spin wait: %d, %v after %d polls, slept %v", n, err, f.polls, f.slept)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	f = &fakeWaiter{due: time.Now().Add(time.Hour)}
	if _, err := spinWait(ctx, p, f, out); !errors.Is(err, verbsio.ErrTimeout) {
		t.Fatalf("wait past its context: %v, want ErrTimeout", err)
	}
}

// With Bounds.Yield (Config.Yield) the pauses between polls give up the
// CPU (sched_yield); without it they never do.
func TestSpinWaitYields(t *testing.T) {
	out := make([]verbsio.Completion, 1)
	for _, yield := range []bool{false, true} {
		// Due well within the poll, even on an emulated CPU.
		p := adaptspin.New(adaptspin.Bounds{Max: 50 * time.Millisecond, Min: 2 * time.Microsecond, Yield: yield})
		f := &fakeWaiter{due: time.Now().Add(5 * time.Millisecond)}
		if n, err := spinWait(context.Background(), p, f, out); n != 1 || err != nil {
			t.Fatalf("spinWait: %d, %v", n, err)
		}
		got := p.Stats().Yields
		if yield && got == 0 || !yield && got != 0 {
			t.Errorf("Yield %v: %d CPU yields while polling for an answer 5 ms out (slept %v)", yield, got, f.slept)
		}
	}
}

// A device measures a wake-up of its host once, at its first completion
// queue, and seeds every queue's spin policy with it: the queues' polls are
// capped at sixteen of them within WithSpin, as tcp's and onnode's queues
// cap theirs at sixteen wake-ups they time themselves.
func TestQueuesKnowWakeCost(t *testing.T) {
	d := openTest(t)
	var cqs []*cq
	for range 2 {
		c, err := d.CreateCQ(8)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		cqs = append(cqs, c.(*cq))
	}
	if d.wake <= 0 {
		t.Fatalf("the device measured no wake-up (%v)", d.wake)
	}
	t.Logf("wake-up measured at the first queue: %v; poll cap %v", d.wake, cqs[0].spin.Stats().Budget)
	for i, c := range cqs {
		if w := c.spin.Stats().Wake; w != d.wake {
			t.Fatalf("queue %d's policy takes a wake-up to cost %v, the device measured %v", i, w, d.wake)
		}
		if b, want := c.spin.Stats().Budget, min(16*d.wake, d.p.o.spin); b != want {
			t.Fatalf("queue %d polls up to %v, want sixteen wake-ups within the %v bound, %v", i, b, d.p.o.spin, want)
		}
	}
}
