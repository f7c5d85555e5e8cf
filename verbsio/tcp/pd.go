package tcp

import (
	"fmt"
	"sync"

	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// pd is a protection domain: the regions and queue pairs that may use them.
type pd struct {
	dev *device

	mu     sync.RWMutex
	closed bool
	byR    map[uint32]*mr
	byL    map[uint32]*mr
	qps    map[*qp]struct{}
	// grants are the live grants of the domain's regions, by rkey
	// (grant.go).
	grants map[uint32]*grant
}

const knownAccess = verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite | verbsio.AccessRemoteRead

// RegisterMemory registers [addr, addr+length). The kernel is asked
// (mincore) that the whole range is mapped.
func (p *pd) RegisterMemory(addr uintptr, length int, access verbsio.Access) (verbsio.MemoryRegion, error) {
	if access&^knownAccess != 0 {
		return nil, fmt.Errorf("%w: unknown access bits %#x", verbsio.ErrNotSupported, uint32(access&^knownAccess))
	}
	if length > maxPayload*4 {
		return nil, fmt.Errorf("%w: %d bytes exceed the tcp provider's limit", verbsio.ErrBadAddress, length)
	}
	if err := checkMapped(addr, length); err != nil {
		return nil, err
	}
	p.dev.mu.Lock()
	if p.dev.closed {
		p.dev.mu.Unlock()
		return nil, fmt.Errorf("%w: tcp device", verbsio.ErrClosed)
	}
	m := &mr{pd: p, addr: addr, n: length, access: access, lkey: p.dev.newKey(), rkey: p.dev.newKey()}
	m.gone.L = &m.mu
	p.dev.mu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.dev.dropKeys(m)
		return nil, fmt.Errorf("%w: protection domain", verbsio.ErrClosed)
	}
	p.byR[m.rkey] = m
	p.byL[m.lkey] = m
	return m, nil
}

// RegisterDMABuf is not supported: the tcp provider moves host memory only.
func (p *pd) RegisterDMABuf(fd int, offset uint64, length int, iova uint64, access verbsio.Access) (verbsio.MemoryRegion, error) {
	return nil, fmt.Errorf("%w: tcp provider cannot register dma-buf (GPU) memory; stage it through host memory", verbsio.ErrNotSupported)
}

// CreateQP makes a queue pair.
func (p *pd) CreateQP(cfg verbsio.QPConfig) (verbsio.QueuePair, error) {
	return newQP(p, cfg)
}

// Close releases the domain; ErrBusy while regions or queue pairs live.
func (p *pd) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	if len(p.byR) > 0 || len(p.qps) > 0 {
		n, m := len(p.byR), len(p.qps)
		p.mu.Unlock()
		return fmt.Errorf("%w: protection domain has %d memory regions and %d queue pairs open", verbsio.ErrBusy, n, m)
	}
	p.closed = true
	p.mu.Unlock()
	p.dev.mu.Lock()
	delete(p.dev.pds, p)
	p.dev.mu.Unlock()
	return nil
}

// local resolves an SGE against the domain's regions: the key must name a
// region of this domain holding the range, with need among its access.
func (p *pd) local(s verbsio.SGE, need verbsio.Access) ([]byte, error) {
	p.mu.RLock()
	m := p.byL[s.LKey]
	p.mu.RUnlock()
	if m == nil {
		return nil, fmt.Errorf("%w: lkey %#x is not a region of this protection domain", verbsio.ErrLocalProtection, s.LKey)
	}
	if !m.contains(uint64(s.Addr), uint64(s.Length)) {
		return nil, fmt.Errorf("%w: [%#x+%d) outside region lkey %#x [%#x+%d)", verbsio.ErrLocalProtection, s.Addr, s.Length, s.LKey, m.addr, m.n)
	}
	if m.access&need != need {
		return nil, fmt.Errorf("%w: region lkey %#x has access %v, need %v", verbsio.ErrLocalProtection, s.LKey, m.access, need)
	}
	return offheap.Bytes(s.Addr, int(s.Length)), nil
}

