package rendezvous

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

func recvCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestInProcessBasics(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider, WithEager(0)) // the request paths; eager_test.go has the other
		ctx := recvCtx(t)
		cases := []struct {
			kind  string
			shape tensor.Shape
			path  Path
		}{
			{"float32", tensor.Shape{16, 16}, PathDirect},
			{"int8", tensor.Shape{3}, PathDirect},
			{"complex128", tensor.Shape{2, 2, 2}, PathDirect},
			{"string", tensor.Shape{4}, PathSerialized},
			{"dead:float32", tensor.Shape{2}, PathNone},
			{"float64", tensor.Shape{0, 4}, PathNone},
		}
		for step := int64(0); step < 3; step++ {
			for i, c := range cases {
				key := fmt.Sprintf("t%d", i)
				src, err := makeTensor(a.pool, c.kind, c.shape, key, step)
				if err != nil {
					t.Fatal(err)
				}
				if err := a.ch.Send(key, step, src); err != nil {
					t.Fatal(err)
				}
				got, tr, err := b.ch.Recv(ctx, key, step)
				if err != nil {
					t.Fatalf("%s step %d: %v", c.kind, step, err)
				}
				if err := checkTensor(got, c.kind, c.shape, key, step); err != nil {
					t.Fatalf("%s step %d: %v", c.kind, step, err)
				}
				if tr.Path != c.path {
					t.Errorf("%s step %d went %s, want %s", c.kind, step, tr.Path, c.path)
				}
				if wantRT := step == 0 && c.path != PathNone; tr.MetaRoundTrip != wantRT {
					t.Errorf("%s step %d: meta round trip %v, want %v", c.kind, step, tr.MetaRoundTrip, wantRT)
				}
				if tr.Provider != provider || tr.Peer != "a" {
					t.Errorf("transfer names provider %q peer %q", tr.Provider, tr.Peer)
				}
				if err := got.Release(); err != nil {
					t.Fatal(err)
				}
			}
		}
		st := b.ch.Stats()
		if st.NameDefs != uint64(len(cases)) {
			t.Errorf("%d names defined, want %d (one per key)", st.NameDefs, len(cases))
		}
		if st.MetaResponses != 4 || st.ReRequests != 4 {
			t.Errorf("%d meta-data responses and %d re-requests, want 4 each (first step of each live tensor)", st.MetaResponses, st.ReRequests)
		}
		if st.Finals != 6 {
			t.Errorf("%d final responses, want 6 (dead and empty, 3 steps)", st.Finals)
		}
		// The sender saw one request per Recv and answered the four
		// re-requests of the first step.
		sa := a.ch.Stats()
		if sa.RequestsIn != 18 || sa.ReRequestsIn != 4 {
			t.Errorf("sender got %d requests and answered %d re-requests, want 18 and 4", sa.RequestsIn, sa.ReRequestsIn)
		}
		// Sends the peer has not asked for yet are pending until it does.
		for i := range 2 {
			src, err := makeTensor(a.pool, "int32", tensor.Shape{8}, fmt.Sprint("later", i), 9)
			if err != nil {
				t.Fatal(err)
			}
			if err := a.ch.Send(fmt.Sprint("later", i), 9, src); err != nil {
				t.Fatal(err)
			}
		}
		if sa := a.ch.Stats(); sa.SendsPending != 2 || sa.Kept != 0 {
			t.Errorf("%d sends pending and %d kept after two unrequested Sends, want 2 and 0", sa.SendsPending, sa.Kept)
		}
		for i := range 2 {
			got, _, err := b.ch.Recv(ctx, fmt.Sprint("later", i), 9)
			if err != nil {
				t.Fatal(err)
			}
			_ = got.Release()
		}
		// The sender hears of its writes' completion after the receiver
		// has the bytes, and of their CONFIRM (tcp's default checksum
		// mode) later still: wait for both.
		deadline := time.Now().Add(10 * time.Second)
		for sa = a.ch.Stats(); (sa.WritesInFlight != 0 || sa.Unconfirmed != 0) && time.Now().Before(deadline); sa = a.ch.Stats() {
			time.Sleep(time.Millisecond)
		}
		if sa.RequestsIn != 20 || sa.ReRequestsIn != 6 || sa.SendsPending != 0 || sa.Kept != 0 || sa.WritesInFlight != 0 || sa.WritesOut != 14 {
			t.Errorf("sender stats after every Recv: %d requests, %d re-requests, %d sends pending, %d kept, %d writes in flight, %d written; want 20, 6, 0, 0, 0, 14",
				sa.RequestsIn, sa.ReRequestsIn, sa.SendsPending, sa.Kept, sa.WritesInFlight, sa.WritesOut)
		}
	})
}

