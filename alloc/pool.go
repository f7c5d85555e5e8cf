package alloc

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/dustin/go-humanize"
	"github.com/gdrlink/gdrlink/tensor"
)

const (
	// nilChunk marks the absence of a neighbour.
	nilChunk int32 = -1
	// numBins is the number of size classes: bin b holds free chunks of
	// (2^(b-1), 2^b] alignment units, the last bin everything larger.
	numBins = 48
	// maxAlloc bounds a single request so that rounding never overflows.
	maxAlloc = math.MaxInt64 >> 2
)

type chunkState uint8

const (
	chunkDead chunkState = iota // slot unused, on the dead list
	chunkFree                   // in a bin
	chunkUsed                   // handed out as a Block
)

// chunk is a piece of one arena. Chunks of an arena form a doubly linked list
// in address order through prev and next, which are indices into Pool.chunks.
type chunk struct {
	addr  uintptr
	size  int // bytes, a multiple of the alignment
	req   int // bytes requested, 0 unless used
	prev  int32
	next  int32
	arena int32 // index into Pool.slots
	gen   uint32
	state chunkState
}

// arenaSlot is the pool's bookkeeping of one arena.
type arenaSlot struct {
	a      *Arena
	first  int32   // lowest chunk; never merged away
	lo, hi uintptr // the aligned part of the region that chunks cover
}

// sortedArena is an entry of the lock-free address index.
type sortedArena struct {
	base, end uintptr
	a         *Arena
	slot      int32
}

// Pool is a BFC pool over arenas from one Source. It is safe for concurrent
// use. A new arena is made and visited without the pool's lock: allocations
// that fit in the existing arenas go on meanwhile, those that need a new
// arena wait for it. Visitors therefore must not allocate from the pool they
// visit. Releases (trimming free arenas, Close) call the visitors with the
// lock held.
type Pool struct {
	cfg   config
	src   Source
	dev   tensor.Device
	shift uint // log2(alignment)

	mu       sync.Mutex
	grown    *sync.Cond // signalled on p.mu when a growth ends
	growing  bool       // a growth runs with p.mu let go
	closed   bool
	broken   error // set when an internal invariant was found broken
	chunks   []chunk
	dead     []int32
	bins     [numBins][]int32 // free chunks by (size, addr)
	nonEmpty uint64           // bit b set when bins[b] is not empty
	slots    []arenaSlot
	nextID   int
	nextSize int
	st       counters

	index      atomic.Pointer[[]sortedArena] // arenas by base, copy on write
	closedFlag atomic.Bool
}

type counters struct {
	inUse, requested, peak, reserved int64
	live                             int
	arenas                           int
	allocs, frees                    uint64
	arenasMade, arenasFreed          uint64
}

// New builds a pool over src. No memory is taken from src until the first
// allocation.
func New(src Source, opts ...Option) (*Pool, error) {
	if src == nil {
		return nil, fmt.Errorf("%w: nil source", ErrBadOption)
	}
	cfg := config{name: src.Name(), align: defaultAlignment, initArena: defaultInitialArena, maxArena: defaultMaxArena}
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(&cfg); err != nil {
			return nil, err
		}
	}
	if cfg.maxArena < cfg.initArena && !cfg.initSet {
		cfg.initArena = cfg.maxArena
	}
	if cfg.maxArena < cfg.initArena {
		return nil, fmt.Errorf("%w: maximum arena %d below initial arena %d", ErrBadOption, cfg.maxArena, cfg.initArena)
	}
	cfg.initArena = alignUp(cfg.initArena, cfg.align)
	cfg.maxArena = alignUp(cfg.maxArena, cfg.align)
	p := &Pool{
		cfg:      cfg,
		src:      src,
		dev:      src.Device(),
		shift:    uint(bits.TrailingZeros(uint(cfg.align))),
		nextSize: cfg.initArena,
	}
	p.grown = sync.NewCond(&p.mu)
	p.index.Store(&[]sortedArena{})
	return p, nil
}

// Name is the pool's name (WithName, or the source's name).
func (p *Pool) name() string { return p.cfg.name }

