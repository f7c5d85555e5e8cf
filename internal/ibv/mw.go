package ibv

import (
	"sync"
	"syscall"
)

// MW is a type 2 memory window: a key to one range of a region, for one
// queue pair, bound and invalidated by work requests on that queue pair's
// send queue (WRBindMW, WRLocalInv). A window is allocated unbound; it
// admits nothing until bound.
type MW struct {
	c  *Context
	mu sync.Mutex
	mw uintptr
}

// AllocMW allocates a type 2 memory window in the domain (the inline
// ibv_alloc_mw, through the context's ops table). A device without memory
// windows fails with EOPNOTSUPP.
func (p *PD) AllocMW() (*MW, error) {
	pd, err := p.live("ibv_alloc_mw")
	if err != nil {
		return nil, err
	}
	if p.c.allocMW == 0 {
		return nil, p.c.errf("ibv_alloc_mw", syscall.EOPNOTSUPP, "the provider has no memory windows")
	}
	p.c.cnt.control.Add(1)
	mw, e := p.c.l.callFnErrno(p.c.allocMW, pd, mwType2)
	if mw == 0 {
		return nil, p.c.errf("ibv_alloc_mw", orEIO(e), "type 2")
	}
	return &MW{c: p.c, mw: mw}, nil
}

// IncRKey is ibv_inc_rkey: rkey with its low 8 bits (the key a consumer
// chooses) advanced by one and its upper 24 bits (the window's index) kept.
func IncRKey(rkey uint32) uint32 { return rkey&^0xff | (rkey+1)&0xff }

// RKey is the window's rkey as last recorded: the one its current (or
// last) bind gave it.
func (m *MW) RKey() uint32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mw == 0 {
		return 0
	}
	return u32At(m.mw, offMWRKey)
}

// NextRKey is the rkey the window's next bind should give it.
func (m *MW) NextRKey() uint32 { return IncRKey(m.RKey()) }

// SetRKey records rkey as the window's, once a bind that gave it has
// completed successfully. libibverbs updates the window's rkey itself only
// in ibv_bind_mw (type 1 windows); a type 2 bind posted with ibv_post_send
// leaves it to the caller, and the provider checks the next bind against it.
func (m *MW) SetRKey(rkey uint32) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mw != 0 {
		*(*uint32)(ptrAt(m.mw, offMWRKey)) = rkey
	}
}

// handle is the window's struct ibv_mw, or 0 once closed.
func (m *MW) handle() uintptr {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mw
}

// Close deallocates the window (the inline ibv_dealloc_mw), which also
// invalidates it if bound. Idempotent.
func (m *MW) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mw == 0 {
		return nil
	}
	if m.c.deallocMW == 0 {
		return m.c.errf("ibv_dealloc_mw", syscall.EOPNOTSUPP, "the provider has no memory windows")
	}
	m.c.cnt.control.Add(1)
	r, e := m.c.l.callFnErrno(m.c.deallocMW, m.mw)
	if rc := rc32(r); rc != 0 {
		return m.c.errf("ibv_dealloc_mw", verbErr(rc, e), "rkey %#x", u32At(m.mw, offMWRKey))
	}
	m.mw = 0
	return nil
}

// handle is the region's struct ibv_mr, or 0 once closed.
func (m *MR) handle() uintptr {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mr
}
