package rendezvous

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
)

// With the smallest ring and one send buffer, traffic both ways at once
// still flows (credits come back piggybacked or alone), and once it stops
// the channel falls silent: no CREDIT answers a CREDIT.
func TestSmallestRingBothWays(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider, WithRing(minRing), withSendSlots(1))
		ctx := recvCtx(t)
		const n = 300
		var wg sync.WaitGroup
		errc := make(chan error, 2*n)
		exchange := func(from, to *side, prefix string) {
			for i := 0; i < n; i++ {
				key := fmt.Sprint(prefix, i%10)
				step := int64(i / 10)
				to.ch.RecvFunc(ctx, key, step, func(got *tensor.Tensor, _ Transfer, err error) {
					defer wg.Done()
					if err == nil {
						err = checkTensor(got, "float32", tensor.Shape{17}, key, step)
						_ = got.Release()
					}
					if err != nil {
						errc <- err
					}
				})
				src, err := makeTensor(from.pool, "float32", tensor.Shape{17}, key, step)
				if err != nil {
					errc <- err
					continue // its Recv fails at the test's deadline
				}
				if err := from.ch.Send(key, step, src); err != nil {
					errc <- err
				}
			}
		}
		wg.Add(2 * n)
		go exchange(a, b, "ab")
		go exchange(b, a, "ba")
		wg.Wait()
		close(errc)
		for err := range errc {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
		before := a.ch.Stats().ControlOut + b.ch.Stats().ControlOut
		time.Sleep(100 * time.Millisecond)
		if after := a.ch.Stats().ControlOut + b.ch.Stats().ControlOut; after != before {
			t.Fatalf("idle channel sent %d control messages", after-before)
		}
	})
}

// A credit stall counts once when the queue runs out of credits, not at
// every flush that finds it still stuck, and again once it has moved and
// runs out anew. The channel has a ring of 8 and no completion goroutine:
// every request Recv queues is flushed at once, one SEND each, while
// credits last.
func TestCreditStallsCounted(t *testing.T) {
	c, q := keepaliveChannel(t, time.Hour)
	stalls := func() uint64 { t.Helper(); return c.Stats().CreditStalls }
	recv := func(i int) {
		c.RecvFunc(context.Background(), fmt.Sprint("k", i), 0, func(*tensor.Tensor, Transfer, error) {})
	}
	// Seven requests take seven of the eight credits: no stall.
	for i := range 7 {
		recv(i)
	}
	if n := stalls(); n != 0 {
		t.Fatalf("%d credit stalls after 7 requests on 8 credits, want 0", n)
	}
	// The eighth finds only the reserve credit: one stall, however many
	// more requests queue behind it.
	for i := 7; i < 12; i++ {
		recv(i)
	}
	if n := stalls(); n != 1 {
		t.Fatalf("%d credit stalls with 5 requests queued behind the reserve credit, want 1", n)
	}
	// One credit back: the queued requests leave in one SEND and the queue
	// empties.
	arrive(c, wire.Message{Type: wire.TypeCredit, Credits: 1})
	if n := len(q.frames); n != 12 {
		t.Fatalf("%d frames posted, want 12 requests and nothing else", n)
	}
	if n := stalls(); n != 1 {
		t.Fatalf("%d credit stalls once the queue emptied, want still 1", n)
	}
	// A new request finds the reserve credit alone again: a second stall.
	recv(12)
	if n := stalls(); n != 2 {
		t.Fatalf("%d credit stalls after the queue ran dry again, want 2", n)
	}
}