// Device is where the pool's memory lives.
func (p *Pool) Device() tensor.Device { return p.dev }

// Alignment is the alignment of every block.
func (p *Pool) alignment() int { return p.cfg.align }

func alignUp(n, align int) int { return (n + align - 1) &^ (align - 1) }

// Alloc returns a block of at least n bytes, aligned to the pool's alignment,
// from an arena that every visitor has visited.
func (p *Pool) Alloc(n int) (Block, error) {
	if n <= 0 || n > maxAlloc {
		return Block{}, fmt.Errorf("%w: cannot allocate %d bytes", ErrBadSize, n)
	}
	rounded := alignUp(n, p.cfg.align)
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return Block{}, fmt.Errorf("%w: pool %q: alloc of %d bytes", ErrClosed, p.cfg.name, n)
	}
	idx := p.take(rounded)
	for idx == nilChunk {
		// Another goroutine may take the new arena's room first: look again.
		if err := p.grow(rounded); err != nil {
			p.mu.Unlock()
			return Block{}, err
		}
		idx = p.take(rounded)
	}
	c := &p.chunks[idx]
	c.state = chunkUsed
	c.req = n
	c.gen++
	st := &p.st
	st.inUse += int64(c.size)
	st.requested += int64(n)
	st.peak = max(st.peak, st.inUse)
	st.live++
	st.allocs++
	b := Block{pool: p, addr: c.addr, size: n, idx: idx, gen: c.gen}
	p.mu.Unlock()
	return b, nil
}

// free returns a block to the pool. A block freed twice, or a stale copy of
// a block whose memory was freed and handed out again, fails with
// ErrDoubleFree and frees nothing; a block of another pool fails with
// ErrNotOwned.
func (p *Pool) free(b Block) error {
	if b.pool != p {
		return fmt.Errorf("%w: block at %#x (%d bytes) is not from pool %q", ErrNotOwned, b.addr, b.size, p.cfg.name)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return fmt.Errorf("%w: pool %q: free of block at %#x", ErrClosed, p.cfg.name, b.addr)
	}
	if b.idx >= 0 && int(b.idx) < len(p.chunks) {
		if c := &p.chunks[b.idx]; c.state == chunkUsed && c.gen == b.gen && c.addr == b.addr {
			p.release(b.idx)
			p.mu.Unlock()
			return nil
		}
	}
	p.mu.Unlock()
	// Only Alloc makes a Block of this pool, so a mismatch is a stale one.
	return fmt.Errorf("%w: block at %#x (%d bytes) of pool %q", ErrDoubleFree, b.addr, b.size, p.cfg.name)
}

// freeAddr frees the block that starts at addr. It walks the chunks of the
// arena holding addr, so it costs time linear in that arena's chunks; free
// finds the chunk from the Block's index without a search.
func (p *Pool) freeAddr(addr uintptr) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("%w: pool %q: free of address %#x", ErrClosed, p.cfg.name, addr)
	}
	e, ok := p.lookup(addr)
	if !ok {
		return fmt.Errorf("%w: address %#x is outside the arenas of pool %q", ErrNotOwned, addr, p.cfg.name)
	}
	for i, steps := p.slots[e.slot].first, 0; i != nilChunk && steps <= len(p.chunks); i, steps = p.chunks[i].next, steps+1 {
		c := &p.chunks[i]
		if addr >= c.addr+uintptr(c.size) {
			continue
		}
		switch {
		case addr != c.addr:
			return fmt.Errorf("%w: address %#x is inside the chunk at %#x (%d bytes) of pool %q, not at its start", ErrNotOwned, addr, c.addr, c.size, p.cfg.name)
		case c.state != chunkUsed:
			return fmt.Errorf("%w: address %#x of pool %q", ErrDoubleFree, addr, p.cfg.name)
		}
		p.release(i)
		return nil
	}
	return fmt.Errorf("%w: address %#x is in the unaligned tail of %s of pool %q", ErrNotOwned, addr, e.a, p.cfg.name)
}

