package rendezvous

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/crc32c"
	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// eagerFrame is an EAGER frame for key and step of n float32s, each byte
// of the data fill.
func eagerFrame(t *testing.T, key string, step int64, n int64, fill byte) wire.Message {
	t.Helper()
	meta, err := tensor.MetaFor(tensor.Float32, tensor.Shape{n})
	if err != nil {
		t.Fatal(err)
	}
	m := wire.Message{Type: wire.TypeEager, Step: step, Name: []byte(key), Data: bytes.Repeat([]byte{fill}, int(4*n))}
	m.Meta.SetMeta(meta)
	return m
}

// recvOne starts a Recv of key and step on c and returns where its result
// arrives.
func recvOne(c *Channel, key string, step int64) chan recvResult {
	ch := make(chan recvResult, 1)
	c.RecvFunc(context.Background(), key, step, func(t *tensor.Tensor, tr Transfer, err error) { ch <- recvResult{t, tr, err} })
	return ch
}

type recvResult struct {
	t   *tensor.Tensor
	tr  Transfer
	err error
}

// wantEager checks that r is n float32s of bytes fill that came eagerly.
func wantEager(t *testing.T, what string, r recvResult, n int64, fill byte) {
	t.Helper()
	if r.err != nil {
		t.Fatalf("%s: %v", what, r.err)
	}
	defer r.t.Release()
	b, err := r.t.Bytes()
	if err != nil || int64(len(b)) != 4*n || !bytes.Equal(b, bytes.Repeat([]byte{fill}, int(4*n))) {
		t.Fatalf("%s: got %d bytes (%v), want %d of %#x", what, len(b), err, 4*n, fill)
	}
	if r.tr.Path != PathEager {
		t.Errorf("%s: path %s, want eager", what, r.tr.Path)
	}
}

func countFrames(q *probeQP, typ wire.Type) int {
	n := 0
	for _, f := range q.frames {
		if f.typ == typ {
			n++
		}
	}
	return n
}

// TestEagerIntoWaitingRecv: an EAGER that crosses the request of a Recv
// already waiting completes that Recv with its bytes (no write comes for
// the request), and the sender's counts move.
func TestEagerIntoWaitingRecv(t *testing.T) {
	c, _, done := stubChannel(t, true)
	defer done()
	res := recvOne(c, "y", 3)
	c.mu.Lock()
	r := c.rcv.byKey[skey{"y", 3}]
	c.mu.Unlock()
	if r == nil {
		t.Fatal("the Recv of y step 3 is not pending")
	}
	m := eagerFrame(t, "y", 3, 8, 0x3c)
	feed(c, m.Append(nil), nil)
	select {
	case got := <-res:
		wantEager(t, "y step 3", got, 8, 0x3c)
	default:
		t.Fatal("the waiting Recv did not complete with the EAGER")
	}
	c.mu.Lock()
	_, pending := c.rcv.reqs[r.idx]
	grants, held := len(r.grants), len(c.rcv.eager.held)
	c.mu.Unlock()
	if pending || grants != 0 || held != 0 {
		t.Errorf("after the EAGER: request pending %v, %d grants left, %d tensors held; want none", pending, grants, held)
	}
	if st := c.Stats(); st.EagerIn != 1 || st.BytesIn != 32 {
		t.Errorf("stats: EagerIn %d, BytesIn %d; want 1 and 32", st.EagerIn, st.BytesIn)
	}
	if err := c.Err(); err != nil {
		t.Fatal(err)
	}
}

