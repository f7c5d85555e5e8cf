package main

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
	"github.com/gdrlink/gdrlink/rendezvous"
	"github.com/gdrlink/gdrlink/tensor"
	"github.com/gdrlink/gdrlink/verbsio"
)

// The tensor scenario's grant rows: the cost of per-request grants. Where a
// provider's regions give grants (verbsio.Granter), each Recv's result
// buffer is asked for with a grant of its own, given with the request and
// revoked when it completes; without them, with the rkey of the whole arena
// (which lets the peer write every tensor in it). The rows measure the
// same Recvs, from the same peer process, both ways, rep after rep:
//
//	tensor-grants/PROVIDER/small-rate     4 KiB tensors/s, 64 in flight
//	tensor-grants/PROVIDER/small-latency  one 4 KiB Recv, us
//	tensor-grants/PROVIDER/large          GB/s at each large size
//
// Value is with grants, Baseline ("arena-rkey") without, so a ratio above
// 1 means grants cost nothing. -set tensor.grants=off leaves the rows out.
const setTensorGrants = "tensor.grants"

// grantGoal is what the note says the ratio should reach.
const grantGoal = "goal: ratio >= 0.85 at 4 KiB, >= 0.95 at 16 MiB and above"

// grantSwitch is the measuring side's rendezvous.Memory. Outside the
// grant rows it hands out result buffers from the scenario's pool. In the
// grant rows it hands them out from one of two pools of their own, made
// alike (same source, shape and registration) and used only by those rows,
// so the two modes differ in the key alone: the grant pool, whose regions
// give grants, or the arena-key pool, whose regions are shown without
// their Granter, so the channel asks with the region's rkey. (The arena
// key needs a pool of its own anyway: a region that gave a grant no longer
// admits its own rkey.)
type grantSwitch struct {
	main, grants, arena  rendezvous.Memory
	grantPool, arenaPool *alloc.Pool
	inRows, useArena     atomic.Bool
}

// newGrantSwitch makes the switch over pool (the scenario's, registered
// by reg's visitor) and the two pools of the grant rows, registered with
// access on pd.
func newGrantSwitch(pd verbsio.ProtectionDomain, reg *visitor.MemoryRegistration, pool *alloc.Pool, src func(name string) alloc.Source, access verbsio.Access, arena, maxArena int) (*grantSwitch, error) {
	g := &grantSwitch{main: rendezvous.PoolMemory(reg.RegionOf, pool)}
	newPool := func(name string) (*alloc.Pool, rendezvous.Memory, error) {
		r := visitor.NewMemoryRegistration(pd, access)
		p, err := alloc.New(src(name), alloc.WithVisitors(r),
			alloc.WithInitialArena(arena), alloc.WithMaxArena(maxArena), alloc.WithName(name))
		if err != nil {
			return nil, nil, fmt.Errorf("pool for the %s rows: %w", name, err)
		}
		return p, rendezvous.PoolMemory(r.RegionOf, p), nil
	}
	var err error
	if g.grantPool, g.grants, err = newPool("grant"); err != nil {
		return nil, err
	}
	if g.arenaPool, g.arena, err = newPool("arena-rkey"); err != nil {
		g.grantPool.Close()
		return nil, err
	}
	return g, nil
}

// Alloc takes the buffer from the pool of the current mode.
func (g *grantSwitch) Alloc(n int, dev tensor.Device) (tensor.Buffer, error) {
	switch {
	case !g.inRows.Load():
		return g.main.Alloc(n, dev)
	case g.useArena.Load():
		return g.arena.Alloc(n, dev)
	}
	return g.grants.Alloc(n, dev)
}

// Region finds the region in any of the pools; those of the arena-key
// pool come without their Granter.
// HostOnly says that every pool of the switch is of host memory, so its
// channel takes tensors sent eagerly (rendezvous.Memory).
func (g *grantSwitch) HostOnly() bool { return true }

