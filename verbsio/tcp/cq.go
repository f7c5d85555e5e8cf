package tcp

import (
	"context"
	"fmt"
	"runtime"
	"sync"

	"github.com/gdrlink/gdrlink/verbsio"
)

// spinPolls is how many times Wait polls, yielding in between, before it
// sleeps on the queue's channel.
const spinPolls = 64

// cq is a completion queue: a growing FIFO and a channel that wakes a
// sleeping Wait.
type cq struct {
	dev *device

	mu     sync.Mutex
	q      []verbsio.Completion
	head   int
	closed bool
	refs   int // queue pairs using it
	notify chan struct{}
	done   chan struct{}
}

func newCQ(d *device, depth int) *cq {
	return &cq{dev: d, q: make([]verbsio.Completion, 0, min(depth, 4096)), notify: make(chan struct{}, 1), done: make(chan struct{})}
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
	c.mu.Unlock()
	select {
	case c.notify <- struct{}{}:
	default:
	}
}

// Poll moves up to len(out) completions into out without blocking.
func (c *cq) Poll(out []verbsio.Completion) (int, error) {
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
	return n, nil
}

// Wait polls a few times, yielding in between, then sleeps until a
// completion arrives, ctx ends or the queue closes.
func (c *cq) Wait(ctx context.Context, out []verbsio.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	for i := 0; ; i++ {
		n, err := c.Poll(out)
		if n > 0 || err != nil {
			return n, err
		}
		if i < spinPolls {
			runtime.Gosched()
			continue
		}
		select {
		case <-c.notify:
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-c.done:
			return 0, fmt.Errorf("%w: completion queue", verbsio.ErrClosed)
		}
	}
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