// TestEagerHeldUntilRecv: an EAGER that comes before its Recv is kept, and
// the Recv takes it at once without a request; every takenEvery EAGERs
// taken send one TAKEN.
func TestEagerHeldUntilRecv(t *testing.T) {
	c, q, done := stubChannel(t, true)
	defer done()
	half := takenEvery
	for i := range half {
		m := eagerFrame(t, fmt.Sprintf("z%d", i), 1, int64(i+1), byte(i+1))
		feed(c, m.Append(nil), nil)
	}
	before := c.Stats().Requests
	for i := range half {
		if i == half-1 && countFrames(q, wire.TypeTaken) != 0 {
			t.Fatalf("a TAKEN went after %d of %d EAGERs taken", i, half)
		}
		res := recvOne(c, fmt.Sprintf("z%d", i), 1)
		select {
		case got := <-res:
			wantEager(t, fmt.Sprintf("z%d", i), got, int64(i+1), byte(i+1))
		default:
			t.Fatalf("the Recv of z%d did not take the tensor held for it", i)
		}
	}
	if after := c.Stats().Requests; after != before {
		t.Errorf("%d requests sent for tensors held, want 0", after-before)
	}
	if n := countFrames(q, wire.TypeTaken); n != 1 {
		t.Errorf("%d TAKEN frames after %d EAGERs taken, want 1", n, half)
	}
	c.mu.Lock()
	reported, held := c.rcv.eager.reported, len(c.rcv.eager.held)
	c.mu.Unlock()
	if int(reported) != half || held != 0 {
		t.Errorf("TAKEN reported %d with %d held, want %d and 0", reported, held, half)
	}
}

// TestEagerCrossedRequestDropped: the peer's request for a tensor this
// side sent eagerly is dropped (no write), a CANCEL of it is answered, and
// TAKEN frees what was kept for it; a TAKEN counting more than was sent
// fails the channel.
func TestEagerCrossedRequestDropped(t *testing.T) {
	c, q, done := stubChannel(t, true)
	defer done()
	// stubChannel sent "k" step 1 eagerly: sequence 0.
	if st := c.Stats(); st.EagerOut != 1 || st.SendsPending != 0 {
		t.Fatalf("after the stub's Send: EagerOut %d, SendsPending %d; want 1 and 0", st.EagerOut, st.SendsPending)
	}
	req := wire.Message{Type: wire.TypeRequest, Flags: wire.ReqName, Req: 9, Step: 1, NameIndex: 1, Name: []byte("k")}
	feed(c, req.Append(nil), nil)
	st := c.Stats()
	if st.EagerCrossed != 1 || st.RequestsParked != 0 || st.WritesInFlight != 0 || st.WritesOut != 0 {
		t.Fatalf("after the crossing request: crossed %d, parked %d, writes in flight %d, out %d; want 1, 0, 0, 0", st.EagerCrossed, st.RequestsParked, st.WritesInFlight, st.WritesOut)
	}
	errs := countFrames(q, wire.TypeError)
	cancel := wire.Message{Type: wire.TypeCancel, Req: 9}
	feed(c, cancel.Append(nil), nil)
	if n := countFrames(q, wire.TypeError); n != errs+1 {
		t.Errorf("CANCEL of the dropped request: %d ERROR_STATUS sent, want 1", n-errs)
	}
	taken := wire.Message{Type: wire.TypeTaken, Count: 1}
	feed(c, taken.Append(nil), nil)
	c.mu.Lock()
	sent, dropped := len(c.snd.eager.sent), len(c.snd.eager.dropped)
	c.mu.Unlock()
	if sent != 0 || dropped != 0 {
		t.Errorf("after TAKEN 1: %d EAGERs and %d dropped requests kept, want none", sent, dropped)
	}
	if err := c.Err(); err != nil {
		t.Fatal(err)
	}
	over := wire.Message{Type: wire.TypeTaken, Count: 2}
	feed(c, over.Append(nil), nil)
	if err := c.Err(); !errors.Is(err, ErrProtocol) {
		t.Fatalf("TAKEN 2 of 1 sent: channel error %v, want ErrProtocol", err)
	}
}