// ArenaOf returns the arena holding addr, by binary search over the arenas
// sorted by base. It never takes the pool's lock.
func (p *Pool) ArenaOf(addr uintptr) (*Arena, bool) {
	e, ok := p.lookup(addr)
	return e.a, ok
}

func (p *Pool) lookup(addr uintptr) (sortedArena, bool) {
	idx := *p.index.Load()
	i := sort.Search(len(idx), func(i int) bool { return idx[i].base > addr }) - 1
	if i < 0 || addr >= idx[i].end {
		return sortedArena{}, false
	}
	return idx[i], true
}

// Arenas returns the pool's arenas sorted by base address.
func (p *Pool) arenas() []*Arena {
	idx := *p.index.Load()
	out := make([]*Arena, len(idx))
	for i, e := range idx {
		out[i] = e.a
	}
	return out
}

// NewTensor allocates a tensor of meta's type and shape. Dead and empty
// tensors get no buffer; String tensors cannot live in a pool.
func (p *Pool) NewTensor(m tensor.Meta) (*tensor.Tensor, error) {
	if p.closedFlag.Load() {
		return nil, fmt.Errorf("%w: pool %q: new tensor %s", ErrClosed, p.cfg.name, m)
	}
	if err := m.Validate(); err != nil {
		return nil, err
	}
	if m.IsDead || m.ByteSize == 0 || !m.DType.DMAable() {
		return tensor.New(m, nil)
	}
	if m.ByteSize > maxAlloc {
		return nil, fmt.Errorf("%w: tensor %s", ErrBadSize, m)
	}
	b, err := p.Alloc(int(m.ByteSize))
	if err != nil {
		return nil, err
	}
	t, err := tensor.New(m, b)
	if err != nil {
		return nil, errors.Join(err, b.Free())
	}
	return t, nil
}

// reserve makes sure the pool has a free chunk of at least n bytes, adding
// an arena (visited like any other) when it has none, so that the cost of
// visiting (registering, locking) is paid now rather than by the first
// allocation that needs it.
func (p *Pool) reserve(n int) error {
	if n <= 0 || n > maxAlloc {
		return fmt.Errorf("%w: cannot reserve %d bytes", ErrBadSize, n)
	}
	rounded := alignUp(n, p.cfg.align)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("%w: pool %q: reserve of %d bytes", ErrClosed, p.cfg.name, n)
	}
	for p.largestFree() < rounded {
		if err := p.grow(rounded); err != nil {
			return err
		}
	}
	return nil
}

// largestFree is the size of the largest free chunk, 0 for none.
func (p *Pool) largestFree() int {
	if p.nonEmpty == 0 {
		return 0
	}
	top := p.bins[63-bits.LeadingZeros64(p.nonEmpty)]
	return p.chunks[top[len(top)-1]].size
}

// trim releases the arenas that hold no allocated block, through the
// visitors, and returns their memory to the source.
func (p *Pool) trim() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("%w: pool %q: trim", ErrClosed, p.cfg.name)
	}
	return p.trimLocked()
}

func (p *Pool) trimLocked() error {
	var errs []error
	for slot := range p.slots {
		s := &p.slots[slot]
		if s.a == nil {
			continue
		}
		if c := &p.chunks[s.first]; c.state == chunkFree && c.next == nilChunk {
			p.binRemove(s.first)
			errs = append(errs, p.releaseArena(int32(slot)))
		}
	}
	return errors.Join(errs...)
}

// Close releases every arena through the visitors, in the reverse order of
// their creation, and returns the memory to the source. Blocks still
// allocated are reported in an error wrapping ErrLeaked; their memory is
// released too and must not be used any more. Close is idempotent; any other
// use of a closed pool fails with ErrClosed. Close does not close the source.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	p.closedFlag.Store(true)
	for p.growing { // the growth drops its arena when it sees the pool closed
		p.grown.Wait()
	}
	var errs []error
	if p.st.live > 0 {
		errs = append(errs, p.leakError())
	}
	order := make([]int32, 0, len(p.slots))
	for i, s := range p.slots {
		if s.a != nil {
			order = append(order, int32(i))
		}
	}
	slices.SortFunc(order, func(a, b int32) int { return cmp.Compare(p.slots[b].a.ID, p.slots[a].a.ID) })
	for _, slot := range order {
		errs = append(errs, p.releaseArena(slot))
	}
	p.chunks, p.dead, p.slots = nil, nil, nil
	p.bins = [numBins][]int32{}
	p.nonEmpty = 0
	p.st.inUse, p.st.requested, p.st.live = 0, 0, 0
	return errors.Join(errs...)
}

