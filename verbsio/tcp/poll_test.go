package tcp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
	"golang.org/x/sys/unix"
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

// TestWaiterLeavesToGoroutine: requests the polling waiter applies stay in
// the socket until it next finds nothing new (lane.applied), and a request
// it cannot apply (a read) goes to the lane's goroutine, which must first
// take those off. Bursts mixing both on one lane, sent in one write, are
// answered in order, each exactly once, with the right bytes.
func TestWaiterLeavesToGoroutine(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite|verbsio.AccessRemoteRead)
	c := tg.dial(t)
	base := tg.base()
	const bursts = 50
	stop := make(chan struct{})
	waited := make(chan error, 1)
	var taken atomic.Int64
	go func() {
		out := make([]verbsio.Completion, 4)
		last := uint32(0)
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			k, err := tg.cq.Wait(ctx, out)
			cancel()
			for _, cp := range out[:k] {
				if cp.Status != verbsio.StatusSuccess || cp.Imm <= last || uint64(cp.Imm) != cp.WRID {
					waited <- fmt.Errorf("completion %+v after immediate %d", cp, last)
					return
				}
				last = cp.Imm
			}
			taken.Add(int64(k))
			select {
			case <-stop:
				waited <- nil
				return
			default:
			}
			if err != nil && !errors.Is(err, context.DeadlineExceeded) {
				waited <- err
				return
			}
		}
	}()
	token := uint64(0)
	imms := 0
	for b := range bursts {
		var burst []byte
		var want []uint64 // tokens; reads are the odd ones out, at want[i] with isRead[i]
		var isRead []bool
		for i := range 6 {
			token++
			if i == 3 || (b%5 == 0 && i == 0) {
				burst = append(burst, header{op: opReadReq, token: token, length: 8, raddr: base + 512, rkey: tg.mr.RKey()}.appendTo()...)
				want, isRead = append(want, token), append(isRead, true)
				continue
			}
			if err := tg.qp.PostRecv([]verbsio.RecvWR{{WRID: token}}); err != nil {
				t.Fatal(err)
			}
			payload := bytes.Repeat([]byte{byte(token)}, 8)
			burst = append(burst, frame(header{op: opWriteImm, flags: flagLast, token: token, raddr: base + uint64(8*i), rkey: tg.mr.RKey(), imm: uint32(token), total: 8}, payload)...)
			want, isRead = append(want, token), append(isRead, false)
			imms++
		}
		copy(tg.mem[tg.page+512:], "readback")
		if _, err := c.Write(burst); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		for i, tok := range want {
			r := readResponse(t, c)
			if r.token != tok {
				t.Fatalf("burst %d: response %d for token %d, want %d", b, i, r.token, tok)
			}
			if !isRead[i] {
				wantAck(t, "write with immediate", r)
				continue
			}
			if r.op != opReadResp || r.length != 8 {
				t.Fatalf("burst %d: read %d answered by %s of %d bytes", b, tok, opName(r.op), r.length)
			}
			var got [8]byte
			if _, err := io.ReadFull(c, got[:]); err != nil || string(got[:]) != "readback" {
				t.Fatalf("burst %d: read %d returned %q (%v)", b, tok, got, err)
			}
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) && taken.Load() < int64(imms) {
		time.Sleep(time.Millisecond)
	}
	close(stop)
	if err := <-waited; err != nil {
		t.Fatal(err)
	}
	n, polled := taken.Load(), tg.qp.polledFrames.Load()
	t.Logf("%d writes with immediate completed, %d requests applied by the polling waiter", n, polled)
	if n != int64(imms) {
		t.Fatalf("%d receive completions, want %d", n, imms)
	}
	if polled == 0 {
		t.Fatal("no request was applied by the polling waiter")
	}
}

