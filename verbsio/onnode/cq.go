package onnode

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/internal/cowlist"
	"github.com/gdrlink/gdrlink/verbsio"
)

// cq is a completion queue. Completions of sends are pushed by PostSend,
// or (SENDs) by whoever reads their acknowledgements: Poll itself from the
// peers' rings, or a queue pair's socket reader when Wait sleeps; those of
// receives by whoever drains the notification rings of the queue pairs
// attached to it: Poll itself, or a queue pair's progress goroutine when
// Wait sleeps.
type cq struct {
	dev   *device
	depth int

	mu     sync.Mutex
	q      []verbsio.Completion
	head   int
	closed bool
	// queued mirrors len(q)-head and gone mirrors closed, so an empty Poll
	// takes no lock.
	queued atomic.Int64
	gone   atomic.Bool

	sleepers atomic.Int32
	pollers  atomic.Int32 // Waits polling (ring.go: offPoll)
	pushed   atomic.Int64 // when a completion last woke a sleeper (UnixNano)
	spin     *adaptspin.Policy
	notify   chan struct{}
	qps      cowlist.List[*qp] // queue pairs whose receives complete here
	sendQPs  cowlist.List[*qp] // connected queue pairs whose sends complete here
	refs     int               // queue pairs using the queue (under mu)
}

func newCQ(d *device, depth int) *cq {
	c := &cq{dev: d, depth: depth, notify: make(chan struct{}, 1),
		spin: adaptspin.New(adaptspin.Bounds{Max: d.opts.Spin, Min: min(d.opts.Spin, adaptspin.DefaultMin), Yield: d.cfg.Yield})}
	return c
}

func (c *cq) push(cs ...verbsio.Completion) {
	c.mu.Lock()
	c.q = append(c.q, cs...)
	c.queued.Store(int64(len(c.q) - c.head))
	c.mu.Unlock()
	if c.sleepers.Load() > 0 {
		c.pushed.Store(time.Now().UnixNano())
		c.wake()
	}
}

func (c *cq) wake() {
	select {
	case c.notify <- struct{}{}:
	default:
	}
}

func (c *cq) take(out []verbsio.Completion) int {
	if c.queued.Load() == 0 {
		return 0
	}
	c.mu.Lock()
	n := copy(out, c.q[c.head:])
	c.head += n
	if c.head == len(c.q) {
		c.q, c.head = c.q[:0], 0
	} else if c.head > 4096 && c.head*2 > len(c.q) {
		c.q = append(c.q[:0], c.q[c.head:]...)
		c.head = 0
	}
	c.queued.Store(int64(len(c.q) - c.head))
	c.mu.Unlock()
	return n
}

func (c *cq) pending() bool { return c.queued.Load() > 0 }

func (c *cq) ref() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("%w: completion queue", verbsio.ErrClosed)
	}
	c.refs++
	return nil
}

func (c *cq) unref() {
	c.mu.Lock()
	c.refs--
	c.mu.Unlock()
}

// Poll implements verbsio.CompletionQueue.
func (c *cq) Poll(out []verbsio.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	n := c.take(out)
	if n == len(out) {
		return n, nil
	}
	drained := false
	for _, q := range c.qps.Load() {
		k, ok := q.drainIfReady(out[n:])
		n += k
		drained = drained || ok
	}
	for _, q := range c.sendQPs.Load() {
		if q.pollAcks() {
			drained = true
		}
	}
	if drained {
		n += c.take(out[n:])
	}
	if n == 0 && c.isClosed() {
		return 0, fmt.Errorf("%w: completion queue", verbsio.ErrClosed)
	}
	return n, nil
}

func (c *cq) isClosed() bool { return c.gone.Load() }

// Wait implements verbsio.CompletionQueue: it polls for as long as the
// queue's spin policy says (at most Options.Spin, learned from its own
// waits: internal/adaptspin), yielding the CPU between polls where
// verbsio.Config.Yield says to, then sleeps until a completion arrives or
// ctx ends. While it polls, the peers of the attached queue pairs see so
// (offPoll) and do not signal their SENDs. Where polls yield (a host with
// more ranks than cores), a wait polls while the device is busy instead:
// until adaptspin.LongFactor times Options.Spin has passed since the last
// completion any of its waits returned, or since its own start
// (busyWait).
func (c *cq) Wait(ctx context.Context, out []verbsio.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	c.poll(true)
	n, err := c.wait(ctx, out)
	c.poll(false)
	return n, err
}

// countIn counts a waiter in (or out) of n and returns the ring flag
// that says whether any is left: 1 if so, else 0.
func countIn(n *atomic.Int32, in bool) uint32 {
	d := int32(-1)
	if in {
		d = 1
	}
	if n.Add(d) > 0 {
		return 1
	}
	return 0
}

// poll counts a polling waiter in or out and says so in the rings of the
// attached queue pairs.
func (c *cq) poll(in bool) {
	flag := countIn(&c.pollers, in)
	for _, q := range c.qps.Load() {
		q.setPoll(flag)
	}
}

func (c *cq) wait(ctx context.Context, out []verbsio.Completion) (int, error) {
	start := time.Now()
	if c.spin.Yields() && c.dev.opts.Spin > 0 {
		if n, done, err := c.busyWait(ctx, out, start); done {
			return n, err
		}
		return c.sleepWait(ctx, out, start)
	}
	if n, done, err := c.spinWait(ctx, out, start, c.spin.Budget()); done {
		return n, err
	}
	return c.sleepWait(ctx, out, start)
}

