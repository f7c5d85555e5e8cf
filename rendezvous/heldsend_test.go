package rendezvous

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// The sources of writes in flight when a channel stops are given back only
// once no queue pair can read them: when their work requests completed
// (successfully or flushed), or once the queue pairs are destroyed. These
// tests fail if the channel gives a source back (Send's release,
// SendFunc's done) any earlier.

// writeQP is a stub queue pair that records the write work requests posted
// on it, fails every post once fail is set, and records its destruction.
// wrs and fail are guarded by the channel's lock, under which it posts.
type writeQP struct {
	stubQP
	wrs    []verbsio.SendWR
	posts  [][]verbsio.Opcode // each post's chain
	fail   error
	closed atomic.Bool
}

func (q *writeQP) PostSend(wrs []verbsio.SendWR) error {
	if q.fail != nil {
		return q.fail
	}
	var ops []verbsio.Opcode
	for _, wr := range wrs {
		ops = append(ops, wr.Op)
	}
	q.posts = append(q.posts, ops)
	for _, wr := range wrs {
		if wr.WRID&wridKind == wridWrite {
			q.wrs = append(q.wrs, wr)
		}
	}
	return nil
}

func (q *writeQP) Close() error { q.closed.Store(true); return nil }

// heldChannel is a connected channel over q with no completion goroutine:
// the tests hand it frames and completions. stop ends it as Close would
// after its goroutines are gone (its failure, then release); it runs once,
// at the latest when the test ends.
func heldChannel(t *testing.T, q *writeQP, credits int) (c *Channel, stop func()) {
	t.Helper()
	const ring, slots = 8, 8
	c = &Channel{
		opts: options{ring: ring, sendSlots: slots, maxStrings: 1 << 20, maxTensor: 1 << 20},
		mem:  PoolMemory(stubRegion, stubPool(t)), qp: q, slot: wire.MaxFrame, provider: "stub", devName: "stub", peer: "receiver",
		pollDone: make(chan struct{}), byeSent: make(chan struct{}),
		state: stateConnected, credits: credits, sqMax: 64, threshold: 2,
	}
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
	var once sync.Once
	stop = func() {
		once.Do(func() {
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
	}
	t.Cleanup(stop)
	return c, stop
}

// writeComplete hands the channel the completion of a write work request.
func writeComplete(c *Channel, wrid uint64, st verbsio.Status) {
	var ds deliveries
	c.mu.Lock()
	wc := verbsio.Completion{WRID: wrid, Status: st, Op: verbsio.OpWrite}
	c.handleLocked(&wc, &ds)
	c.mu.Unlock()
	ds.run()
}

// release records when a source was given back: whether its queue pair
// was destroyed by then, and the error.
type release struct {
	qpGone bool
	err    error
}

// sendHeld sends a patterned tensor of n bytes as "k" step 0 on c and
// returns the channel of its release.
func sendHeld(t *testing.T, c *Channel, q *writeQP, n int) <-chan release {
	t.Helper()
	meta, err := tensor.MetaFor(tensor.Uint8, tensor.Shape{int64(n)})
	if err != nil {
		t.Fatal(err)
	}
	src, err := stubPool(t).NewTensor(meta)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan release, 1)
	if err := c.SendFunc("k", 0, src, func(err error) {
		got <- release{q.closed.Load(), err}
		_ = src.Release()
	}); err != nil {
		t.Fatal(err)
	}
	return got
}

// requestFor is the receiver's TENSOR_REQUEST for "k" step 0 of n bytes,
// exact meta-data, chunks of 1<<shift bytes if shift is not 0.
func requestFor(n int, shift uint8) wire.Message {
	meta, _ := tensor.MetaFor(tensor.Uint8, tensor.Shape{int64(n)})
	m := wire.Message{Type: wire.TypeRequest, Flags: wire.ReqName | wire.ReqMeta, Req: 9, Step: 0, NameIndex: 1, Name: []byte("k"), Addr: 0x10000, RKey: 2, Capacity: uint64(n)}
	m.Meta.SetMeta(meta)
	if shift != 0 {
		m.Flags |= wire.ReqChunks
		m.ChunkShift = shift
	}
	return m
}

func notYet(t *testing.T, got <-chan release, when string) {
	t.Helper()
	select {
	case r := <-got:
		t.Fatalf("source given back %s (queue pair destroyed: %v, err %v), while its write may still read it", when, r.qpGone, r.err)
	default:
	}
}

func released(t *testing.T, got <-chan release, when string) release {
	t.Helper()
	select {
	case r := <-got:
		return r
	default:
		t.Fatalf("source not given back %s", when)
	}
	return release{}
}

func TestSourceHeldUntilQueuePairGone(t *testing.T) {
	stops := []struct {
		name string
		stop func(c *Channel)
		want error
	}{
		{"closed", func(c *Channel) {
			var ds deliveries
			c.mu.Lock()
			c.failLocked(ErrClosed, &ds, stateClosed)
			c.mu.Unlock()
			ds.run()
		}, ErrClosed},
		{"peer's protocol error", func(c *Channel) {
			arrive(c, wire.Message{Type: wire.TypeRequest, Req: 3, NameIndex: 77})
		}, ErrProtocol},
		{"peer said bye", func(c *Channel) {
			arrive(c, wire.Message{Type: wire.TypeBye})
		}, ErrClosed},
	}
	for _, st := range stops {
		t.Run(st.name, func(t *testing.T) {
			q := &writeQP{}
			c, stop := heldChannel(t, q, 8)
			got := sendHeld(t, c, q, 4096)
			arrive(c, requestFor(4096, 0))
			if len(q.wrs) != 1 {
				t.Fatalf("%d writes posted, want 1", len(q.wrs))
			}
			st.stop(c)
			if err := c.Err(); !errors.Is(err, st.want) && !errors.Is(c.stateErr(), st.want) {
				t.Fatalf("channel stopped with %v, want %v", err, st.want)
			}
			notYet(t, got, "when the channel stopped")
			stop()
			r := released(t, got, "once the queue pair was destroyed")
			if !r.qpGone {
				t.Fatal("source given back before the queue pair was destroyed")
			}
			if !errors.Is(r.err, st.want) {
				t.Fatalf("source given back with %v, want %v", r.err, st.want)
			}
		})
	}
}

// stateErr is the error a Send would see now.
func (c *Channel) stateErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stateErrLocked()
}

