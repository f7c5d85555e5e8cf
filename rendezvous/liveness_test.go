package rendezvous

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// The liveness tests stop a peer process (SIGSTOP) for less than the peer
// timeout, which both sides survive with every tensor right, and for
// longer, which the other side reports with ErrPeerTimeout within the
// timeout and a margin.
const (
	livePeerTimeout = 4 * time.Second
	// livePause is long enough for heartbeats to go unanswered during it
	// (a tick is a quarter of the timeout).
	livePause = 2 * time.Second
	// liveMargin is how late after the timeout the failure may come on a
	// loaded machine (a tick is a quarter of the timeout).
	liveMargin = 5 * time.Second
)

// recvStream is the peer's "recv" command: it receives and checks steps
// 0..count-1 of key, then answers "recvd COUNT MAXGAP_MS" (the longest
// wait between two tensors) or "recverr STEP ERROR".
func recvStream(ch *Channel, out io.Writer, key, kind string, shape tensor.Shape, count int64) {
	var maxGap time.Duration
	last := time.Now()
	for step := int64(0); step < count; step++ {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		got, _, err := ch.Recv(ctx, key, step)
		cancel()
		if err == nil {
			err = checkTensor(got, kind, shape, key, step)
			_ = got.Release()
		}
		if err != nil {
			fmt.Fprintf(out, "recverr %d %v\n", step, err)
			return
		}
		now := time.Now()
		maxGap = max(maxGap, now.Sub(last))
		last = now
	}
	fmt.Fprintf(out, "recvd %d %d\n", count, maxGap.Milliseconds())
}

// startLivePeer starts a peer process with the short peer timeout on both
// sides.
func startLivePeer(t *testing.T, provider string) *peerProc {
	t.Helper()
	env := []string{"GDRLINK_RDV_PEER_TIMEOUT=" + livePeerTimeout.String()}
	p := startPeerWith(t, provider, nil, env, nil, WithPeerTimeout(livePeerTimeout))
	// A peer left stopped could not take its quit: it resumes first (the
	// cleanups run in reverse).
	t.Cleanup(func() { _ = p.cmd.Process.Signal(syscall.SIGCONT) })
	return p
}

func (p *peerProc) signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("%v to the peer: %v", sig, err)
	}
}

// stopped waits until the peer, sent SIGSTOP, is stopped (its state in
// /proc): the signal takes effect when the peer next enters the kernel,
// and a peer that still runs meanwhile (on a loaded host, for a few of
// its Recvs) would ask for what the test means it never to see.
func (p *peerProc) stopped() {
	p.t.Helper()
	stat := fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid)
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Microsecond) {
		b, err := os.ReadFile(stat)
		if err != nil {
			p.t.Fatalf("the peer's state: %v", err)
		}
		// pid (comm) state ...: comm may hold spaces and parentheses.
		if i := bytes.LastIndexByte(b, ')'); i >= 0 && i+2 < len(b) && b[i+2] == 'T' {
			return
		}
	}
	p.t.Fatal("the peer was not stopped 5s after SIGSTOP")
}

// checkTimedOut checks that err is the peer timeout, naming the peer and
// its silence, and came within the timeout and the margin of the stop.
func checkTimedOut(t *testing.T, err error, after time.Duration) {
	t.Helper()
	t.Logf("after %v: %v", after.Round(time.Millisecond), err)
	if !errors.Is(err, ErrPeerTimeout) || !errors.Is(err, verbsio.ErrPeerLost) {
		t.Fatalf("error %v, want ErrPeerTimeout (and ErrPeerLost)", err)
	}
	if !strings.Contains(err.Error(), "peer") || !strings.Contains(err.Error(), "sent nothing for") {
		t.Fatalf("error %q does not name the peer and its silence", err)
	}
	if after < livePeerTimeout/2 || after > livePeerTimeout+liveMargin {
		t.Fatalf("failed %v after the stop, want about the peer timeout %v (at most %v more)", after, livePeerTimeout, liveMargin)
	}
}

