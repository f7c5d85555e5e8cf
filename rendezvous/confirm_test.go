package rendezvous

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
)

// A write corrupted in flight once is asked for again and the Recv gets the
// right bytes; one corrupted on every try fails on both sides, with a
// *ChecksumError naming the other, after MaxChecksumRetries retries. The
// sender is a process of its own.
func TestTwoProcessChecksumRetry(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		p := startPeer(t, provider, true)
		ctx := recvCtx(t)
		const steps = 3
		shape := tensor.Shape{100}
		for step := int64(0); step < steps; step++ {
			p.send("sendfn once %d float64 100", step)
			got, tr, err := p.local.ch.Recv(ctx, "once", step)
			if err != nil || !tr.Checksummed {
				t.Fatalf("step %d corrupted once: %v (checksummed %v)", step, err, tr.Checksummed)
			}
			if err := checkTensor(got, "float64", shape, "once", step); err != nil {
				t.Fatalf("step %d corrupted once: %v", step, err)
			}
			_ = got.Release()
			p.send("done once %d", step)
			if d := p.expect("done "); d != "nil" {
				t.Fatalf("step %d corrupted once: the sender's done says %s", step, d)
			}

			p.send("sendfn corrupt %d float64 100", step)
			_, _, err = p.local.ch.Recv(ctx, "corrupt", step)
			var ce *ChecksumError
			if !errors.As(err, &ce) || !errors.Is(err, ErrChecksum) || ce.Peer != "peer" || ce.Tries != 1+MaxChecksumRetries || ce.Key != "corrupt" || ce.Step != step {
				t.Fatalf("step %d corrupted every time: %v (%+v), want a ChecksumError naming the peer after %d tries", step, err, ce, 1+MaxChecksumRetries)
			}
			p.send("done corrupt %d", step)
			want := fmt.Sprintf("checksum peer=%q tries=%d sending=true", "receiver", 1+MaxChecksumRetries)
			if d := p.expect("done "); !strings.HasPrefix(d, want) {
				t.Fatalf("step %d corrupted every time: the sender's done says %q, want %q...", step, d, want)
			}
		}
		st := p.local.ch.Stats()
		if st.ChecksumFailures != steps*(2+MaxChecksumRetries) || st.ChecksumRetries != steps*(1+MaxChecksumRetries) || st.ConfirmsOut != 2*steps {
			t.Fatalf("receiver: %d checksum failures, %d retries, %d confirms; want %d, %d, %d", st.ChecksumFailures, st.ChecksumRetries, st.ConfirmsOut, steps*(2+MaxChecksumRetries), steps*(1+MaxChecksumRetries), 2*steps)
		}
		p.send("stats")
		var rewrites, confirms, writes, control uint64
		if _, err := fmt.Sscan(p.expect("stats "), &rewrites, &confirms, &writes, &control); err != nil {
			t.Fatal(err)
		}
		if rewrites != steps*(1+MaxChecksumRetries) || confirms != 2*steps || writes != steps {
			t.Fatalf("sender: %d rewrites, %d confirms, %d writes delivered; want %d, %d, %d", rewrites, confirms, writes, steps*(1+MaxChecksumRetries), 2*steps, steps)
		}
	})
}

// With checksums on and nothing corrupted, the only frames beyond those of
// checksum mode without confirmations are one CONFIRM per write: no
// retries, no rewrites, and every Send reported delivered once confirmed.
func TestTwoProcessConfirmClean(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		p := startPeer(t, provider, true)
		ctx := recvCtx(t)
		const n = 20
		for step := int64(0); step < n; step++ {
			p.send("sendfn clean %d float32 1024", step)
			got, tr, err := p.local.ch.Recv(ctx, "clean", step)
			if err != nil || !tr.Checksummed {
				t.Fatalf("step %d: %v (checksummed %v)", step, err, tr.Checksummed)
			}
			_ = got.Release()
			p.send("done clean %d", step)
			if d := p.expect("done "); d != "nil" {
				t.Fatalf("step %d: the sender's done says %s", step, d)
			}
		}
		st := p.local.ch.Stats()
		// One meta-data round trip for the first step, then the cache.
		if st.Requests != n || st.ReRequests != 1 || st.ConfirmsOut != n || st.ChecksumRetries != 0 || st.ChecksumFailures != 0 || st.WritesIn != n {
			t.Fatalf("receiver: %d requests, %d re-requests, %d confirms, %d retries, %d failures, %d writes in; want %d, 1, %d, 0, 0, %d",
				st.Requests, st.ReRequests, st.ConfirmsOut, st.ChecksumRetries, st.ChecksumFailures, st.WritesIn, n, n, n)
		}
		p.send("stats")
		var rewrites, confirms, writes, control uint64
		if _, err := fmt.Sscan(p.expect("stats "), &rewrites, &confirms, &writes, &control); err != nil {
			t.Fatal(err)
		}
		if rewrites != 0 || confirms != n || writes != n {
			t.Fatalf("sender: %d rewrites, %d confirms, %d writes delivered; want 0, %d, %d", rewrites, confirms, writes, n, n)
		}
	})
}

