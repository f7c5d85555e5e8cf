package alloc

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/gdrlink/gdrlink/tensor"
)

func TestAllocSizes(t *testing.T) {
	p := newTestPool(t, NewMmapSource(MmapOptions{}), WithInitialArena(1<<20))
	for _, tc := range []struct {
		n, chunk int
	}{
		{1, 256}, {255, 256}, {256, 256}, {257, 512}, {4096, 4096}, {1<<20 + 1, 1<<20 + 256}, {3 << 20, 3 << 20},
	} {
		t.Run(fmt.Sprint(tc.n), func(t *testing.T) {
			before := p.Stats().InUse
			b := mustAlloc(t, p, tc.n)
			if b.Len() != tc.n || len(b.Bytes()) != tc.n {
				t.Errorf("Len %d, len(Bytes) %d, want %d", b.Len(), len(b.Bytes()), tc.n)
			}
			if b.Addr()%defaultAlignment != 0 {
				t.Errorf("address %#x not aligned to %d", b.Addr(), defaultAlignment)
			}
			if got := p.Stats().InUse - before; got != int64(tc.chunk) {
				t.Errorf("in use grew by %d, want %d", got, tc.chunk)
			}
			a, ok := arenaOf(b)
			if !ok || !a.contains(b.Addr(), tc.chunk) {
				t.Errorf("block [%#x+%d] not inside one arena (%v, %v)", b.Addr(), tc.chunk, a, ok)
			}
			mem := b.Bytes()
			for i := range mem {
				mem[i] = byte(i)
			}
			if mem[tc.n-1] != byte(tc.n-1) {
				t.Errorf("last byte reads %d", mem[tc.n-1])
			}
			if b.Device() != tensor.Host {
				t.Errorf("device %v", b.Device())
			}
			mustCheck(t, p)
			mustFree(t, b)
			mustCheck(t, p)
		})
	}
}

func TestBadSize(t *testing.T) {
	p := newTestPool(t, NewMmapSource(MmapOptions{}))
	for _, n := range []int{0, -1, -1 << 40, maxAlloc + 1} {
		if _, err := p.Alloc(n); !errors.Is(err, ErrBadSize) {
			t.Errorf("Alloc(%d) = %v, want ErrBadSize", n, err)
		}
	}
	if st := p.Stats(); st.Arenas != 0 || st.Allocs != 0 {
		t.Errorf("bad sizes touched the pool: %v", st)
	}
}