// spinWait polls until budget has passed since start; done says it
// returns what a poll took, or ctx's end, and not that the budget ran out.
func (c *cq) spinWait(ctx context.Context, out []verbsio.Completion, start time.Time, budget time.Duration) (n int, done bool, err error) {
	yield := c.spin.Yields()
	for i := 0; ; i++ {
		n, err := c.Poll(out)
		if n > 0 || err != nil {
			c.spin.Polled(time.Since(start))
			return n, true, err
		}
		if yield {
			c.spin.Yield()
		}
		if i&63 == 63 || yield {
			if err := ctx.Err(); err != nil {
				return 0, true, fmt.Errorf("%w: waiting for completions: %w", verbsio.ErrTimeout, err)
			}
			if time.Since(start) >= budget {
				return 0, false, nil
			}
			if !yield {
				runtime.Gosched()
			}
		}
	}
}

// busyWait is the wait where polls yield (a host with more ranks than
// cores): it polls, yielding, for as long as the device has returned a
// completion within adaptspin.LongFactor times the spin bound (its own
// start counting as one), and meanwhile wakes the device's sleeping
// waits whose completions are ready: no wait of a busy device waits for
// the network poller, which a host whose processors all poll serves
// only every 10 ms. So a rank of a collective, whose links see traffic
// in turn, polls them all through the call and between calls that
// follow each other, as an MPI rank polls, and sleeps once its device
// has been quiet for the long poll. 8 ranks of a 1 MiB AllReduce on 2
// cores (three links each) took 2.8-2.9 ms a call with waits that each
// polled their own long poll only while the device had no more waits
// than Go processors, and 1.9 ms with this (README, Collectives). done
// says it returns what a poll took, or ctx's end.
func (c *cq) busyWait(ctx context.Context, out []verbsio.Completion, start time.Time) (n int, done bool, err error) {
	long := int64(adaptspin.LongFactor * c.dev.opts.Spin)
	for {
		n, err := c.Poll(out)
		if n > 0 || err != nil {
			if n > 0 {
				now := time.Now()
				c.dev.lastDone.Store(now.UnixNano())
				c.spin.Polled(now.Sub(start))
			}
			return n, true, err
		}
		c.dev.wakeReady(c)
		c.spin.Yield()
		if err := ctx.Err(); err != nil {
			return 0, true, fmt.Errorf("%w: waiting for completions: %w", verbsio.ErrTimeout, err)
		}
		if time.Now().UnixNano()-max(start.UnixNano(), c.dev.lastDone.Load()) >= long {
			return 0, false, nil
		}
	}
}

// wakeReady wakes the sleeping waits of d's queues, other than self,
// whose completions are ready.
func (d *device) wakeReady(self *cq) {
	for _, x := range d.cqs.Load() {
		if x != self && x.sleepers.Load() > 0 && x.ready() {
			x.wake()
		}
	}
}

// ready says whether a Poll of c would find completions: queued ones, a
// receive's record in an attached queue pair's ring, or an
// acknowledgement of a SEND waiting for one.
func (c *cq) ready() bool {
	if c.pending() {
		return true
	}
	for _, q := range c.qps.Load() {
		if q.ringReady() {
			return true
		}
	}
	for _, q := range c.sendQPs.Load() {
		if q.acksReady() {
			return true
		}
	}
	return false
}

// sleepWait sleeps until a completion arrives (the peers signal) or ctx
// ends; start is when the Wait began.
func (c *cq) sleepWait(ctx context.Context, out []verbsio.Completion, start time.Time) (int, error) {
	for {
		c.sleep(true)
		n, err := c.Poll(out)
		if n > 0 || err != nil {
			c.sleep(false)
			c.dev.lastDone.Store(time.Now().UnixNano())
			c.spin.Slept(time.Since(start))
			return n, err
		}
		select {
		case <-c.notify:
			if p := c.pushed.Load(); p > 0 {
				c.spin.Woke(time.Duration(time.Now().UnixNano() - p))
			}
		case <-ctx.Done():
			c.sleep(false)
			return 0, fmt.Errorf("%w: waiting for completions: %w", verbsio.ErrTimeout, ctx.Err())
		}
		c.sleep(false)
		n, err = c.Poll(out)
		if n > 0 || err != nil {
			if c.sleepers.Load() > 0 && c.pending() {
				c.wake()
			}
			c.dev.lastDone.Store(time.Now().UnixNano())
			c.spin.Slept(time.Since(start))
			return n, err
		}
	}
}

// sleep counts a sleeping waiter in or out and tells the senders of the
// attached queue pairs whether to signal.
func (c *cq) sleep(in bool) {
	flag := countIn(&c.sleepers, in)
	for _, q := range c.qps.Load() {
		q.setSleep(flag)
	}
	for _, q := range c.sendQPs.Load() {
		q.setAckWake(flag)
	}
}

// Close implements verbsio.CompletionQueue; ErrBusy while queue pairs use it.
func (c *cq) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	if c.refs > 0 {
		return fmt.Errorf("%w: completion queue used by %d queue pairs", verbsio.ErrBusy, c.refs)
	}
	c.closed = true
	c.gone.Store(true)
	c.dev.cqs.Remove(c)
	c.dev.dropChild()
	return nil
}