// TestEagerWindow: a sender sends at most a window of EAGERs that TAKEN
// has not counted; the Sends beyond it wait, and go eagerly, in order,
// when a TAKEN makes room (unless their request came first); none goes
// eagerly while a Recv of the sender's own is pending.
func TestEagerWindow(t *testing.T) {
	c, _, done := stubChannel(t, true)
	defer done()
	send := func(key string) {
		if err := c.Send(key, 0, stubTensor(t)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range wire.EagerWindow + 4 {
		send(fmt.Sprintf("w%d", i))
	}
	// The stub's own Send was the first EAGER.
	if st := c.Stats(); st.EagerOut != wire.EagerWindow || st.SendsPending != 5 {
		t.Fatalf("%d Sends: EagerOut %d, SendsPending %d; want %d and 5", wire.EagerWindow+5, st.EagerOut, st.SendsPending, wire.EagerWindow)
	}
	// A TAKEN makes room for 8: the 5 waiting go, then the next Send.
	taken := wire.Message{Type: wire.TypeTaken, Count: 8}
	feed(c, taken.Append(nil), nil)
	if st := c.Stats(); st.EagerOut != wire.EagerWindow+5 || st.SendsPending != 0 {
		t.Errorf("after TAKEN 8: EagerOut %d, SendsPending %d; want %d and 0", st.EagerOut, st.SendsPending, wire.EagerWindow+5)
	}
	send("after")
	if st := c.Stats(); st.EagerOut != wire.EagerWindow+6 {
		t.Errorf("a Send after that: EagerOut %d, want %d", st.EagerOut, wire.EagerWindow+6)
	}
	if err := c.Send("after", 0, tensor.Dead(tensor.Uint8, tensor.Shape{1})); !errors.Is(err, ErrDuplicate) {
		t.Errorf("a second Send of a key and step sent eagerly: %v, want ErrDuplicate", err)
	}
	// With a Recv of its own pending (an exchange), a Send goes by request.
	c.RecvFunc(context.Background(), "theirs", 0, nil)
	send("exchange")
	if st := c.Stats(); st.EagerOut != wire.EagerWindow+6 || st.SendsPending != 1 {
		t.Errorf("a Send while a Recv is pending: EagerOut %d, SendsPending %d; want %d and 1", st.EagerOut, st.SendsPending, wire.EagerWindow+6)
	}
}

// TestEagerHostile: EAGER frames a channel must refuse fail it with
// ErrProtocol: to a channel that did not offer to take them, beyond the
// window, and a second one for a key and step held.
func TestEagerHostile(t *testing.T) {
	c, done := hostileChannel(t) // checksum mode: takes none
	m := eagerFrame(t, "a", 0, 4, 1)
	feed(c, m.Append(nil), nil)
	if err := c.Err(); !errors.Is(err, ErrProtocol) {
		t.Errorf("EAGER to a channel in checksum mode: %v, want ErrProtocol", err)
	}
	done()

	c, _, done = stubChannel(t, true)
	for i := range wire.EagerWindow {
		m := eagerFrame(t, fmt.Sprintf("a%d", i), 0, 4, 1)
		feed(c, m.Append(nil), nil)
	}
	if err := c.Err(); err != nil {
		t.Fatalf("a window of EAGERs: %v", err)
	}
	m = eagerFrame(t, "one-more", 0, 4, 1)
	feed(c, m.Append(nil), nil)
	if err := c.Err(); !errors.Is(err, ErrProtocol) {
		t.Errorf("EAGER beyond the window: %v, want ErrProtocol", err)
	}
	done()

	c, _, done = stubChannel(t, true)
	m = eagerFrame(t, "twice", 7, 4, 1)
	feed(c, m.Append(nil), nil)
	feed(c, m.Append(nil), nil)
	if err := c.Err(); !errors.Is(err, ErrProtocol) {
		t.Errorf("a second EAGER for a tensor held: %v, want ErrProtocol", err)
	}
	done()
}

// TestEagerPair runs real channels: a small Send made before its Recv goes
// eagerly (the Recv sends no request), a tensor above the bound and one
// with no bytes go by request, with and without checksum mode (where its
// checksum goes with it, and its Send ends at the TAKEN that counts it).
func TestEagerPair(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		ctx := recvCtx(t)
		for _, checksum := range []bool{false, true} {
			a, b := pair(t, provider, WithChecksum(checksum))
			cases := []struct {
				kind  string
				shape tensor.Shape
				eager bool
			}{
				{"float32", tensor.Shape{1024}, true}, // 4 KiB
				{"int8", tensor.Shape{3}, true},
				{"float32", tensor.Shape{1025}, false}, // above the bound
				{"dead:float32", tensor.Shape{2}, false},
			}
			for i, tc := range cases {
				key := fmt.Sprintf("e%d", i)
				src, err := makeTensor(a.pool, tc.kind, tc.shape, key, 0)
				if err != nil {
					t.Fatal(err)
				}
				before := b.ch.Stats()
				if err := a.ch.Send(key, 0, src); err != nil {
					t.Fatal(err)
				}
				if tc.eager {
					deadline := time.Now().Add(10 * time.Second)
					for b.ch.Stats().EagerIn == before.EagerIn && time.Now().Before(deadline) {
						time.Sleep(time.Millisecond)
					}
				}
				got, tr, err := b.ch.Recv(ctx, key, 0)
				if err != nil {
					t.Fatalf("checksum %v, %s: %v", checksum, tc.kind, err)
				}
				if err := checkTensor(got, tc.kind, tc.shape, key, 0); err != nil {
					t.Fatalf("checksum %v, %s: %v", checksum, tc.kind, err)
				}
				_ = got.Release()
				after := b.ch.Stats()
				if eager := tr.Path == PathEager; eager != tc.eager {
					t.Errorf("checksum %v, %s %v: path %s, want eager %v", checksum, tc.kind, tc.shape, tr.Path, tc.eager)
				}
				if tc.eager && after.Requests != before.Requests {
					t.Errorf("checksum %v, %s %v: %d requests for a tensor that came eagerly, want 0", checksum, tc.kind, tc.shape, after.Requests-before.Requests)
				}
			}
			if n := a.ch.Stats().EagerOut; n != 2 {
				t.Errorf("checksum %v: %d tensors sent eagerly, want 2", checksum, n)
			}
		}
	})
}

