package proxy

import (
	"runtime"
	"sync"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
)

// Backoff of the poller while the oldest event is pending, for events a
// thread cannot wait on in the driver. A Go timer shorter than a
// millisecond fires after about a millisecond when the process is
// otherwise idle (the runtime's netpoller sleeps in whole milliseconds), so
// these sleeps are the slow path.
const (
	pollMinSleep = 5 * time.Microsecond
	pollMaxSleep = 200 * time.Microsecond
)

// syncEvent is an Event that a thread can wait on inside the driver
// (cuEventSynchronize on an event made with CU_EVENT_BLOCKING_SYNC): the
// thread sleeps until the device signals, and wakes in microseconds rather
// than at the next millisecond tick of a Go timer.
type syncEvent interface {
	Event
	Synchronize() error
}

// spinEvent queries ev until it is done, fails, or budget passes, yielding
// the processor between queries. It returns whether the event is done, its
// error, and how long it polled.
func spinEvent(ev Event, budget time.Duration) (done bool, polled time.Duration, err error) {
	start := time.Now()
	for {
		done, err := ev.Query()
		if done || err != nil {
			return done, time.Since(start), err
		}
		if time.Since(start) >= budget {
			return false, time.Since(start), nil
		}
		runtime.Gosched()
	}
}

type pending struct {
	ev Event
	fn func(error)
}

// poller runs completions of events recorded on one stream, in order, from
// one goroutine: no goroutine is parked per copy. Events of a stream
// complete in the order they were recorded, so only the oldest is waited
// on: polled for as long as polling has paid lately (adaptspin), then, for
// an event the driver can wait on, waited on in the driver (the poller's
// thread blocks; Close waits for every receive first, so nothing needs to
// interrupt it), else polled with a backoff.
type poller struct {
	spin  *adaptspin.Policy
	mu    sync.Mutex
	queue []pending
	wake  chan struct{}
	stop  chan struct{}
	done  chan struct{}
	once  sync.Once
}

func newPoller() *poller {
	p := &poller{spin: adaptspin.New(adaptspin.Bounds{Max: adaptspin.DefaultMax, Min: adaptspin.DefaultMin}),
		wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	go p.run()
	return p
}

// add queues fn to run with the event's error once it completes. The
// poller closes the event.
func (p *poller) add(ev Event, fn func(error)) {
	p.mu.Lock()
	p.queue = append(p.queue, pending{ev, fn})
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (p *poller) head() (pending, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.queue) == 0 {
		return pending{}, false
	}
	return p.queue[0], true
}

func (p *poller) pop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.queue[0] = pending{}
	p.queue = p.queue[1:]
}

func (p *poller) run() {
	defer close(p.done)
	sleep := pollMinSleep
	var spun Event // the head event already polled for its budget
	for {
		h, ok := p.head()
		if !ok {
			select {
			case <-p.wake:
				continue
			case <-p.stop:
				return
			}
		}
		start := time.Now()
		budget := p.spin.Budget()
		if h.ev == spun {
			budget = 0 // polled already: query once, then back off
		}
		done, polled, err := spinEvent(h.ev, budget)
		switch {
		case done || err != nil:
			if h.ev != spun {
				p.spin.Polled(polled)
			}
		default:
			spun = h.ev
			se, ok := h.ev.(syncEvent)
			if !ok {
				break
			}
			err = se.Synchronize()
			done = true
			p.spin.Slept(time.Since(start))
		}
		if !done {
			t := time.NewTimer(sleep)
			select {
			case <-t.C:
			case <-p.stop:
				t.Stop()
				// Closing waits for the queue to drain first (see close), so
				// a stop here means the caller gave up waiting.
				return
			}
			if sleep *= 2; sleep > pollMaxSleep {
				sleep = pollMaxSleep
			}
			continue
		}
		sleep = pollMinSleep
		p.pop()
		_ = h.ev.Close()
		h.fn(err)
	}
}

// len is the number of events pending.
func (p *poller) len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.queue)
}

// close stops the goroutine. Idempotent.
func (p *poller) close() {
	p.once.Do(func() { close(p.stop) })
	<-p.done
}