func (g *grantSwitch) Region(addr uintptr, n int) (verbsio.MemoryRegion, bool) {
	for _, m := range []rendezvous.Memory{g.main, g.grants} {
		if r, ok := m.Region(addr, n); ok {
			return r, true
		}
	}
	r, ok := g.arena.Region(addr, n)
	if !ok {
		return nil, false
	}
	return plainRegion{r}, true
}

// plainRegion is a region without its Granter.
type plainRegion struct{ verbsio.MemoryRegion }

// close releases the grant rows' pools; the channel must be closed first.
func (g *grantSwitch) close() error {
	return errors.Join(g.grantPool.Close(), g.arenaPool.Close())
}

// grantsActive reports whether a result buffer of the grant mode sits in a
// region that gives grants, and if not, why.
func (g *grantSwitch) grantsActive() error {
	b, err := g.grants.Alloc(tensorSmall, tensor.Host)
	if err != nil {
		return err
	}
	defer b.Free()
	r, ok := g.grants.Region(b.Addr(), b.Len())
	if !ok {
		return errors.New("a result buffer has no region")
	}
	if _, ok := r.(verbsio.Granter); !ok {
		return errors.New("the provider's regions give no grants (verbsio.Granter)")
	}
	return nil
}

// grantRows measures the grant rows: each case with grants and with the
// arena key in turn, rep after rep, the order swapped every rep, so the
// load of a shared machine falls on both alike.
func (m *tensorMeasure) grantRows(sizes []int64, reps, nSmall int, note string) error {
	g := m.s.grants
	if m.env.Args[setTensorGrants] == "off" || g == nil {
		return nil
	}
	if err := g.grantsActive(); err != nil {
		m.env.Log.Info("grant rows skipped", "provider", m.provider, "reason", err)
		return nil
	}
	g.inRows.Store(true)
	defer func() {
		g.useArena.Store(false)
		g.inRows.Store(false)
	}()
	// both runs f with grants and with the arena key, reps times, and
	// returns the two medians.
	both := func(f func() (float64, error)) (grants, arena float64, err error) {
		var gs, as []float64
		for r := 0; r < reps; r++ {
			for i := 0; i < 2; i++ {
				arenaKey := (r+i)%2 == 1
				g.useArena.Store(arenaKey)
				v, err := f()
				if err != nil {
					return 0, 0, fmt.Errorf("arena key %v: %w", arenaKey, err)
				}
				if arenaKey {
					as = append(as, v)
				} else {
					gs = append(gs, v)
				}
			}
		}
		return median(gs), median(as), nil
	}
	note = fmt.Sprintf("%s; value with a grant per request, baseline with the arena's rkey; ratio above 1: grants cost nothing (%s)", note, grantGoal)
	gr, ar, err := both(func() (float64, error) { return m.oursRate(tensorSmall, nSmall, 1) })
	if err != nil {
		return fmt.Errorf("grant rows, rate: %w", err)
	}
	m.emitGrants("small-rate", tensorSmall, gr, "tensors/s", ar, note)
	gl, al, err := both(func() (float64, error) {
		d, err := m.oursLatency(tensorSmall, 1)
		return us(d), err
	})
	if err != nil {
		return fmt.Errorf("grant rows, latency: %w", err)
	}
	m.emitGrants("small-latency", tensorSmall, gl, "us", al, note)
	for _, size := range sizes {
		gb, ab, err := both(func() (float64, error) {
			d, err := m.oursLatency(int(size), 1)
			return rateGBs(size, d), err
		})
		if err != nil {
			return fmt.Errorf("grant rows, %d bytes: %w", size, err)
		}
		m.emitGrants("large", size, gb, "GB/s", ab, note)
	}
	return nil
}

func (m *tensorMeasure) emitGrants(name string, size int64, value float64, unit string, arena float64, note string) {
	r := newResult("tensor", "tensor-grants/"+m.provider+"/"+name, size, value, unit, arena, "arena-rkey")
	r.Note = note
	m.env.Emit(r)
}
