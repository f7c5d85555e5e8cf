package alloc

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/dustin/go-humanize"
)

// grow adds an arena that fits rounded bytes: the next size of the doubling
// policy, or an arena of its own for a request above the maximum arena size,
// within the limit. When the source refuses, it tries halving down to the
// request.
//
// It is called with p.mu held and returns with it held, but lets it go while
// the source and the visitors work, so that allocations that fit in the
// existing arenas go on meanwhile. One growth runs at a time: a caller that
// finds one under way waits for it and returns nil, and then looks for a
// chunk again, as every caller of grow does.
func (p *Pool) grow(rounded int) error {
	if p.growing {
		for p.growing {
			p.grown.Wait()
		}
		if p.closed {
			return fmt.Errorf("%w: pool %q closed while growing", ErrClosed, p.cfg.name)
		}
		return nil
	}
	size := p.nextSize
	for size < rounded && size < p.cfg.maxArena {
		size = min(size*2, p.cfg.maxArena)
	}
	size = max(size, rounded)
	room := int64(maxAlloc)
	if lim := p.cfg.limit; lim > 0 {
		if int64(rounded) > lim-p.st.reserved {
			// Arenas with nothing allocated cannot hold the request (take
			// found no chunk), but their bytes count against the limit.
			if err := p.trimLocked(); err != nil {
				return err
			}
		}
		// Only this growth adds arenas, so the room can only get larger
		// while the lock is let go.
		room = lim - p.st.reserved
		if int64(rounded) > room {
			return p.exhausted(rounded, nil)
		}
		size = max(int(min(int64(size), room))&^(p.cfg.align-1), rounded)
	}
	b := p.cfg.budget
	var taken int64
	if b != nil {
		if int64(rounded) > b.room() {
			// This pool's idle arenas may make the room; other pools'
			// are theirs to give back.
			if err := p.trimLocked(); err != nil {
				return err
			}
		}
		room = min(room, b.room())
		if int64(rounded) > room {
			return p.exhausted(rounded, errors.New(b.describe()))
		}
		size = max(int(min(int64(size), room))&^(p.cfg.align-1), rounded)
		if !b.take(int64(size)) {
			return p.exhausted(rounded, errors.New(b.describe()))
		}
		taken = int64(size)
	}
	id := p.nextID
	p.nextID++
	p.growing = true
	p.mu.Unlock()
	a, got, err := p.makeArena(id, size, rounded, room)
	if b != nil {
		// What the budget holds for this growth becomes the arena's size.
		switch {
		case err != nil:
			b.give(taken)
		case int64(a.Size()) < taken:
			b.give(taken - int64(a.Size()))
		case int64(a.Size()) > taken && !b.take(int64(a.Size())-taken):
			b.give(taken)
			err = errors.Join(fmt.Errorf("%w: pool %q: source %s made a region of %d bytes for %d asked, beyond %s", ErrPoolExhausted, p.cfg.name, p.src.Name(), a.Size(), taken, b.describe()), p.dropArena(a))
		}
	}
	p.mu.Lock()
	defer func() {
		p.growing = false
		p.grown.Broadcast()
	}()
	switch {
	case errors.Is(err, errSource):
		return p.exhausted(rounded, err)
	case err != nil:
		return err
	case p.closed:
		if b != nil {
			b.give(int64(a.Size()))
		}
		return fmt.Errorf("%w: pool %q closed while growing: %w", ErrClosed, p.cfg.name, p.dropArena(a))
	}
	if err := p.insertArena(a); err != nil {
		if b != nil {
			b.give(int64(a.Size()))
		}
		return err
	}
	if got > p.nextSize {
		p.nextSize = min(got, p.cfg.maxArena)
	}
	p.nextSize = min(p.nextSize*2, p.cfg.maxArena)
	return nil
}

// errSource marks the failure of every try of the source in makeArena.
var errSource = errors.New("source refused every size")

