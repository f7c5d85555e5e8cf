package collective

import (
	"iter"
	"sync"
)

// A lane is one segment's way through a call's steps, run as a coroutine
// (iter.Pull): it runs on whichever goroutine delivers what it waits for
// (the completion goroutine of a link, as a rule), until it must wait
// again. A step's receive thus wakes no goroutine of its own: the step
// runs on the thread that took its completion, not on a lane goroutine
// the scheduler must wake and place (on a host with as many ranks as
// cores, each such hand-off waits for a core).
type lane struct {
	mu sync.Mutex
	// running: a goroutine runs the coroutine now; pending: something
	// came while it ran, so it looks again before it lets go.
	running, pending, finished bool

	co    *coroutine
	ended *sync.WaitGroup
}

// A coroutine runs lanes, one call's after another's: the Ring keeps
// those of finished calls (Ring.Close ends them), so that a call starts
// no goroutine per lane and runs on a stack grown already (a fresh
// goroutine's stack grows, copied each time, through the depth of a
// provider's post; on two ranks of a 4 KiB AllReduce that copying was a
// sixth of the call).
type coroutine struct {
	next  func() (struct{}, bool)
	stop  func()
	yield func(struct{}) bool
	// body is the lane to run on the next resume after idle; idle says
	// the last one returned and the coroutine waits for another.
	body func()
	idle bool
}

func newCoroutine() *coroutine {
	co := &coroutine{}
	co.next, co.stop = iter.Pull(func(yield func(struct{}) bool) {
		co.yield = yield
		for {
			body := co.body
			co.body = nil
			body()
			co.idle = true
			if !yield(struct{}{}) {
				return
			}
		}
	})
	return co
}

// coroutines takes n coroutines from r's idle ones, making those missing.
func (r *Ring) coroutines(n int) []*coroutine {
	out := make([]*coroutine, n)
	r.comu.Lock()
	k := min(n, len(r.idle))
	copy(out, r.idle[len(r.idle)-k:])
	clear(r.idle[len(r.idle)-k:])
	r.idle = r.idle[:len(r.idle)-k]
	r.comu.Unlock()
	for i := k; i < n; i++ {
		out[i] = newCoroutine()
	}
	return out
}

// release gives back the coroutines of a call whose lanes all finished;
// after Close it ends them.
func (r *Ring) release(cos []*coroutine) {
	r.comu.Lock()
	if !r.closed {
		r.idle = append(r.idle, cos...)
		cos = nil
	}
	r.comu.Unlock()
	for _, co := range cos {
		co.stop()
	}
}

// Close ends the coroutines r keeps between calls. A call still running
// ends its own when it returns. r stays usable: a later call starts new
// coroutines and ends them when it returns.
func (r *Ring) Close() error {
	r.comu.Lock()
	r.closed = true
	idle := r.idle
	r.idle = nil
	r.comu.Unlock()
	for _, co := range idle {
		co.stop()
	}
	return nil
}

// startLanes runs lane(k) for every segment lane, each as a coroutine,
// and runs each up to its first wait on the calling goroutine. x.ended
// counts those not finished; a failed lane's error goes to fail. Once
// x.ended is done, x.releaseLanes gives the coroutines back.
func (x *run) startLanes(body func(k int) error) {
	cos := x.r.coroutines(x.lanes)
	x.co = make([]*lane, x.lanes)
	x.ended.Add(x.lanes)
	for k := range x.co {
		co := cos[k]
		co.idle = false
		co.body = func() {
			if err := body(k); err != nil {
				x.fail(err)
			}
		}
		x.co[k] = &lane{co: co, ended: &x.ended}
	}
	for _, l := range x.co {
		l.resume()
	}
}

// releaseLanes gives the coroutines of a call whose lanes all finished
// back to the Ring.
func (x *run) releaseLanes() {
	cos := make([]*coroutine, len(x.co))
	for k, l := range x.co {
		cos[k] = l.co
	}
	x.r.release(cos)
}

// resume runs the lane until it waits again, unless another goroutine
// runs it now: that one then looks again before it lets go.
func (l *lane) resume() {
	l.mu.Lock()
	if l.running || l.finished {
		l.pending = true
		l.mu.Unlock()
		return
	}
	l.running = true
	l.mu.Unlock()
	for {
		_, more := l.co.next()
		l.mu.Lock()
		if !more || l.co.idle {
			l.running, l.finished = false, true
			l.mu.Unlock()
			l.ended.Done()
			return
		}
		if l.pending {
			l.pending = false
			l.mu.Unlock()
			continue
		}
		l.running = false
		l.mu.Unlock()
		return
	}
}

// await gives the lane's goroutine back until ready() holds: whoever
// makes it hold resumes the lane. It runs inside the lane's coroutine.
func (l *lane) await(ready func() bool) {
	for !ready() {
		l.co.yield(struct{}{})
	}
}