func (p *Pool) leakError() error {
	var first []string
	for i := range p.chunks {
		if c := &p.chunks[i]; c.state == chunkUsed && len(first) < 3 {
			first = append(first, fmt.Sprintf("%#x+%d", c.addr, c.req))
		}
	}
	return fmt.Errorf("%w: pool %q: %d blocks of %s (%d bytes) still allocated at Close (first %v)",
		ErrLeaked, p.cfg.name, p.st.live, humanize.IBytes(uint64(p.st.requested)), p.st.requested, first)
}

// take finds the smallest free chunk of at least rounded bytes (the lowest
// address among equals), takes it out of its bin and splits off the rest.
func (p *Pool) take(rounded int) int32 {
	b := p.binOf(rounded)
	mask := p.nonEmpty >> b << b
	for mask != 0 {
		bi := bits.TrailingZeros64(mask)
		list := p.bins[bi]
		pos := 0
		if bi == b {
			pos = p.firstFit(list, rounded)
		}
		if pos < len(list) {
			idx := list[pos]
			if r := p.split(idx, rounded); r != nilChunk {
				// The rest takes the chunk's place in the bin.
				p.binReplace(bi, pos, r)
			} else {
				p.binRemoveAt(bi, pos)
			}
			return idx
		}
		mask &^= 1 << bi
	}
	return nilChunk
}

// split cuts chunk idx to rounded bytes and returns the rest, a new free
// chunk in no bin yet, or nilChunk when nothing is left to split off.
func (p *Pool) split(idx int32, rounded int) int32 {
	if p.chunks[idx].size-rounded < p.cfg.align {
		return nilChunk
	}
	r, ok := p.newSlot()
	if !ok {
		return nilChunk // no index left: hand out the whole chunk
	}
	c := &p.chunks[idx]
	p.chunks[r] = chunk{
		addr:  c.addr + uintptr(rounded),
		size:  c.size - rounded,
		prev:  idx,
		next:  c.next,
		arena: c.arena,
		gen:   p.chunks[r].gen,
		state: chunkFree,
	}
	if c.next != nilChunk {
		p.chunks[c.next].prev = r
	}
	c.next = r
	c.size = rounded
	return r
}

// release frees chunk idx and merges it with free neighbours. A merged chunk
// takes its neighbour's place in the bins when it stays in the same bin.
func (p *Pool) release(idx int32) {
	c := &p.chunks[idx]
	st := &p.st
	st.inUse -= int64(c.size)
	st.requested -= int64(c.req)
	st.live--
	st.frees++
	c.state = chunkFree
	c.req = 0
	c.gen++
	binned := false
	if nx := c.next; nx != nilChunk && p.chunks[nx].state == chunkFree {
		b, pos := p.binFind(nx)
		p.absorbNext(idx)
		binned = p.binReplace(b, pos, idx)
	}
	if pv := p.chunks[idx].prev; pv != nilChunk && p.chunks[pv].state == chunkFree {
		if binned {
			p.binRemove(idx)
		}
		b, pos := p.binFind(pv)
		p.absorbNext(pv)
		binned = p.binReplace(b, pos, pv)
		idx = pv
	}
	if !binned {
		p.binInsert(idx)
	}
}

// absorbNext merges the chunk after a into a and retires its slot.
func (p *Pool) absorbNext(a int32) {
	n := p.chunks[a].next
	nn := p.chunks[n].next
	p.chunks[a].size += p.chunks[n].size
	p.chunks[a].next = nn
	if nn != nilChunk {
		p.chunks[nn].prev = a
	}
	p.retire(n)
}

