package rendezvous

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// sentFrame is one frame a probeQP saw posted.
type sentFrame struct {
	wrid    uint64
	typ     wire.Type
	credits uint16
	count   uint32 // TAKEN's
}

// probeQP is a stub queue pair that records the frames of every control
// SEND and fails every post once fail is set. Its fields are guarded by the
// channel's lock, under which the channel posts.
type probeQP struct {
	stubQP
	c      *Channel
	frames []sentFrame
	fail   error
}

func (q *probeQP) PostSend(wrs []verbsio.SendWR) error {
	if q.fail != nil {
		return q.fail
	}
	for _, wr := range wrs {
		if wr.WRID&wridKind != wridCtrl {
			continue
		}
		off := int(wr.SG[0].Addr - q.c.sendBuf.Addr())
		b := q.c.sendBuf.Bytes()[off : off+int(wr.SG[0].Length)]
		for len(b) > 0 {
			var m wire.Message
			n, err := wire.Decode(b, &m)
			if err != nil {
				return err
			}
			q.frames = append(q.frames, sentFrame{wr.WRID, m.Type, m.Credits, m.Count})
			b = b[n:]
		}
	}
	return nil
}

// keepalives returns the CREDIT frames posted so far.
func (q *probeQP) keepalives() []sentFrame {
	q.c.mu.Lock()
	defer q.c.mu.Unlock()
	var ka []sentFrame
	for _, f := range q.frames {
		if f.typ == wire.TypeCredit {
			ka = append(ka, f)
		}
	}
	return ka
}

// keepaliveChannel is a connected channel to the peer "sender" over a
// probeQP, with no completion goroutine: the tests hand it arrivals and
// completions, and drive ticks by hand when the interval is long.
func keepaliveChannel(t *testing.T, interval time.Duration) (*Channel, *probeQP) {
	t.Helper()
	const ring, slots = 8, 8
	c := &Channel{
		opts: options{ring: ring, sendSlots: slots, maxStrings: 1 << 20, maxTensor: 1 << 20, keepalive: interval},
		mem:  PoolMemory(stubRegion, stubPool(t)), slot: wire.MaxFrame, peerSlot: wire.MaxFrame, provider: "stub", devName: "stub", peer: "sender",
		pollDone: make(chan struct{}), byeSent: make(chan struct{}),
		state: stateConnected, credits: ring, sqMax: 64, threshold: 2,
	}
	q := &probeQP{c: c}
	c.qp = q
	c.initHalves()
	c.log = slog.New(discard{})
	c.ctx, c.stop = context.WithCancel(context.Background())
	var err error
	if c.recvBuf, c.recvMR, err = c.allocRegistered(ring * c.slot); err != nil {
		t.Fatal(err)
	}
	if c.sendBuf, c.sendMR, err = c.allocRegistered(slots * c.slot); err != nil {
		t.Fatal(err)
	}
	for i := slots - 1; i >= 0; i-- {
		c.freeSlots = append(c.freeSlots, i)
	}
	c.recvSGEs = make([]verbsio.SGE, ring)
	t.Cleanup(func() {
		var ds deliveries
		c.mu.Lock()
		c.failLocked(ErrClosed, &ds, stateClosed)
		c.mu.Unlock()
		ds.run()
		c.stop()
		if err := c.release(); err != nil {
			t.Error(err)
		}
	})
	return c, q
}

// arrive hands the channel m as a SEND received in ring slot 0, through its
// completion path, as its completion goroutine would.
func arrive(c *Channel, m wire.Message) {
	var ds deliveries
	c.mu.Lock()
	b := m.Append(c.recvBuf.Bytes()[:0:c.slot])
	wc := verbsio.Completion{WRID: wridRecv, Status: verbsio.StatusSuccess, Op: verbsio.OpRecv, ByteLen: uint32(len(b))}
	c.recvWRs = c.recvWRs[:0]
	c.handleLocked(&wc, &ds)
	c.owed += len(c.recvWRs)
	c.flushLocked()
	c.armKeepaliveLocked()
	c.mu.Unlock()
	ds.run()
}

// complete hands the channel the completion of a posted control SEND.
func complete(c *Channel, wrid uint64, st verbsio.Status) {
	var ds deliveries
	c.mu.Lock()
	wc := verbsio.Completion{WRID: wrid, Status: st, Op: verbsio.OpSend}
	c.handleLocked(&wc, &ds)
	c.flushLocked()
	c.mu.Unlock()
	ds.run()
}

