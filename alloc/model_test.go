package alloc

import (
	"errors"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
)

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)) }

// modelBlock is what the model knows of a live block.
type modelBlock struct {
	b    Block
	fill byte
}

// TestRandomAgainstModel runs random allocations and frees against a model
// (the set of live blocks with the byte each was filled with) and checks, at
// every step, that blocks never overlap, lie inside one arena, keep their
// bytes, and that the pool's counters and invariants agree with the model.
func TestRandomAgainstModel(t *testing.T) {
	seeds := []uint64{1, 2, 3, 42}
	steps := 3000
	if testing.Short() {
		steps = 500
	}
	for _, seed := range seeds {
		t.Run("", func(t *testing.T) {
			rng := newRand(seed)
			align := 1 << (4 + rng.IntN(6))
			limit := int64(0)
			if seed%2 == 0 {
				limit = 24 << 20
			}
			p := newTestPool(t, newCountingSource(), withAlignment(align), WithInitialArena(256<<10), WithMaxArena(4<<20), WithLimit(limit))
			var live []modelBlock
			var inUse int64
			for step := range steps {
				if rng.IntN(100) < 55 || len(live) == 0 {
					n := 1 + rng.IntN(1<<uint(4+rng.IntN(17)))
					b, err := p.Alloc(n)
					if errors.Is(err, ErrPoolExhausted) {
						// Only when nothing free fits and the limit is reached.
						if st := p.Stats(); st.LargestFree >= int64(alignUp(n, align)) || limit == 0 {
							t.Fatalf("step %d: exhausted for %d bytes with %v", step, n, st)
						}
						continue
					}
					if err != nil {
						t.Fatalf("step %d: Alloc(%d): %v", step, n, err)
					}
					fill := byte(rng.Uint32())
					mem := b.Bytes()
					for i := range mem {
						mem[i] = fill
					}
					live = append(live, modelBlock{b, fill})
					inUse += int64(alignUp(n, align))
				} else {
					k := rng.IntN(len(live))
					m := live[k]
					for i, c := range m.b.Bytes() {
						if c != m.fill {
							t.Fatalf("step %d: block %#x byte %d is %d, want %d: overwritten", step, m.b.Addr(), i, c, m.fill)
						}
					}
					if rng.IntN(2) == 0 {
						if err := p.freeAddr(m.b.Addr()); err != nil {
							t.Fatalf("step %d: FreeAddr: %v", step, err)
						}
					} else {
						mustFree(t, m.b)
					}
					live[k] = live[len(live)-1]
					live = live[:len(live)-1]
					inUse -= int64(alignUp(m.b.Len(), align))
				}
				st := p.Stats()
				if st.InUse != inUse || st.Blocks != len(live) {
					t.Fatalf("step %d: pool says %d bytes in %d blocks, model %d in %d", step, st.InUse, st.Blocks, inUse, len(live))
				}
				if limit > 0 && st.Reserved > limit {
					t.Fatalf("step %d: reserved %d over limit %d", step, st.Reserved, limit)
				}
				if step%100 == 0 {
					checkDisjoint(t, p, live, align)
					mustCheck(t, p)
				}
			}
			checkDisjoint(t, p, live, align)
			for _, m := range live {
				mustFree(t, m.b)
			}
		})
	}
}

func checkDisjoint(t *testing.T, p *Pool, live []modelBlock, align int) {
	t.Helper()
	sorted := make([]Block, len(live))
	for i, m := range live {
		sorted[i] = m.b
	}
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Addr() < sorted[j].Addr() })
	for i, b := range sorted {
		n := alignUp(b.Len(), align)
		a, ok := p.ArenaOf(b.Addr())
		if !ok || !a.contains(b.Addr(), n) {
			t.Fatalf("block [%#x+%d] is not inside one arena", b.Addr(), n)
		}
		if i > 0 && sorted[i-1].Addr()+uintptr(alignUp(sorted[i-1].Len(), align)) > b.Addr() {
			t.Fatalf("blocks at %#x and %#x overlap", sorted[i-1].Addr(), b.Addr())
		}
	}
}

// TestConcurrent hammers one pool from many goroutines under the race
// detector; each goroutine checks that its blocks keep their bytes.
func TestConcurrent(t *testing.T) {
	v := newCountingVisitor("v", nil)
	p := newTestPool(t, newCountingSource(), WithVisitors(v), WithInitialArena(1<<20))
	const goroutines = 32
	iters := 400
	if testing.Short() {
		iters = 100
	}
	var wg sync.WaitGroup
	errs := make(chan error, goroutines+1)
	stop := make(chan struct{})
	var side sync.WaitGroup
	side.Add(1)
	go func() { // trims, checks and looks up while the others allocate
		defer side.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := p.trim(); err != nil {
				errs <- err
				return
			}
			if err := p.Check(); err != nil {
				errs <- err
				return
			}
			for _, a := range p.arenas() {
				if got, ok := p.ArenaOf(a.Base()); ok && got.Base() != a.Base() {
					errs <- errors.New("ArenaOf found another arena for a base")
					return
				}
			}
		}
	}()
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := newRand(uint64(g))
			var mine []modelBlock
			for i := range iters {
				if len(mine) < 8 && rng.IntN(3) > 0 {
					b, err := p.Alloc(1 + rng.IntN(64<<10))
					if err != nil {
						errs <- err
						return
					}
					fill := byte(g*31 + i)
					mem := b.Bytes()
					mem[0], mem[len(mem)-1] = fill, fill
					if _, ok := p.ArenaOf(b.Addr()); !ok {
						errs <- errors.New("ArenaOf missed a fresh block")
						return
					}
					mine = append(mine, modelBlock{b, fill})
				} else if len(mine) > 0 {
					m := mine[len(mine)-1]
					mine = mine[:len(mine)-1]
					mem := m.b.Bytes()
					if mem[0] != m.fill || mem[len(mem)-1] != m.fill {
						errs <- errors.New("a block's bytes were overwritten by another goroutine")
						return
					}
					if err := m.b.Free(); err != nil {
						errs <- err
						return
					}
				}
				if i%100 == 0 {
					_ = p.Stats()
				}
			}
			for _, m := range mine {
				if err := m.b.Free(); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	side.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	mustCheck(t, p)
	st := p.Stats()
	if visits, releases := v.totals(); visits-releases != st.Arenas || uint64(visits) != st.ArenasCreated {
		t.Errorf("%d visits, %d releases for %d arenas (%d created)", visits, releases, st.Arenas, st.ArenasCreated)
	}
	if st.Blocks != 0 || st.Allocs != st.Frees {
		t.Errorf("after all goroutines: %v", st)
	}
}