func TestBadOptions(t *testing.T) {
	src := NewMmapSource(MmapOptions{})
	for name, o := range map[string]Option{
		"alignment 0":     withAlignment(0),
		"alignment 3":     withAlignment(3),
		"alignment 4MiB":  withAlignment(4 << 20),
		"initial 0":       WithInitialArena(0),
		"max -1":          WithMaxArena(-1),
		"limit -1":        WithLimit(-1),
		"nil visitor":     WithVisitors(nil),
		"max below start": func(c *config) error { c.initArena, c.initSet, c.maxArena = 4<<20, true, 1<<20; return nil },
		"huge max":        WithMaxArena(maxAlloc + 1),
		"huge initial":    WithInitialArena(maxAlloc + 1),
	} {
		if p, err := New(src, o); !errors.Is(err, ErrBadOption) {
			t.Errorf("%s: New = %v, %v; want ErrBadOption", name, p, err)
		}
	}
	// A small maximum alone lowers the first arena to it.
	p, err := New(src, WithMaxArena(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Alloc(1)
	if a, _ := arenaOf(b); err != nil || a.Size() != 64<<10 {
		t.Errorf("first arena with WithMaxArena(64 KiB): %v, %v", a, err)
	}
	if err := errors.Join(b.Free(), p.Close()); err != nil {
		t.Fatal(err)
	}
	if _, err := New(nil); !errors.Is(err, ErrBadOption) {
		t.Errorf("New(nil) = %v", err)
	}
}

// TestBestFitSplitCoalesce follows the chunks of one arena through splits,
// best-fit reuse and merges.
func TestBestFitSplitCoalesce(t *testing.T) {
	p := newTestPool(t, NewMmapSource(MmapOptions{}), WithInitialArena(1<<20))
	a := mustAlloc(t, p, 1024)
	b := mustAlloc(t, p, 4096)
	c := mustAlloc(t, p, 1024)
	d := mustAlloc(t, p, 2048)
	e := mustAlloc(t, p, 1024)
	if b.Addr() != a.Addr()+1024 || c.Addr() != b.Addr()+4096 || d.Addr() != c.Addr()+1024 {
		t.Fatalf("first allocations are not packed: %#x %#x %#x %#x", a.Addr(), b.Addr(), c.Addr(), d.Addr())
	}
	mustFree(t, b) // 4 KiB hole
	mustFree(t, d) // 2 KiB hole
	mustCheck(t, p)
	// Best fit: 2 KiB goes to the 2 KiB hole, not the first (4 KiB) one.
	f := mustAlloc(t, p, 2000)
	if f.Addr() != d.Addr() {
		t.Errorf("2000 bytes at %#x, want the 2 KiB hole at %#x", f.Addr(), d.Addr())
	}
	// 1 KiB splits the 4 KiB hole; the rest stays free at its end.
	g := mustAlloc(t, p, 1024)
	if g.Addr() != b.Addr() {
		t.Errorf("1 KiB at %#x, want the 4 KiB hole at %#x", g.Addr(), b.Addr())
	}
	h := mustAlloc(t, p, 3072)
	if h.Addr() != b.Addr()+1024 {
		t.Errorf("3 KiB at %#x, want the rest of the hole at %#x", h.Addr(), b.Addr()+1024)
	}
	mustCheck(t, p)
	for _, x := range []Block{c, a, h, g, f, e} {
		mustFree(t, x)
		mustCheck(t, p)
	}
	st := p.Stats()
	if st.Arenas != 1 || st.InUse != 0 || st.LargestFree != 1<<20 || st.Fragmentation != 0 {
		t.Errorf("after freeing everything: %v, want one free chunk of 1 MiB", st)
	}
}

func TestFragmentationStat(t *testing.T) {
	p := newTestPool(t, NewMmapSource(MmapOptions{}), WithInitialArena(1<<20), WithMaxArena(1<<20))
	var blocks []Block
	for range 4096 / 4 {
		blocks = append(blocks, mustAlloc(t, p, 1024))
	}
	// Free every other block: 512 holes of 1 KiB, nothing larger.
	for i := 0; i < len(blocks); i += 2 {
		mustFree(t, blocks[i])
	}
	st := p.Stats()
	if st.LargestFree != 1024 {
		t.Errorf("largest free %d, want 1024", st.LargestFree)
	}
	want := 1 - 1024.0/float64(512*1024)
	if d := st.Fragmentation - want; d > 1e-9 || d < -1e-9 {
		t.Errorf("fragmentation %v, want %v", st.Fragmentation, want)
	}
	for i := 1; i < len(blocks); i += 2 {
		mustFree(t, blocks[i])
	}
	if st := p.Stats(); st.Fragmentation != 0 || st.LargestFree != 1<<20 {
		t.Errorf("after freeing all: %v", st)
	}
}

func TestGrowthPolicy(t *testing.T) {
	src := newCountingSource()
	p := newTestPool(t, src, WithInitialArena(1<<20), WithMaxArena(8<<20))
	// Each 1 MiB block fills an arena's worth of the doubling sequence.
	var blocks []Block
	for range 1 + 2 + 4 + 8 + 8 {
		blocks = append(blocks, mustAlloc(t, p, 1<<20))
	}
	want := []int{1 << 20, 2 << 20, 4 << 20, 8 << 20, 8 << 20}
	if !slices.Equal(src.sizes, want) {
		t.Errorf("arena sizes %v, want %v", src.sizes, want)
	}
	// Larger than the maximum arena: an arena of its own, exactly as large.
	big := mustAlloc(t, p, 20<<20)
	if got := src.sizes[len(src.sizes)-1]; got != 20<<20 {
		t.Errorf("oversized request got an arena of %d bytes", got)
	}
	a, _ := arenaOf(big)
	if a.Size() != 20<<20 || a.Base() != big.Addr() {
		t.Errorf("oversized block %#x in %v", big.Addr(), a)
	}
	// A request larger than the next size doubles until it fits.
	p2 := newTestPool(t, newCountingSource(), WithInitialArena(1<<20), WithMaxArena(64<<20))
	b2 := mustAlloc(t, p2, 5<<20)
	if a2, _ := arenaOf(b2); a2.Size() != 8<<20 {
		t.Errorf("5 MiB request made an arena of %d bytes, want 8 MiB", a2.Size())
	}
	mustFree(t, b2)
	for _, b := range append(blocks, big) {
		mustFree(t, b)
	}
	mustCheck(t, p)
	if err := p.trim(); err != nil {
		t.Fatal(err)
	}
	if st := p.Stats(); st.Arenas != 0 || st.Reserved != 0 || st.ArenasReleased != 6 {
		t.Errorf("after Trim: %v", st)
	}
	if _, frees, live := src.counts(); frees != 6 || live != 0 {
		t.Errorf("source freed %d regions, %d live", frees, live)
	}
}

func TestDoubleFreeAndStaleBlock(t *testing.T) {
	p := newTestPool(t, NewMmapSource(MmapOptions{}))
	b := mustAlloc(t, p, 1000)
	copyOfB := b
	mustFree(t, b)
	if err := b.Free(); !errors.Is(err, ErrDoubleFree) {
		t.Errorf("second Free = %v, want ErrDoubleFree", err)
	}
	// The same chunk is handed out again; the stale copy must not free it.
	c := mustAlloc(t, p, 1000)
	if c.Addr() != b.Addr() {
		t.Fatalf("expected the chunk to be reused: %#x vs %#x", c.Addr(), b.Addr())
	}
	if err := copyOfB.Free(); !errors.Is(err, ErrDoubleFree) {
		t.Errorf("stale Free = %v, want ErrDoubleFree", err)
	}
	if st := p.Stats(); st.Blocks != 1 {
		t.Errorf("stale free changed the pool: %v", st)
	}
	if err := p.freeAddr(c.Addr()); err != nil {
		t.Errorf("FreeAddr of a live block: %v", err)
	}
	if err := p.freeAddr(c.Addr()); !errors.Is(err, ErrDoubleFree) {
		t.Errorf("FreeAddr twice = %v, want ErrDoubleFree", err)
	}
	if err := c.Free(); !errors.Is(err, ErrDoubleFree) {
		t.Errorf("Free after FreeAddr = %v, want ErrDoubleFree", err)
	}
}

func TestForeignPointers(t *testing.T) {
	p := newTestPool(t, NewMmapSource(MmapOptions{}))
	other := newTestPool(t, NewMmapSource(MmapOptions{}))
	b := mustAlloc(t, p, 4096)
	defer mustFree(t, b)
	ob := mustAlloc(t, other, 64)
	defer mustFree(t, ob)
	heap := make([]byte, 64)
	cases := map[string]func() error{
		"block of another pool": func() error { return p.free(ob) },
		"zero block":            func() error { return Block{}.Free() },
		"zero block to pool":    func() error { return p.free(Block{}) },
		"go heap address":       func() error { return p.freeAddr(uintptr(unsafe.Pointer(&heap[0]))) },
		"nil address":           func() error { return p.freeAddr(0) },
		"inside a block":        func() error { return p.freeAddr(b.Addr() + 256) },
		"other pool's address":  func() error { return p.freeAddr(ob.Addr()) },
	}
	for name, f := range cases {
		if err := f(); !errors.Is(err, ErrNotOwned) {
			t.Errorf("%s: %v, want ErrNotOwned", name, err)
		}
	}
	if _, ok := p.ArenaOf(uintptr(unsafe.Pointer(&heap[0]))); ok {
		t.Error("ArenaOf found a Go heap address")
	}
	if st := p.Stats(); st.Blocks != 1 || st.Frees != 0 {
		t.Errorf("foreign frees changed the pool: %v", st)
	}
}

func TestArenaOf(t *testing.T) {
	var order []string
	v := newCountingVisitor("handles", &order)
	p := newTestPool(t, NewMmapSource(MmapOptions{}), WithVisitors(v), WithInitialArena(1<<20), WithMaxArena(1<<20))
	var blocks []Block
	for range 5 {
		blocks = append(blocks, mustAlloc(t, p, 1<<20))
	}
	arenas := p.arenas()
	if len(arenas) != 5 {
		t.Fatalf("%d arenas, want 5", len(arenas))
	}
	for i := 1; i < len(arenas); i++ {
		if arenas[i-1].Base() >= arenas[i].Base() {
			t.Fatalf("Arenas not sorted by base: %v", arenas)
		}
	}
	for _, a := range arenas {
		for _, addr := range []uintptr{a.Base(), a.Base() + uintptr(a.Size())/2, a.Base() + uintptr(a.Size()) - 1} {
			got, ok := p.ArenaOf(addr)
			if !ok || got != a {
				t.Errorf("ArenaOf(%#x) = %v, %v; want %v", addr, got, ok, a)
			}
		}
		h, ok := a.Handle(v)
		if !ok || h != fmt.Sprint("handles", a.ID) {
			t.Errorf("handle of %v = %v, %v", a, h, ok)
		}
		end := a.Base() + uintptr(a.Size())
		if got, ok := p.ArenaOf(end); ok && got == a {
			t.Errorf("ArenaOf(end of %v) found it", a)
		}
	}
	if _, ok := p.ArenaOf(arenas[0].Base() - 1); ok {
		t.Error("ArenaOf below the lowest arena found one")
	}
	for _, b := range blocks {
		mustFree(t, b)
	}
}

func TestOverLimit(t *testing.T) {
	p := newTestPool(t, NewMmapSource(MmapOptions{}), WithName("limited"), WithInitialArena(1<<20), WithLimit(3<<20))
	a := mustAlloc(t, p, 512<<10)
	b := mustAlloc(t, p, 1<<20) // second arena: the 2 MiB step, within 3 MiB
	_, err := p.Alloc(2 << 20)
	if !errors.Is(err, ErrPoolExhausted) {
		t.Fatalf("Alloc beyond the limit = %v, want ErrPoolExhausted", err)
	}
	msg := err.Error()
	for _, want := range []string{`"limited"`, "requested 2.0 MiB", "in use 1.5 MiB", "reserved 3.0 MiB", "limit 3.0 MiB", "bins: [", "free"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q lacks %q", msg, want)
		}
	}
	// A request within the limit still works after a refusal.
	c := mustAlloc(t, p, 256<<10)
	mustFree(t, a)
	mustFree(t, b)
	mustFree(t, c)
	// With nothing allocated, the pool trims free arenas to make room.
	d := mustAlloc(t, p, 3<<20)
	if st := p.Stats(); st.Reserved != 3<<20 || st.Arenas != 1 {
		t.Errorf("after trimming for a 3 MiB block: %v", st)
	}
	mustFree(t, d)
}

func TestSourceFailure(t *testing.T) {
	src := newCountingSource()
	p := newTestPool(t, src, WithInitialArena(4<<20))
	src.failAt[1] = true // the 4 MiB try fails, 2 MiB succeeds
	b := mustAlloc(t, p, 1<<20)
	if !slices.Equal(src.sizes, []int{4 << 20, 2 << 20}) {
		t.Errorf("tries %v, want 4 MiB then 2 MiB", src.sizes)
	}
	src.failAll = true
	_, err := p.Alloc(3 << 20)
	if !errors.Is(err, ErrPoolExhausted) || !errors.Is(err, errInjected) {
		t.Errorf("Alloc with a failing source = %v, want ErrPoolExhausted wrapping the source's error", err)
	}
	mustFree(t, b)
}

// badSource returns regions that must be refused.
type badSource struct {
	countingSource
	mode string
}

func (s *badSource) Alloc(size int) (*Region, error) {
	r, err := s.countingSource.Alloc(size)
	if err != nil {
		return nil, err
	}
	switch s.mode {
	case "small":
		r.Size /= 2
		r.Private = nil // bookkeeping lives in countingSource.live
	case "nil":
		_ = s.countingSource.Free(r)
		return nil, nil
	}
	return r, nil
}

func (s *badSource) Free(r *Region) error {
	if s.mode == "small" {
		s.mu.Lock()
		r.Size = s.live[r.Base]
		s.mu.Unlock()
	}
	return s.countingSource.Free(r)
}

func TestBadRegion(t *testing.T) {
	for _, mode := range []string{"small", "nil"} {
		t.Run(mode, func(t *testing.T) {
			src := &badSource{countingSource: *newCountingSource(), mode: mode}
			p := newTestPool(t, src)
			_, err := p.Alloc(4096)
			if !errors.Is(err, ErrPoolExhausted) || !errors.Is(err, errBadRegion) {
				t.Errorf("Alloc over a bad region = %v", err)
			}
			if _, _, live := src.counts(); live != 0 {
				t.Errorf("%d regions left", live)
			}
		})
	}
}

func TestUseAfterClose(t *testing.T) {
	src := newCountingSource()
	p, err := New(src)
	if err != nil {
		t.Fatal(err)
	}
	b := mustAlloc(t, p, 100)
	mustFree(t, b)
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close = %v", err)
	}
	if _, err := p.Alloc(1); !errors.Is(err, ErrClosed) {
		t.Errorf("Alloc = %v", err)
	}
	if err := b.Free(); !errors.Is(err, ErrClosed) {
		t.Errorf("Free = %v", err)
	}
	if err := p.freeAddr(b.Addr()); !errors.Is(err, ErrClosed) {
		t.Errorf("FreeAddr = %v", err)
	}
	if err := p.trim(); !errors.Is(err, ErrClosed) {
		t.Errorf("Trim = %v", err)
	}
	if err := p.reserve(1); !errors.Is(err, ErrClosed) {
		t.Errorf("Reserve = %v", err)
	}
	m, _ := tensor.MetaFor(tensor.Float32, tensor.Shape{2})
	if _, err := p.NewTensor(m); !errors.Is(err, ErrClosed) {
		t.Errorf("NewTensor = %v", err)
	}
	if _, ok := p.ArenaOf(b.Addr()); ok || len(p.arenas()) != 0 {
		t.Error("arenas still visible after Close")
	}
	if b.Bytes() != nil {
		t.Error("Bytes of a block of a closed pool is not nil")
	}
	if err := p.Check(); err != nil {
		t.Errorf("Check after Close: %v", err)
	}
	if allocs, frees, live := src.counts(); allocs != 1 || frees != 1 || live != 0 {
		t.Errorf("source: %d allocs, %d frees, %d live", allocs, frees, live)
	}
}

