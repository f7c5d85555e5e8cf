package tcp

import (
	"bytes"
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
)

// TestWaiterTakesFrames checks that a polling waiter reads and applies
// requests itself: writes with immediate sent one at a time, each answered
// by its acknowledgement, while a goroutine spins in the queue's Wait. Most
// must be applied by the waiter (the lane's goroutine is woken by the
// network poller, later), every one exactly once and in order.
func TestWaiterTakesFrames(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	const n = 200
	recvs := make([]verbsio.RecvWR, n)
	for i := range recvs {
		recvs[i].WRID = uint64(i)
	}
	if err := tg.qp.PostRecv(recvs); err != nil {
		t.Fatal(err)
	}
	c := tg.dial(t)
	got := make(chan verbsio.Completion, n)
	go func() {
		out := make([]verbsio.Completion, 1)
		for range n {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			k, err := tg.cq.Wait(ctx, out)
			cancel()
			if err != nil || k != 1 {
				close(got)
				return
			}
			got <- out[0]
		}
	}()
	base := tg.base()
	for i := range n {
		payload := bytes.Repeat([]byte{byte(i)}, 64)
		r := exchange(t, c, header{op: opWriteImm, flags: flagLast, token: uint64(i + 1), raddr: base + 64, rkey: tg.mr.RKey(), imm: uint32(i), total: 64}, payload)
		wantAck(t, "write with immediate", r)
		cp, ok := <-got
		if !ok {
			t.Fatalf("waiter gave up at %d", i)
		}
		if cp.Status != verbsio.StatusSuccess || cp.Imm != uint32(i) || cp.WRID != uint64(i) {
			t.Fatalf("completion %d: %+v", i, cp)
		}
		if m := tg.region()[64:128]; !bytes.Equal(m, payload) {
			t.Fatalf("write %d landed as %x", i, m[:8])
		}
		runtime.Gosched()
	}
	polled := tg.qp.polledFrames.Load()
	t.Logf("%d of %d requests applied by the polling waiter", polled, n)
	if polled == 0 {
		t.Fatalf("no request of %d was applied by the polling waiter", n)
	}
}

// TestHeldAckSent: the polling waiter holds a request's acknowledgement
// back, so that its caller has the completion before the acknowledgement's
// write; when the caller then neither waits nor posts again, the
// acknowledgement still reaches the peer (the lane's timer sends it after
// ackHold, and the lane answers the next ackPrompt requests at once). Each
// round's Wait is the last call on the queue pair until the peer has its
// acknowledgement.
func TestHeldAckSent(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	c := tg.dial(t)
	base := tg.base()
	// Until the timer has sent one (a Wait that sleeps when the request
	// comes leaves it to the lane's goroutine, which answers at once).
	const most = 400
	var worst time.Duration
	rounds := 0
	for i := range most {
		if i >= 10 && tg.timedFlushes() > 0 {
			break
		}
		rounds++
		if err := tg.qp.PostRecv([]verbsio.RecvWR{{WRID: uint64(i)}}); err != nil {
			t.Fatal(err)
		}
		waited := make(chan error, 1)
		go func() {
			out := make([]verbsio.Completion, 1)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := tg.cq.Wait(ctx, out)
			waited <- err
		}()
		runtime.Gosched() // the Wait polls (mostly) when the request comes
		start := time.Now()
		c.SetReadDeadline(start.Add(5 * time.Second))
		r := exchange(t, c, header{op: opWriteImm, flags: flagLast, token: uint64(i + 1), raddr: base, rkey: tg.mr.RKey(), imm: uint32(i), total: 8}, make([]byte, 8))
		wantAck(t, "write with immediate", r)
		worst = max(worst, time.Since(start))
		if err := <-waited; err != nil {
			t.Fatalf("round %d: Wait: %v", i, err)
		}
	}
	polled, timed := tg.qp.polledFrames.Load(), tg.timedFlushes()
	t.Logf("%d of %d requests applied by the polling waiter, %d acknowledged by the timer; slowest acknowledgement %v", polled, rounds, timed, worst)
	if polled == 0 {
		t.Fatalf("no request of %d was applied by the polling waiter", rounds)
	}
	if timed == 0 {
		t.Fatal("the waiter held no acknowledgement back (none went out by the timer)")
	}
}

// timedFlushes counts the responses the lanes' timers sent.
func (tg *target) timedFlushes() uint64 {
	var n uint64
	if ls := tg.qp.inLanes.Load(); ls != nil {
		for _, l := range *ls {
			n += l.timed.Load()
		}
	}
	return n
}