// A sending peer stopped for less than the peer timeout: the stream
// resumes and every tensor is right; stopped for longer: the receiver's
// Recv fails with ErrPeerTimeout.
func TestLivenessSenderStopped(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		t.Run("short", func(t *testing.T) {
			p := startLivePeer(t, provider)
			const steps = 800
			p.send("stream s float32 4096 %d 2", steps)
			var maxGap time.Duration
			last := time.Now()
			for step := int64(0); step < steps; step++ {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				got, _, err := p.local.ch.Recv(ctx, "s", step)
				cancel()
				if err == nil {
					err = checkTensor(got, "float32", tensor.Shape{4096}, "s", step)
					_ = got.Release()
				}
				if err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
				now := time.Now()
				maxGap, last = max(maxGap, now.Sub(last)), now
				if step == 100 {
					p.signal(syscall.SIGSTOP)
					time.AfterFunc(livePause, func() { _ = p.cmd.Process.Signal(syscall.SIGCONT) })
				}
			}
			if maxGap < livePause*8/10 {
				t.Fatalf("longest wait between tensors %v: the stop of %v did not hold up the stream", maxGap, livePause)
			}
			if err := p.local.ch.Err(); err != nil {
				t.Fatalf("channel failed: %v", err)
			}
			ka := p.local.ch.Stats().Keepalives
			t.Logf("longest wait %v; %d heartbeat frames sent", maxGap.Round(time.Millisecond), ka)
			if ka == 0 {
				t.Fatal("no heartbeat to the stopped peer")
			}
		})
		t.Run("long", func(t *testing.T) {
			p := startLivePeer(t, provider)
			p.send("stream s float32 4096 100000 2")
			var start time.Time
			for step := int64(0); ; step++ {
				ctx, cancel := context.WithTimeout(context.Background(), livePeerTimeout+4*liveMargin)
				got, _, err := p.local.ch.Recv(ctx, "s", step)
				cancel()
				if err == nil {
					err = checkTensor(got, "float32", tensor.Shape{4096}, "s", step)
					_ = got.Release()
					if err != nil {
						t.Fatalf("step %d: %v", step, err)
					}
					if step == 50 {
						p.signal(syscall.SIGSTOP)
						start = time.Now()
					}
					continue
				}
				if start.IsZero() {
					t.Fatalf("step %d before the stop: %v", step, err)
				}
				checkTimedOut(t, err, time.Since(start))
				break
			}
		})
	})
}

