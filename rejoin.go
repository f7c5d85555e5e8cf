package gdrlink

import (
	"context"
	"fmt"

	"github.com/gdrlink/gdrlink/internal/hostcard"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Rejoining. A rank whose process died can be started again with the same
// environment (rank, size, root, job key) while the others run on: its
// Join finds the job running and joins in place of the dead process, as
// the rank's next incarnation (bootstrap's rejoin: the root first makes
// sure the old process no longer answers, and refuses a second live
// claimant). The new process tells every other rank, which discards what
// it had with the old one (its connection, queued Sends and pending Recvs
// fail with an error wrapping ErrPeerLost and naming the restart) and
// connects afresh on the next Send or Recv. Nothing of the old process's
// traffic is replayed: the survivors and the new process resume at steps
// the application chooses. Rank 0 holds the job and cannot rejoin.

// Rejoined reports whether this process joined in place of a dead process
// of its rank, the job already running.
func (g *Group) Rejoined() bool { return g.boot.Rejoined() }

// WaitRejoin waits until rank r runs as a process newer than incarnation
// after (a rejoin this rank has taken in: its old peer state is gone) and
// returns r's incarnation. A process that serves a rank which may restart
// calls it after an error wrapping ErrPeerLost, then resumes. ctx bounds
// the wait.
func (g *Group) WaitRejoin(ctx context.Context, r int, after uint64) (uint64, error) {
	if r < 0 || r >= g.Size() || r == g.Rank() {
		return 0, fmt.Errorf("gdrlink: %w: peer rank %d (this is rank %d of %d)", verbsio.ErrBadConfig, r, g.Rank(), g.Size())
	}
	for {
		g.mu.Lock()
		inc := max(g.peerInc[r], 1)
		sig, closed := g.rejoinSig, g.closed
		g.mu.Unlock()
		switch {
		case inc > after:
			return inc, nil
		case closed:
			return 0, fmt.Errorf("gdrlink: rank %d waiting for rank %d to rejoin: %w", g.Rank(), r, ErrClosed)
		}
		select {
		case <-sig:
		case <-ctx.Done():
			return 0, fmt.Errorf("gdrlink: %w: rank %d waiting for rank %d to rejoin after incarnation %d: %w", verbsio.ErrTimeout, g.Rank(), r, after, ctx.Err())
		}
	}
}

// rejoinCards are the host cards of a process that rejoined: each peer
// answered its notice with its own (a peer that did not answer, dead as
// well, is left unknown until it rejoins and tells this one).
func (g *Group) rejoinCards() [][]byte {
	all := g.boot.PeerData()
	all[g.Rank()] = g.me.Append(nil)
	return all
}

// onRejoin is told by the bootstrap that rank restarted as incarnation inc
// and handed this rank its host card: the peer state of the old process
// goes, with an error for whatever waited on it, and this rank's card goes
// back.
func (g *Group) onRejoin(ctx context.Context, rank int, inc uint64, data []byte) ([]byte, error) {
	select {
	case <-g.ready:
	case <-ctx.Done():
		return nil, fmt.Errorf("rank %d is still joining: %w", g.Rank(), ctx.Err())
	}
	card, err := hostcard.Decode(data)
	if err != nil {
		return nil, fmt.Errorf("host card of rank %d: %w", rank, err)
	}
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return nil, fmt.Errorf("gdrlink: rank %d: %w", g.Rank(), ErrClosed)
	}
	g.cards[rank] = card
	old := g.peers[rank]
	delete(g.peers, rank)
	g.rejoins++
	g.mu.Unlock()
	if old != nil {
		old.discard(fmt.Errorf("gdrlink: %w: rank %d restarted as a new process (incarnation %d); what was pending with the old one is lost", verbsio.ErrPeerLost, rank, inc))
	}
	g.mu.Lock()
	g.peerInc[rank] = max(g.peerInc[rank], inc)
	close(g.rejoinSig) // WaitRejoin looks again
	g.rejoinSig = make(chan struct{})
	g.mu.Unlock()
	g.log.Warn("gdrlink: peer rejoined", "rank", g.Rank(), "peer", rank, "incarnation", inc)
	return g.me.Append(nil), nil
}

// discard ends the peer state of a process that was replaced: an attempt
// in progress stops, queued Sends are released, waiting Recvs and later
// users of this state get err (new ones find a fresh peer state), and the
// channel closes.
func (p *peer) discard(err error) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	ch := p.ch
	p.ch = nil
	q := p.queue
	p.queue = nil
	p.err = err
	if !p.isDone() {
		close(p.done)
	}
	if p.attemptCancel != nil {
		p.attemptCancel()
	}
	p.mu.Unlock()
	for _, s := range q {
		_ = s.t.Release()
	}
	if ch != nil {
		_ = ch.Close()
	}
	p.g.dropIPCPeer(p.rank)
}