// The sender's stats follow one tensor through a stale meta-data round
// trip: pending until requested, kept until re-requested, in flight until
// its write completes.
func TestSenderStats(t *testing.T) {
	c, _ := keepaliveChannel(t, time.Hour) // no completion goroutine: every step by hand
	check := func(when string, requests, reRequests uint64, pending, kept, inFlight int) {
		t.Helper()
		st := c.Stats()
		if st.RequestsIn != requests || st.ReRequestsIn != reRequests || st.SendsPending != pending || st.Kept != kept || st.WritesInFlight != inFlight {
			t.Fatalf("%s: %d requests, %d re-requests, %d sends pending, %d kept, %d writes in flight; want %d, %d, %d, %d, %d",
				when, st.RequestsIn, st.ReRequestsIn, st.SendsPending, st.Kept, st.WritesInFlight, requests, reRequests, pending, kept, inFlight)
		}
	}
	meta, err := tensor.MetaFor(tensor.Uint8, tensor.Shape{64})
	if err != nil {
		t.Fatal(err)
	}
	blk, err := stubPool(t).Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	src, err := tensor.New(meta, blk)
	if err != nil {
		t.Fatal(err)
	}
	check("before Send", 0, 0, 0, 0, 0)
	if err := c.Send("w", 3, src); err != nil {
		t.Fatal(err)
	}
	check("after Send", 0, 0, 1, 0, 0)
	// A request with no meta-data: answered META_DATA_RESPONSE, tensor kept.
	arrive(c, wire.Message{Type: wire.TypeRequest, Flags: wire.ReqName, Name: []byte("w"), NameIndex: 1, Step: 3, Req: 5})
	check("after the request", 1, 0, 0, 1, 0)
	// The re-request with a buffer that fits: the write is posted.
	arrive(c, wire.Message{Type: wire.TypeReRequest, Req: 5, Addr: 0x10000, RKey: 2, Capacity: 64})
	check("after the re-request", 1, 1, 0, 0, 1)
	if st := c.Stats(); st.WritesOut != 0 {
		t.Fatalf("%d writes counted done before their completion", st.WritesOut)
	}
	complete(c, wridWrite|1<<8|1, verbsio.StatusSuccess) // write sequence 1, last part
	check("after the write completed", 1, 1, 0, 0, 0)
	if st := c.Stats(); st.WritesOut != 1 || st.BytesOut != 64 {
		t.Fatalf("%d writes and %d bytes out, want 1 and 64", st.WritesOut, st.BytesOut)
	}
}

// TestShapeChangeRoundTripOnce: the request path's meta-data cache makes
// a shape change cost one META_DATA_RESPONSE and one re-request, whichever
// of Send and Recv comes first (nothing goes eagerly: an EAGER carries its
// meta-data and asks no round trip).
func TestShapeChangeRoundTripOnce(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider, WithEager(0))
		ctx := recvCtx(t)
		shapes := []tensor.Shape{{8, 8}, {8, 8}, {8, 8}, {4, 32}, {4, 32}, {4, 32}}
		var before Stats
		for step, sh := range shapes {
			if step == 3 {
				before = b.ch.Stats()
			}
			src, err := makeTensor(a.pool, "float32", sh, "w", int64(step))
			if err != nil {
				t.Fatal(err)
			}
			// Recv first on even steps, Send first on odd ones.
			type res struct {
				t   *tensor.Tensor
				tr  Transfer
				err error
			}
			ch := make(chan res, 1)
			if step%2 == 0 {
				b.ch.RecvFunc(ctx, "w", int64(step), func(t *tensor.Tensor, tr Transfer, err error) { ch <- res{t, tr, err} })
				time.Sleep(time.Millisecond)
				if err := a.ch.Send("w", int64(step), src); err != nil {
					t.Fatal(err)
				}
			} else {
				if err := a.ch.Send("w", int64(step), src); err != nil {
					t.Fatal(err)
				}
				time.Sleep(time.Millisecond)
				b.ch.RecvFunc(ctx, "w", int64(step), func(t *tensor.Tensor, tr Transfer, err error) { ch <- res{t, tr, err} })
			}
			r := <-ch
			if r.err != nil {
				t.Fatal(r.err)
			}
			if err := checkTensor(r.t, "float32", sh, "w", int64(step)); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			_ = r.t.Release()
		}
		after := b.ch.Stats()
		if d := after.MetaResponses - before.MetaResponses; d != 1 {
			t.Errorf("shape change caused %d meta-data responses, want exactly 1", d)
		}
		if d := after.ReRequests - before.ReRequests; d != 1 {
			t.Errorf("shape change caused %d re-requests, want exactly 1", d)
		}
	})
}