// A receiving peer stopped for less than the peer timeout: the stream
// resumes and the peer gets every tensor right; stopped for longer: the
// sender's channel fails with ErrPeerTimeout, and so do its Sends.
func TestLivenessReceiverStopped(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		send := func(t *testing.T, p *peerProc, step int64, done func(error)) {
			t.Helper()
			src, err := makeTensor(p.local.pool, "float32", tensor.Shape{4096}, "s", step)
			if err != nil {
				t.Fatal(err)
			}
			if err := p.local.ch.SendFunc("s", step, src, func(err error) { _ = src.Release(); done(err) }); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
		}
		t.Run("short", func(t *testing.T) {
			p := startLivePeer(t, provider)
			const steps = 800
			p.send("recv s float32 4096 %d", steps)
			p.sync()
			failed := make(chan error, steps)
			for step := int64(0); step < steps; step++ {
				send(t, p, step, func(err error) {
					if err != nil {
						failed <- err
					}
				})
				if step == 100 {
					p.signal(syscall.SIGSTOP)
					time.AfterFunc(livePause, func() { _ = p.cmd.Process.Signal(syscall.SIGCONT) })
				}
				time.Sleep(2 * time.Millisecond)
			}
			f := strings.Fields(p.expect("recvd "))
			if len(f) != 2 || f[0] != strconv.Itoa(steps) {
				t.Fatalf("peer said recvd %v", f)
			}
			gap, _ := strconv.Atoi(f[1])
			if time.Duration(gap)*time.Millisecond < livePause*8/10 {
				t.Fatalf("the peer's longest wait between tensors was %dms: the stop of %v did not hold up the stream", gap, livePause)
			}
			select {
			case err := <-failed:
				t.Fatalf("a Send failed: %v", err)
			default:
			}
			if err := p.local.ch.Err(); err != nil {
				t.Fatalf("channel failed: %v", err)
			}
			ka := p.local.ch.Stats().Keepalives
			t.Logf("the peer's longest wait %dms; %d heartbeat frames sent", gap, ka)
			if ka == 0 {
				t.Fatal("no heartbeat to the stopped peer")
			}
		})
		t.Run("long", func(t *testing.T) {
			p := startLivePeer(t, provider)
			p.send("recv s float32 4096 1000000")
			p.sync()
			for step := int64(0); step < 100; step++ {
				send(t, p, step, func(error) {})
				time.Sleep(2 * time.Millisecond)
			}
			p.signal(syscall.SIGSTOP)
			start := time.Now()
			p.stopped()
			// Sends the stopped peer has not asked for: work pending.
			sendErr := make(chan error, 10)
			for step := int64(100); step < 110; step++ {
				send(t, p, step, func(err error) { sendErr <- err })
			}
			deadline := time.Now().Add(livePeerTimeout + 4*liveMargin)
			for p.local.ch.Err() == nil {
				if time.Now().After(deadline) {
					t.Fatalf("channel still working %v after the peer stopped", time.Since(start))
				}
				time.Sleep(10 * time.Millisecond)
			}
			checkTimedOut(t, p.local.ch.Err(), time.Since(start))
			// The Sends not written fail with it. (The one the peer
			// asked for before it stopped may have been written: its
			// write, posted, ends when it completes or the queue pair
			// goes.)
			var timedOut, delivered int
			wait := time.After(liveMargin)
		collect:
			for timedOut+delivered < 10 {
				select {
				case err := <-sendErr:
					switch {
					case errors.Is(err, ErrPeerTimeout):
						timedOut++
					case err != nil:
						t.Fatalf("a Send after the stop: %v, want nil or ErrPeerTimeout", err)
					default:
						delivered++
						t.Logf("a Send after the stop was delivered")
					}
				case <-wait:
					break collect
				}
			}
			if timedOut < 8 {
				t.Fatalf("%d of the 10 Sends after the stop failed with ErrPeerTimeout (%d delivered), want 8 or more", timedOut, delivered)
			}
			t.Logf("%d of the 10 Sends after the stop failed", timedOut)
		})
	})
}

// A peer that runs no heartbeat and no keepalive of its own, as one of an
// earlier release with nothing to send, still answers the heartbeats
// through the credit scheme: a Recv that waits twice the peer timeout for
// a Send the peer makes late is not failed, and gets its tensor.
func TestLivenessPeerWithoutHeartbeats(t *testing.T) {
	forEachProvider(t, func(t *testing.T, provider string) {
		env := []string{"GDRLINK_RDV_PEER_TIMEOUT=0", "GDRLINK_RDV_KEEPALIVE=0"}
		p := startPeerWith(t, provider, nil, env, nil, WithPeerTimeout(livePeerTimeout))
		ctx, cancel := context.WithTimeout(context.Background(), 2*livePeerTimeout+liveMargin)
		defer cancel()
		got := make(chan error, 1)
		p.local.ch.RecvFunc(ctx, "late", 0, func(r *tensor.Tensor, _ Transfer, err error) {
			if err == nil {
				err = checkTensor(r, "float32", tensor.Shape{33}, "late", 0)
				_ = r.Release()
			}
			got <- err
		})
		time.Sleep(2 * livePeerTimeout)
		if err := p.local.ch.Err(); err != nil {
			t.Fatalf("channel failed while the peer had nothing to send: %v", err)
		}
		p.send("send late 0 float32 33")
		if err := <-got; err != nil {
			t.Fatalf("Recv: %v", err)
		}
		st := p.local.ch.Stats()
		t.Logf("%d heartbeat frames sent, %d control frames", st.Keepalives, st.ControlOut)
		if st.Keepalives == 0 {
			t.Fatal("no heartbeat while the peer was silent for twice the peer timeout")
		}
	})
}

// withHeartbeat gives a keepaliveChannel a peer timeout and a peer whose
// ring is peerRing buffers, all of them credits of this side's.
func withHeartbeat(c *Channel, timeout time.Duration, peerRing int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.opts.peerTimeout = timeout
	c.live.peerRing = peerRing
	c.credits = peerRing
}

