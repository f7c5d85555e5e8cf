package tcp

import (
	"fmt"
	"math/rand/v2"
	"net"
	"time"

	"github.com/gdrlink/gdrlink/verbsio"
)

// grantKeyBit is set in every grant's rkey and clear in every region's
// key, so a grant's rkey never names a region, whatever either drew.
const grantKeyBit = 1 << 31

// grant is a peer's right to write one range of a region, through one
// queue pair (verbsio.Granter). Live grants are listed in their protection
// domain by rkey; a write through one is checked in pd.remote.
type grant struct {
	m    *mr
	q    *qp
	rkey uint32
	addr uint64
	n    uint64

	// Guarded by m.mu: imms is how many more writes with immediate the
	// grant admits (0 from the start: plain writes only); revoked ends it.
	imms    int
	revoked bool
}

var _ verbsio.Granter = (*mr)(nil)

// Grant lets the peer of qp write [addr, addr+length) of the region with
// the returned grant's rkey, until imms writes with immediate through it
// have arrived (imms 0: plain writes only) or until Revoke. The rkey is
// drawn at random among those no live grant of the protection domain has.
// From the first grant on, the region's own rkey admits no remote access
// (writes or reads): only grants let a peer in.
func (m *mr) Grant(addr uintptr, length int, to verbsio.QueuePair, imms int) (verbsio.Grant, error) {
	q, ok := to.(*qp)
	switch {
	case !ok || q == nil || q.pd != m.pd:
		return nil, fmt.Errorf("%w: a grant needs a queue pair of the region's tcp protection domain", verbsio.ErrBadConfig)
	case imms < 0:
		return nil, fmt.Errorf("%w: grant for %d writes with immediate", verbsio.ErrBadConfig, imms)
	case length <= 0 || !m.contains(uint64(addr), uint64(length)):
		return nil, fmt.Errorf("%w: grant of [%#x+%d) outside region [%#x+%d)", verbsio.ErrBadAddress, addr, length, m.addr, m.n)
	case m.access&verbsio.AccessLocalWrite == 0:
		return nil, fmt.Errorf("%w: region lkey %#x has access %v; a grant to write it needs %v", verbsio.ErrLocalProtection, m.lkey, m.access, verbsio.AccessLocalWrite)
	}
	g := &grant{m: m, q: q, addr: uint64(addr), n: uint64(length), imms: imms}
	p := m.pd
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.byR[m.rkey] != m {
		return nil, fmt.Errorf("%w: memory region", verbsio.ErrClosed)
	}
	// Under p.mu, so that a queue pair's Close, which drops its grants
	// under p.mu after it left the ready states, cannot miss this one.
	if st := q.State(); st != verbsio.QPInit && st != verbsio.QPReady {
		return nil, fmt.Errorf("%w: grant to a queue pair in state %v", verbsio.ErrQPState, st)
	}
	for {
		k := rand.Uint32() | grantKeyBit
		if _, dup := p.grants[k]; !dup {
			g.rkey = k
			break
		}
	}
	p.grants[g.rkey] = g
	m.mu.Lock()
	m.granted = true
	m.mu.Unlock()
	return g, nil
}

func (g *grant) contains(addr, n uint64) bool {
	return addr >= g.addr && addr+n >= addr && addr+n <= g.addr+g.n
}

// RKey names the grant in the peer's writes.
func (g *grant) RKey() uint32 { return g.rkey }

// Revoke ends the grant: a write through it under way is cut short (its
// writer's work request fails with StatusRemoteAccess), and none starts
// after. Idempotent.
func (g *grant) Revoke() error {
	m := g.m
	m.mu.Lock()
	g.revoked = true
	m.fenceLocked(g)
	m.mu.Unlock()
	m.pd.dropGrant(g)
	return nil
}

// dropGrant takes g out of the domain's table.
func (p *pd) dropGrant(g *grant) {
	p.mu.Lock()
	if p.grants[g.rkey] == g {
		delete(p.grants, g.rkey)
	}
	p.mu.Unlock()
}

// dropGrantsOf takes the grants given to q out of the table, once q is
// closed.
func (p *pd) dropGrantsOf(q *qp) {
	p.mu.Lock()
	for k, g := range p.grants {
		if g.q == q {
			delete(p.grants, k)
		}
	}
	p.mu.Unlock()
}

// transfer is one peer request moving bytes into or out of a region: one
// per lane, reused from request to request. While its bytes move it is
// listed in the region (mr.moving) and no lock is held, so a peer that
// stalls in the middle of a payload holds up nobody: the region's Close,
// or the Revoke of the grant it goes through, cuts it short with a past
// deadline on its connection and waits only for its goroutine to notice.
type transfer struct {
	c      net.Conn
	m      *mr
	g      *grant
	out    bool // the region's bytes go to the peer (a read)
	raw    bool // a polling waiter's: its reads never block, so no deadline wakes them
	fenced bool // cut short: the request fails
}

// pastDeadline wakes a blocked read or write at once.
var pastDeadline = time.Unix(1, 0)

// end takes t off its region's list and reports whether Close or Revoke
// cut it short (the request must then fail). A connection whose read was
// cut short gets its deadline back, so its lane can skip the rest of the
// payload and go on.
func (t *transfer) end() (fenced bool) {
	m := t.m
	m.mu.Lock()
	for i, x := range m.moving {
		if x == t {
			last := len(m.moving) - 1
			m.moving[i], m.moving[last] = m.moving[last], nil
			m.moving = m.moving[:last]
			break
		}
	}
	fenced = t.fenced
	if fenced {
		m.gone.Broadcast()
	}
	m.mu.Unlock()
	t.m, t.g = nil, nil
	if fenced && !t.out && !t.raw {
		t.c.SetReadDeadline(time.Time{})
	}
	return fenced
}

// fenceLocked cuts short the transfers under way in the region (those
// through g, or all when g is nil) and waits until they have ended.
// Callers hold m.mu.
func (m *mr) fenceLocked(g *grant) {
	for {
		waiting := false
		for _, t := range m.moving {
			if g != nil && t.g != g {
				continue
			}
			waiting = true
			if t.fenced {
				continue
			}
			t.fenced = true
			if t.raw {
				continue
			}
			if t.out {
				t.c.SetWriteDeadline(pastDeadline)
			} else {
				t.c.SetReadDeadline(pastDeadline)
			}
		}
		if !waiting {
			return
		}
		m.gone.Wait()
	}
}
