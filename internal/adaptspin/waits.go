package adaptspin

import (
	"runtime"
	"sync/atomic"
	"time"
)

// LongFactor is how many times its spin bound a wait polls where polls
// yield the CPU (Bounds.Yield: more runnable threads than CPUs) and its
// device has no more waits in progress than the process has Go processors
// (Waits.Enter): 5 ms for the default 200 µs. There a sleeping wait costs
// its rank a wake-up that waits for a core, while a poll that yields the
// CPU between looks costs the other ranks little: a 1 MiB AllReduce of 4
// ranks on 2 cores (two links each, so two waits) took 0.66-0.84 ms on
// onnode with long polls against 0.96-1.24 ms, and 1.85-2.69 against
// 2.18-2.94 ms on tcp (README, Collectives). With more waits than Go
// processors, polling waits would leave no processor idle, and the runtime
// then looks at the network (the descriptors that wake sleeping waits, a
// barrier's socket) only every 10 ms, from its monitor thread: 8 such ranks
// (three links each) took 8-9 ms a call instead of 3.
const LongFactor = 25

// Waits counts the waits in progress on a device, to give them long polls
// where that pays (LongFactor). The zero value is ready to use; it is safe
// for concurrent use.
type Waits struct{ n atomic.Int32 }

// Enter counts a wait in (Leave counts it out, whatever Enter returned)
// and returns how long it may poll instead of its own budget: LongFactor
// times spin where polls yield (yield) and the waits in progress, this one
// included, are at most GOMAXPROCS; else 0. A spin of 0 or less (never
// poll) stays so.
func (w *Waits) Enter(yield bool, spin time.Duration) time.Duration {
	n := w.n.Add(1)
	if !yield || spin <= 0 || n > int32(runtime.GOMAXPROCS(0)) {
		return 0
	}
	return LongFactor * spin
}

// Budget counts a wait that polls under p in (Leave counts it out) and
// returns how long it polls: the long poll Enter gives it (p's Yields and
// Max being the yield and spin bound), else p's own Budget.
func (w *Waits) Budget(p *Policy) time.Duration {
	b := p.Budget()
	if long := w.Enter(p.Yields(), p.b.Max); long > 0 {
		return long
	}
	return b
}

// Leave counts a wait out.
func (w *Waits) Leave() { w.n.Add(-1) }

// InProgress is the number of waits counted in now.
func (w *Waits) InProgress() int { return int(w.n.Load()) }