// TestEagerConcurrent sends and receives many small tensors at once: in
// rounds that start each Send and its Recv together, so that EAGERs cross
// requests, then all at once with the Recvs in a random order. Every
// tensor arrives whole, and afterwards nothing is held or kept beyond a
// window.
func TestEagerConcurrent(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider, WithChecksum(false))
		ctx := recvCtx(t)
		const n = 600
		var sends, recvs sync.WaitGroup
		errc := make(chan error, 2*n)
		shape := func(i int) tensor.Shape { return tensor.Shape{int64(1 + i%300)} }
		send := func(i int) {
			key := fmt.Sprintf("c%d", i%37)
			src, err := makeTensor(a.pool, "float32", shape(i), key, int64(i))
			if err == nil {
				err = a.ch.SendFunc(key, int64(i), src, func(err error) {
					_ = src.Release()
					if err != nil {
						errc <- err
					}
					sends.Done()
				})
			}
			if err != nil {
				errc <- err
				sends.Done()
			}
		}
		recv := func(i int) {
			key := fmt.Sprintf("c%d", i%37)
			b.ch.RecvFunc(ctx, key, int64(i), func(got *tensor.Tensor, _ Transfer, err error) {
				defer recvs.Done()
				if err == nil {
					err = checkTensor(got, "float32", shape(i), key, int64(i))
					_ = got.Release()
				}
				if err != nil {
					errc <- fmt.Errorf("%s step %d: %w", key, i, err)
				}
			})
		}
		sends.Add(n)
		recvs.Add(n)
		toSend, toRecv := make(chan int), make(chan int)
		go func() {
			for i := range toSend {
				send(i)
			}
		}()
		go func() {
			for i := range toRecv {
				recv(i)
			}
		}()
		for i := range n / 2 { // together
			toSend <- i
			toRecv <- i
		}
		close(toSend)
		close(toRecv)
		rest := rand.Perm(n - n/2)
		go func() {
			for j := range rest {
				send(n/2 + j)
				if j%8 == 0 {
					runtime.Gosched()
				}
			}
		}()
		for j, k := range rest { // racing, in any order
			recv(n/2 + k)
			if j%8 == 0 {
				runtime.Gosched()
			}
		}
		recvs.Wait()
		sends.Wait()
		close(errc)
		for err := range errc {
			t.Fatal(err)
		}
		sa, sb := a.ch.Stats(), b.ch.Stats()
		t.Logf("%s: %d of %d eagerly (%d crossed requests), %d written", provider, sa.EagerOut, n, sa.EagerCrossed, sa.WritesOut)
		if sb.EagerIn != sa.EagerOut || sa.EagerOut+sa.WritesOut != n {
			t.Errorf("%d EAGERs sent, %d taken in, %d written; want the first two equal and the sent and written %d", sa.EagerOut, sb.EagerIn, sa.WritesOut, n)
		}
		b.ch.mu.Lock()
		held := len(b.ch.rcv.eager.held)
		b.ch.mu.Unlock()
		a.ch.mu.Lock()
		kept, dropped := len(a.ch.snd.eager.sent), len(a.ch.snd.eager.dropped)
		a.ch.mu.Unlock()
		if held != 0 || kept > wire.EagerWindow || dropped > wire.EagerWindow {
			t.Errorf("afterwards: %d held, %d EAGERs and %d dropped requests kept; want 0 and at most %d", held, kept, dropped, wire.EagerWindow)
		}
	})
}

