package gdrlink

import (
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/verbsio"
)

// Results in arenas of the peer's own. Where a provider cannot give a peer
// a key to just one result buffer (an ibverbs device whose memory windows
// do not bound writes, as Soft-RoCE's do not: Caps.Grants is false), the
// peer gets the rkey of the whole arena its result lies in. So on such a
// device the results of each peer come from a pool of that peer's own,
// whose arenas alone are registered for remote write; the group's pool
// (the application's tensors, the sources of Sends) is registered for
// local access only, and the pinned proxy pool of a GPU group for remote
// write (shared by the peers: a known limit). One peer's key then reaches
// its own results and nothing else. The peers' pools and the group's
// share one byte budget, the pool limit. onnode is left out: its peers map
// the arenas they write, and it protects against mistakes, not a hostile
// process of the same user (see the README's threat model).

// perPeer reports whether device dev gives each peer a result pool of its
// own; forced says the group was told to wherever the provider allows.
func perPeer(name string, dev verbsio.Device, forced bool) bool {
	return name != "onnode" && (forced || !dev.Caps().Grants)
}

// peerPoolKey names a peer's result pool: one per peer and provider.
type peerPoolKey struct {
	rank     int
	provider string
}

// regionOf finds the region of an arena of any of d's pools.
func (d *device) regionOf(a *alloc.Arena) (verbsio.MemoryRegion, bool) {
	if r, ok := d.reg.RegionOf(a); ok {
		return r, true
	}
	if d.writable != nil {
		return d.writable.RegionOf(a)
	}
	return nil, false
}

// peerMemory is the memory of a channel to rank over d: the group's pools,
// and first, where d gives per-peer pools, the peer's own, made on first
// use.
func (g *Group) peerMemory(d *device, rank int) (rendezvous.Memory, error) {
	if d.writable == nil {
		return g.channelMemory(d), nil
	}
	k := peerPoolKey{rank, d.name}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil, fmt.Errorf("gdrlink: rank %d: %w", g.Rank(), ErrClosed)
	}
	p := g.peerPools[k]
	if p == nil {
		var err error
		p, err = alloc.New(g.src, alloc.WithVisitors(d.writable), alloc.WithBudget(g.budget),
			alloc.WithName(fmt.Sprintf("gdrlink rank %d results from rank %d over %s", g.Rank(), rank, d.name)))
		if err != nil {
			return nil, fmt.Errorf("result pool for rank %d: %w", rank, err)
		}
		g.peerPools[k] = p
	}
	pools := []*alloc.Pool{p, g.pool}
	if g.gpu != nil {
		pools = append(pools, g.gpu.pinned)
	}
	return rendezvous.PoolMemory(d.regionOf, pools...), nil
}

// newRegistrations makes d's registration visitors: reg for the group's
// pool, and writable, on a device that gives per-peer pools, for the
// pools peers write (the peers' and the pinned proxy pool).
// forcePeerPools gives per-peer pools whatever the device
// (config.peerPools).
func newRegistrations(d *device, forcePeerPools bool) {
	// No remote read anywhere: the protocol never issues an RDMA READ, so
	// a peer holding a key can write what it was granted and read nothing
	// (a GPU's regions keep it for the flush's loopback read).
	rw := verbsio.AccessLocalWrite | verbsio.AccessRemoteWrite
	switch {
	case perPeer(d.name, d.dev, forcePeerPools):
		d.reg = visitor.NewMemoryRegistration(d.pd, verbsio.AccessLocalWrite)
		d.writable = visitor.NewMemoryRegistration(d.pd, rw)
	case d.dev.Caps().Grants:
		// Every buffer a peer writes is handed out as a grant
		// (verbsio.Granter needs local write only), so no arena's own
		// rkey admits a remote write: not even one that never granted.
		d.reg = visitor.NewMemoryRegistration(d.pd, verbsio.AccessLocalWrite)
	default:
		d.reg = visitor.NewMemoryRegistration(d.pd, rw)
	}
}

// writableVisitor is the visitor of d for pools peers write.
func (d *device) writableVisitor() alloc.Visitor {
	if d.writable != nil {
		return d.writable
	}
	return d.reg
}
