package onnode

import (
	"fmt"
	"hash/fnv"
	"runtime"
	"time"

	"github.com/gdrlink/gdrlink/internal/adaptspin"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Grants (verbsio.Granter). A grant is an entry of the region table of its
// own: a key, the granted range, remote write only, the queue pair it was
// given to (eQP: a hash of that queue pair's socket name, which its peer
// learned in the hello) and the region it lies in (eParent). The table is
// the receiver's and peers map it read-only, so the sender's provider code
// checks each write against what the receiver granted: a write through a
// grant from another queue pair, outside its range or after it was revoked
// completes with verbsio.StatusRemoteAccess and copies nothing. Once a
// region has given a grant its own entry carries flagGranted and admits no
// remote access through the region's rkey.
//
// This bounds what an honest (possibly buggy or confused) peer writes: a
// peer using MechSHM holds a mapping of the whole region's file, and with
// MechVM the right to process_vm_writev, so a hostile peer bypassing this
// package is not bounded by it (see the package doc).
const (
	eQP     = 48
	eParent = 56

	flagGrant   = 4 // the entry is a grant
	flagGranted = 8 // the region gave grants: no access through its own key
)

// qpToken names a queue pair in grant entries.
func qpToken(name string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(name))
	return h.Sum64() | 1
}

var _ verbsio.Granter = (*memoryRegion)(nil)

// grant is a live grant; its fields after creation are guarded by pd.mu.
type grant struct {
	pd    *pd
	mr    *memoryRegion
	q     *qp
	idx   int
	key   uint32
	imms  int // writes with immediate left; 0: plain writes until Revoke
	count bool
	gone  bool
}

// Grant implements verbsio.Granter.
func (m *memoryRegion) Grant(addr uintptr, length int, to verbsio.QueuePair, imms int) (verbsio.Grant, error) {
	q, ok := to.(*qp)
	if !ok || q.pd != m.pd {
		return nil, fmt.Errorf("%w: onnode: grant to a queue pair of another protection domain", verbsio.ErrBadConfig)
	}
	if length <= 0 || imms < 0 || addr < m.addr || uint64(addr-m.addr)+uint64(length) > uint64(m.length) {
		return nil, fmt.Errorf("%w: onnode: grant of %#x+%d outside region %#x+%d", verbsio.ErrLocalLength, addr, length, m.addr, m.length)
	}
	if m.access&verbsio.AccessLocalWrite == 0 {
		return nil, fmt.Errorf("%w: onnode: grant of a region without local write", verbsio.ErrBadConfig)
	}
	p := m.pd
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || p.slots[m.idx].mr != m {
		return nil, fmt.Errorf("%w: onnode: region %#x", verbsio.ErrClosed, m.key)
	}
	idx := p.freeSlotLocked()
	if idx < 0 {
		return nil, fmt.Errorf("%w: onnode: all %d memory-region slots in use", verbsio.ErrQueueFull, tableSlots)
	}
	s := &p.slots[idx]
	g := &grant{pd: p, mr: m, q: q, idx: idx, key: s.gen<<slotBits | uint32(idx), imms: imms, count: imms > 0}
	s.busy, s.g = true, g
	flags := uint64(flagValid | flagGrant)
	if m.fd >= 0 {
		flags |= flagFile
	}
	p.writeEntryLocked(idx, g.key, verbsio.AccessRemoteWrite, uint64(addr), uint64(length), 0, flags, qpToken(q.name), uint64(m.key))
	if !m.granted {
		m.granted = true
		base := m.idx * entrySize
		seq := load64(p.table, base+eSeq)
		store64(p.table, base+eSeq, seq+1)
		store64(p.table, base+eFlags, load64(p.table, base+eFlags)|flagGranted)
		store64(p.table, base+eSeq, seq+2)
	}
	if m.grants == nil {
		m.grants = map[*grant]struct{}{}
	}
	m.grants[g] = struct{}{}
	p.live++
	return g, nil
}

// RKey implements verbsio.Grant.
func (g *grant) RKey() uint32 { return g.key }