// TestEagerChecksumEndsAtTaken: in checksum mode an EAGER carries the
// CRC-32C of its bytes, its Send does not end when the SEND that carried
// it completes but at the TAKEN that counts it (the receiver checked the
// bytes), and a receiver hands a checked tensor on as checksummed, its
// TAKEN held for a frame to ride with, as a CONFIRM is, and sent alone
// after confirmDelay; an EAGER without a checksum there fails the channel.
func TestEagerChecksumEndsAtTaken(t *testing.T) {
	c, q, done := stubChannel(t, true)
	defer done()
	c.mu.Lock()
	c.checksum = true
	c.mu.Unlock()
	sent := make(chan error, 1)
	src := stubTensor(t)
	want, _ := src.Bytes()
	want = append([]byte(nil), want...)
	if err := c.SendFunc("c", 0, src, func(err error) { sent <- err }); err != nil {
		t.Fatal(err)
	}
	// The frame as posted: flagged, with the CRC of the bytes.
	var last sentFrame
	for _, f := range q.frames {
		if f.typ == wire.TypeEager {
			last = f
		}
	}
	slot := int(last.wrid &^ wridKind)
	var m wire.Message
	b := c.sendSlot(slot)
	for len(b) > 0 {
		n, err := wire.Decode(b, &m)
		if err != nil {
			t.Fatal(err)
		}
		if m.Type == wire.TypeEager && string(m.Name) == "c" {
			break
		}
		b = b[n:]
	}
	if m.Type != wire.TypeEager || m.Flags&wire.EagerChecksum == 0 || m.Checksum != crcOf(want) || !bytes.Equal(m.Data, want) {
		t.Fatalf("EAGER posted: type %s flags %#x checksum %#x; want the flag and %#x", m.Type, m.Flags, m.Checksum, crcOf(want))
	}
	// Its SEND completes: not the end of the Send in checksum mode.
	var ds deliveries
	c.mu.Lock()
	c.sqOut++ // the stub posted it; its completion counts it back
	c.handleLocked(&verbsio.Completion{WRID: last.wrid, Status: verbsio.StatusSuccess, Op: verbsio.OpSend}, &ds)
	c.mu.Unlock()
	ds.run()
	select {
	case err := <-sent:
		t.Fatalf("the Send ended (%v) at its SEND's completion, before a TAKEN", err)
	default:
	}
	// The stub's own Send was frame 0, this one frame 1: a TAKEN of 2.
	taken := wire.Message{Type: wire.TypeTaken, Count: 2}
	feed(c, taken.Append(nil), nil)
	select {
	case err := <-sent:
		if err != nil {
			t.Fatalf("the Send ended with %v at the TAKEN", err)
		}
	default:
		t.Fatal("the Send did not end at the TAKEN that counts it")
	}
	// Receiving: a checked EAGER is delivered as checksummed; one without
	// a checksum fails the channel.
	in := eagerFrame(t, "in", 0, 4, 7)
	in.Flags, in.Checksum = wire.EagerChecksum, crcOf(in.Data)
	start := time.Now() // the hold's timer starts after this
	feed(c, in.Append(nil), nil)
	r := <-recvOne(c, "in", 0)
	wantEager(t, "checked EAGER", r, 4, 7)
	if !r.tr.Checksummed {
		t.Error("a checked EAGER is not reported checksummed")
	}
	// Its TAKEN waits for a frame to ride with, then goes alone (from
	// the hold's timer, which posts under the channel's lock).
	takens := func() int {
		c.mu.Lock()
		defer c.mu.Unlock()
		return countFrames(q, wire.TypeTaken)
	}
	if n := takens(); n != 0 && time.Since(start) < confirmDelay {
		// (On a host so slow that the hold may have ended, nothing to
		// check here.)
		t.Errorf("%d TAKEN sent at once for a tensor taken in checksum mode, want it held", n)
	}
	deadline := time.Now().Add(5 * time.Second)
	for takens() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if n := takens(); n != 1 {
		t.Errorf("%d TAKEN sent for one tensor taken in checksum mode, want 1 within %v", n, confirmDelay)
	}
	// A quarter window taken: its TAKEN goes at once, not after the hold
	// (which may also have sent some on a slow host: the hold never keeps
	// a quarter window).
	for i := range takenEvery {
		key := fmt.Sprintf("q%d", i)
		m := eagerFrame(t, key, 0, 4, 2)
		m.Flags, m.Checksum = wire.EagerChecksum, crcOf(m.Data)
		feed(c, m.Append(nil), nil)
		wantEager(t, key, <-recvOne(c, key, 0), 4, 2)
	}
	var counted uint32
	c.mu.Lock()
	for _, f := range q.frames {
		if f.typ == wire.TypeTaken {
			counted = max(counted, f.count)
		}
	}
	c.mu.Unlock()
	if held := 1 + takenEvery - counted; held >= takenEvery {
		t.Errorf("%d tensors taken, the TAKENs sent count %d: %d held, want fewer than a quarter window (%d)", 1+takenEvery, counted, held, takenEvery)
	}
	plain := eagerFrame(t, "plain", 0, 4, 1)
	feed(c, plain.Append(nil), nil)
	if err := c.Err(); !errors.Is(err, ErrProtocol) {
		t.Errorf("an EAGER without a checksum in checksum mode: %v, want ErrProtocol", err)
	}
}