// The sender keeps a source until its CONFIRM, and a Close with some
// outstanding, on either side, still reports delivered exactly what the
// receiver got: the CONFIRMs still waiting go out ahead of the BYE (the
// receiver's own, or its answer to the sender's). The same holds of
// tensors sent eagerly, whose Sends end at the TAKEN that counts them:
// those still waiting for one end at the peer's BYE.
func TestConfirmAcrossClose(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		for _, tc := range []struct{ senderFirst, eager bool }{{false, false}, {true, false}, {false, true}, {true, true}} {
			senderFirst := tc.senderFirst
			t.Run(fmt.Sprintf("sender-closes-first=%v/eager=%v", senderFirst, tc.eager), func(t *testing.T) {
				eagerMax := 0
				if tc.eager {
					eagerMax = defaultEagerMax
				}
				a, b := pair(t, provider, WithChecksum(true), WithEager(eagerMax))
				ctx := recvCtx(t)
				const n = 50
				dones := make(chan error, n)
				for step := int64(0); step < n; step++ {
					src, err := makeTensor(a.pool, "uint8", tensor.Shape{4096}, "k", step)
					if err != nil {
						t.Fatal(err)
					}
					if err := a.ch.SendFunc("k", step, src, func(err error) { _ = src.Release(); dones <- err }); err != nil {
						t.Fatal(err)
					}
				}
				got := 0
				for step := int64(0); step < n; step++ {
					r, _, err := b.ch.Recv(ctx, "k", step)
					if err != nil {
						t.Fatalf("step %d: %v", step, err)
					}
					if err := checkTensor(r, "uint8", tensor.Shape{4096}, "k", step); err != nil {
						t.Fatal(err)
					}
					_ = r.Release()
					got++
				}
				first, second := b, a
				if senderFirst {
					first, second = a, b
				}
				if err := first.ch.Close(); err != nil {
					t.Fatal(err)
				}
				if err := second.ch.Close(); err != nil {
					t.Fatal(err)
				}
				delivered := 0
				for i := 0; i < n; i++ {
					if err := <-dones; err == nil {
						delivered++
					} else if !errors.Is(err, ErrClosed) {
						t.Fatalf("a send ended with %v", err)
					}
				}
				if delivered != got {
					t.Fatalf("sender reports %d delivered, the receiver got %d", delivered, got)
				}
				st := a.ch.Stats()
				if out := st.WritesOut + st.EagerOut; out != uint64(got) || tc.eager != (st.EagerOut > 0) {
					t.Fatalf("sender counts %d writes and %d tensors sent eagerly, the receiver got %d", st.WritesOut, st.EagerOut, got)
				}
			})
		}
	})
}

