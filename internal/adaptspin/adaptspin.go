// Package adaptspin decides how long a completion queue's Wait polls before
// it goes to sleep, learned at run time from the waits themselves.
//
// Polling answers in the time of one poll, but burns a core; sleeping costs
// a wake-up (a futex, the scheduler, on a busy host much more) but leaves
// the core to others. Polling pays while completions come sooner than a
// wake-up would: a ping-pong, a stream of small messages. It wastes a core
// when they come later: a large transfer, an idle peer, a host with more
// runnable threads than cores, where the poller steals the very core the
// completion needs.
//
// A Policy keeps a poll budget and an estimate of what a wake-up costs
// (from a completion's arrival to the sleeper running again, as the queue
// measures it). A wait answered while polling after d moves the budget
// toward 4d (up at once, down slowly: a scheduling hiccup must not teach a
// ping-pong to sleep); a wait that polled its whole budget in vain and
// slept raises it to twice that wait when the wait was within the cap, and
// halves it when it was not. One wait in 16 polls for the whole cap, so a queue that learned to
// sleep finds out when polling would pay again. The cap is sixteen wake-ups
// (within the caller's bounds): a completion later than that costs little
// more for the sleep; until a wake-up has been measured, the caller's
// bound.
package adaptspin

import (
	"runtime"
	"sync/atomic"
	"time"
)

// Bounds are a Policy's limits.
type Bounds struct {
	// Max is the longest a wait ever polls; 0 means never poll.
	Max time.Duration
	// Min is the shortest poll of a wait (a completion already on its
	// way); it is also the poll of a queue whose waits run long.
	Min time.Duration
	// Yield makes waits give up their thread's CPU between polls
	// (YieldCPU), not only their goroutine's processor: for hosts with
	// more runnable threads than CPUs. It changes how a wait polls, not
	// for how long.
	Yield bool
}

// The default bounds: a wait polls between DefaultMin and DefaultMax.
const (
	DefaultMax = 200 * time.Microsecond
	DefaultMin = 2 * time.Microsecond
)

// Policy learns how long to poll. Its methods are safe for concurrent use;
// the zero value is not usable, make one with New.
type Policy struct {
	b      Bounds
	budget atomic.Int64 // ns
	wake   atomic.Int64 // ns, a moving average
	waits  atomic.Uint32
	yields atomic.Uint64
}

// probeEvery: one wait in so many polls for the whole cap.
const probeEvery = 16

// New returns a policy within b. It starts by polling for the cap, taking
// a wake-up's cost as unknown until it has measured one (Woke): until then
// the cap is b.Max.
func New(b Bounds) *Policy {
	b.Max = max(b.Max, 0)
	b.Min = min(max(b.Min, 0), b.Max)
	p := &Policy{b: b}
	p.budget.Store(int64(p.cap()))
	return p
}

// cap is the longest a wait polls now: sixteen wake-ups, within the
// bounds. A completion that takes longer costs little more for a sleep;
// one that comes sooner is worth polling for, since a round trip through
// two sleeping peers pays the wake-up twice. While no wake-up has been
// measured it is the caller's Max: a queue that cannot time its wake-ups
// (an ibverbs completion channel's) polls for as long as its caller
// allows, not for sixteen wake-ups of a guessed cost.
func (p *Policy) cap() time.Duration {
	w := time.Duration(p.wake.Load())
	if w == 0 {
		return p.b.Max
	}
	return min(max(16*w, p.b.Min), p.b.Max)
}

// Yields says whether waits yield their thread's CPU between polls
// (Bounds.Yield).
func (p *Policy) Yields() bool { return p.b.Yield }

// Yield is what a wait that yields (Yields) does between two polls:
// YieldCPU, counted (Stats.Yields).
func (p *Policy) Yield() {
	p.yields.Add(1)
	YieldCPU()
}

// Relax is what a polling wait does between two polls: Yield where the
// policy yields (Yields), else runtime.Gosched.
func (p *Policy) Relax() {
	if p.b.Yield {
		p.Yield()
		return
	}
	runtime.Gosched()
}

// Budget is how long the next wait polls before it sleeps.
func (p *Policy) Budget() time.Duration {
	if p.b.Max == 0 {
		return 0
	}
	c := p.cap()
	if p.waits.Add(1)%probeEvery == 0 {
		return c
	}
	return min(time.Duration(p.budget.Load()), c)
}

// Polled records a wait that a poll answered after d.
func (p *Policy) Polled(d time.Duration) {
	target := min(max(4*d+p.b.Min, p.b.Min), p.b.Max)
	old := p.budget.Load()
	if int64(target) > old {
		p.budget.Store(int64(target)) // up at once: polling paid
		return
	}
	p.budget.Store(old + (int64(target)-old)/8)
}

// Slept records a wait that polled its budget in vain and slept, and was
// answered after d in all. Where polling a little longer would have
// answered it (d within the cap), the budget grows to cover it; where not,
// it halves.
func (p *Policy) Slept(d time.Duration) {
	if c := p.cap(); d <= c {
		p.budget.Store(max(p.budget.Load(), int64(min(2*d, c))))
		return
	}
	p.budget.Store(max(p.budget.Load()/2, int64(p.b.Min)))
}

// Woke records the cost of one wake-up from sleep: from the moment the
// completion was queued to the sleeper running again.
func (p *Policy) Woke(d time.Duration) {
	if d > 0 {
		old := p.wake.Load()
		if old == 0 {
			p.wake.Store(int64(d)) // the first measure
			return
		}
		p.wake.Store(old + (int64(d)-old)/8)
	}
}

// Stats are a policy's current estimates.
type Stats struct {
	// Budget is how long a wait polls now (probes aside).
	Budget time.Duration
	// Wake is what a wake-up from sleep costs, a moving average; 0
	// until one has been measured.
	Wake time.Duration
	// Yields counts the CPU yields of the policy's waits (Yield).
	Yields uint64
}

// Stats returns the current estimates.
func (p *Policy) Stats() Stats {
	return Stats{Budget: min(time.Duration(p.budget.Load()), p.cap()), Wake: time.Duration(p.wake.Load()), Yields: p.yields.Load()}
}