func crcOf(b []byte) uint32 { return crc32c.Checksum(b) }

// TestEagerCorruptedNotDelivered: an EAGER corrupted on the way (checksum
// mode) fails the receiver's channel with ErrChecksum, and its Send is
// never reported delivered: it ends with an error once the channels go.
func TestEagerCorruptedNotDelivered(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		corrupt := func(o *options) error {
			o.corrupt = func(key string, _ int64, b []byte) {
				if key == "bad" {
					b[0] ^= 0x10
				}
			}
			return nil
		}
		a, b := pair(t, provider, WithChecksum(true), corrupt)
		src, err := makeTensor(a.pool, "float32", tensor.Shape{64}, "bad", 0)
		if err != nil {
			t.Fatal(err)
		}
		sent := make(chan error, 1)
		if err := a.ch.SendFunc("bad", 0, src, func(err error) { _ = src.Release(); sent <- err }); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for b.ch.Err() == nil && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if err := b.ch.Err(); !errors.Is(err, ErrChecksum) {
			t.Fatalf("receiver's channel after a corrupted EAGER: %v, want ErrChecksum", err)
		}
		if st := b.ch.Stats(); st.EagerIn != 0 {
			t.Errorf("%d EAGERs taken in, want 0", st.EagerIn)
		}
		if err := b.ch.Close(); err != nil {
			t.Fatal(err)
		}
		if err := a.ch.Close(); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-sent:
			if err == nil {
				t.Error("the corrupted tensor's Send was reported delivered")
			}
		case <-time.After(10 * time.Second):
			t.Error("the corrupted tensor's Send did not end after both channels closed")
		}
	})
}