// TestGoroutineSkipsApplied: a request the polling waiter applied is left
// in the socket until the next look (lane.applied); when no look comes and
// the lane's goroutine reads the next request (a read, which the waiter
// leaves to it), the goroutine takes the applied one off first instead of
// serving it again.
func TestGoroutineSkipsApplied(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite|verbsio.AccessRemoteRead)
	c := tg.dial(t)
	base := tg.base()
	copy(tg.mem[tg.page+512:], "readback")
	token, left := uint64(0), 0
	for round := 0; round < 200 && left < 5; round++ {
		if err := tg.qp.PostRecv([]verbsio.RecvWR{{WRID: uint64(round)}}); err != nil {
			t.Fatal(err)
		}
		before := tg.qp.polledFrames.Load()
		waited := make(chan error, 1)
		go func() {
			out := make([]verbsio.Completion, 1)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := tg.cq.Wait(ctx, out)
			waited <- err
		}()
		runtime.Gosched()
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		token++
		wantAck(t, "write with immediate", exchange(t, c, header{op: opWriteImm, flags: flagLast, token: token, raddr: base, rkey: tg.mr.RKey(), imm: 1, total: 8}, make([]byte, 8)))
		if err := <-waited; err != nil {
			t.Fatal(err)
		}
		if tg.qp.polledFrames.Load() > before {
			left++ // the waiter applied it, and nobody has looked since
		}
		// Nobody polls now: the goroutine serves the read.
		token++
		if _, err := c.Write(header{op: opReadReq, token: token, length: 8, raddr: base + 512, rkey: tg.mr.RKey()}.appendTo()); err != nil {
			t.Fatal(err)
		}
		r := readResponse(t, c)
		if r.op != opReadResp || r.length != 8 || r.token != token {
			t.Fatalf("round %d: read %d answered by %s %d of %d bytes", round, token, opName(r.op), r.token, r.length)
		}
		var got [8]byte
		if _, err := io.ReadFull(c, got[:]); err != nil || string(got[:]) != "readback" {
			t.Fatalf("round %d: read returned %q (%v)", round, got, err)
		}
	}
	t.Logf("%d rounds left a request the waiter applied in the socket", left)
	if left == 0 {
		t.Fatal("the polling waiter applied no request")
	}
}

