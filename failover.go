package gdrlink

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Failover. A connection whose queue pair fails while its peer's process
// lives (a link down on one device, a socket reset, a NIC error) is made
// again: the lower rank connects anew, the provider that failed tried last
// (an ibverbs pair moves to tcp when RDMA is gone; a pair with one provider
// gets a fresh queue pair of it), and the higher rank asks it to (kickMsg
// saying kickReconnect) or accepts its new connection in place of the old.
// Sends not known delivered (queued, parked, or with writes in flight when
// the queue pair failed: given back once the old channel is closed) go to
// the new connection; a Recv pending on the old one is asked again there.
// A write that landed just before the failure may then be sent twice: the
// copy the receiver no longer asks for waits on the sender until Close.
// Each move is logged, counted (Stats.Failovers,
// gdrlink_failovers_total) and visible in Transfer.Provider. When the peer's
// process is gone, the reconnection fails at once (its ports are closed)
// and the error says both why the connection failed and why it could not
// be made again.

// kickReconnect is the payload of a kick that asks the lower rank to
// replace a connection the higher rank lost.
const kickReconnect = "reconnect"

// maxRetired is how many replaced connections a peer remembers.
const maxRetired = 8

// maxFailovers bounds the connections one Recv waits through.
const maxFailovers = 3

// errFailingOver: the connection failed and is being made again (peer.wait
// then waits for it).
var errFailingOver = errors.New("gdrlink: failing over")

// failoverable reports whether err says the connection is lost, not that
// the peer refused, closed, answered with an error, or went silent past the
// peer timeout (a stopped process answers no new connection either, and
// the timeout is the caller's bound on waiting for it).
func failoverable(err error) bool {
	return errors.Is(err, verbsio.ErrPeerLost) && !errors.Is(err, rendezvous.ErrClosed) &&
		!errors.Is(err, rendezvous.ErrRemote) && !errors.Is(err, rendezvous.ErrProtocol) &&
		!errors.Is(err, rendezvous.ErrPeerTimeout)
}

// moveOn reports whether what failed on ch with err goes to the next
// connection: ch was lost, or replaced (its Close ended what it held).
func (p *peer) moveOn(ch *rendezvous.Channel, err error) bool {
	if failoverable(err) {
		return true
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Contains(p.retired, ch) && !p.closed
}

// failover replaces ch, which failed with cause, if it is still the
// peer's connection: the peer waits for a new one (the lower rank makes
// it), and ch is closed, which gives back the Sends it held (sent on the
// new connection).
func (p *peer) failover(ch *rendezvous.Channel, cause error) { p.replace(ch, cause, true) }

// replace is failover; restart says whether to make the next connection
// now (false where the caller is taking the lower rank's new connection
// in: the higher rank then asks for none).
func (p *peer) replace(ch *rendezvous.Channel, cause error, restart bool) {
	g := p.g
	p.mu.Lock()
	if p.closed || p.ch != ch || !p.isDone() {
		p.mu.Unlock()
		return // not the current connection: handled already
	}
	p.ch = nil
	// What its Close ends is sent or asked again. Only the last few are
	// kept: an older one's Close and the callbacks it ran are long over,
	// and a job whose links flap for days must not keep every one.
	p.retired = append(p.retired, ch)
	if len(p.retired) > maxRetired {
		p.retired = slices.Delete(p.retired, 0, len(p.retired)-maxRetired)
	}
	p.failedProv, p.provider = p.provider, ""
	p.done = make(chan struct{})
	p.started = false
	p.failovers++
	p.kickFailover = !p.lower
	// The kick names the connection to replace by the lower rank's hello
	// for it: one that comes after the lower rank replaced it already is
	// stale and changes nothing.
	p.kickFor, p.peerHello = p.peerHello, nil
	prov := p.failedProv
	p.mu.Unlock()
	g.log.Warn("gdrlink: connection lost, making it again", "rank", g.Rank(), "peer", p.rank, "provider", prov, "err", cause)
	g.mu.Lock()
	g.failovers++
	closing := !g.closed
	if closing {
		g.wg.Add(1)
	}
	g.mu.Unlock()
	if closing {
		go func() {
			defer g.wg.Done()
			_ = ch.Close()
		}()
	} else {
		_ = ch.Close()
	}
	if restart {
		p.start()
	}
}

// sendOn sends t on ch; a send the connection's failure drops is sent
// again on the next connection.
func (p *peer) sendOn(ch *rendezvous.Channel, key string, step int64, t *tensor.Tensor) error {
	err := ch.SendFunc(key, step, t, func(err error) { p.sent(ch, key, step, t, err) })
	if err != nil && p.moveOn(ch, err) {
		p.failover(ch, err)
		return p.send(key, step, t)
	}
	return err
}

// sent is a Send's end on ch: delivered (or dropped for a reason a new
// connection would not change) gives t back to the pool; dropped because
// the connection failed sends it again.
func (p *peer) sent(ch *rendezvous.Channel, key string, step int64, t *tensor.Tensor, err error) {
	if err == nil || !p.moveOn(ch, err) {
		_ = t.Release()
		return
	}
	p.failover(ch, err)
	if serr := p.send(key, step, t); serr != nil {
		p.g.log.Warn("gdrlink: send lost with its connection", "rank", p.g.Rank(), "peer", p.rank, "key", key, "step", step, "err", err, "resend", serr)
		_ = t.Release()
	}
}

// recvFailover receives on the peer's connection and, when the connection
// fails under it, on the next one (up to maxFailovers times).
func (p *peer) recvFailover(ctx context.Context, key string, step int64, opts ...rendezvous.RecvOption) (*tensor.Tensor, Transfer, error) {
	var lost error
	for moves := 0; ; moves++ {
		ch, err := p.wait(ctx)
		if errors.Is(err, errFailingOver) {
			continue // replaced between the wake-up and the look
		}
		if err != nil {
			if lost != nil {
				err = fmt.Errorf("%w (after the connection was lost: %w)", err, lost)
			}
			return nil, Transfer{}, err
		}
		t, tr, err := ch.Recv(ctx, key, step, opts...)
		if err == nil || !p.moveOn(ch, err) || moves >= maxFailovers || ctx.Err() != nil {
			return t, tr, err
		}
		lost = err
		p.failover(ch, err)
	}
}