// remote resolves a peer's request f, which arrived on a lane of q, and
// starts t on the region it names: on success it returns the bytes to move,
// and t stays listed in the region until t.end, so that the region's Close
// (or a grant's Revoke) can cut it short. No lock is held while the bytes
// move: a stalled peer never holds up Close.
//
// f.rkey names a region (its rkey admits remote access only while the
// region has given no grant) or a grant of one (grant.go): a write from the
// queue pair it was given to, inside its range, until it is revoked.
func (p *pd) remote(q *qp, t *transfer, f header, need verbsio.Access) ([]byte, error) {
	rkey, addr, n := f.rkey, f.raddr, f.length
	p.mu.RLock()
	m := p.byR[rkey]
	var g *grant
	if m == nil {
		if g = p.grants[rkey]; g != nil {
			m = g.m
		}
	}
	p.mu.RUnlock()
	switch {
	case m == nil:
		return nil, fmt.Errorf("%w: rkey %#x unknown", verbsio.ErrRemoteAccess, rkey)
	case g != nil && need != verbsio.AccessRemoteWrite:
		return nil, fmt.Errorf("%w: grant %#x admits writes only, need %v", verbsio.ErrRemoteAccess, rkey, need)
	case g != nil && g.q != q:
		return nil, fmt.Errorf("%w: grant %#x was given to another queue pair", verbsio.ErrRemoteAccess, rkey)
	case g != nil && !g.contains(addr, uint64(n)):
		return nil, fmt.Errorf("%w: [%#x+%d) outside grant %#x [%#x+%d)", verbsio.ErrRemoteAccess, addr, n, rkey, g.addr, g.n)
	case g == nil && !m.contains(addr, uint64(n)):
		return nil, fmt.Errorf("%w: [%#x+%d) outside region rkey %#x [%#x+%d)", verbsio.ErrRemoteAccess, addr, n, rkey, m.addr, m.n)
	case g == nil && m.access&need != need:
		return nil, fmt.Errorf("%w: region rkey %#x has access %v, need %v", verbsio.ErrRemoteAccess, rkey, m.access, need)
	}
	imm := f.op == opWriteImm && f.flags&flagLast != 0
	usedUp := false
	m.mu.Lock()
	var err error
	switch {
	case m.closed:
		err = fmt.Errorf("%w: rkey %#x deregistered", verbsio.ErrRemoteAccess, rkey)
	case g != nil && g.revoked:
		err = fmt.Errorf("%w: grant %#x revoked or used", verbsio.ErrRemoteAccess, rkey)
	case g != nil && imm && g.imms == 0:
		err = fmt.Errorf("%w: grant %#x admits no write with immediate", verbsio.ErrRemoteAccess, rkey)
	case g == nil && m.granted:
		err = fmt.Errorf("%w: region rkey %#x gives grants, so its own rkey admits no remote access", verbsio.ErrRemoteAccess, rkey)
	}
	if err != nil {
		m.mu.Unlock()
		return nil, err
	}
	if g != nil && imm {
		// The write with immediate that uses the grant up takes it out
		// of use now, before its bytes land: no other frame may start on it.
		g.imms--
		usedUp = g.imms == 0
		g.revoked = usedUp
	}
	t.m, t.g, t.out, t.fenced = m, g, need == verbsio.AccessRemoteRead, false
	m.moving = append(m.moving, t)
	m.mu.Unlock()
	if usedUp {
		p.dropGrant(g)
	}
	return offheap.Bytes(uintptr(addr), int(n)), nil
}

func (d *device) dropKeys(m *mr) {
	d.mu.Lock()
	delete(d.keys, m.lkey)
	delete(d.keys, m.rkey)
	d.mu.Unlock()
}

// mr is a registered region.
type mr struct {
	pd         *pd
	addr       uintptr
	n          int
	lkey, rkey uint32
	access     verbsio.Access

	// mu guards what follows. moving are the peers' transfers under way
	// into or out of the region (at most one per lane); gone is signalled
	// when one that Close or Revoke cut short ends. granted: the region
	// has given a grant, and its own rkey admits no more remote access.
	mu      sync.Mutex
	gone    sync.Cond
	moving  []*transfer
	closed  bool
	granted bool
}

func (m *mr) contains(addr, n uint64) bool {
	base := uint64(m.addr)
	return addr >= base && addr+n >= addr && addr+n <= base+uint64(m.n)
}

// Addr is the region's first byte.
func (m *mr) Addr() uintptr { return m.addr }

// Len is the region's length.
func (m *mr) Len() int { return m.n }

// LKey names the region in this side's work requests.
func (m *mr) LKey() uint32 { return m.lkey }

// RKey names the region in a peer's requests; it differs from LKey.
func (m *mr) RKey() uint32 { return m.rkey }

// Access is what the region allows.
func (m *mr) Access() verbsio.Access { return m.access }

// Close deregisters the region and revokes its grants. A peer's transfer
// into or out of it that is under way is cut short (and fails at the peer
// with StatusRemoteAccess) rather than waited for, so Close never waits on
// a peer's socket; once Close returns, no peer's byte moves into or out of
// the region. Idempotent.
func (m *mr) Close() error {
	p := m.pd
	p.mu.Lock()
	if p.byR[m.rkey] != m {
		p.mu.Unlock()
		return nil
	}
	delete(p.byR, m.rkey)
	delete(p.byL, m.lkey)
	for k, g := range p.grants {
		if g.m == m {
			delete(p.grants, k)
		}
	}
	p.mu.Unlock()
	m.mu.Lock()
	m.closed = true
	m.fenceLocked(nil)
	m.mu.Unlock()
	// The keys stay taken for the device's life (8 bytes per region ever
	// registered), so a stale rkey never names a later region.
	return nil
}