func TestLeakReport(t *testing.T) {
	src := newCountingSource()
	v := newCountingVisitor("v", nil)
	p, err := New(src, WithVisitors(v), WithName("leaky"))
	if err != nil {
		t.Fatal(err)
	}
	mustAlloc(t, p, 1000)
	mustAlloc(t, p, 3000)
	mustFree(t, mustAlloc(t, p, 50))
	err = p.Close()
	if !errors.Is(err, ErrLeaked) {
		t.Fatalf("Close = %v, want ErrLeaked", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "2 blocks") || !strings.Contains(msg, "4000 bytes") || !strings.Contains(msg, `"leaky"`) {
		t.Errorf("leak report %q lacks the count, bytes or name", msg)
	}
	if visits, releases := v.totals(); visits != 1 || releases != 1 {
		t.Errorf("visitor: %d visits, %d releases", visits, releases)
	}
	if _, _, live := src.counts(); live != 0 {
		t.Errorf("%d regions still mapped", live)
	}
}

func TestVisitorFailure(t *testing.T) {
	for _, mode := range []string{"error", "panic"} {
		t.Run(mode, func(t *testing.T) {
			var order []string
			src := newCountingSource()
			first := newCountingVisitor("first", &order)
			second := newCountingVisitor("second", &order)
			failing := newCountingVisitor("failing", &order)
			cause := errors.New("registration refused")
			if mode == "panic" {
				failing.panicVisit = true
			} else {
				failing.failVisit = cause
			}
			last := newCountingVisitor("last", &order)
			p := newTestPool(t, src, WithVisitors(first, second, failing, last))
			_, err := p.Alloc(4096)
			if !errors.Is(err, ErrVisitor) || !strings.Contains(err.Error(), `"failing"`) {
				t.Fatalf("Alloc = %v, want ErrVisitor naming the visitor", err)
			}
			if mode == "error" && !errors.Is(err, cause) {
				t.Errorf("error %v does not wrap the visitor's error", err)
			}
			want := []string{"visit first 0", "visit second 0", "visit failing 0", "release second 0", "release first 0"}
			if !slices.Equal(order, want) {
				t.Errorf("calls %v, want %v", order, want)
			}
			for _, v := range []*countingVisitor{first, second} {
				if v.visits[0] != 1 || v.releases[0] != 1 {
					t.Errorf("%s: visits %v releases %v", v.name, v.visits, v.releases)
				}
			}
			if allocs, frees, live := src.counts(); allocs != 1 || frees != 1 || live != 0 {
				t.Errorf("source: %d allocs, %d frees, %d live; want the region freed", allocs, frees, live)
			}
			if st := p.Stats(); st.Arenas != 0 || st.Reserved != 0 || len(p.arenas()) != 0 {
				t.Errorf("half-registered arena left: %v", st)
			}
			// Once the visitor recovers, the pool works.
			failing.failVisit, failing.panicVisit = nil, false
			b := mustAlloc(t, p, 4096)
			a, _ := arenaOf(b)
			if a.ID != 1 {
				t.Errorf("new arena has ID %d, want 1", a.ID)
			}
			mustFree(t, b)
		})
	}
}

// TestVisitOncePerArena allocates 10,000 tensors of mixed sizes and checks
// that the visitors ran once per arena, not once per tensor.
func TestVisitOncePerArena(t *testing.T) {
	src := newCountingSource()
	v := newCountingVisitor("count", nil)
	p, err := New(src, WithVisitors(v))
	if err != nil {
		t.Fatal(err)
	}
	rng := newRand(1)
	var live []*tensor.Tensor
	const tensors = 10000
	for i := range tensors {
		// Log-uniform sizes from 256 B to 4 MiB, in float32 elements.
		size := 256 << rng.IntN(15)
		size += rng.IntN(size)
		size = min(size, 4<<20)
		m, err := tensor.MetaFor(tensor.Float32, tensor.Shape{int64(size / 4)})
		if err != nil {
			t.Fatal(err)
		}
		x, err := p.NewTensor(m)
		if err != nil {
			t.Fatalf("tensor %d of %d bytes: %v", i, size, err)
		}
		f, _ := tensor.View[float32](x)
		f[0], f[len(f)-1] = float32(i), float32(i)
		live = append(live, x)
		// Keep a working set of up to 64 tensors, released in random order.
		if len(live) > 64 {
			k := rng.IntN(len(live))
			if err := live[k].Release(); err != nil {
				t.Fatal(err)
			}
			live = slices.Delete(live, k, k+1)
		}
	}
	mustCheck(t, p)
	for _, x := range live {
		if err := x.Release(); err != nil {
			t.Fatal(err)
		}
	}
	st := p.Stats()
	visits, _ := v.totals()
	if visits != st.Arenas || uint64(visits) != st.ArenasCreated {
		t.Errorf("%d visits for %d arenas (%d created)", visits, st.Arenas, st.ArenasCreated)
	}
	if st.Arenas == 0 || st.Arenas > tensors/100 {
		t.Errorf("%d arenas for %d tensors", st.Arenas, tensors)
	}
	t.Logf("%d tensors in %d arenas: %v", tensors, st.Arenas, st)
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if visits, releases := v.totals(); visits != releases || visits != st.Arenas {
		t.Errorf("%d visits, %d releases, %d arenas", visits, releases, st.Arenas)
	}
	if allocs, frees, live := src.counts(); allocs != st.Arenas || frees != allocs || live != 0 {
		t.Errorf("source: %d allocs, %d frees, %d live", allocs, frees, live)
	}
}

func TestNewTensor(t *testing.T) {
	p := newTestPool(t, NewMmapSource(MmapOptions{}))
	m, _ := tensor.MetaFor(tensor.Float32, tensor.Shape{3, 5})
	x, err := p.NewTensor(m)
	if err != nil {
		t.Fatal(err)
	}
	b, err := x.Bytes()
	if err != nil || len(b) != 60 {
		t.Fatalf("Bytes = %d bytes, %v", len(b), err)
	}
	if a, ok := p.ArenaOf(x.Addr()); !ok || !a.contains(x.Addr(), 60) {
		t.Error("tensor not inside an arena")
	}
	if err := x.Release(); err != nil {
		t.Fatal(err)
	}
	if st := p.Stats(); st.Blocks != 0 {
		t.Errorf("Release did not free: %v", st)
	}
	for name, m := range map[string]tensor.Meta{
		"dead":  {DType: tensor.Float32, Shape: tensor.Shape{4}, IsDead: true},
		"empty": {DType: tensor.Int64, Shape: tensor.Shape{0, 7}},
	} {
		x, err := p.NewTensor(m)
		if err != nil || x.Buffer() != nil {
			t.Errorf("%s: %v, buffer %v", name, err, x.Buffer())
		}
	}
	if _, err := p.NewTensor(tensor.Meta{DType: tensor.String, Shape: tensor.Shape{2}, ByteSize: 10}); !errors.Is(err, tensor.ErrNotDMAable) {
		t.Errorf("string tensor: %v", err)
	}
	if _, err := p.NewTensor(tensor.Meta{DType: tensor.Float32, Shape: tensor.Shape{2}, ByteSize: 7}); !errors.Is(err, tensor.ErrSizeMismatch) {
		t.Errorf("inconsistent meta: %v", err)
	}
	if st := p.Stats(); st.Blocks != 0 {
		t.Errorf("failed tensors left blocks: %v", st)
	}
}

func TestAlignment(t *testing.T) {
	for _, align := range []int{1, 64, 4096, 64 << 10} {
		t.Run(fmt.Sprint(align), func(t *testing.T) {
			p := newTestPool(t, NewMmapSource(MmapOptions{}), withAlignment(align), WithInitialArena(1<<20))
			var blocks []Block
			for n := 1; n < 100000; n = n*3 + 1 {
				b := mustAlloc(t, p, n)
				if b.Addr()%uintptr(align) != 0 {
					t.Errorf("block of %d at %#x not aligned to %d", n, b.Addr(), align)
				}
				blocks = append(blocks, b)
			}
			mustCheck(t, p)
			for _, b := range blocks {
				mustFree(t, b)
			}
		})
	}
}

func TestStatsString(t *testing.T) {
	p := newTestPool(t, NewMmapSource(MmapOptions{}), WithName("s"), WithInitialArena(1<<20))
	b := mustAlloc(t, p, 3000)
	s := p.Stats().String()
	for _, want := range []string{`pool "s"`, "in use 3.0 KiB", "requested 2.9 KiB", "1 blocks", "reserved 1.0 MiB in 1 arenas", "limit none"} {
		if !strings.Contains(s, want) {
			t.Errorf("%q lacks %q", s, want)
		}
	}
	mustFree(t, b)
}

func TestReserve(t *testing.T) {
	v := newCountingVisitor("v", nil)
	p := newTestPool(t, newCountingSource(), WithVisitors(v), WithInitialArena(1<<20))
	if err := p.reserve(3 << 20); err != nil {
		t.Fatal(err)
	}
	if visits, _ := v.totals(); visits != 1 || p.Stats().Reserved != 4<<20 {
		t.Fatalf("after Reserve: %d visits, %v", visits, p.Stats())
	}
	if err := p.reserve(1 << 20); err != nil {
		t.Fatal(err)
	}
	b := mustAlloc(t, p, 3<<20)
	if visits, _ := v.totals(); visits != 1 || p.Stats().Arenas != 1 {
		t.Errorf("allocating what was reserved visited again: %d visits, %v", visits, p.Stats())
	}
	mustFree(t, b)
	if err := p.reserve(0); !errors.Is(err, ErrBadSize) {
		t.Errorf("Reserve(0) = %v", err)
	}
}

// blockingVisitor blocks in Visit of every arena after the first until
// released, to hold a growth open.
type blockingVisitor struct {
	countingVisitor
	entered chan int
	release chan struct{}
}

func (v *blockingVisitor) Visit(a *Arena) error {
	if a.ID > 0 {
		v.entered <- a.ID
		<-v.release
	}
	return v.countingVisitor.Visit(a)
}

func newBlockingVisitor() *blockingVisitor {
	return &blockingVisitor{countingVisitor: *newCountingVisitor("blocking", nil), entered: make(chan int, 4), release: make(chan struct{})}
}

// TestAllocDuringSlowVisit checks that an arena being visited does not hold
// up allocations that fit in the arenas already there.
func TestAllocDuringSlowVisit(t *testing.T) {
	v := newBlockingVisitor()
	p := newTestPool(t, newCountingSource(), WithVisitors(v), WithInitialArena(1<<20), WithMaxArena(1<<20))
	first := mustAlloc(t, p, 512<<10)
	grown := make(chan error, 2)
	var big []Block
	var mu sync.Mutex
	for range 2 {
		go func() {
			b, err := p.Alloc(1 << 20) // needs a new arena each
			mu.Lock()
			big = append(big, b)
			mu.Unlock()
			grown <- err
		}()
	}
	<-v.entered // one growth is inside Visit, the other waits for it
	small := mustAlloc(t, p, 256<<10)
	if a, _ := arenaOf(small); a.ID != 0 {
		t.Errorf("small block in %v, want arena 0", a)
	}
	mustFree(t, small)
	close(v.release)
	for range 2 {
		if err := <-grown; err != nil {
			t.Fatal(err)
		}
	}
	if st := p.Stats(); st.Arenas != 3 || st.ArenasCreated != 3 {
		t.Errorf("after two growths: %v", st)
	}
	for _, b := range append(big, first) {
		mustFree(t, b)
	}
}

// TestCloseDuringGrowth closes a pool while an arena is being visited: Close
// waits, the growth gives its arena back, and nothing is left.
func TestCloseDuringGrowth(t *testing.T) {
	v := newBlockingVisitor()
	src := newCountingSource()
	p, err := New(src, WithVisitors(v), WithInitialArena(1<<20), WithMaxArena(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	first := mustAlloc(t, p, 1<<20)
	grown := make(chan error, 1)
	go func() {
		_, err := p.Alloc(1 << 20)
		grown <- err
	}()
	<-v.entered
	mustFree(t, first)
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	for !p.closedFlag.Load() { // Close has begun and waits for the growth
		runtime.Gosched()
	}
	close(v.release)
	if err := <-grown; !errors.Is(err, ErrClosed) {
		t.Errorf("Alloc across Close = %v, want ErrClosed", err)
	}
	if err := <-closed; err != nil {
		t.Errorf("Close = %v", err)
	}
	if allocs, frees, live := src.counts(); allocs != 2 || frees != 2 || live != 0 {
		t.Errorf("source: %d allocs, %d frees, %d live", allocs, frees, live)
	}
	if visits, releases := v.totals(); visits != 2 || releases != 2 {
		t.Errorf("visitor: %d visits, %d releases", visits, releases)
	}
}