// A heartbeat brings the credits the peer owes this side to the threshold
// at which the credit scheme makes it answer, and no further while it has
// not answered; its answer ends the silence.
func TestHeartbeatReachesThePeersThreshold(t *testing.T) {
	c, q := keepaliveChannel(t, time.Hour) // ticks by hand
	const peerRing = 32
	threshold := max(2, peerRing/4)
	withHeartbeat(c, time.Hour, peerRing)
	c.RecvFunc(context.Background(), "k", 0, nil)
	spent := func() int {
		c.mu.Lock()
		defer c.mu.Unlock()
		return peerRing - c.credits
	}
	if s := spent(); s != 1 {
		t.Fatalf("%d credits spent by the request, want 1", s)
	}
	tick(t, c)
	if s, n := spent(), len(q.keepalives()); s != threshold || n != threshold-1 {
		t.Fatalf("after a silent tick: %d credits out, %d heartbeat frames; want %d and %d", s, n, threshold, threshold-1)
	}
	tick(t, c)
	if s := spent(); s != threshold {
		t.Fatalf("a second silent tick took the peer's debt to %d, want it left at %d", s, threshold)
	}
	// The peer answers: a CREDIT returning what it owes.
	arrive(c, wire.Message{Type: wire.TypeCredit, Credits: uint16(threshold)})
	c.mu.Lock()
	heard := c.live.heard
	c.mu.Unlock()
	if time.Since(heard) > time.Minute {
		t.Fatal("the answer did not end the silence")
	}
	if s := spent(); s != 0 {
		t.Fatalf("%d credits out after the answer, want 0", s)
	}
	if st := c.Stats(); st.Keepalives != uint64(threshold-1) {
		t.Fatalf("Stats.Keepalives %d, want %d", st.Keepalives, threshold-1)
	}
}

// Past the peer timeout with work pending, the channel fails with
// ErrPeerTimeout, which names the peer.
func TestPeerTimeoutFailsPending(t *testing.T) {
	c, _ := keepaliveChannel(t, time.Hour)
	const timeout = 60 * time.Millisecond
	withHeartbeat(c, timeout, 8)
	start := time.Now()
	done := make(chan error, 1)
	c.RecvFunc(context.Background(), "k", 0, func(_ *tensor.Tensor, _ Transfer, err error) { done <- err })
	select {
	case err := <-done:
		if !errors.Is(err, ErrPeerTimeout) || !errors.Is(err, verbsio.ErrPeerLost) || !strings.Contains(err.Error(), "sender") {
			t.Fatalf("Recv: %v, want ErrPeerTimeout naming the peer", err)
		}
		if d := time.Since(start); d < timeout {
			t.Fatalf("failed after %v, before the timeout %v", d, timeout)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a Recv still waits 10s after a peer timeout of 60ms")
	}
	if armed(c) {
		t.Fatal("the keepalive timer stays armed on a failed channel")
	}
}

// A tick that fires late (this process was stopped) does not count the
// time it was stopped as the peer's silence.
func TestLateTickDoesNotBlameThePeer(t *testing.T) {
	c, _ := keepaliveChannel(t, time.Hour)
	const timeout = time.Minute
	withHeartbeat(c, timeout, 8)
	c.RecvFunc(context.Background(), "k", 0, nil)
	c.mu.Lock()
	// Silent for two timeouts, all of them spent stopped: the tick was due
	// two timeouts ago.
	c.live.heard = time.Now().Add(-2 * timeout)
	c.live.due = c.live.heard.Add(timeout / 4)
	c.mu.Unlock()
	tick(t, c)
	if err := c.Err(); err != nil {
		t.Fatalf("a late tick failed the channel: %v", err)
	}
	// The same silence with the tick on time fails it.
	c.mu.Lock()
	c.live.heard = time.Now().Add(-2 * timeout)
	c.live.due = time.Now()
	c.mu.Unlock()
	tick(t, c)
	if err := c.Err(); !errors.Is(err, ErrPeerTimeout) {
		t.Fatalf("channel error %v after a silence of two timeouts, want ErrPeerTimeout", err)
	}
}