// Revoke implements verbsio.Grant: the entry goes, then the writes the
// peers announced before it did are waited for (bounded, as a region's
// deregistration: a peer still writing then is fenced).
func (g *grant) Revoke() error {
	p := g.pd
	p.mu.Lock()
	if !p.unlinkLocked(g) {
		p.mu.Unlock()
		return nil
	}
	p.mu.Unlock()
	p.drain(g.idx, g.key, "grant")
	p.freeGrantSlot(g)
	return nil
}

// unlinkLocked takes g out of the table; false if it was out already.
func (p *pd) unlinkLocked(g *grant) bool {
	if g.gone {
		return false
	}
	g.gone = true
	base := g.idx * entrySize
	seq := load64(p.table, base+eSeq)
	store64(p.table, base+eSeq, seq+1)
	store64(p.table, base+eFlags, 0)
	store64(p.table, base+eSeq, seq+2)
	p.slots[g.idx].g = nil
	delete(g.mr.grants, g)
	return true
}

func (p *pd) freeGrantSlot(g *grant) {
	p.mu.Lock()
	p.slots[g.idx].busy = false
	p.live--
	p.mu.Unlock()
}

// immArrived counts a write with immediate through rkey that q's peer
// completed; the grant's last one revokes it before the completion is
// delivered. The caller holds q.consMu, so the writes still announced for
// the grant (none, from an honest peer: its copy ended before it published
// the record) are waited for in the background.
func (p *pd) immArrived(q *qp, rkey uint32) {
	p.mu.Lock()
	g := p.slots[rkey&(tableSlots-1)].g
	if g == nil || g.key != rkey || g.q != q || !g.count {
		p.mu.Unlock()
		return
	}
	g.imms--
	if g.imms > 0 || !p.unlinkLocked(g) {
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	if len(p.writersOf(g.idx)) == 0 {
		p.freeGrantSlot(g)
		return
	}
	go func() {
		p.drain(g.idx, g.key, "grant")
		p.freeGrantSlot(g)
	}()
}

// unlinkGrantsLocked unlinks the grants that match (those of a closing
// region or queue pair); the caller frees their slots after a drain.
func (p *pd) unlinkGrantsLocked(match func(*grant) bool) []*grant {
	var out []*grant
	for i := range p.slots {
		if g := p.slots[i].g; g != nil && match(g) && p.unlinkLocked(g) {
			out = append(out, g)
		}
	}
	return out
}

// revokeGrantsOf revokes every grant given to q (the queue pair closes).
func (p *pd) revokeGrantsOf(q *qp) {
	p.mu.Lock()
	gs := p.unlinkGrantsLocked(func(g *grant) bool { return g.q == q })
	p.mu.Unlock()
	for _, g := range gs {
		p.drain(g.idx, g.key, "grant")
		p.freeGrantSlot(g)
	}
}

// drain waits until no peer that can still write has a write announced in
// slot idx, for at most Options.DeregTimeout; the peers still writing then
// are fenced. Nothing signals the end of a peer's write: it polls the
// counters, yielding for the first 20 us (a small write ends in a few),
// then pausing 20 us, doubling up to a millisecond (adaptspin.Pause: a Go
// timer that short would take a millisecond each time).
func (p *pd) drain(idx int, key uint32, what string) {
	start := time.Now()
	deadline := start.Add(p.dev.opts.DeregTimeout)
	pause := 20 * time.Microsecond
	for {
		busy := p.writersOf(idx)
		if len(busy) == 0 {
			return
		}
		if !time.Now().Before(deadline) {
			for _, q := range busy {
				q.fence(fmt.Errorf("%w: onnode peer pid %d: a write it announced into %s %#x did not finish within %s (deregistration)",
					verbsio.ErrPeerLost, q.peerPID, what, key, p.dev.opts.DeregTimeout))
				p.fences.Add(1)
			}
			return
		}
		if time.Since(start) < 20*time.Microsecond {
			runtime.Gosched()
			continue
		}
		adaptspin.Pause(pause)
		pause = min(2*pause, time.Millisecond)
	}
}