// makeArena gets a region of size bytes from the source (halving down to
// rounded while the source refuses), checks it and shows it to every
// visitor. It returns the arena and the size asked for it. On failure nothing
// stays registered and the region is freed. It runs without the pool's lock
// and touches nothing of the pool but its configuration and source.
func (p *Pool) makeArena(id, size, rounded int, room int64) (*Arena, int, error) {
	var srcErrs []error
	var r *Region
	for {
		var err error
		if r, err = p.src.Alloc(size); err == nil {
			break
		}
		srcErrs = append(srcErrs, fmt.Errorf("%d bytes: %w", size, err))
		if size == rounded {
			return nil, 0, fmt.Errorf("%w: %w", errSource, errors.Join(srcErrs...))
		}
		size = max(alignUp(size/2, p.cfg.align), rounded)
	}
	if err := p.checkRegion(r, size); err != nil {
		if r != nil {
			err = errors.Join(err, p.src.Free(r))
		}
		return nil, 0, fmt.Errorf("%w: %w", ErrPoolExhausted, err)
	}
	if int64(r.Size) > room {
		err := fmt.Errorf("%w: pool %q: source %s made a region of %d bytes for %d asked, beyond the %d bytes left under the limit",
			ErrPoolExhausted, p.cfg.name, p.src.Name(), r.Size, size, room)
		return nil, 0, errors.Join(err, p.src.Free(r))
	}
	a := &Arena{ID: id, region: r}
	for i, v := range p.cfg.visitors {
		if err := visit(v, a); err != nil {
			var rollback []error
			for j := i - 1; j >= 0; j-- {
				if rerr := unvisit(p.cfg.visitors[j], a); rerr != nil {
					rollback = append(rollback, fmt.Errorf("releasing visitor %q: %w", p.cfg.visitors[j].Name(), rerr))
				}
			}
			if ferr := p.src.Free(r); ferr != nil {
				rollback = append(rollback, fmt.Errorf("freeing region: %w", ferr))
			}
			return nil, 0, fmt.Errorf("%w: visitor %q on %s of pool %q: %w", ErrVisitor, v.Name(), a, p.cfg.name, errors.Join(append([]error{err}, rollback...)...))
		}
	}
	return a, size, nil
}

// insertArena makes a visited arena one free chunk of the pool and
// publishes it. Called with p.mu held.
func (p *Pool) insertArena(a *Arena) error {
	idx, ok := p.newSlot()
	if !ok {
		err := p.dropArena(a)
		return fmt.Errorf("%w: pool %q: no chunk index left: %w", ErrPoolExhausted, p.cfg.name, err)
	}
	r := a.region
	lo := uintptr(alignUp(int(r.Base), p.cfg.align))
	hi := (r.Base + uintptr(r.Size)) &^ uintptr(p.cfg.align-1)
	slot := slices.IndexFunc(p.slots, func(s arenaSlot) bool { return s.a == nil })
	if slot < 0 {
		slot = len(p.slots)
		p.slots = append(p.slots, arenaSlot{})
	}
	p.slots[slot] = arenaSlot{a: a, first: idx, lo: lo, hi: hi}
	p.chunks[idx] = chunk{addr: lo, size: int(hi - lo), prev: nilChunk, next: nilChunk, arena: int32(slot), gen: p.chunks[idx].gen, state: chunkFree}
	p.binInsert(idx)
	p.st.reserved += int64(r.Size)
	p.st.arenas++
	p.st.arenasMade++
	p.publish()
	return nil
}

// exhausted describes why the pool cannot serve rounded more bytes.
func (p *Pool) exhausted(rounded int, cause error) error {
	lim := "none"
	if p.cfg.limit > 0 {
		lim = humanize.IBytes(uint64(p.cfg.limit))
	}
	msg := fmt.Sprintf("pool %q: requested %s (%d bytes), in use %s, reserved %s, limit %s, %d arenas; bins: %s",
		p.cfg.name, humanize.IBytes(uint64(rounded)), rounded, humanize.IBytes(uint64(p.st.inUse)),
		humanize.IBytes(uint64(p.st.reserved)), lim, p.st.arenas, p.binSummary())
	if cause != nil {
		return fmt.Errorf("%w: %s: source %s: %w", ErrPoolExhausted, msg, p.src.Name(), cause)
	}
	return fmt.Errorf("%w: %s", ErrPoolExhausted, msg)
}

