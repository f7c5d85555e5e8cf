package bootstrap

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
)

// Rejoining. A rank whose process died can be replaced by a new process
// while the others run on: the new process joins as any rank does, with
// the job's key; the root, finding the job already joined, asks the rank's
// old contact address which incarnation answers there (tPing). If the old
// process answers, the newcomer is refused: a rank has one live process.
// If nothing answers within probeTimeout (the process is gone, or too
// stopped to prove the key), the root takes the newcomer as the rank's next
// incarnation, sends it the address list (tRejoined), and replaces the old
// control connection. The new process then tells every other rank
// (tNotice, proven with the key and bound to its rank), which update its
// address and incarnation, drop their pairwise connection to the old one,
// tell their OnRejoin, and answer with their own data. From then on a call
// from an older incarnation of the rank is refused. Rank 0 holds the job
// and cannot rejoin.

// RejoinHandler is told that rank restarted as a new process, now
// incarnation inc, and what that process handed this one (its
// Config.RejoinData); what it returns goes back to the new process. It
// runs on the connection's goroutine, bounded by ctx.
type RejoinHandler func(ctx context.Context, rank int, inc uint64, data []byte) ([]byte, error)

// probeTimeout bounds the root's question to a rank's old process: an
// answer within it means the process is alive and keeps its rank.
const probeTimeout = 3 * time.Second

// Rejoined reports whether this process joined in place of a dead process
// of its rank, the job already running.
func (g *Group) Rejoined() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.rejoined
}

// Incarnation is the incarnation of rank r's process as this rank knows
// it: 1 for the job's first processes, one more for each rejoin.
func (g *Group) Incarnation(r int) uint64 { return g.incOf(r) }

// Rejoins counts the rejoins of other ranks this rank has taken in.
func (g *Group) Rejoins() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.rejoins
}

// PeerData is, in a process that rejoined, what each peer answered its
// notice with (by rank; nil for this rank and for a peer that did not
// answer); nil otherwise.
func (g *Group) PeerData() [][]byte {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.peerData
}

func (g *Group) incOf(r int) uint64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	if r < 0 || r >= len(g.incs) {
		return 0
	}
	return g.incs[r]
}

// rejoin decides, at the root, on a hello for a rank of a job that has
// joined. It reports whether it kept c as the rank's control connection.
func (g *Group) rejoin(c net.Conn, h helloBody) bool {
	r := h.rank
	g.mu.Lock()
	if r == 0 || g.rejoining[r] {
		g.mu.Unlock()
		g.turnAway(c, fmt.Sprintf("rank %d: the job of %d ranks has already joined and another process is claiming that rank now", h.rank, g.size))
		return false
	}
	g.rejoining[r] = true
	oldAddr, oldInc := g.addrs[r], g.incs[r]
	g.mu.Unlock()
	defer func() {
		g.mu.Lock()
		delete(g.rejoining, r)
		g.mu.Unlock()
	}()
	if inc, err := g.ping(oldAddr); err == nil && inc == oldInc {
		g.turnAway(c, fmt.Sprintf("rank %d: the job of %d ranks has already joined and rank %d's process (incarnation %d) is alive at %s; a second process may not claim its rank", h.rank, g.size, r, oldInc, oldAddr))
		return false
	}
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return false
	}
	old := g.ranks[r]
	inc := oldInc + 1
	g.ranks[r], g.addrs[r], g.incs[r] = c, h.contact, inc
	g.rejoins++
	g.dropPairLocked(r)
	m := appendMsg(nil, tRejoined, appendAddrs(nil, g.addrs, g.incs))
	g.mu.Unlock()
	if old != nil {
		old.Close()
	}
	c.SetWriteDeadline(time.Now().Add(CallTimeout))
	if _, err := c.Write(m); err != nil {
		return true // the connection is the rank's now; it failed as any may
	}
	c.SetWriteDeadline(time.Time{})
	return true
}

// ping asks the process at addr which incarnation it is.
func (g *Group) ping(addr string) (uint64, error) {
	ctx, cancel := context.WithTimeout(g.ctx, probeTimeout)
	defer cancel()
	c, err := g.dial(ctx, addr)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	if err := g.initiate(ctx, c); err != nil {
		return 0, err
	}
	var m msg
	err = g.io(ctx, c, func(c net.Conn) error {
		if _, err := c.Write(appendMsg(nil, tPing, nil)); err != nil {
			return err
		}
		var err error
		m, err = readMsg(c, 64)
		return err
	})
	if err != nil {
		return 0, err
	}
	if m.typ != tPong || len(m.body) != 8 {
		return 0, fmt.Errorf("%w: answer of type %d to a ping", verbsio.ErrBadFrame, m.typ)
	}
	return binary.BigEndian.Uint64(m.body), nil
}

