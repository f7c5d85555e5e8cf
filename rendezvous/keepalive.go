package rendezvous

import (
	"time"

	"github.com/gdrlink/gdrlink/internal/wire"
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

// pendingLocked reports whether the channel waits on its peer for anything:
// an answer to a request, a request for a Send, the peer's re-request for a
// kept tensor, a write's completion, or queued items.
func (c *Channel) pendingLocked() bool {
	return c.rcv.pendingLocked() || c.snd.pendingLocked() || len(c.outq) > 0
}

// armKeepaliveLocked starts the keepalive timer if work is pending and it is
// not running. The first tick comes one interval from now.
func (c *Channel) armKeepaliveLocked() {
	d := c.opts.keepalive
	if d <= 0 || c.kaArmed || c.state != stateConnected || !c.pendingLocked() {
		return
	}
	c.kaArmed = true
	c.kaSeen = c.arrivals
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
}

// keepaliveTick is the timer's function: a keepalive if the peer was silent
// for the whole interval, then the next tick while work is still pending.
func (c *Channel) keepaliveTick() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.kaArmed {
		return // disarmed after this tick was due
	}
	c.kaArmed = false
	if c.state != stateConnected || !c.pendingLocked() {
		return // idle: armed again when work is pending
	}
	if c.arrivals == c.kaSeen {
		c.probeLocked()
	}
	c.armKeepaliveLocked()
}

// probeLocked posts a keepalive: a CREDIT frame returning whatever credits
// are owed (perhaps none). It follows the credit scheme (see WithKeepalive):
// it needs two credits, or one when it returns credits, and a free send
// slot and send-queue room; short of those it waits for the next tick (sends
// in flight fail by themselves if the peer is gone).
func (c *Channel) probeLocked() {
	if len(c.freeSlots) == 0 || c.sqOut >= c.sqMax {
		return
	}
	if c.credits < 2 && (c.credits < 1 || c.owed == 0) {
		return
	}
	slot := c.freeSlots[len(c.freeSlots)-1]
	buf := c.sendBuf.Bytes()[slot*c.slot : (slot+1)*c.slot]
	m := wire.Message{Type: wire.TypeCredit}
	n := len(m.Append(buf[:0]))
	c.putCredits(buf)
	if c.postCtrlLocked(slot, n, false) {
		c.stats.keepalives.Add(1)
		c.log.Debug("rendezvous: keepalive", "peer", c.peer, "interval", c.opts.keepalive)
	}
}