// tick runs the keepalive timer's function now, as if the interval had
// passed.
func tick(t *testing.T, c *Channel) {
	t.Helper()
	c.mu.Lock()
	armed := c.kaArmed
	c.mu.Unlock()
	if armed {
		c.keepaliveTick()
	}
}

func armed(c *Channel) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.kaArmed
}

// A keepalive goes out on a tick that finds work pending and the peer
// silent since the last one, and not when the peer spoke or when nothing
// is pending; an idle channel runs no timer at all.
func TestKeepaliveOnlyWhilePending(t *testing.T) {
	c, q := keepaliveChannel(t, time.Hour) // ticks by hand
	c.mu.Lock()
	c.armKeepaliveLocked()
	c.mu.Unlock()
	if armed(c) || c.kaTimer != nil {
		t.Fatal("an idle channel armed its keepalive timer")
	}
	got := make(chan error, 1)
	c.RecvFunc(context.Background(), "k", 0, func(_ *tensor.Tensor, _ Transfer, err error) { got <- err })
	if !armed(c) {
		t.Fatal("a pending Recv left the keepalive timer unarmed")
	}
	tick(t, c)
	if n := len(q.keepalives()); n != 1 {
		t.Fatalf("%d keepalives after a silent interval with a Recv pending, want 1", n)
	}
	arrive(c, wire.Message{Type: wire.TypeCredit, Credits: 1})
	tick(t, c)
	if n := len(q.keepalives()); n != 1 {
		t.Fatalf("%d keepalives after an interval in which the peer spoke, want still 1", n)
	}
	tick(t, c)
	if n := len(q.keepalives()); n != 2 {
		t.Fatalf("%d keepalives after a second silent interval, want 2", n)
	}
	if st := c.Stats(); st.Keepalives != 2 || st.CreditsOnly != 0 {
		t.Fatalf("stats %+v, want 2 keepalives counted apart from CreditsOnly", st)
	}
	// The answer ends the pending work: the next tick sends nothing and
	// leaves the timer off.
	arrive(c, wire.Message{Type: wire.TypeError, Req: 1, Code: wire.CodeSender, Text: []byte("no")})
	if err := <-got; !errors.Is(err, ErrRemote) {
		t.Fatalf("Recv = %v, want ErrRemote", err)
	}
	tick(t, c)
	tick(t, c)
	if n := len(q.keepalives()); n != 2 {
		t.Fatalf("%d keepalives once idle, want still 2", n)
	}
	if armed(c) {
		t.Fatal("the keepalive timer stays armed on an idle channel")
	}
	// A Send waiting for its request is pending work too.
	meta, err := tensor.MetaFor(tensor.Uint8, tensor.Shape{0})
	if err != nil {
		t.Fatal(err)
	}
	src, err := tensor.New(meta, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Send("s", 0, src); err != nil {
		t.Fatal(err)
	}
	tick(t, c)
	if n := len(q.keepalives()); n != 3 {
		t.Fatalf("%d keepalives with a Send pending, want 3", n)
	}
}

// With the timer running for real, keepalives follow the interval while a
// Recv is pending and stop once it is answered.
func TestKeepaliveTimer(t *testing.T) {
	c, _ := keepaliveChannel(t, 5*time.Millisecond)
	got := make(chan error, 1)
	c.RecvFunc(context.Background(), "k", 0, func(_ *tensor.Tensor, _ Transfer, err error) { got <- err })
	deadline := time.Now().Add(10 * time.Second)
	for c.Stats().Keepalives < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("%d keepalives in 10s with a 5ms interval", c.Stats().Keepalives)
		}
		time.Sleep(time.Millisecond)
	}
	arrive(c, wire.Message{Type: wire.TypeError, Req: 1, Code: wire.CodeSender, Text: []byte("no")})
	if err := <-got; !errors.Is(err, ErrRemote) {
		t.Fatalf("Recv = %v, want ErrRemote", err)
	}
	before := c.Stats().Keepalives
	time.Sleep(50 * time.Millisecond)
	if after := c.Stats().Keepalives; after != before {
		t.Fatalf("%d keepalives sent by an idle channel", after-before)
	}
	if armed(c) {
		t.Fatal("the keepalive timer stays armed on an idle channel")
	}
}

