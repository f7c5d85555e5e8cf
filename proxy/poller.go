package proxy

import (
	"sync"
	"time"
)

// Backoff of the poller while the oldest event is pending.
const (
	pollMinSleep = 5 * time.Microsecond
	pollMaxSleep = 200 * time.Microsecond
)

type pending struct {
	ev Event
	fn func(error)
}

// poller runs completions of events recorded on one stream, in order, from
// one goroutine: no goroutine is parked per copy. Events of a stream
// complete in the order they were recorded, so only the oldest is queried.
type poller struct {
	mu    sync.Mutex
	queue []pending
	wake  chan struct{}
	stop  chan struct{}
	done  chan struct{}
	once  sync.Once
}

func newPoller() *poller {
	p := &poller{wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
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
		done, err := h.ev.Query()
		if !done && err == nil {
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
