package onnode

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
)

// sendOnce posts one signaled SEND of 8 bytes from a to b (b's receive
// posted first) and returns when both completions are in: b's by polling
// its receive queue, a's by polling or waiting on its send queue.
func sendOnce(t *testing.T, a, b *node, wait bool) {
	t.Helper()
	sendBuffers(t, a, b).send(t, wait)
}

// sendPair is a registered source on a and destination on b, for SENDs
// from a to b.
type sendPair struct {
	a, b     *node
	src, dst verbsio.MemoryRegion
}

func sendBuffers(t *testing.T, a, b *node) sendPair {
	t.Helper()
	src, err := a.register("anon", 4096, verbsio.AccessLocalWrite, 7)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := b.register("anon", 4096, verbsio.AccessLocalWrite, 0)
	if err != nil {
		t.Fatal(err)
	}
	return sendPair{a, b, src, dst}
}

// send is sendOnce with p's buffers.
func (p sendPair) send(t *testing.T, wait bool) {
	t.Helper()
	a, b, src, dst := p.a, p.b, p.src, p.dst
	if err := b.qp.PostRecv([]verbsio.RecvWR{{WRID: 1, SG: []verbsio.SGE{{Addr: dst.Addr(), Length: 4096, LKey: dst.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	if err := a.qp.PostSend([]verbsio.SendWR{{WRID: 2, Op: verbsio.OpSend, Signaled: true, SG: []verbsio.SGE{{Addr: src.Addr(), Length: 8, LKey: src.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	if c := pollOne(t, b.rcq); c.Status != verbsio.StatusSuccess || c.Op != verbsio.OpRecv {
		t.Fatalf("receive: %+v", c)
	}
	var c verbsio.Completion
	if wait {
		c = waitOne(t, a.scq, 5*time.Second)
	} else {
		c = pollOne(t, a.scq)
	}
	if c.Status != verbsio.StatusSuccess || c.WRID != 2 {
		t.Fatalf("send: %+v", c)
	}
}

// pollOne polls cq (never sleeping in it) for one completion.
func pollOne(t *testing.T, cq verbsio.CompletionQueue) verbsio.Completion {
	t.Helper()
	var c [1]verbsio.Completion
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		n, err := cq.Poll(c[:])
		if err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			return c[0]
		}
	}
	t.Fatal("no completion in 5s")
	return c[0]
}

// A SEND to a peer whose Wait polls costs no wake-up: no signal of the
// peer's progress goroutine, no acknowledgement through the socket (the
// sender reads it from the peer's ring as it polls).
func TestSendToPollingPeerWakesNobody(t *testing.T) {
	a, b := loopback(t, Options{}, 0)
	b.rcq.(*cq).poll(true) // as a Wait polling there
	defer b.rcq.(*cq).poll(false)
	qa, qb := a.qp.(*qp), b.qp.(*qp)
	sendOnce(t, a, b, false)
	if n := qa.signals.Load(); n != 0 {
		t.Errorf("%d signals of the polling peer", n)
	}
	if n := qb.sockAcks.Load(); n != 0 {
		t.Errorf("%d acknowledgements through the socket to a sender that polls", n)
	}
}

// A SEND to a peer that does not poll is signalled, so that its progress
// goroutine takes it even when nobody waits there.
func TestSendToIdlePeerSignals(t *testing.T) {
	a, b := loopback(t, Options{}, 0)
	sendOnce(t, a, b, false)
	if n := a.qp.(*qp).signals.Load(); n != 1 {
		t.Errorf("%d signals for one SEND, want 1", n)
	}
}

// A sender whose send queue sleeps is woken by an acknowledgement through
// the socket.
func TestSleepingSenderGetsSocketAck(t *testing.T) {
	a, b := loopback(t, Options{Spin: -1}, 0) // Waits sleep at once
	b.rcq.(*cq).poll(true)
	defer b.rcq.(*cq).poll(false)
	done := make(chan struct{})
	go func() {
		// Once a's Wait sleeps, it says so in b's ring.
		for atomic.LoadUint32(u32(b.qp.(*qp).in.mem, offAckWake)) == 0 {
			time.Sleep(time.Millisecond)
		}
		close(done)
	}()
	src, _ := a.register("anon", 4096, verbsio.AccessLocalWrite, 7)
	dst, _ := b.register("anon", 4096, verbsio.AccessLocalWrite, 0)
	if err := b.qp.PostRecv([]verbsio.RecvWR{{WRID: 1, SG: []verbsio.SGE{{Addr: dst.Addr(), Length: 4096, LKey: dst.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	got := make(chan verbsio.Completion, 1)
	go func() {
		var c [1]verbsio.Completion
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := a.scq.Wait(ctx, c[:]); err != nil {
			t.Error(err)
		}
		got <- c[0]
	}()
	<-done
	if err := a.qp.PostSend([]verbsio.SendWR{{WRID: 2, Op: verbsio.OpSend, Signaled: true, SG: []verbsio.SGE{{Addr: src.Addr(), Length: 8, LKey: src.LKey()}}}}); err != nil {
		t.Fatal(err)
	}
	if c := pollOne(t, b.rcq); c.Status != verbsio.StatusSuccess {
		t.Fatalf("receive: %+v", c)
	}
	if c := <-got; c.Status != verbsio.StatusSuccess || c.WRID != 2 {
		t.Fatalf("send: %+v", c)
	}
	if n := b.qp.(*qp).sockAcks.Load(); n != 1 {
		t.Errorf("%d acknowledgements through the socket, want 1", n)
	}
}

// A sender of an earlier release reads no acknowledgement from the ring:
// it is acknowledged through the socket, every SEND.
func TestSenderWithoutAckWord(t *testing.T) {
	a, b := loopback(t, Options{}, 0)
	atomic.StoreUint32(u32(b.qp.(*qp).in.mem, offFeatures), 0) // a as of an earlier release
	b.rcq.(*cq).poll(true)
	defer b.rcq.(*cq).poll(false)
	sendOnce(t, a, b, true)
	if n := b.qp.(*qp).sockAcks.Load(); n != 1 {
		t.Errorf("%d acknowledgements through the socket, want 1", n)
	}
}

// The acknowledgement word covers every SEND up to its sequence number,
// across the wrap of the 31-bit sequence space.
func TestResolveUpToWraps(t *testing.T) {
	a, _ := loopback(t, Options{}, 0)
	q := a.qp.(*qp)
	seqs := []uint32{1<<31 - 2, 1<<31 - 1, 0, 1}
	q.compMu.Lock()
	for i, s := range seqs {
		q.pending = append(q.pending, pendingComp{c: verbsio.Completion{WRID: uint64(i), Op: verbsio.OpSend, QP: q}, signaled: true, waiting: true, seq: s})
		q.waiting.Add(1)
	}
	q.resolveUpToLocked(0)
	left := len(q.pending)
	q.compMu.Unlock()
	if left != 1 || q.waiting.Load() != 1 {
		t.Fatalf("%d pending, %d waiting after acknowledging up to 0; want 1 and 1", left, q.waiting.Load())
	}
	var cs [4]verbsio.Completion
	if n, _ := a.scq.Poll(cs[:]); n != 3 || cs[0].WRID != 0 || cs[2].WRID != 2 {
		t.Fatalf("completions %+v (%d), want WRIDs 0, 1, 2", cs[:n], n)
	}
}
