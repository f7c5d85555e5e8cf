package alloc

import (
	"fmt"

	"github.com/dustin/go-humanize"
)

// Stats is a snapshot of a pool's usage.
type Stats struct {
	// Name is the pool's name.
	Name string
	// InUse is the bytes of allocated blocks, each rounded up to the alignment.
	InUse int64
	// Requested is the bytes asked for by the allocated blocks.
	Requested int64
	// PeakInUse is the highest InUse so far.
	PeakInUse int64
	// Reserved is the bytes of all arenas.
	Reserved int64
	// Limit is the cap on Reserved, 0 for none: WithLimit's, or the
	// budget's (WithBudget) when that is lower; a budget is shared, so
	// other pools may hold part of it.
	Limit int64
	// Arenas is the number of arenas now.
	Arenas int
	// Blocks is the number of allocated blocks now.
	Blocks int
	// Allocs and Frees count successful allocations and frees.
	Allocs, Frees uint64
	// ArenasCreated and ArenasReleased count visits and releases of arenas.
	ArenasCreated, ArenasReleased uint64
	// LargestFree is the largest free chunk, in bytes.
	LargestFree int64
	// Fragmentation is 1 - LargestFree/free bytes: 0 when the free memory is
	// one chunk (or there is none), near 1 when it is scattered.
	Fragmentation float64
}

// Stats returns a snapshot of the pool's usage.
func (p *Pool) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := p.st
	s := Stats{
		Name: p.cfg.name, InUse: st.inUse, Requested: st.requested, PeakInUse: st.peak,
		Reserved: st.reserved, Limit: p.limit(), Arenas: st.arenas, Blocks: st.live,
		Allocs: st.allocs, Frees: st.frees, ArenasCreated: st.arenasMade, ArenasReleased: st.arenasFreed,
	}
	s.LargestFree = int64(p.largestFree())
	if free := p.freeBytes(); free > 0 {
		s.Fragmentation = 1 - float64(s.LargestFree)/float64(free)
	}
	return s
}

// freeBytes is the bytes that chunks cover and no block holds.
func (p *Pool) freeBytes() int64 {
	var covered int64
	for _, s := range p.slots {
		if s.a != nil {
			covered += int64(s.hi - s.lo)
		}
	}
	return covered - p.st.inUse
}

// String prints the stats for people, sizes in IEC units.
func (s Stats) String() string {
	lim := "none"
	if s.Limit > 0 {
		lim = humanize.IBytes(uint64(s.Limit))
	}
	return fmt.Sprintf("pool %q: in use %s (peak %s, requested %s) in %d blocks, reserved %s in %d arenas (limit %s), %d allocs, %d frees, largest free %s, fragmentation %.1f%%",
		s.Name, humanize.IBytes(uint64(s.InUse)), humanize.IBytes(uint64(s.PeakInUse)), humanize.IBytes(uint64(s.Requested)),
		s.Blocks, humanize.IBytes(uint64(s.Reserved)), s.Arenas, lim, s.Allocs, s.Frees,
		humanize.IBytes(uint64(s.LargestFree)), 100*s.Fragmentation)
}

// limit is the pool's effective byte limit: its own (WithLimit) or its
// budget's, the lower; 0 for none.
func (p *Pool) limit() int64 {
	l := p.cfg.limit
	if b := p.cfg.budget; b != nil && (l == 0 || b.limit < l) {
		l = b.limit
	}
	return l
}