// A write's completion, flushed or successful, after the channel stopped
// gives its source back at once: the queue pair reads it no more.
func TestSourceGivenBackOnLateCompletion(t *testing.T) {
	for _, status := range []verbsio.Status{verbsio.StatusFlushed, verbsio.StatusSuccess} {
		t.Run(status.String(), func(t *testing.T) {
			q := &writeQP{}
			c, _ := heldChannel(t, q, 8)
			got := sendHeld(t, c, q, 4096)
			arrive(c, requestFor(4096, 0))
			arrive(c, wire.Message{Type: wire.TypeBye})
			notYet(t, got, "when the peer said bye")
			writeComplete(c, q.wrs[0].WRID, status)
			r := released(t, got, "once its write completed")
			if r.qpGone || !errors.Is(r.err, ErrClosed) {
				t.Fatalf("release %+v, want one before the queue pair's destruction with ErrClosed", r)
			}
		})
	}
}

// A write asked for in chunks, half posted when the channel stops, is held
// until the chunks posted have completed; the rest never reaches the queue
// pair.
func TestChunkedSourceHeldUntilPostedChunksComplete(t *testing.T) {
	q := &writeQP{}
	c, _ := heldChannel(t, q, 3) // two chunks go out, one credit stays in reserve
	got := sendHeld(t, c, q, 4<<12)
	arrive(c, requestFor(4<<12, 12))
	if len(q.wrs) != 2 {
		t.Fatalf("%d chunks posted, want 2", len(q.wrs))
	}
	arrive(c, wire.Message{Type: wire.TypeBye})
	notYet(t, got, "when the peer said bye")
	writeComplete(c, q.wrs[0].WRID, verbsio.StatusFlushed)
	notYet(t, got, "with one posted chunk still out")
	writeComplete(c, q.wrs[1].WRID, verbsio.StatusFlushed)
	if r := released(t, got, "once the chunks posted completed"); r.qpGone {
		t.Fatalf("release %+v, want one before the queue pair's destruction", r)
	}
}

