package visitor

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/verbsio"
)

// ErrNoRegion: an address that lies in no arena, or in an arena that no
// memory-registration visitor registered.
var ErrNoRegion = errors.New("visitor: address not in a registered arena")

// gpuRegisterFunc registers a GPU arena with a protection domain (with
// dma-buf, or a peer-memory driver); a MemoryRegistration given one calls it
// for arenas whose device is a GPU. Without one, a GPU arena fails its Visit
// with an error wrapping errNotHostMemory (NewGPUMemoryRegions is the visitor
// for GPU pools).
type gpuRegisterFunc func(pd verbsio.ProtectionDomain, a *alloc.Arena, access verbsio.Access) (verbsio.MemoryRegion, error)

// MemoryRegistration is the visitor that makes every tensor of a pool
// RDMA-ready: it registers each arena once with a verbs protection domain
// when the pool creates it, attaches the memory region to the arena, and
// deregisters it when the pool releases the arena. One visitor may serve
// several pools.
type MemoryRegistration struct {
	pd     verbsio.ProtectionDomain
	access verbsio.Access
	gpu    gpuRegisterFunc
	name   string

	mu     sync.Mutex
	live   map[*alloc.Arena]verbsio.MemoryRegion
	regs   atomic.Int64
	deregs atomic.Int64
}

// regionKey is the arena handle key under which the first registration of
// an arena is found by MemoryRegionOf.
type regionKey struct{}

// NewMemoryRegistration returns a visitor registering the host arenas of
// pools in pd with access. GPU arenas are refused: NewGPUMemoryRegions is the
// visitor for GPU pools.
func NewMemoryRegistration(pd verbsio.ProtectionDomain, access verbsio.Access) *MemoryRegistration {
	return newMemoryRegistration(pd, access, nil)
}

func newMemoryRegistration(pd verbsio.ProtectionDomain, access verbsio.Access, gpu gpuRegisterFunc) *MemoryRegistration {
	return &MemoryRegistration{pd: pd, access: access, gpu: gpu, name: "verbs-mr", live: map[*alloc.Arena]verbsio.MemoryRegion{}}
}

// Name implements alloc.Visitor.
func (m *MemoryRegistration) Name() string { return m.name }

// Visit registers the arena and attaches its memory region.
func (m *MemoryRegistration) Visit(a *alloc.Arena) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, dup := m.live[a]; dup {
		return fmt.Errorf("%w: %v by %s", errAlreadyVisited, a, m.name)
	}
	var mr verbsio.MemoryRegion
	var err error
	if a.Device().IsGPU() {
		if m.gpu == nil {
			return fmt.Errorf("%w: %v: %s registers host arenas; use NewGPUMemoryRegions for GPU pools", errNotHostMemory, a, m.name)
		}
		mr, err = m.gpu(m.pd, a, m.access)
	} else {
		mr, err = m.pd.RegisterMemory(a.Base(), a.Size(), m.access)
	}
	if err != nil {
		return fmt.Errorf("%s: registering %v with access %v: %w", m.name, a, m.access, err)
	}
	m.live[a] = mr
	m.regs.Add(1)
	a.SetHandle(m, mr)
	if _, taken := a.Handle(regionKey{}); !taken {
		a.SetHandle(regionKey{}, mr)
	}
	return nil
}

// Release deregisters the arena's memory region.
func (m *MemoryRegistration) Release(a *alloc.Arena) error {
	m.mu.Lock()
	mr, ok := m.live[a]
	delete(m.live, a)
	m.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %v by %s", errNotVisited, a, m.name)
	}
	a.DeleteHandle(m)
	if h, ok := a.Handle(regionKey{}); ok && h == mr {
		a.DeleteHandle(regionKey{})
	}
	m.deregs.Add(1)
	if err := mr.Close(); err != nil {
		return fmt.Errorf("%s: deregistering %v: %w", m.name, a, err)
	}
	return nil
}

// Registered is the number of arenas the visitor holds registered now:
// visited and not yet released, over every pool it serves.
func (m *MemoryRegistration) Registered() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.live)
}

// registrations is how many arenas the visitor has registered, in all.
func (m *MemoryRegistration) registrations() int { return int(m.regs.Load()) }

// deregistrations is how many arenas the visitor has deregistered, in all.
func (m *MemoryRegistration) deregistrations() int { return int(m.deregs.Load()) }

// RegionOf returns the memory region this visitor attached to a.
func (m *MemoryRegistration) RegionOf(a *alloc.Arena) (verbsio.MemoryRegion, bool) {
	h, ok := a.Handle(m)
	if !ok {
		return nil, false
	}
	return h.(verbsio.MemoryRegion), true
}

// MemoryRegionOf returns the memory region of an arena: the first one a
// MemoryRegistration attached, else the one a NewGPUMemoryRegions visitor
// attached.
func MemoryRegionOf(a *alloc.Arena) (verbsio.MemoryRegion, bool) {
	if h, ok := a.Handle(regionKey{}); ok {
		return h.(verbsio.MemoryRegion), true
	}
	if g, ok := gpuMemoryRegionOf(a); ok && g.MR != nil {
		return g.MR, true
	}
	return nil, false
}

// SGEOf returns the scatter/gather entry for [addr, addr+n) of a pool's
// memory: the lkey of the arena's region. The range must lie in one arena,
// which it does for any block of the pool.
func SGEOf(p *alloc.Pool, addr uintptr, n int) (verbsio.SGE, verbsio.MemoryRegion, error) {
	mr, err := regionFor(p, addr, n)
	if err != nil {
		return verbsio.SGE{}, nil, err
	}
	return verbsio.SGE{Addr: addr, Length: uint32(n), LKey: mr.LKey()}, mr, nil
}

// RemoteKeyOf returns the rkey a peer needs to write or read [addr, addr+n)
// of a pool's memory.
func RemoteKeyOf(p *alloc.Pool, addr uintptr, n int) (uint32, error) {
	mr, err := regionFor(p, addr, n)
	if err != nil {
		return 0, err
	}
	return mr.RKey(), nil
}

func regionFor(p *alloc.Pool, addr uintptr, n int) (verbsio.MemoryRegion, error) {
	if n < 0 || uint64(n) > 1<<32-1 {
		return nil, fmt.Errorf("%w: length %d", ErrNoRegion, n)
	}
	a, ok := p.ArenaOf(addr)
	if !ok {
		return nil, fmt.Errorf("%w: %#x is in no arena", ErrNoRegion, addr)
	}
	if !inArena(a, addr, n) {
		return nil, fmt.Errorf("%w: [%#x+%d) runs past the end of %v", ErrNoRegion, addr, n, a)
	}
	mr, ok := MemoryRegionOf(a)
	if !ok {
		return nil, fmt.Errorf("%w: %v has no memory region (no MemoryRegistration visitor in its pool)", ErrNoRegion, a)
	}
	return mr, nil
}

// inArena reports whether [addr, addr+n) lies inside a.
func inArena(a *alloc.Arena, addr uintptr, n int) bool {
	return addr >= a.Base() && n >= 0 && uint64(addr-a.Base())+uint64(n) <= uint64(a.Size())
}
