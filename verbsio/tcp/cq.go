package tcp

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/internal/cowlist"
	"github.com/gdrlink/gdrlink/verbsio"
)

// cq is a completion queue: a growing FIFO and a channel that wakes a
// sleeping Wait. While Wait polls, it also reads the lanes of the queue
// pairs attached to it (see poll.go), for as long as the queue's spin
// policy says.
type cq struct {
	dev  *device
	spin *adaptspin.Policy

	mu     sync.Mutex
	q      []verbsio.Completion
	head   int
	closed bool
	refs   int // queue pairs using it
	notify chan struct{}
	done   chan struct{}

	queued   atomic.Int64 // len(q)-head, so an empty Poll takes no lock
	qps      cowlist.List[*qp]
	sleepers atomic.Int32
	pushed   atomic.Int64 // when a completion last woke a sleeper (UnixNano)
	// polling counts the Waits polling the lanes now; polled is when
	// the last stopped (UnixNano): the queue pairs' quiet timers read
	// them (qp.quietCheck).
	polling atomic.Int32
	polled  atomic.Int64
}

func newCQ(d *device, depth int) *cq {
	c := &cq{dev: d, spin: adaptspin.New(adaptspin.Bounds{Max: max(d.opt.Spin, 0), Min: min(max(d.opt.Spin, 0), adaptspin.DefaultMin), Yield: d.cfg.Yield}), q: make([]verbsio.Completion, 0, min(depth, 4096)), notify: make(chan struct{}, 1), done: make(chan struct{})}
	return c
}

func (c *cq) push(cs ...verbsio.Completion) {
	if len(cs) == 0 {
		return
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.q = append(c.q, cs...)
	c.queued.Store(int64(len(c.q) - c.head))
	c.mu.Unlock()
	if c.sleepers.Load() > 0 {
		c.pushed.Store(time.Now().UnixNano())
		select {
		case c.notify <- struct{}{}:
		default:
		}
	}
}

// Poll moves up to len(out) completions into out without blocking.
func (c *cq) Poll(out []verbsio.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	if c.queued.Load() == 0 {
		select {
		case <-c.done:
			return 0, fmt.Errorf("%w: completion queue", verbsio.ErrClosed)
		default:
			return 0, nil
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return 0, fmt.Errorf("%w: completion queue", verbsio.ErrClosed)
	}
	n := copy(out, c.q[c.head:])
	c.head += n
	if c.head == len(c.q) {
		c.q, c.head = c.q[:0], 0
	} else if c.head > 4096 && c.head > len(c.q)/2 {
		k := copy(c.q, c.q[c.head:])
		c.q, c.head = c.q[:k], 0
	}
	c.queued.Store(int64(len(c.q) - c.head))
	return n, nil
}

// progress reads the lanes of the attached queue pairs once: the inbound
// ones always, the outbound ones (acknowledgements, which complete
// sends) when this is the queue pair's send queue or acks says to. A
// look at a lane is a system call: a receive queue's waiter that read
// the outbound lanes at every turn would see its requests later.
func (c *cq) progress(acks bool) bool {
	did := false
	for _, q := range c.qps.Load() {
		if q.poll(acks || q.scq == c) {
			did = true
		}
	}
	return did
}

// Wait polls, reading the lanes itself, for as long as the queue's spin
// policy says (yielding the CPU between polls where verbsio.Config.Yield
// says to; there, while the device has no more waits than the process has
// Go processors, for adaptspin.LongFactor times Options.Spin), then sleeps
// until a completion arrives, ctx ends or the queue closes.
func (c *cq) Wait(ctx context.Context, out []verbsio.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	start := time.Now()
	budget := c.dev.waits.Budget(c.spin)
	defer c.dev.waits.Leave()
	c.polling.Add(1)
	yield := c.spin.Yields()
	for i := 0; ; i++ {
		n, err := c.Poll(out)
		if n > 0 || err != nil {
			d := time.Since(start)
			c.endPoll(start.Add(d))
			c.spin.Polled(d)
			return n, err
		}
		if c.progress(i&7 == 0) {
			continue
		}
		if i&7 == 7 || yield {
			if err := ctx.Err(); err != nil {
				c.endPoll(time.Now())
				return 0, err
			}
			if time.Since(start) >= budget {
				break
			}
		}
		c.spin.Relax()
	}
	c.endPoll(time.Now())
	for _, q := range c.qps.Load() {
		q.unquiet() // nobody polls their lanes now
	}
	for {
		c.sleepers.Add(1)
		n, err := c.Poll(out)
		if n > 0 || err != nil {
			c.sleepers.Add(-1)
			c.spin.Slept(time.Since(start))
			return n, err
		}
		select {
		case <-c.notify:
			c.sleepers.Add(-1)
			if p := c.pushed.Load(); p > 0 {
				c.spin.Woke(time.Duration(time.Now().UnixNano() - p))
			}
		case <-ctx.Done():
			c.sleepers.Add(-1)
			return 0, ctx.Err()
		case <-c.done:
			c.sleepers.Add(-1)
			return 0, fmt.Errorf("%w: completion queue", verbsio.ErrClosed)
		}
	}
}

// endPoll records that a Wait stopped polling the lanes at t.
func (c *cq) endPoll(t time.Time) {
	c.polled.Store(t.UnixNano())
	c.polling.Add(-1)
}

// Close releases the queue; ErrBusy while queue pairs use it. Idempotent.
func (c *cq) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	if c.refs > 0 {
		n := c.refs
		c.mu.Unlock()
		return fmt.Errorf("%w: completion queue used by %d queue pairs", verbsio.ErrBusy, n)
	}
	c.closed = true
	close(c.done)
	c.mu.Unlock()
	c.dev.mu.Lock()
	delete(c.dev.cqs, c)
	c.dev.mu.Unlock()
	return nil
}