// A post that fails may have left part of its chain on the queue pair,
// whose completions the channel cannot count: the source is held until the
// queue pair is destroyed, whatever completes before.
func TestSourceHeldAfterFailedPost(t *testing.T) {
	q := &writeQP{}
	c, stop := heldChannel(t, q, 8)
	got := sendHeld(t, c, q, 4096)
	q.fail = errors.New("post failed")
	arrive(c, requestFor(4096, 0))
	if c.Err() == nil {
		t.Fatal("the channel goes on after a failed post")
	}
	notYet(t, got, "when the post failed")
	writeComplete(c, wridWrite|1<<8|1, verbsio.StatusFlushed)
	notYet(t, got, "on a completion of a post that failed")
	stop()
	if r := released(t, got, "once the queue pair was destroyed"); !r.qpGone {
		t.Fatal("source given back before the queue pair was destroyed")
	}
}

// gatedQP is a real queue pair whose writes wait, unposted, until open:
// writes in flight that do not complete, as with a stalled peer.
type gatedQP struct {
	verbsio.QueuePair
	mu     sync.Mutex
	open   bool
	held   [][]verbsio.SendWR
	closed atomic.Bool
}

func (q *gatedQP) PostSend(wrs []verbsio.SendWR) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.open && wrs[0].WRID&wridKind == wridWrite {
		q.held = append(q.held, append([]verbsio.SendWR(nil), wrs...))
		return nil
	}
	return q.QueuePair.PostSend(wrs)
}

func (q *gatedQP) heldWrites() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.held)
}

// release posts the writes held so far and lets the next ones through.
func (q *gatedQP) release() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.open = true
	for _, wrs := range q.held {
		if err := q.QueuePair.PostSend(wrs); err != nil {
			return err
		}
	}
	q.held = nil
	return nil
}

func (q *gatedQP) Close() error {
	err := q.QueuePair.Close()
	q.closed.Store(true)
	return err
}

// gatedPD makes gated queue pairs.
type gatedPD struct {
	verbsio.ProtectionDomain
	qp *gatedQP
}

func (pd *gatedPD) CreateQP(cfg verbsio.QPConfig) (verbsio.QueuePair, error) {
	qp, err := pd.ProtectionDomain.CreateQP(cfg)
	if err != nil {
		return nil, err
	}
	pd.qp = &gatedQP{QueuePair: qp}
	return pd.qp, nil
}

