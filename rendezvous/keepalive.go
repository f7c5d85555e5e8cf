package rendezvous

import (
	"fmt"
	"time"

	"github.com/gdrlink/gdrlink/internal/wire"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Liveness. A reliable-connected queue pair learns that its peer is gone only
// when it sends something: the transport then retries, gives up, and the
// work request completes with an error (verbsio.ErrPeerLost). Providers over
// a stream socket see the peer's end of stream as well, but an RDMA queue
// pair whose side has nothing to send waits for ever. So while work is
// pending, a timer runs with the keepalive interval, and on each tick that
// finds nothing arrived from the peer since the last one, the channel sends
// a keepalive (probeLocked). The failure path is the usual one: a failed
// post or completion fails the channel with peerLost. With no pending work,
// no timer runs and nothing is sent.
//
// A NIC or kernel acknowledges for a process that is stopped, though, so
// with a peer timeout (WithPeerTimeout) the keepalive is a heartbeat that
// the peer's process answers: CREDIT frames enough that the peer owes this
// side the credits it returns unasked (max(2, ring/4) of its ring, the
// threshold of flushLocked), so its answer is a CREDIT of its own, from
// any release of the protocol. The tick interval is then at most a quarter
// of the timeout, and a tick that finds the peer silent for the timeout
// with work pending fails the channel (ErrPeerTimeout). Silence is counted
// from the last arrival, or from when work became pending, whichever is
// later; a tick that fires late by more than a quarter of the timeout (this
// process was stopped, or starved) adds its lateness to that start, so a
// process never blames its peer for its own pause.

// liveness is the channel's heartbeat state, guarded by the channel's lock.
type liveness struct {
	peerRing int       // the peer's receive buffers (its HELLO)
	count    uint64    // arrivals when heard was taken
	heard    time.Time // the peer's last arrival, or when work became pending
	due      time.Time // when the armed tick should fire
	owe      int       // heartbeat frames still to post
}

// ErrPeerTimeout: the peer sent nothing for longer than the peer timeout
// (WithPeerTimeout) while the channel had work pending; the channel failed.
// It matches verbsio.ErrPeerLost too.
var ErrPeerTimeout = fmt.Errorf("rendezvous: peer timed out: %w", verbsio.ErrPeerLost)

// pendingLocked reports whether the channel waits on its peer for anything:
// an answer to a request, a request for a Send, the peer's re-request for a
// kept tensor, a write's completion, or queued items.
func (c *Channel) pendingLocked() bool {
	return c.rcv.pendingLocked() || c.snd.pendingLocked() || len(c.outq) > 0
}

// tickInterval is the keepalive timer's interval: the keepalive interval,
// or a quarter of the peer timeout if that is shorter or keepalives are
// off; 0 when neither is set.
func (o *options) tickInterval() time.Duration {
	d := o.keepalive
	if q := o.peerTimeout / 4; q > 0 && (d <= 0 || q < d) {
		d = q
	}
	return d
}

// heardLocked notes a new arrival from the peer: it ends the silence and
// any heartbeat still to post.
func (c *Channel) heardLocked() {
	if c.opts.peerTimeout <= 0 || c.arrivals == c.live.count {
		return
	}
	c.live.count, c.live.heard, c.live.owe = c.arrivals, time.Now(), 0
}

// armKeepaliveLocked starts the keepalive timer if work is pending and it is
// not running. The first tick comes one interval from now. It also notes
// arrivals and posts what a heartbeat could not post before (its send
// slots are back, or credits).
func (c *Channel) armKeepaliveLocked() {
	c.heardLocked()
	if c.live.owe > 0 && c.state == stateConnected {
		c.pingLocked()
	}
	d := c.opts.tickInterval()
	if d <= 0 || c.kaArmed || c.state != stateConnected || !c.pendingLocked() {
		return
	}
	// Work became pending: the peer's silence counts from now.
	c.live.count, c.live.heard = c.arrivals, time.Now()
	c.startTickLocked(d)
}

// startTickLocked arms the timer for a tick d from now.
func (c *Channel) startTickLocked(d time.Duration) {
	c.kaArmed = true
	c.kaSeen = c.arrivals
	c.live.due = time.Now().Add(d)
	if c.kaTimer == nil {
		c.kaTimer = time.AfterFunc(d, c.keepaliveTick)
	} else {
		c.kaTimer.Reset(d)
	}
}

// disarmKeepaliveLocked stops the timer (the channel failed or closed); a
// tick already under way finds the channel stopped and does nothing.
func (c *Channel) disarmKeepaliveLocked() {
	if c.kaTimer != nil {
		c.kaTimer.Stop()
	}
	c.kaArmed = false
	c.live.owe = 0
}

// keepaliveTick is the timer's function: the channel fails if the peer was
// silent past the peer timeout; else a keepalive if the peer was silent
// for the whole interval, then the next tick while work is still pending.
func (c *Channel) keepaliveTick() {
	var ds deliveries
	c.mu.Lock()
	c.tickLocked(&ds)
	c.mu.Unlock()
	ds.run()
}

func (c *Channel) tickLocked(ds *deliveries) {
	if !c.kaArmed {
		return // disarmed after this tick was due
	}
	c.kaArmed = false
	if c.state != stateConnected || !c.pendingLocked() {
		return // idle: armed again when work is pending
	}
	d := c.opts.tickInterval()
	c.heardLocked()
	if t := c.opts.peerTimeout; t > 0 {
		now := time.Now()
		if late := now.Sub(c.live.due); late > t/4 {
			// This process did not run for a good part of the timeout
			// (stopped, or starved): that time is not the peer's
			// silence. (Lateness of a scheduler's order is not.)
			c.live.heard = c.live.heard.Add(late)
			if c.live.heard.After(now) {
				c.live.heard = now
			}
		}
		if silent := now.Sub(c.live.heard); silent >= t {
			err := fmt.Errorf("%w: %s (%s on %s) sent nothing for %v with work pending (peer timeout %v)",
				ErrPeerTimeout, c.peer, c.provider, c.devName, silent.Round(time.Millisecond), t)
			c.log.Warn("rendezvous: peer timed out", "peer", c.peer, "silent", silent, "timeout", t)
			c.failLocked(err, ds, stateFailed)
			return
		}
	}
	if c.arrivals == c.kaSeen {
		c.probeLocked()
	}
	if c.state == stateConnected {
		c.startTickLocked(d)
	}
}

// probeLocked sends a keepalive to a peer silent for a tick. Without a peer
// timeout it is one CREDIT frame, which the peer's NIC must acknowledge.
// With one it is a heartbeat: as many CREDIT frames as bring the credits
// the peer owes this side, once it has taken them in, to the threshold at
// which it returns them unasked, max(2, ring/4) of its ring (none when it
// owes that many already: its answer is due).
func (c *Channel) probeLocked() {
	if c.opts.peerTimeout <= 0 || c.live.peerRing <= 0 {
		c.live.owe = 1
	} else {
		r := c.live.peerRing
		c.live.owe = max(0, max(2, r/4)-(r-c.credits))
	}
	c.pingLocked()
}

// pingLocked posts the keepalive frames still owed: each a CREDIT frame
// returning whatever credits are owed (perhaps none). It follows the credit
// scheme (see WithKeepalive): each needs two credits, or one when it
// returns credits, and a free send slot and send-queue room; short of
// those the rest waits (for a completion, or the next tick; sends in
// flight fail by themselves if the peer is gone).
func (c *Channel) pingLocked() {
	for c.live.owe > 0 {
		if len(c.freeSlots) == 0 || c.sqOut >= c.sqMax {
			return
		}
		if c.credits < 2 && (c.credits < 1 || c.owed == 0) {
			return
		}
		slot := c.freeSlots[len(c.freeSlots)-1]
		buf := c.sendSlot(slot)
		m := wire.Message{Type: wire.TypeCredit}
		n := len(m.Append(buf[:0]))
		c.putCredits(buf)
		if !c.postCtrlLocked(slot, n, false) {
			c.live.owe = 0
			return
		}
		c.live.owe--
		c.stats.keepalives.Add(1)
		c.log.Debug("rendezvous: keepalive", "peer", c.peer, "interval", c.opts.tickInterval(), "more", c.live.owe)
	}
}
