package onnode

import (
	"fmt"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/verbsio"
)

// The memory-region table that a protection domain publishes to its peers.
// Entry i is 64 bytes at i*entrySize: seq, key|access<<32, addr, len, flags,
// file offset. The write counters are a second file, counter i at i*64, one
// cache line each, one file per queue pair: the peer of a queue pair maps
// its counters read-write (and no other's), and the table read-only; the
// table's memfd is sealed (F_SEAL_FUTURE_WRITE) so that no peer can map it
// otherwise.
const (
	tableSlots   = 16384 // regions and grants: a grant per result buffer in flight
	slotBits     = 14
	entrySize    = 64
	tableBytes   = tableSlots * entrySize
	counterSize  = 64
	counterBytes = tableSlots * counterSize

	eSeq    = 0
	eKey    = 8
	eAddr   = 16
	eLen    = 24
	eFlags  = 32
	eOffset = 40

	flagValid = 1
	flagFile  = 2

	validAccess = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead
)

// entry is a consistent snapshot of a table entry.
type entry struct {
	key    uint32
	access verbsio.Access
	addr   uint64
	length uint64
	flags  uint64
	offset uint64
	qp     uint64 // grants: the qpToken of the queue pair given it
	parent uint64 // grants: the key of the region it lies in
}

// readEntry takes a consistent snapshot of slot i of a table and, when hold is
// true and the snapshot is a valid entry, announces a write in its counter
// (the caller must end it with unhold(held)). ok is false when the slot is
// being rewritten for too long.
func readEntry(table, counters []byte, i int, hold bool) (e entry, held *uint64, ok bool) {
	base := i * entrySize
	for try := 0; try < 1000; try++ {
		s1 := load64(table, base+eSeq)
		if s1&1 != 0 {
			continue
		}
		k := load64(table, base+eKey)
		e = entry{key: uint32(k), access: verbsio.Access(k >> 32), addr: load64(table, base+eAddr),
			length: load64(table, base+eLen), flags: load64(table, base+eFlags), offset: load64(table, base+eOffset),
			qp: load64(table, base+eQP), parent: load64(table, base+eParent)}
		var ctr *uint64
		if hold && e.flags&flagValid != 0 {
			ctr = u64(counters, i*counterSize)
			atomic.AddUint64(ctr, 1)
		}
		if load64(table, base+eSeq) != s1 {
			if ctr != nil {
				atomic.AddUint64(ctr, ^uint64(0))
			}
			continue
		}
		return e, ctr, true
	}
	return entry{}, nil, false
}

// unhold ends the write that readEntry announced on held (nil: none).
func unhold(held *uint64) {
	if held != nil {
		atomic.AddUint64(held, ^uint64(0))
	}
}

type slot struct {
	gen  uint32
	busy bool
	mr   *memoryRegion
	g    *grant // a grant's slot (mr is nil)
}

// pd is a protection domain: its regions and its published table.
type pd struct {
	dev *device

	mu      sync.RWMutex // guards slots and qps; held for reading during local copies
	slots   [tableSlots]slot
	tableFD int
	table   []byte // the table, read-write here
	// qps are the queue pairs whose write counters peers may hold (from
	// setup until release), which deregistration reads.
	qps    map[*qp]struct{}
	live   int // regions and queue pairs
	closed bool
	// fences counts the queue pairs that deregistration fenced.
	fences atomic.Uint64
}

func newPD(d *device) (*pd, error) {
	fd, mem, err := newMemfd("gdrlink-onnode-mrtable", tableBytes, sealsTable)
	if err != nil {
		return nil, fmt.Errorf("%w: onnode: %w", verbsio.ErrNotSupported, err)
	}
	return &pd{dev: d, tableFD: fd, table: mem, qps: map[*qp]struct{}{}}, nil
}

// RegisterMemory implements verbsio.ProtectionDomain. When the memory is a
// shared mapping of a file this process has open (a memfd arena), peers using
// MechSHM write it through that file.
func (p *pd) RegisterMemory(addr uintptr, length int, access verbsio.Access) (verbsio.MemoryRegion, error) {
	return p.register(addr, length, access, -1, 0, true)
}

// registerMemoryFD registers memory that is a MAP_SHARED mapping of fd at
// offset (an alloc memfd region: Region.FD), where RegisterMemory finds the
// file by itself in /proc/self/maps. The descriptor is duplicated; the
// caller keeps its own.
func (p *pd) registerMemoryFD(addr uintptr, length int, access verbsio.Access, fd int, offset int64) (verbsio.MemoryRegion, error) {
	if fd < 0 || offset < 0 {
		return nil, fmt.Errorf("%w: onnode: file descriptor %d offset %d", verbsio.ErrBadConfig, fd, offset)
	}
	return p.register(addr, length, access, fd, offset, false)
}