// gatedPair is pair whose side a writes through a gatedQP.
func gatedPair(t *testing.T, provider string) (a, b *side, q *gatedQP) {
	t.Helper()
	a, err := openSide(provider, "a")
	if err != nil {
		skipUnavailable(t, provider, err)
	}
	_ = a.ch.Close()
	gpd := &gatedPD{ProtectionDomain: a.pd}
	if a.ch, err = New(a.dev, gpd, a.mem, WithName("a")); err != nil {
		_ = a.close()
		t.Fatal(err)
	}
	b, err = openSide(provider, "b")
	if err != nil {
		_ = a.close()
		skipUnavailable(t, provider, err)
	}
	t.Cleanup(func() {
		if err := b.close(); err != nil {
			t.Errorf("closing b: %v", err)
		}
		if err := a.close(); err != nil {
			t.Errorf("closing a: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := connectSides(ctx, a, b); err != nil {
		t.Fatalf("connect: %v", err)
	}
	return a, b, gpd.qp
}

// sendGated sends "k" step 0 from a, has b ask for it, and waits until the
// write is posted (and held by the gate). It returns when a's source was
// given back and whether a's queue pair was destroyed by then.
func sendGated(t *testing.T, a, b *side, q *gatedQP) <-chan release {
	t.Helper()
	src, err := makeTensor(a.pool, "float32", tensor.Shape{4096}, "k", 0)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan release, 1)
	if err := a.ch.SendFunc("k", 0, src, func(err error) {
		got <- release{q.closed.Load(), err}
		_ = src.Release()
	}); err != nil {
		t.Fatal(err)
	}
	b.ch.RecvFunc(context.Background(), "k", 0, func(t *tensor.Tensor, _ Transfer, _ error) {
		if t != nil {
			_ = t.Release()
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for q.heldWrites() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no write posted in 10s")
		}
		time.Sleep(time.Millisecond)
	}
	return got
}

// Over real providers: a channel closed with a write in flight gives its
// source back only after its queue pair is destroyed.
func TestCloseHoldsSourceOfWriteInFlight(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b, q := gatedPair(t, provider)
		got := sendGated(t, a, b, q)
		if err := a.ch.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
		r := released(t, got, "once Close returned")
		if !r.qpGone {
			t.Fatal("source given back before the queue pair was destroyed")
		}
		if !errors.Is(r.err, ErrClosed) {
			t.Fatalf("source given back with %v, want ErrClosed", r.err)
		}
	})
}

// Over real providers: a channel that failed with a write in flight keeps
// its completion goroutine for the write, and gives the source back when
// the write completes, before Close.
func TestFailedChannelGivesSourceBackOnCompletion(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b, q := gatedPair(t, provider)
		got := sendGated(t, a, b, q)
		var ds deliveries
		a.ch.mu.Lock()
		a.ch.protocolLocked(&ds, "test: stopped with a write in flight")
		a.ch.mu.Unlock()
		ds.run()
		time.Sleep(50 * time.Millisecond)
		notYet(t, got, "when the channel failed")
		if err := q.release(); err != nil {
			t.Fatalf("posting the held write: %v", err)
		}
		select {
		case r := <-got:
			// With confirmations (tcp's default checksum mode) the
			// receiver's CONFIRM, taken on the failed channel too, may
			// say that the write arrived.
			confirmed := r.err == nil && a.ch.Stats().ConfirmsIn == 1
			if r.qpGone || !errors.Is(r.err, ErrProtocol) && !confirmed {
				t.Fatalf("release %+v, want one before the queue pair's destruction with ErrProtocol (or nil, confirmed)", r)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("source not given back 10s after its write was posted")
		}
	})
}

// TestControlRidesWithWrite: control frames taken from the queue just
// ahead of a write (in checksum mode, the CHECKSUM that announces it) go in
// one post with it, the frames first; without a credit for each and one in
// reserve, the frames go alone and the write waits.
func TestControlRidesWithWrite(t *testing.T) {
	for _, tc := range []struct {
		credits int
		want    [][]verbsio.Opcode
	}{
		{8, [][]verbsio.Opcode{{verbsio.OpSend, verbsio.OpWriteImm}}},
		{2, [][]verbsio.Opcode{{verbsio.OpSend}}},
	} {
		q := &writeQP{}
		c, _ := heldChannel(t, q, tc.credits)
		c.checksum = true
		sendHeld(t, c, q, 4096)
		arrive(c, requestFor(4096, 0))
		if fmt.Sprint(q.posts) != fmt.Sprint(tc.want) {
			t.Errorf("%d credits: posts %v, want %v", tc.credits, q.posts, tc.want)
		}
	}
}