func TestSendErrorAndCancel(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider)
		ctx := recvCtx(t)
		if err := a.ch.SendError("bad", 1, errors.New("kernel exploded")); err != nil {
			t.Fatal(err)
		}
		_, _, err := b.ch.Recv(ctx, "bad", 1)
		if !errors.Is(err, ErrRemote) {
			t.Fatalf("Recv after SendError = %v, want ErrRemote", err)
		}
		t.Log(err)
		short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		start := time.Now()
		_, _, err = b.ch.Recv(short, "never", 1)
		if !errors.Is(err, ErrCancelled) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Recv with a deadline = %v, want ErrCancelled and DeadlineExceeded", err)
		}
		if el := time.Since(start); el > 5*time.Second {
			t.Fatalf("Recv returned %v after its 50ms deadline", el)
		}
		// The key works again after the cancellation.
		src, _ := makeTensor(a.pool, "int32", tensor.Shape{5}, "never", 1)
		if err := a.ch.Send("never", 1, src); err != nil {
			t.Fatal(err)
		}
		got, _, err := b.ch.Recv(ctx, "never", 1)
		if err != nil {
			t.Fatal(err)
		}
		_ = got.Release()
		if err := a.ch.Send("dup", 1, tensor.Dead(tensor.Int8, nil)); err != nil {
			t.Fatal(err)
		}
		if err := a.ch.Send("dup", 1, tensor.Dead(tensor.Int8, nil)); !errors.Is(err, ErrDuplicate) {
			t.Fatalf("second Send = %v, want ErrDuplicate", err)
		}
		if err := a.ch.Send("", 1, tensor.Dead(tensor.Int8, nil)); !errors.Is(err, ErrBadKey) {
			t.Fatalf("Send with an empty key = %v, want ErrBadKey", err)
		}
	})
}

func TestChecksumDetectsCorruption(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		corrupt := func(o *options) error {
			o.corrupt = func(key string, step int64, b []byte) {
				if key == "bad" {
					b[len(b)/2] ^= 0x40
				}
			}
			return nil
		}
		a, b := pair(t, provider, WithChecksum(true), WithEager(0), corrupt)
		ctx := recvCtx(t)
		for step := int64(0); step < 2; step++ {
			for _, key := range []string{"good", "bad"} {
				src, _ := makeTensor(a.pool, "uint8", tensor.Shape{1000}, key, step)
				if err := a.ch.Send(key, step, src); err != nil {
					t.Fatal(err)
				}
				got, tr, err := b.ch.Recv(ctx, key, step)
				if key == "good" {
					if err != nil || !tr.Checksummed {
						t.Fatalf("good step %d: %v (checksummed %v)", step, err, tr.Checksummed)
					}
					_ = got.Release()
					continue
				}
				if !errors.Is(err, ErrChecksum) {
					t.Fatalf("corrupted write step %d: err %v, want ErrChecksum", step, err)
				}
			}
		}
		// Every write of "bad" is corrupted: each is asked for again
		// MaxChecksumRetries times before the Recv fails.
		if st := b.ch.Stats(); st.ChecksumFailures != 2*(1+MaxChecksumRetries) || st.ChecksumRetries != 2*MaxChecksumRetries {
			t.Fatalf("%d checksum failures, %d retries; want %d, %d", st.ChecksumFailures, st.ChecksumRetries, 2*(1+MaxChecksumRetries), 2*MaxChecksumRetries)
		}
	})
}