func (p *pd) register(addr uintptr, length int, access verbsio.Access, fd int, offset int64, detect bool) (verbsio.MemoryRegion, error) {
	if length <= 0 || length > maxMessage*2 {
		return nil, fmt.Errorf("%w: onnode: region length %d", verbsio.ErrLocalLength, length)
	}
	if access&^validAccess != 0 {
		return nil, fmt.Errorf("%w: onnode: access flags %#x", verbsio.ErrBadConfig, uint32(access))
	}
	maps, err := readSelfMaps()
	if err != nil {
		return nil, fmt.Errorf("%w: onnode: %w", verbsio.ErrNotSupported, err)
	}
	ms, err := mappingsCovering(maps, uint64(addr), uint64(length))
	if err != nil {
		return nil, fmt.Errorf("%w: onnode: registering %#x+%d: %w", verbsio.ErrLocalProtection, addr, length, err)
	}
	fileFD, fileOff := -1, uint64(0)
	if fd >= 0 {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return nil, fmt.Errorf("%w: onnode: fstat fd %d: %w", verbsio.ErrBadConfig, fd, err)
		}
		m := ms[0]
		if len(ms) != 1 || !m.Shared() || m.Inode != st.Ino || m.Offset+(uint64(addr)-m.Start) != uint64(offset) {
			return nil, fmt.Errorf("%w: %#x+%d and fd %d offset %d", errNotShared, addr, length, fd, offset)
		}
		if fileFD, err = unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0); err != nil {
			return nil, fmt.Errorf("%w: onnode: dup fd %d: %w", verbsio.ErrNotSupported, fd, err)
		}
		fileOff = uint64(offset)
	} else if detect && len(ms) == 1 && ms[0].Shared() && ms[0].Inode != 0 {
		m := ms[0]
		if fileFD = findFD(unix.Mkdev(m.DevMajor, m.DevMinor), m.Inode); fileFD >= 0 {
			fileOff = m.Offset + (uint64(addr) - m.Start)
		}
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		closeFD(fileFD)
		return nil, fmt.Errorf("%w: protection domain", verbsio.ErrClosed)
	}
	idx := p.freeSlotLocked()
	if idx < 0 {
		closeFD(fileFD)
		return nil, fmt.Errorf("%w: onnode: all %d memory-region slots in use", verbsio.ErrQueueFull, tableSlots)
	}
	s := &p.slots[idx]
	mr := &memoryRegion{pd: p, idx: idx, key: s.gen<<slotBits | uint32(idx), addr: addr, length: length, access: access, fd: fileFD}
	s.busy, s.mr = true, mr
	flags := uint64(flagValid)
	if fileFD >= 0 {
		flags |= flagFile
	}
	p.writeEntryLocked(idx, mr.key, access, uint64(addr), uint64(length), fileOff, flags, 0, 0)
	p.live++
	return mr, nil
}

// freeSlotLocked finds a free table slot and gives it its next key
// generation; -1 when all are in use. The caller holds p.mu.
func (p *pd) freeSlotLocked() int {
	for i := range p.slots {
		s := &p.slots[i]
		if s.busy {
			continue
		}
		s.gen = (s.gen + 1) & (1<<(32-slotBits) - 1)
		if s.gen == 0 {
			s.gen = 1
		}
		return i
	}
	return -1
}

// writeEntryLocked publishes table entry idx (seqlock). The caller holds
// p.mu.
func (p *pd) writeEntryLocked(idx int, key uint32, access verbsio.Access, addr, length, fileOff, flags, qpTok, parent uint64) {
	base := idx * entrySize
	seq := load64(p.table, base+eSeq)
	store64(p.table, base+eSeq, seq+1)
	store64(p.table, base+eKey, uint64(key)|uint64(access)<<32)
	store64(p.table, base+eAddr, addr)
	store64(p.table, base+eLen, length)
	store64(p.table, base+eOffset, fileOff)
	store64(p.table, base+eQP, qpTok)
	store64(p.table, base+eParent, parent)
	store64(p.table, base+eFlags, flags)
	store64(p.table, base+eSeq, seq+2)
}

func closeFD(fd int) {
	if fd >= 0 {
		unix.Close(fd)
	}
}

// lookupLocal finds the region of lkey that holds [addr, addr+n) with the
// needed access. The caller holds p.mu for reading.
func (p *pd) lookupLocal(lkey uint32, addr uintptr, n uint32, need verbsio.Access) (*memoryRegion, verbsio.Status) {
	s := &p.slots[lkey&(tableSlots-1)]
	mr := s.mr
	if mr == nil || mr.key != lkey || addr < mr.addr || uint64(addr-mr.addr)+uint64(n) > uint64(mr.length) || mr.access&need != need {
		return nil, verbsio.StatusLocalProtection
	}
	return mr, verbsio.StatusSuccess
}

