package alloc

import (
	"errors"
	"fmt"
)

// maxCheckErrors bounds the problems Check reports at once.
const maxCheckErrors = 8

// Check walks the pool and returns an error that lists the broken
// invariants ("alloc: pool invariant broken: ..."), or nil. It checks that the chunks of each arena are
// adjacent, linked both ways, cover exactly the arena's aligned range and never
// leave two free neighbours unmerged; that every free chunk sits once in the
// bin of its size, bins are sorted and their bitmap is right; that no chunk
// index is lost; that the address index holds the arenas sorted and
// disjoint; and that the counters add up. It takes the pool's lock and costs
// time linear in the chunks, for tests and debugging.
func (p *Pool) Check() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	bad := func(format string, args ...any) {
		if len(errs) < maxCheckErrors {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	if p.broken != nil {
		bad("%v", p.broken)
	}
	n := int32(len(p.chunks))
	inBin := make([]uint8, n)
	for b := range p.bins {
		list := p.bins[b]
		if (len(list) > 0) != (p.nonEmpty&(1<<b) != 0) {
			bad("bin %d has %d chunks but its bitmap bit is %v", b, len(list), p.nonEmpty&(1<<b) != 0)
		}
		for k, i := range list {
			if i < 0 || i >= n {
				bad("bin %d holds chunk index %d of %d", b, i, n)
				continue
			}
			c := &p.chunks[i]
			if c.state != chunkFree {
				bad("bin %d holds chunk %d in state %d", b, i, c.state)
			}
			if p.binOf(c.size) != b {
				bad("bin %d holds chunk %d of %d bytes (bin %d)", b, i, c.size, p.binOf(c.size))
			}
			if k > 0 && list[k-1] >= 0 && list[k-1] < n && !p.chunkLess(list[k-1], i) {
				bad("bin %d is not sorted at position %d", b, k)
			}
			inBin[i]++
		}
	}
	seen := make([]bool, n)
	var inUse, requested int64
	var live, arenas int
	var reserved int64
	for slot, s := range p.slots {
		if s.a == nil {
			continue
		}
		arenas++
		reserved += int64(s.a.Size())
		if s.lo < s.a.Base() || s.hi > s.a.Base()+uintptr(s.a.Size()) || s.lo%uintptr(p.cfg.align) != 0 {
			bad("%s: chunk range [%#x, %#x) outside the region or unaligned", s.a, s.lo, s.hi)
		}
		addr, prev := s.lo, nilChunk
		for i, steps := s.first, int32(0); i != nilChunk; i, steps = p.chunks[i].next, steps+1 {
			if i < 0 || i >= n || steps > n || seen[i] {
				bad("%s: chunk list broken or cyclic at index %d", s.a, i)
				break
			}
			seen[i] = true
			c := &p.chunks[i]
			switch {
			case c.arena != int32(slot):
				bad("%s: chunk %d names arena slot %d", s.a, i, c.arena)
			case c.prev != prev:
				bad("%s: chunk %d has prev %d, want %d", s.a, i, c.prev, prev)
			case c.addr != addr:
				bad("%s: chunk %d at %#x, want %#x (gap or overlap)", s.a, i, c.addr, addr)
			case c.size <= 0 || c.size%p.cfg.align != 0:
				bad("%s: chunk %d has size %d", s.a, i, c.size)
			}
			switch c.state {
			case chunkFree:
				if inBin[i] != 1 {
					bad("%s: free chunk %d is in %d bins", s.a, i, inBin[i])
				}
				if prev != nilChunk && p.chunks[prev].state == chunkFree {
					bad("%s: free chunks %d and %d are neighbours, not merged", s.a, prev, i)
				}
			case chunkUsed:
				if inBin[i] != 0 {
					bad("%s: used chunk %d is in a bin", s.a, i)
				}
				if c.req <= 0 || c.req > c.size {
					bad("%s: used chunk %d of %d bytes was asked %d", s.a, i, c.size, c.req)
				}
				inUse += int64(c.size)
				requested += int64(c.req)
				live++
			default:
				bad("%s: dead chunk %d in the chunk list", s.a, i)
			}
			addr += uintptr(c.size)
			prev = i
		}
		if addr != s.hi {
			bad("%s: chunks end at %#x, the arena's range at %#x", s.a, addr, s.hi)
		}
	}
	deadCount := 0
	for i := range p.chunks {
		if p.chunks[i].state == chunkDead {
			deadCount++
		} else if !seen[i] {
			bad("chunk %d (state %d) belongs to no arena", i, p.chunks[i].state)
		}
	}
	if deadCount != len(p.dead) {
		bad("%d dead chunks, %d on the dead list", deadCount, len(p.dead))
	}
	for _, i := range p.dead {
		if i < 0 || i >= n || p.chunks[i].state != chunkDead {
			bad("dead list holds chunk %d which is not dead", i)
		}
	}
	idx := *p.index.Load()
	if len(idx) != arenas {
		bad("address index has %d arenas, the pool %d", len(idx), arenas)
	}
	for k, e := range idx {
		if k > 0 && idx[k-1].end > e.base {
			bad("address index: %s and %s overlap or are unsorted", idx[k-1].a, e.a)
		}
		if int(e.slot) >= len(p.slots) || p.slots[e.slot].a != e.a {
			bad("address index: %s is not in slot %d", e.a, e.slot)
		}
	}
	st := p.st
	if st.inUse != inUse || st.requested != requested || st.live != live || st.arenas != arenas || st.reserved != reserved {
		bad("counters say in use %d, requested %d, %d blocks, %d arenas, reserved %d; chunks say %d, %d, %d, %d, %d",
			st.inUse, st.requested, st.live, st.arenas, st.reserved, inUse, requested, live, arenas, reserved)
	}
	if !p.closed && st.allocs-st.frees != uint64(live) {
		bad("%d allocs - %d frees != %d blocks", st.allocs, st.frees, live)
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: pool %q: %w", errCorrupt, p.cfg.name, errors.Join(errs...))
}