// TestAcksCoalesced: of the unsignaled writes with immediate a sender
// posts in a row, only one in ackEvery asks for an acknowledgement
// (flagNoAck on the others), and a later response on the lane completes
// them. Every receive completes once, in order, every signaled send
// completes, and most requests went without an acknowledgement of their
// own.
func TestAcksCoalesced(t *testing.T) {
	key := newJobKey(t)
	a := openAuthSide(t, key, 0x11)
	z := openAuthSide(t, key, 0x22)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if errA, errZ := connectBoth(ctx, a, z); errA != nil || errZ != nil {
		t.Fatalf("Connect: %v, %v", errA, errZ)
	}
	const n = 96
	for i := range n {
		z.postRecv(t, uint64(i))
	}
	got := make(chan error, 1)
	go func() {
		buf := make([]verbsio.Completion, 8)
		next := 0
		for next < n {
			k, err := z.cq.Wait(ctx, buf)
			if err != nil {
				got <- fmt.Errorf("after %d receives: %w", next, err)
				return
			}
			for _, c := range buf[:k] {
				if c.Status != verbsio.StatusSuccess || c.Op != verbsio.OpRecvImm || c.Imm != uint32(next) || c.WRID != uint64(next) {
					got <- fmt.Errorf("receive %d: %+v", next, c)
					return
				}
				next++
			}
		}
		got <- nil
	}()
	buf := make([]verbsio.Completion, 4)
	for i := range n {
		signaled := i%16 == 15
		wr := verbsio.SendWR{WRID: uint64(i), Op: verbsio.OpWriteImm, Imm: uint32(i), Signaled: signaled, RemoteAddr: uint64(z.mr.Addr()), RKey: z.mr.RKey(),
			SG: []verbsio.SGE{{Addr: a.mr.Addr(), Length: 8, LKey: a.mr.LKey()}}}
		if err := a.qp.PostSend([]verbsio.SendWR{wr}); err != nil {
			t.Fatalf("post %d: %v", i, err)
		}
		if !signaled {
			continue
		}
		k, err := a.cq.Wait(ctx, buf[:1])
		if err != nil || k != 1 || buf[0].WRID != uint64(i) || buf[0].Status != verbsio.StatusSuccess {
			t.Fatalf("send completion of %d: %v %+v", i, err, buf[:k])
		}
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	implied := a.qp.impliedAcks.Load()
	t.Logf("%d of %d writes completed by a later response", implied, n)
	if implied < n/2 {
		t.Fatalf("%d of %d writes completed by a later response, want most (one in %d asks for its own)", implied, n, ackEvery)
	}
}

// TestNoAckAnswers plays a sender of flagNoAck frames with raw frames: a
// write that asks for no acknowledgement gets none when it succeeds (the
// next response, for a later request, stands for it) and a nak when it
// fails, and the writes land all the same.
func TestNoAckAnswers(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	c := tg.dial(t)
	base := tg.base()
	var burst []byte
	for i := range 3 {
		burst = append(burst, frame(header{op: opWrite, flags: flagNoAck, token: uint64(i + 1), raddr: base + uint64(8*i), rkey: tg.mr.RKey()}, bytes.Repeat([]byte{byte(0xa0 + i)}, 8))...)
	}
	burst = append(burst, frame(header{op: opWrite, token: 4, raddr: base + 24, rkey: tg.mr.RKey()}, bytes.Repeat([]byte{0xa3}, 8))...)
	if _, err := c.Write(burst); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if r := readResponse(t, c); r.op != opAck || r.token != 4 {
		t.Fatalf("first response %s for token %d, want the ack of token 4 alone", opName(r.op), r.token)
	}
	for i := range 4 {
		if m := tg.region()[8*i : 8*i+8]; !bytes.Equal(m, bytes.Repeat([]byte{byte(0xa0 + i)}, 8)) {
			t.Fatalf("write %d landed as %x", i+1, m)
		}
	}
	// A failing one is answered: a nak for its token.
	if _, err := c.Write(frame(header{op: opWrite, flags: flagNoAck, token: 5, raddr: base, rkey: tg.mr.RKey() ^ 0x5a5a}, make([]byte, 8))); err != nil {
		t.Fatal(err)
	}
	if r := readResponse(t, c); r.op != opNak || r.token != 5 || r.status != verbsio.StatusRemoteAccess {
		t.Fatalf("response %s for token %d status %v, want a nak of token 5 (remote access)", opName(r.op), r.token, r.status)
	}
	// Nothing else comes.
	c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	var b [1]byte
	if k, err := c.Read(b[:]); k != 0 || err == nil {
		t.Fatalf("an extra response: %d bytes, %v", k, err)
	}
}

// TestGoroutineLooksAfterWaiter: the lane's goroutine reads on without
// looking at the socket only when its own last answer saw a request
// queued (responder.sawNext). A polling waiter that answers a request too
// large for its peek buffer looks at the socket the same way, then applies
// the request it saw from the peeked bytes; the goroutine that then takes
// the lane must look again before it reads, or it waits in the read for a
// request that was applied already, holding the lane, while the
// acknowledgements the waiter held back wait behind it for ever. Each
// round holds the lane while it sends, in one write, two writes that fill
// half the peek buffer each, one that does not fit in what is left, and a
// write with immediate; once all are in the socket it plays the waiter
// (pollInLocked) and lets the lane go to the goroutine, which the bytes'
// arrival woke. All four must be acknowledged and the receive completed.
func TestGoroutineLooksAfterWaiter(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	c := tg.dial(t)
	base := tg.base()
	var l *inLane
	for deadline := time.Now().Add(5 * time.Second); l == nil; {
		if ls := tg.qp.inLanes.Load(); ls != nil && len(*ls) == 1 {
			l = (*ls)[0]
		} else if time.Now().After(deadline) {
			t.Fatal("the dialed lane never joined the queue pair")
		} else {
			time.Sleep(time.Millisecond)
		}
	}
	token := uint64(0)
	for round := range 20 {
		if err := tg.qp.PostRecv([]verbsio.RecvWR{{WRID: uint64(round)}}); err != nil {
			t.Fatal(err)
		}
		var burst []byte
		for _, size := range []int{2048, 2048, 4096} {
			token++
			burst = append(burst, frame(header{op: opWrite, token: token, raddr: base + uint64(4096-size), rkey: tg.mr.RKey()}, bytes.Repeat([]byte{byte(token)}, size))...)
		}
		token++
		burst = append(burst, frame(header{op: opWriteImm, flags: flagLast, token: token, raddr: base, rkey: tg.mr.RKey(), imm: uint32(round), total: 8}, make([]byte, 8))...)
		l.rd.Lock() // neither the goroutine nor the target's poller reads now
		if _, err := c.Write(burst); err != nil {
			l.rd.Unlock()
			t.Fatal(err)
		}
		for deadline := time.Now().Add(5 * time.Second); l.resp.queued() < len(burst); {
			if time.Now().After(deadline) {
				l.rd.Unlock()
				t.Fatalf("round %d: %d of the burst's %d bytes in the socket after 5 s", round, l.resp.queued(), len(burst))
			}
			time.Sleep(100 * time.Microsecond)
		}
		before := tg.qp.polledFrames.Load()
		tg.qp.pollInLocked(l)
		applied := tg.qp.polledFrames.Load() - before
		l.rd.Unlock()
		if applied != 4 {
			t.Fatalf("round %d: the waiter applied %d of the burst's 4 requests", round, applied)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		for i := range 4 {
			r := readResponse(t, c)
			if r.op != opAck || r.token != token-3+uint64(i) {
				t.Fatalf("round %d: response %d is %s for token %d, want the ack of token %d", round, i, opName(r.op), r.token, token-3+uint64(i))
			}
		}
		out := make([]verbsio.Completion, 1)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		k, err := tg.cq.Wait(ctx, out)
		cancel()
		if err != nil || k != 1 || out[0].WRID != uint64(round) || out[0].Imm != uint32(round) {
			t.Fatalf("round %d: receive completion %+v, %v", round, out[:k], err)
		}
	}
}

// rcvLowat is the SO_RCVLOWAT of the socket of q's first inbound lane.
func rcvLowat(t *testing.T, q *qp) int {
	t.Helper()
	ls := q.inLanes.Load()
	if ls == nil || len(*ls) == 0 {
		t.Fatal("no inbound lane")
	}
	v, gerr := 0, error(nil)
	if err := (*ls)[0].rc.Control(func(fd uintptr) { v, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT) }); err != nil || gerr != nil {
		t.Fatalf("SO_RCVLOWAT: %v %v", err, gerr)
	}
	return v
}

// TestQuietLanes: while a Wait polls a lane, the lane's socket has a high
// low-water mark (a frame the waiter reads itself wakes no thread); once
// nobody has polled for quietHold it is 1 again, and a frame that comes
// when nobody waits is still applied (by the lane's goroutine) and
// acknowledged.
func TestQuietLanes(t *testing.T) {
	tg := newTarget(t, verbsio.AccessLocalWrite|verbsio.AccessRemoteWrite)
	c := tg.dial(t)
	base := tg.base()
	high := false
	for i := 0; i < 200 && !high; i++ {
		if err := tg.qp.PostRecv([]verbsio.RecvWR{{WRID: uint64(i)}}); err != nil {
			t.Fatal(err)
		}
		waited := make(chan error, 1)
		lowat := make(chan int, 1)
		go func() {
			out := make([]verbsio.Completion, 1)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := tg.cq.Wait(ctx, out)
			lowat <- rcvLowat(t, tg.qp) // at once, within the hold (mostly)
			waited <- err
		}()
		runtime.Gosched()
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		r := exchange(t, c, header{op: opWriteImm, flags: flagLast, token: uint64(i + 1), raddr: base, rkey: tg.mr.RKey(), imm: uint32(i), total: 8}, make([]byte, 8))
		wantAck(t, "write with immediate", r)
		if err := <-waited; err != nil {
			t.Fatalf("round %d: Wait: %v", i, err)
		}
		high = <-lowat > 1
	}
	if !high {
		t.Fatal("no Wait left the lane's socket with a raised low-water mark")
	}
	// Nobody waits now: a write still lands and is acknowledged.
	time.Sleep(time.Millisecond)
	payload := bytes.Repeat([]byte{0x5a}, 64)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	r := exchange(t, c, header{op: opWrite, token: 1000, raddr: base + 64, rkey: tg.mr.RKey()}, payload)
	wantAck(t, "write with nobody waiting", r)
	if m := tg.region()[64:128]; !bytes.Equal(m, payload) {
		t.Fatalf("the write landed as %x", m[:8])
	}
	deadline := time.Now().Add(5 * time.Second)
	for rcvLowat(t, tg.qp) != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("low-water mark %d long after the last Wait, want 1", rcvLowat(t, tg.qp))
		}
		time.Sleep(time.Millisecond)
	}
}