// fileOf returns the descriptor of the region with key rkey if it is still
// registered, file-backed and remotely writable (the answer to a peer's
// request); regions peers may only read are read with process_vm_readv, so
// no peer holds a writable file of them.
func (p *pd) fileOf(rkey uint32) int {
	p.mu.RLock()
	defer p.mu.RUnlock()
	mr := p.slots[rkey&(tableSlots-1)].mr
	if mr == nil || mr.key != rkey || (mr.access&verbsio.AccessRemoteWrite == 0 && !mr.granted) {
		return -1
	}
	return mr.fd
}

func (p *pd) deregister(mr *memoryRegion) {
	p.mu.Lock()
	base := mr.idx * entrySize
	seq := load64(p.table, base+eSeq)
	store64(p.table, base+eSeq, seq+1)
	store64(p.table, base+eFlags, 0)
	store64(p.table, base+eSeq, seq+2)
	p.slots[mr.idx].mr = nil // slot stays busy until peers' writes drain
	gs := p.unlinkGrantsLocked(func(g *grant) bool { return g.mr == mr })
	p.mu.Unlock()

	// No write starts once the entries changed; the writes peers announced
	// before they did finish before the region is given back. The counters
	// are the peers' (each writes its own queue pair's), so they are not
	// trusted to come down: the wait is bounded, and a peer whose counter
	// is still up then is fenced (its queue pair failed) before the slot is
	// used again, whatever the counter says.
	for _, g := range gs {
		p.drain(g.idx, g.key, "grant")
		p.freeGrantSlot(g)
	}
	p.drain(mr.idx, mr.key, "region")
	closeFD(mr.fd)

	p.mu.Lock()
	p.slots[mr.idx].busy = false
	p.live--
	p.mu.Unlock()
}

// writersOf returns the queue pairs whose peers may still be writing into
// the region of slot idx: those with a write announced in their counter
// for it, unless their peer is gone (it closed its end: a peer process
// that exits or closes its queue pair has no copy under way) or they were
// fenced already.
func (p *pd) writersOf(idx int) []*qp {
	p.mu.RLock()
	defer p.mu.RUnlock()
	var busy []*qp
	for q := range p.qps {
		if q.fenced.Load() || q.lost.Load() {
			continue
		}
		if atomic.LoadUint64(u64(q.ctrMem, idx*counterSize)) != 0 {
			busy = append(busy, q)
		}
	}
	return busy
}

// addCounters and dropCounters add and remove q's write counters from those
// deregistration reads; q unmaps them only after dropCounters.
func (p *pd) addCounters(q *qp) {
	p.mu.Lock()
	p.qps[q] = struct{}{}
	p.mu.Unlock()
}

func (p *pd) dropCounters(q *qp) {
	p.mu.Lock()
	delete(p.qps, q)
	p.mu.Unlock()
}

func (p *pd) addQP() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("%w: protection domain", verbsio.ErrClosed)
	}
	p.live++
	return nil
}

func (p *pd) dropQP() {
	p.mu.Lock()
	p.live--
	p.mu.Unlock()
}

// RegisterDMABuf implements verbsio.ProtectionDomain: not on this provider.
func (p *pd) RegisterDMABuf(fd int, offset uint64, length int, iova uint64, access verbsio.Access) (verbsio.MemoryRegion, error) {
	return nil, fmt.Errorf("%w: onnode registers host memory only (no dma-buf)", verbsio.ErrNotSupported)
}

// CreateQP implements verbsio.ProtectionDomain.
func (p *pd) CreateQP(cfg verbsio.QPConfig) (verbsio.QueuePair, error) {
	return newQP(p, cfg)
}

// Close implements verbsio.ProtectionDomain.
func (p *pd) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	if p.live > 0 {
		return fmt.Errorf("%w: protection domain has %d live regions or queue pairs", verbsio.ErrBusy, p.live)
	}
	p.closed = true
	unix.Munmap(p.table)
	unix.Close(p.tableFD)
	p.table = nil
	p.dev.dropChild()
	return nil
}

// memoryRegion is a registered range.
type memoryRegion struct {
	pd     *pd
	idx    int
	key    uint32
	addr   uintptr
	length int
	access verbsio.Access
	fd     int
	once   sync.Once
	// granted: the region gave a grant (its own key admits no remote
	// access since); grants are the live ones. Guarded by pd.mu.
	granted bool
	grants  map[*grant]struct{}
}

func (m *memoryRegion) Addr() uintptr          { return m.addr }
func (m *memoryRegion) Len() int               { return m.length }
func (m *memoryRegion) LKey() uint32           { return m.key }
func (m *memoryRegion) RKey() uint32           { return m.key }
func (m *memoryRegion) Access() verbsio.Access { return m.access }

// FileBacked reports whether peers can map the region (MechSHM).
func (m *memoryRegion) FileBacked() bool { return m.fd >= 0 }

// Close deregisters the region; idempotent. It returns once no peer's write
// into the region is in flight, or once the peers that may still be writing
// are fenced, at most Options.DeregTimeout after the call (see the package
// doc).
func (m *memoryRegion) Close() error {
	m.once.Do(func() { m.pd.deregister(m) })
	return nil
}