// Without WithChecksum on either side, a channel runs in its provider's
// default checksum mode (DefaultChecksum); a side that chose wins over a
// side that did not, and two that chose differently do not connect.
func TestChecksumDefaults(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		for _, c := range []struct {
			name   string
			a, b   []Option
			want   bool
			refuse bool
		}{
			{"default", nil, nil, DefaultChecksum(provider), false},
			{"on-default", []Option{WithChecksum(true)}, nil, true, false},
			{"off-default", []Option{WithChecksum(false)}, nil, false, false},
			{"on-off", []Option{WithChecksum(true)}, []Option{WithChecksum(false)}, false, true},
		} {
			t.Run(c.name, func(t *testing.T) {
				a, err := openSide(provider, "a", c.a...)
				if err != nil {
					skipUnavailable(t, provider, err)
				}
				t.Cleanup(func() { _ = a.close() })
				b, err := openSide(provider, "b", c.b...)
				if err != nil {
					skipUnavailable(t, provider, err)
				}
				t.Cleanup(func() { _ = b.close() })
				err = connectSides(recvCtx(t), a, b)
				if c.refuse {
					if err == nil || !strings.Contains(err.Error(), ErrMismatch.Error()) {
						t.Fatalf("connect = %v, want ErrMismatch on both", err)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				for i, pair := range [][2]*side{{a, b}, {b, a}} {
					src, _ := makeTensor(pair[0].pool, "int32", tensor.Shape{64}, "d", int64(i))
					if err := pair[0].ch.Send("d", int64(i), src); err != nil {
						t.Fatal(err)
					}
					got, tr, err := pair[1].ch.Recv(recvCtx(t), "d", int64(i))
					if err != nil {
						t.Fatal(err)
					}
					_ = got.Release()
					if tr.Checksummed != c.want {
						t.Fatalf("direction %d: checksummed %v, want %v", i, tr.Checksummed, c.want)
					}
				}
			})
		}
	})
}

// README.md's table of checksum defaults says what DefaultChecksum does.
func TestChecksumDefaultsInReadme(t *testing.T) {
	f, err := os.Open("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	in, rows := false, 0
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, "| Provider | Checksums by default |") {
			in = true
			continue
		}
		if !in || strings.HasPrefix(l, "|---") || strings.HasPrefix(l, "| ---") {
			continue
		}
		if !strings.HasPrefix(l, "|") {
			break
		}
		cells := strings.Split(l, "|")
		if len(cells) < 3 {
			t.Fatalf("README row %q", l)
		}
		provider := strings.Trim(strings.TrimSpace(cells[1]), "`")
		on := strings.TrimSpace(cells[2])
		if on != "on" && on != "off" {
			t.Fatalf("README row %q: want on or off", l)
		}
		if DefaultChecksum(provider) != (on == "on") {
			t.Errorf("README says checksums are %s by default on %s, DefaultChecksum says %v", on, provider, DefaultChecksum(provider))
		}
		rows++
	}
	if rows < 3 {
		t.Fatalf("README's table of checksum defaults has %d rows, want tcp, onnode and ibverbs", rows)
	}
}

// A peer whose HELLO offers no confirmations (a peer of the first
// release) gets today's checksum mode: no CONFIRM is sent to it, a
// corrupted write fails the Recv at once, and its Send is done when
// written.
func TestChecksumWithFirstReleasePeer(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		corrupt := func(o *options) error {
			o.corrupt = func(key string, _ int64, b []byte) {
				if key == "bad" {
					b[0] ^= 0x80
				}
			}
			return nil
		}
		old := func(o *options) error { o.firstRelease = true; return nil }
		for _, oldSends := range []bool{true, false} {
			t.Run(fmt.Sprintf("old-sends=%v", oldSends), func(t *testing.T) {
				sOpts, rOpts := []Option{WithChecksum(true), corrupt}, []Option{}
				if oldSends {
					sOpts = append(sOpts, old)
				} else {
					rOpts = append(rOpts, old, WithChecksum(true))
				}
				s, err := openSide(provider, "s", sOpts...)
				if err != nil {
					skipUnavailable(t, provider, err)
				}
				t.Cleanup(func() { _ = s.close() })
				r, err := openSide(provider, "r", rOpts...)
				if err != nil {
					skipUnavailable(t, provider, err)
				}
				t.Cleanup(func() { _ = r.close() })
				if err := connectSides(recvCtx(t), s, r); err != nil {
					t.Fatal(err)
				}
				ctx := recvCtx(t)
				for step := int64(0); step < 2; step++ {
					for _, key := range []string{"good", "bad"} {
						src, _ := makeTensor(s.pool, "uint8", tensor.Shape{1000}, key, step)
						done := make(chan error, 1)
						if err := s.ch.SendFunc(key, step, src, func(err error) { _ = src.Release(); done <- err }); err != nil {
							t.Fatal(err)
						}
						got, tr, err := r.ch.Recv(ctx, key, step)
						if key == "good" {
							if err != nil || !tr.Checksummed {
								t.Fatalf("good step %d: %v (checksummed %v)", step, err, tr.Checksummed)
							}
							_ = got.Release()
						} else if !errors.Is(err, ErrChecksum) {
							t.Fatalf("bad step %d: %v, want ErrChecksum", step, err)
						}
						if err := <-done; err != nil {
							t.Fatalf("%s step %d: the send's done got %v, want nil as before confirmations", key, step, err)
						}
					}
				}
				rs, ss := r.ch.Stats(), s.ch.Stats()
				if rs.ConfirmsOut != 0 || ss.ConfirmsIn != 0 || rs.ChecksumRetries != 0 || rs.ChecksumFailures != 2 {
					t.Fatalf("%d confirms out, %d in, %d retries, %d failures; want 0, 0, 0, 2", rs.ConfirmsOut, ss.ConfirmsIn, rs.ChecksumRetries, rs.ChecksumFailures)
				}
			})
		}
	})
}