// binSummary lists the non-empty bins: their chunks, bytes and largest chunk.
func (p *Pool) binSummary() string {
	var sb strings.Builder
	for b := range p.bins {
		list := p.bins[b]
		if len(list) == 0 {
			continue
		}
		total := 0
		for _, i := range list {
			total += p.chunks[i].size
		}
		if sb.Len() > 0 {
			sb.WriteString(", ")
		}
		fmt.Fprintf(&sb, "[up to %s: %d free, %s, largest %s]", humanize.IBytes(uint64(p.cfg.align)<<b), len(list),
			humanize.IBytes(uint64(total)), humanize.IBytes(uint64(p.chunks[list[len(list)-1]].size)))
	}
	if sb.Len() == 0 {
		return "all empty"
	}
	return sb.String()
}

// checkRegion refuses a region that could corrupt the pool.
func (p *Pool) checkRegion(r *Region, asked int) error {
	switch {
	case r == nil:
		return fmt.Errorf("%w: source %s returned no region", errBadRegion, p.src.Name())
	case r.Base == 0 || r.Size < asked || r.Base+uintptr(r.Size) < r.Base:
		return fmt.Errorf("%w: source %s returned [%#x+%d] for %d bytes", errBadRegion, p.src.Name(), r.Base, r.Size, asked)
	}
	lo := uintptr(alignUp(int(r.Base), p.cfg.align))
	if hi := (r.Base + uintptr(r.Size)) &^ uintptr(p.cfg.align-1); hi <= lo || int(hi-lo) < min(asked, p.cfg.align) {
		return fmt.Errorf("%w: region [%#x+%d] holds no aligned block", errBadRegion, r.Base, r.Size)
	}
	for _, e := range *p.index.Load() {
		if r.Base < e.end && e.base < r.Base+uintptr(r.Size) {
			return fmt.Errorf("%w: region [%#x+%d] overlaps %s", errBadRegion, r.Base, r.Size, e.a)
		}
	}
	return nil
}

// releaseArena unpublishes the arena of slot, releases it through the
// visitors in reverse order and frees its region. Its chunks must be gone
// from the bins already.
func (p *Pool) releaseArena(slot int32) error {
	s := p.slots[slot]
	for i := s.first; i != nilChunk; {
		next := p.chunks[i].next
		p.retire(i)
		i = next
	}
	p.slots[slot] = arenaSlot{}
	p.st.reserved -= int64(s.a.Size())
	if b := p.cfg.budget; b != nil {
		b.give(int64(s.a.Size()))
	}
	p.st.arenas--
	p.st.arenasFreed++
	p.publish()
	return p.dropArena(s.a)
}

// dropArena releases a visited arena through the visitors in reverse order
// and frees its region.
func (p *Pool) dropArena(a *Arena) error {
	var errs []error
	for j := len(p.cfg.visitors) - 1; j >= 0; j-- {
		v := p.cfg.visitors[j]
		if err := unvisit(v, a); err != nil {
			errs = append(errs, fmt.Errorf("%w: visitor %q releasing %s of pool %q: %w", ErrVisitor, v.Name(), a, p.cfg.name, err))
		}
	}
	if err := p.src.Free(a.region); err != nil {
		errs = append(errs, fmt.Errorf("pool %q: freeing %s: %w", p.cfg.name, a, err))
	}
	return errors.Join(errs...)
}

// publish rebuilds the address index that ArenaOf reads without the lock.
func (p *Pool) publish() {
	idx := make([]sortedArena, 0, p.st.arenas)
	for i, s := range p.slots {
		if s.a != nil {
			idx = append(idx, sortedArena{base: s.a.Base(), end: s.a.Base() + uintptr(s.a.Size()), a: s.a, slot: int32(i)})
		}
	}
	slices.SortFunc(idx, func(a, b sortedArena) int {
		switch {
		case a.base < b.base:
			return -1
		case a.base > b.base:
			return 1
		}
		return 0
	})
	p.index.Store(&idx)
}

// visit and unvisit call a visitor, turning a panic into an error so that the
// pool's lock and bookkeeping survive a broken visitor.
func visit(v Visitor, a *Arena) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic in Visit: %v", r)
		}
	}()
	return v.Visit(a)
}

func unvisit(v Visitor, a *Arena) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic in Release: %v", r)
		}
	}()
	return v.Release(a)
}