func (p *Pool) retire(i int32) {
	p.chunks[i] = chunk{prev: nilChunk, next: nilChunk, arena: -1, gen: p.chunks[i].gen + 1, state: chunkDead}
	p.dead = append(p.dead, i)
}

// newSlot returns an unused chunk index; false when all 2^31 are taken.
func (p *Pool) newSlot() (int32, bool) {
	if n := len(p.dead); n > 0 {
		i := p.dead[n-1]
		p.dead = p.dead[:n-1]
		return i, true
	}
	if len(p.chunks) >= math.MaxInt32 {
		return nilChunk, false
	}
	p.chunks = append(p.chunks, chunk{prev: nilChunk, next: nilChunk, arena: -1})
	return int32(len(p.chunks) - 1), true
}

// binOf is the bin of a chunk of size bytes (at least one unit). Bins are
// closed above, (2^(b-1), 2^b] units, so that an arena of a power-of-two
// size and what is left of it after small splits share a bin: the rest then
// keeps its place in the bin instead of moving to another one.
func (p *Pool) binOf(size int) int {
	return min(bits.Len((uint(size)>>p.shift)-1), numBins-1)
}

// chunkLess orders chunks by size, then address.
func (p *Pool) chunkLess(i, j int32) bool {
	a, b := &p.chunks[i], &p.chunks[j]
	return a.size < b.size || a.size == b.size && a.addr < b.addr
}

// firstFit is the position of the first chunk of list with at least size bytes.
func (p *Pool) firstFit(list []int32, size int) int {
	lo, hi := 0, len(list)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if p.chunks[list[m]].size < size {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo
}

// position is where idx is, or would be, in list.
func (p *Pool) position(list []int32, idx int32) int {
	lo, hi := 0, len(list)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if p.chunkLess(list[m], idx) {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo
}

func (p *Pool) binInsert(idx int32) {
	b := p.binOf(p.chunks[idx].size)
	list := p.bins[b]
	p.bins[b] = slices.Insert(list, p.position(list, idx), idx)
	p.nonEmpty |= 1 << b
}

func (p *Pool) binRemove(idx int32) {
	if b, pos := p.binFind(idx); pos >= 0 {
		p.binRemoveAt(b, pos)
	}
}

// binFind locates free chunk idx in its bin; pos is -1 (and the pool marked
// broken) when it is missing.
func (p *Pool) binFind(idx int32) (b, pos int) {
	b = p.binOf(p.chunks[idx].size)
	list := p.bins[b]
	pos = p.position(list, idx)
	if pos >= len(list) || list[pos] != idx {
		if pos = slices.Index(list, idx); pos < 0 {
			p.broken = fmt.Errorf("%w: pool %q: free chunk %d missing from bin %d", errCorrupt, p.cfg.name, idx, b)
		}
	}
	return b, pos
}

// binReplace puts free chunk idx where bins[b][pos] was, when idx belongs to
// bin b, and moves it to its sorted place; otherwise it removes the old entry
// and inserts idx in its own bin. It reports whether idx is binned, false only
// when pos is -1.
func (p *Pool) binReplace(b, pos int, idx int32) bool {
	if pos < 0 {
		return false
	}
	if p.binOf(p.chunks[idx].size) != b {
		p.binRemoveAt(b, pos)
		p.binInsert(idx)
		return true
	}
	list := p.bins[b]
	list[pos] = idx
	for ; pos > 0 && p.chunkLess(idx, list[pos-1]); pos-- {
		list[pos], list[pos-1] = list[pos-1], idx
	}
	for ; pos+1 < len(list) && p.chunkLess(list[pos+1], idx); pos++ {
		list[pos], list[pos+1] = list[pos+1], idx
	}
	return true
}

func (p *Pool) binRemoveAt(b, pos int) {
	p.bins[b] = slices.Delete(p.bins[b], pos, pos+1)
	if len(p.bins[b]) == 0 {
		p.nonEmpty &^= 1 << b
	}
}