func TestNegotiateChecksum(t *testing.T) {
	const (
		on   = wire.HelloChecksum
		auto = wire.HelloChecksumAuto
		conf = wire.HelloConfirm
	)
	for _, c := range []struct {
		ours, theirs uint8
		on, confirm  bool
		mismatch     bool
		name         string
	}{
		{auto | on | conf, auto | on | conf, true, true, false, "both default on"},
		{auto | conf, auto | conf, false, false, false, "both default off"},
		{auto | conf, auto | on | conf, true, true, false, "defaults differ: on"},
		{auto | on | conf, conf, false, false, false, "chosen off wins"},
		{auto | conf, on | conf, true, true, false, "chosen on wins"},
		{on | conf, on | conf, true, true, false, "both chose on"},
		{on | conf, conf, false, false, true, "chosen on and off"},
		{auto | on | conf, on, true, false, false, "first-release peer on: no confirmations"},
		{auto | on | conf, 0, false, false, false, "first-release peer off"},
		{on | conf, 0, false, false, true, "chosen on, first-release peer off"},
	} {
		gotOn, gotConfirm, err := negotiateChecksum(c.ours, c.theirs, "p")
		if c.mismatch {
			if !errors.Is(err, ErrMismatch) {
				t.Errorf("%s: %v, want ErrMismatch", c.name, err)
			}
			continue
		}
		if err != nil || gotOn != c.on || gotConfirm != c.confirm {
			t.Errorf("%s: on %v confirm %v err %v; want %v %v", c.name, gotOn, gotConfirm, err, c.on, c.confirm)
		}
		// The same decision on the other side.
		if on2, conf2, err := negotiateChecksum(c.theirs, c.ours, "p"); err != nil || on2 != gotOn || conf2 != gotConfirm {
			t.Errorf("%s, the other way: on %v confirm %v err %v", c.name, on2, conf2, err)
		}
	}
}

// ConfirmNow sends a CONFIRM the receiver holds for a frame to ride with
// at once (a control frame out, none held after it), and the sender's
// Send then completes; without held confirmations it sends nothing.
func TestConfirmNow(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		a, b := pair(t, provider, WithChecksum(true), WithEager(0))
		ctx := recvCtx(t)
		held := func() int {
			b.ch.mu.Lock()
			defer b.ch.mu.Unlock()
			return len(b.ch.rcv.confirms)
		}
		caught := false
		for step := int64(0); step < 50 && !caught; step++ {
			src, err := makeTensor(a.pool, "uint8", tensor.Shape{4096}, "k", step)
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			if err := a.ch.SendFunc("k", step, src, func(err error) { _ = src.Release(); done <- err }); err != nil {
				t.Fatal(err)
			}
			r, _, err := b.ch.Recv(ctx, "k", step)
			if err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			_ = r.Release()
			// The CONFIRM is held unless its timer fired already (a
			// loaded host): then try the next step.
			if held() == 1 {
				before := b.ch.Stats().ControlOut
				b.ch.ConfirmNow()
				if n := held(); n != 0 {
					t.Fatalf("%d CONFIRMs still held after ConfirmNow", n)
				}
				if out := b.ch.Stats().ControlOut; out != before+1 {
					t.Fatalf("ConfirmNow posted %d control frames, want 1", out-before)
				}
				caught = true
			}
			if err := <-done; err != nil {
				t.Fatalf("step %d: the sender's done: %v", step, err)
			}
		}
		if !caught {
			t.Fatal("no CONFIRM was still held after its Recv in 50 tries")
		}
		before := b.ch.Stats().ControlOut
		b.ch.ConfirmNow()
		if out := b.ch.Stats().ControlOut; out != before {
			t.Fatalf("ConfirmNow with nothing held posted %d control frames", out-before)
		}
	})
}