// A channel whose peer has the smallest ring stalls on credits when it
// sends more than that ring takes (here a 1 MiB proxy result in 16 chunks,
// each taking a credit, three at a time at most); with the same ring one
// small tensor never waits.
func TestCreditStallsTinyRing(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		t.Run("chunks", func(t *testing.T) {
			const size, chunk = 1 << 20, 64 << 10
			a, b := proxyPair(t, provider, []Option{WithRing(minRing)}, []Option{WithRing(minRing), WithProxyChunk(chunk)})
			ctx := recvCtx(t)
			src, err := makeTensor(a.pool, "float32", tensor.Shape{size / 4}, "big", 0)
			if err != nil {
				t.Fatal(err)
			}
			if err := a.ch.Send("big", 0, src); err != nil {
				t.Fatal(err)
			}
			got, tr, err := b.ch.Recv(ctx, "big", 0, OnDevice(tensor.GPUDevice(0)))
			if err != nil {
				t.Fatal(err)
			}
			b.checkOnGPU(t, got, "big", 0)
			_ = got.Release()
			if tr.Chunks != size/chunk {
				t.Fatalf("%d chunks, want %d", tr.Chunks, size/chunk)
			}
			if n := a.ch.Stats().CreditStalls; n == 0 {
				t.Errorf("the sender of %d chunks on %d credits counted no credit stall", size/chunk, minRing)
			}
			b.waitPinnedIdle(t)
		})
		t.Run("one-small", func(t *testing.T) {
			a, b := pair(t, provider, WithRing(minRing))
			ctx := recvCtx(t)
			src, err := makeTensor(a.pool, "float32", tensor.Shape{17}, "w", 0)
			if err != nil {
				t.Fatal(err)
			}
			if err := a.ch.Send("w", 0, src); err != nil {
				t.Fatal(err)
			}
			got, _, err := b.ch.Recv(ctx, "w", 0)
			if err != nil {
				t.Fatal(err)
			}
			if err := checkTensor(got, "float32", tensor.Shape{17}, "w", 0); err != nil {
				t.Fatal(err)
			}
			_ = got.Release()
			if sa, sb := a.ch.Stats(), b.ch.Stats(); sa.CreditStalls != 0 || sb.CreditStalls != 0 {
				t.Errorf("one small tensor on %d credits: %d credit stalls sending, %d receiving; want 0", minRing, sa.CreditStalls, sb.CreditStalls)
			}
		})
	})
}

// Writes wait for credits one at a time: a queue that moves (a write
// posted on a credit that came back) and runs out again counts a new
// stall, while flushes that move nothing do not.
func TestCreditStallAfterMoving(t *testing.T) {
	c, _ := keepaliveChannel(t, time.Hour)
	stalls := func() uint64 { t.Helper(); return c.Stats().CreditStalls }
	meta, err := tensor.MetaFor(tensor.Uint8, tensor.Shape{64})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		blk, err := stubPool(t).Alloc(64)
		if err != nil {
			t.Fatal(err)
		}
		src, err := tensor.New(meta, blk)
		if err != nil {
			t.Fatal(err)
		}
		key := fmt.Sprint("w", i)
		if err := c.Send(key, 0, src); err != nil {
			t.Fatal(err)
		}
		// Requested with no meta-data: a META_DATA_RESPONSE (one credit)
		// and the tensor kept for the re-request.
		arrive(c, wire.Message{Type: wire.TypeRequest, Flags: wire.ReqName, Name: []byte(key), NameIndex: uint32(i + 1), Step: 0, Req: uint32(5 + i)})
	}
	// Five requests of this side's own leave the reserve credit alone.
	for i := range 5 {
		c.RecvFunc(context.Background(), fmt.Sprint("r", i), 0, func(*tensor.Tensor, Transfer, error) {})
	}
	if n := stalls(); n != 0 {
		t.Fatalf("%d credit stalls with the queue empty, want 0", n)
	}
	// Both re-requests queue a write; neither can go: one stall.
	for i := range 2 {
		arrive(c, wire.Message{Type: wire.TypeReRequest, Req: uint32(5 + i), Addr: 0x10000, RKey: 2, Capacity: 64})
	}
	if n := stalls(); n != 1 {
		t.Fatalf("%d credit stalls with two writes waiting, want 1", n)
	}
	// Two credits back: the first write goes, the second waits anew.
	arrive(c, wire.Message{Type: wire.TypeCredit, Credits: 2})
	if st := c.Stats(); st.WritesInFlight != 1 || st.CreditStalls != 2 {
		t.Fatalf("%d writes in flight, %d credit stalls; want 1 and 2", st.WritesInFlight, st.CreditStalls)
	}
	// One more: the second write goes and the queue is empty.
	arrive(c, wire.Message{Type: wire.TypeCredit, Credits: 1})
	if st := c.Stats(); st.WritesInFlight != 2 || st.CreditStalls != 2 {
		t.Fatalf("%d writes in flight, %d credit stalls; want 2 and 2", st.WritesInFlight, st.CreditStalls)
	}
}
