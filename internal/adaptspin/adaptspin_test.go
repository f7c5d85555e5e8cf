package adaptspin

import (
	"fmt"
	"testing"
	"time"
)

const us = time.Microsecond

func budgets(p *Policy, n int) []time.Duration {
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = p.Budget()
	}
	return out
}

func TestLearns(t *testing.T) {
	p := New(Bounds{Max: 200 * us, Min: 2 * us})
	// A wake-up taken to cost 20us: the cap is 16 of them, within Max.
	if got := p.Budget(); got != 200*us {
		t.Fatalf("first budget %v, want the cap 200us", got)
	}
	// Waits far longer than the cap, slept through, halve the budget
	// down to Min.
	for range 10 {
		p.Slept(5 * time.Millisecond)
	}
	if got := p.Stats().Budget; got != 2*us {
		t.Fatalf("after 10 long waits the budget is %v, want Min 2us", got)
	}
	// One wait in 16 still polls for the cap.
	bs := budgets(p, 32)
	probes := 0
	for _, b := range bs {
		switch b {
		case 200 * us:
			probes++
		case 2 * us:
		default:
			t.Fatalf("budget %v, want 2us or the 200us probe", b)
		}
	}
	if probes != 2 {
		t.Fatalf("%d probes in 32 waits, want 2: %v", probes, bs)
	}
	// A probe answered after 30us raises the budget at once to 4*30+2.
	p.Polled(30 * us)
	if got := p.Stats().Budget; got != 122*us {
		t.Fatalf("after a 30us answer the budget is %v, want 122us", got)
	}
	// Quicker answers bring it down slowly.
	for range 40 {
		p.Polled(5 * us)
	}
	if got := p.Stats().Budget; got < 22*us || got > 24*us {
		t.Fatalf("after 40 answers in 5us the budget is %v, want about 22us", got)
	}
	// A wait slept through but answered within the cap (a hiccup) raises
	// the budget to cover it instead of halving it.
	p.Slept(40 * us)
	if got := p.Stats().Budget; got != 80*us {
		t.Fatalf("after a 40us wait slept through the budget is %v, want 80us", got)
	}
}

func TestWakeCostCaps(t *testing.T) {
	p := New(Bounds{Max: time.Millisecond, Min: us})
	for range 100 {
		p.Woke(5 * us)
	}
	if got := p.Stats().Wake; got < 5*us || got > 6*us {
		t.Fatalf("wake estimate %v after 100 samples of 5us", got)
	}
	p.Polled(500 * us)
	if got := p.Budget(); got > 81*us {
		t.Fatalf("budget %v with wake-ups at 5us, want at most 16 of them", got)
	}
}

func TestNeverPolls(t *testing.T) {
	p := New(Bounds{})
	for i, b := range budgets(p, 20) {
		if b != 0 {
			t.Fatalf("wait %d polls %v with Max 0", i, b)
		}
	}
	p.Polled(10 * us)
	if b := p.Budget(); b != 0 {
		t.Fatalf("budget %v after a poll with Max 0", b)
	}
}

func ExamplePolicy() {
	p := New(Bounds{Max: DefaultMax, Min: DefaultMin})
	fmt.Println("at first:", p.Stats().Budget)
	// Completions come 10us after each Wait starts: the budget comes
	// down toward four times that.
	for range 60 {
		p.Polled(10 * time.Microsecond)
	}
	fmt.Println("quick answers:", p.Stats().Budget.Round(time.Microsecond))
	// Then a long pause: the waits poll in vain and sleep for 10ms.
	p.Slept(10 * time.Millisecond)
	p.Slept(10 * time.Millisecond)
	fmt.Println("after two long waits:", p.Stats().Budget.Round(time.Microsecond))
	// Output:
	// at first: 200µs
	// quick answers: 42µs
	// after two long waits: 11µs
}

// A policy yields only where its bounds say so, and counts each yield.
func TestPolicyYield(t *testing.T) {
	if New(Bounds{Max: DefaultMax}).Yields() {
		t.Fatal("a policy without Bounds.Yield yields")
	}
	p := New(Bounds{Max: DefaultMax, Yield: true})
	if !p.Yields() {
		t.Fatal("a policy with Bounds.Yield does not yield")
	}
	p.Yield()
	p.Yield()
	if n := p.Stats().Yields; n != 2 {
		t.Fatalf("Stats().Yields = %d after two yields", n)
	}
}

// A policy that has measured no wake-up (its queue cannot time one) polls
// up to its caller's bound: a Max of 5 ms is not cut to sixteen wake-ups
// of a guessed cost. The first wake-up measured sets the cap.
func TestUnmeasuredWakeCapsAtMax(t *testing.T) {
	p := New(Bounds{Max: 5 * time.Millisecond, Min: 2 * us})
	if got := p.Budget(); got != 5*time.Millisecond {
		t.Fatalf("first budget %v, want Max 5ms", got)
	}
	// A 1 ms answer moves the budget an eighth of the way to 4 ms:
	// 5 ms - (5 ms - 4.002 ms)/8, not down to a 320 us cap.
	p.Polled(time.Millisecond)
	if got := p.Stats().Budget; got != 4875250*time.Nanosecond {
		t.Fatalf("after a 1ms answer the budget is %v, want 4.87525ms", got)
	}
	if w := p.Stats().Wake; w != 0 {
		t.Fatalf("wake estimate %v before any was measured, want 0", w)
	}
	p.Woke(30 * us)
	if w := p.Stats().Wake; w != 30*us {
		t.Fatalf("wake estimate %v after one of 30us, want 30us", w)
	}
	if got := p.Stats().Budget; got != 480*us {
		t.Fatalf("budget %v with wake-ups at 30us, want the cap of 16 of them, 480us", got)
	}
}