// A keepalive that cannot be posted, or whose SEND completes in error (the
// transport gave up on a dead peer), fails every pending request with
// ErrPeerLost naming the peer, and stops the timer.
func TestKeepaliveFailureFailsPending(t *testing.T) {
	for _, how := range []string{"post", "completion"} {
		t.Run(how, func(t *testing.T) {
			c, q := keepaliveChannel(t, time.Hour)
			errc := make(chan error, 3)
			for i := range 3 {
				c.RecvFunc(context.Background(), "k", int64(i), func(_ *tensor.Tensor, _ Transfer, err error) { errc <- err })
			}
			if how == "post" {
				c.mu.Lock()
				q.fail = errors.New("stub: queue pair in error")
				c.mu.Unlock()
				tick(t, c)
			} else {
				tick(t, c)
				ka := q.keepalives()
				if len(ka) != 1 {
					t.Fatalf("%d keepalives, want 1", len(ka))
				}
				complete(c, ka[0].wrid, verbsio.StatusRetryExceeded)
			}
			for range 3 {
				select {
				case err := <-errc:
					if !errors.Is(err, verbsio.ErrPeerLost) || !strings.Contains(err.Error(), "sender") {
						t.Fatalf("pending Recv = %v, want ErrPeerLost naming the peer", err)
					}
				case <-time.After(10 * time.Second):
					t.Fatal("a pending Recv still waits 10s after the keepalive failed")
				}
			}
			if err := c.Err(); !errors.Is(err, verbsio.ErrPeerLost) {
				t.Fatalf("channel error %v, want ErrPeerLost", err)
			}
			if armed(c) {
				t.Fatal("the keepalive timer stays armed on a failed channel")
			}
		})
	}
}

// A keepalive leaves the reserve credit alone unless it returns credits,
// and carries the credits owed.
func TestKeepaliveRespectsCredits(t *testing.T) {
	c, q := keepaliveChannel(t, time.Hour)
	c.mu.Lock()
	c.credits = 1 // only the reserve: the request waits in the queue
	c.mu.Unlock()
	c.RecvFunc(context.Background(), "k", 0, nil)
	tick(t, c)
	if n := len(q.keepalives()); n != 0 {
		t.Fatalf("a keepalive spent the reserve credit with none owed (%d sent)", n)
	}
	c.mu.Lock()
	c.owed = 3
	c.mu.Unlock()
	tick(t, c)
	ka := q.keepalives()
	if len(ka) != 1 || ka[0].credits != 3 {
		t.Fatalf("keepalives %+v, want one returning the 3 credits owed", ka)
	}
	c.mu.Lock()
	credits, owed := c.credits, c.owed
	c.mu.Unlock()
	if credits != 0 || owed != 0 {
		t.Fatalf("after the keepalive: %d credits, %d owed; want 0 and 0", credits, owed)
	}
}

// Over a real provider, with the smallest ring, one send buffer and a
// keepalive every 2ms, both peers keepalive while a Recv waits, the credits
// they take come back, and the channel works and falls silent afterwards.
func TestKeepaliveSmallestRing(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider, WithRing(minRing), withSendSlots(1), WithKeepalive(2*time.Millisecond))
		ctx := recvCtx(t)
		got := make(chan error, 1)
		b.ch.RecvFunc(ctx, "late", 0, func(r *tensor.Tensor, _ Transfer, err error) {
			if err == nil {
				err = checkTensor(r, "float32", tensor.Shape{33}, "late", 0)
				_ = r.Release()
			}
			got <- err
		})
		time.Sleep(300 * time.Millisecond)
		for step := int64(0); step < 20; step++ {
			src, err := makeTensor(a.pool, "float32", tensor.Shape{33}, "late", step)
			if err != nil {
				t.Fatal(err)
			}
			if err := a.ch.Send("late", step, src); err != nil {
				t.Fatal(err)
			}
			if step > 0 {
				r, _, err := b.ch.Recv(ctx, "late", step)
				if err == nil {
					err = checkTensor(r, "float32", tensor.Shape{33}, "late", step)
					_ = r.Release()
				}
				if err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
			} else if err := <-got; err != nil {
				t.Fatalf("step 0, pending through the keepalives: %v", err)
			}
		}
		sa, sb := a.ch.Stats(), b.ch.Stats()
		t.Logf("keepalives: %d from the sender, %d from the receiver", sa.Keepalives, sb.Keepalives)
		if sb.Keepalives == 0 {
			t.Fatal("no keepalive while a Recv waited 300ms with a 2ms interval")
		}
		time.Sleep(20 * time.Millisecond)
		before := a.ch.Stats().ControlOut + b.ch.Stats().ControlOut
		time.Sleep(100 * time.Millisecond)
		if after := a.ch.Stats().ControlOut + b.ch.Stats().ControlOut; after != before {
			t.Fatalf("idle channel sent %d control messages", after-before)
		}
	})
}