// TestChecksumOfOfferedBytes: in checksum mode a large tensor's checksum
// is taken when it is offered (sourceCRC), so a source changed after Send
// and before the peer asks for it (against Send's contract) arrives as
// corrupted, while one left alone arrives verified.
func TestChecksumOfOfferedBytes(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider, WithChecksum(true))
		ctx := recvCtx(t)
		shape := tensor.Shape{eagerCRCMin} // bytes: above the eager threshold
		for _, key := range []string{"kept", "changed"} {
			src, err := makeTensor(a.pool, "uint8", shape, key, 0)
			if err != nil {
				t.Fatal(err)
			}
			sent := make(chan error, 1)
			if err := a.ch.SendFunc(key, 0, src, func(err error) { sent <- err }); err != nil {
				t.Fatal(err)
			}
			if key == "changed" {
				b, _ := src.Bytes()
				b[len(b)/3] ^= 0x10
			}
			got, tr, err := b.ch.Recv(ctx, key, 0)
			serr := <-sent
			_ = src.Release()
			if key == "kept" {
				if err != nil || !tr.Checksummed || serr != nil {
					t.Fatalf("unchanged source: Recv %v (checksummed %v), Send %v", err, tr.Checksummed, serr)
				}
				if err := checkTensor(got, "uint8", shape, key, 0); err != nil {
					t.Fatal(err)
				}
				_ = got.Release()
				continue
			}
			if !errors.Is(err, ErrChecksum) || !errors.Is(serr, ErrChecksum) {
				t.Fatalf("source changed after Send: Recv %v, Send %v; want ErrChecksum for both", err, serr)
			}
		}
	})
}

func TestManyConcurrentRecvs(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider, WithRing(16))
		ctx := recvCtx(t)
		const n = 2000
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i := 0; i < n; i++ {
			key := fmt.Sprintf("k%d", i%300)
			step := int64(i / 300)
			wg.Add(1)
			b.ch.RecvFunc(ctx, key, step, func(got *tensor.Tensor, _ Transfer, err error) {
				defer wg.Done()
				if err == nil {
					err = checkTensor(got, "int16", tensor.Shape{int64(i%7 + 1)}, key, step)
					_ = got.Release()
				}
				if err != nil {
					errs <- fmt.Errorf("%s/%d: %w", key, step, err)
				}
			})
		}
		for i := n - 1; i >= 0; i-- {
			key := fmt.Sprintf("k%d", i%300)
			src, err := makeTensor(a.pool, "int16", tensor.Shape{int64(i%7 + 1)}, key, int64(i/300))
			if err != nil {
				t.Fatal(err)
			}
			if err := a.ch.Send(key, int64(i/300), src); err != nil {
				t.Fatal(err)
			}
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		if st := a.ch.Stats(); st.CreditsOnly == 0 && st.ControlOut == 0 {
			t.Errorf("no control traffic counted: %+v", st)
		}
	})
}

func TestPeerCloseFailsPending(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		before := runtime.NumGoroutine()
		a, b := pair(t, provider)
		ctx := recvCtx(t)
		errc := make(chan error, 10)
		for i := 0; i < 10; i++ {
			b.ch.RecvFunc(ctx, fmt.Sprint("p", i), 0, func(_ *tensor.Tensor, _ Transfer, err error) { errc <- err })
		}
		time.Sleep(20 * time.Millisecond)
		if err := a.ch.Close(); err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 10; i++ {
			select {
			case err := <-errc:
				if !errors.Is(err, ErrClosed) && !errors.Is(err, verbsio.ErrPeerLost) {
					t.Fatalf("pending Recv after the peer closed: %v", err)
				}
				if i == 0 {
					t.Log(err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("pending Recv still waiting 10s after the peer closed")
			}
		}
		_ = b.ch.Close()
		_ = before
	})
}
