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

	next  func() (struct{}, bool)
	stop  func()
	yield func(struct{}) bool
	ended *sync.WaitGroup
}

// startLanes runs lane(k) for every segment lane, each as a coroutine,
// and runs each up to its first wait on the calling goroutine. x.ended
// counts those not finished; a failed lane's error goes to fail.
func (x *run) startLanes(body func(k int) error) {
	x.co = make([]*lane, x.lanes)
	x.ended.Add(x.lanes)
	for k := range x.co {
		l := &lane{ended: &x.ended}
		l.next, l.stop = iter.Pull(func(yield func(struct{}) bool) {
			l.yield = yield
			if err := body(k); err != nil {
				x.fail(err)
			}
		})
		x.co[k] = l
	}
	for _, l := range x.co {
		l.resume()
	}
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
		_, more := l.next()
		l.mu.Lock()
		if !more {
			l.running, l.finished = false, true
			l.mu.Unlock()
			l.stop()
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
		l.yield(struct{}{})
	}
}
