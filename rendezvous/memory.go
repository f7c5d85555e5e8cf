package rendezvous

import (
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Memory is where a channel gets registered memory: result tensors, staging
// blocks for strings, and its control-message buffers. Every buffer it hands
// out must lie inside a region registered with the channel's protection
// domain for local and remote write. A Memory that also has a method
// HostOnly() bool saying true hands out host memory alone, with a view of
// its bytes: a channel over it takes small tensors sent eagerly
// (WithEager), whose bytes it copies into its results; PoolMemory's says
// whether all its pools are of host memory.
type Memory interface {
	// Alloc returns a buffer of at least n bytes on dev. A device it has no
	// registered memory for gives an error wrapping verbsio.ErrNotSupported.
	Alloc(n int, dev tensor.Device) (tensor.Buffer, error)
	// Region returns the registered region holding [addr, addr+n), if any.
	Region(addr uintptr, n int) (verbsio.MemoryRegion, bool)
}

// PoolMemory is a Memory over pools whose arenas a memory-registration
// visitor registered; regionOf finds the region the visitor attached to an
// arena (the visitor's RegionOf method, from
// alloc/visitor.NewMemoryRegistration, or visitor.MemoryRegionOf). Alloc
// uses the first pool of the asked device; Region searches them all.
func PoolMemory(regionOf func(*alloc.Arena) (verbsio.MemoryRegion, bool), pools ...*alloc.Pool) Memory {
	return &poolMemory{pools: pools, regionOf: regionOf}
}

type poolMemory struct {
	pools    []*alloc.Pool
	regionOf func(*alloc.Arena) (verbsio.MemoryRegion, bool)
}

func (m *poolMemory) Alloc(n int, dev tensor.Device) (tensor.Buffer, error) {
	for _, p := range m.pools {
		if p.Device() == dev {
			b, err := p.Alloc(max(n, 1))
			if err != nil {
				return nil, err
			}
			return b, nil
		}
	}
	return nil, fmt.Errorf("%w: no registered pool on %s", verbsio.ErrNotSupported, dev)
}

func (m *poolMemory) Region(addr uintptr, n int) (verbsio.MemoryRegion, bool) {
	for _, p := range m.pools {
		a, ok := p.ArenaOf(addr)
		if !ok || !inArena(a, addr, n) {
			continue
		}
		return m.regionOf(a)
	}
	return nil, false
}

// inArena reports whether [addr, addr+n) lies inside a.
func inArena(a *alloc.Arena, addr uintptr, n int) bool {
	return addr >= a.Base() && n >= 0 && uint64(addr-a.Base())+uint64(n) <= uint64(a.Size())
}

// HostOnly reports whether every pool is of host memory.
func (m *poolMemory) HostOnly() bool {
	for _, p := range m.pools {
		if p.Device() != tensor.Host {
			return false
		}
	}
	return true
}

// takesEager says whether a channel with options o and memory mem takes
// EAGER frames (wire.HelloEager): where every Recv's result is host memory
// the frame's bytes can be copied into. A Proxy or a Puller means results
// on a device; so may a Memory that does not say otherwise (HostOnly).
func takesEager(o *options, mem Memory) bool {
	h, ok := mem.(interface{ HostOnly() bool })
	return o.eagerMax > 0 && o.proxy == nil && o.puller == nil && ok && h.HostOnly()
}