// dropPairLocked forgets the pairwise connection to rank r (its process
// was replaced).
func (g *Group) dropPairLocked(r int) {
	if p := g.pairs[r]; p != nil {
		if p.c != nil {
			p.c.Close()
		}
		delete(g.pairs, r)
	}
}

// notifyAll, in a process that rejoined, tells every other rank who it is
// now, and keeps what each answers (PeerData). A peer that cannot be told
// (dead too, or unreachable) is logged in the answer's place as nil: it
// learns of this process when it rejoins itself, from this one's answer.
func (g *Group) notifyAll(ctx context.Context) {
	g.mu.Lock()
	body := noticeBody{rank: g.rank, size: g.size, inc: g.inc, contact: g.addrs[g.rank], data: g.rejoinData}.Append(nil)
	addrs := append([]string(nil), g.addrs...)
	g.mu.Unlock()
	out := make([][]byte, g.size)
	var wg sync.WaitGroup
	for r := range addrs {
		if r == g.rank {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			nctx, cancel := context.WithTimeout(ctx, CallTimeout)
			defer cancel()
			if data, err := g.notify(nctx, addrs[r], body); err == nil {
				out[r] = data
			}
		}()
	}
	wg.Wait()
	g.mu.Lock()
	g.peerData = out
	g.mu.Unlock()
}

func (g *Group) notify(ctx context.Context, addr string, body []byte) ([]byte, error) {
	c, err := g.dial(ctx, addr)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	if err := g.initiate(ctx, c); err != nil {
		return nil, err
	}
	var m msg
	err = g.io(ctx, c, func(c net.Conn) error {
		if _, err := c.Write(appendMsg(nil, tNotice, body)); err != nil {
			return err
		}
		var err error
		m, err = readMsg(c, g.max)
		return err
	})
	if err != nil {
		return nil, err
	}
	switch m.typ {
	case tReply:
		return m.body, nil
	case tRefused:
		return nil, fmt.Errorf("%w: %s", ErrRefused, m.body)
	}
	return nil, fmt.Errorf("%w: answer of type %d to a notice", verbsio.ErrBadFrame, m.typ)
}

// onNotice takes a rejoined rank's notice: its new address and incarnation
// replace the old, the pairwise connection to the old process goes, and
// OnRejoin hears of it. A notice from an incarnation older than the one
// known is refused.
func (g *Group) onNotice(c net.Conn, body []byte, bound int) {
	n, err := parseNotice(body)
	if err != nil {
		g.turnAway(c, err.Error())
		return
	}
	if n.size != g.size || n.rank == g.rank || (bound >= 0 && n.rank != bound) {
		g.turnAway(c, fmt.Sprintf("notice from rank %d of %d on a connection proven for rank %d: this is rank %d of %d", n.rank, n.size, bound, g.rank, g.size))
		return
	}
	g.mu.Lock()
	if len(g.incs) != g.size || n.inc < g.incs[n.rank] {
		known := uint64(0)
		if len(g.incs) == g.size {
			known = g.incs[n.rank]
		}
		g.mu.Unlock()
		g.turnAway(c, fmt.Sprintf("notice from incarnation %d of rank %d: this rank knows incarnation %d", n.inc, n.rank, known))
		return
	}
	if n.inc > g.incs[n.rank] || g.rank == 0 {
		if n.inc > g.incs[n.rank] {
			g.rejoins++
		}
		g.addrs[n.rank], g.incs[n.rank] = n.contact, n.inc
		g.dropPairLocked(n.rank)
	}
	g.mu.Unlock()
	var reply []byte
	if g.onRejoin != nil {
		ctx, cancel := context.WithTimeout(g.ctx, CallTimeout)
		reply, err = g.onRejoin(ctx, n.rank, n.inc, n.data)
		cancel()
		if err != nil {
			refuse(c, err.Error())
			return
		}
	}
	c.SetWriteDeadline(time.Now().Add(CallTimeout))
	c.Write(appendMsg(nil, tReply, reply))
}
