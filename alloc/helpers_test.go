package alloc

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/gdrlink/gdrlink/tensor"
)

// countingSource wraps a real source, counts regions and can be told to fail.
type countingSource struct {
	inner Source

	mu      sync.Mutex
	allocs  int
	frees   int
	live    map[uintptr]int
	failAt  map[int]bool // fail the n-th Alloc (1-based)
	failAll bool
	sizes   []int // sizes asked, in order
}

var errInjected = errors.New("injected source failure")

func newCountingSource() *countingSource {
	return &countingSource{inner: NewMmapSource(MmapOptions{}), live: map[uintptr]int{}, failAt: map[int]bool{}}
}

func (s *countingSource) Name() string          { return "counting" }
func (s *countingSource) Device() tensor.Device { return s.inner.Device() }

func (s *countingSource) Alloc(size int) (*Region, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sizes = append(s.sizes, size)
	n := len(s.sizes)
	if s.failAll || s.failAt[n] {
		return nil, fmt.Errorf("alloc %d of %d bytes: %w", n, size, errInjected)
	}
	r, err := s.inner.Alloc(size)
	if err != nil {
		return nil, err
	}
	s.allocs++
	s.live[r.Base] = r.Size
	return r, nil
}

func (s *countingSource) Close() error { return s.inner.Close() }

func (s *countingSource) Free(r *Region) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.live[r.Base]; !ok {
		return fmt.Errorf("region %#x freed twice or never made", r.Base)
	}
	delete(s.live, r.Base)
	s.frees++
	return s.inner.Free(r)
}

func (s *countingSource) counts() (allocs, frees, live int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.allocs, s.frees, len(s.live)
}

// countingVisitor records visits and releases per arena ID.
type countingVisitor struct {
	name string
	mu   sync.Mutex
	// visits and releases count calls per arena ID.
	visits, releases map[int]int
	order            *[]string // shared log of calls across visitors
	failVisit        error
	panicVisit       bool
}

func newCountingVisitor(name string, order *[]string) *countingVisitor {
	return &countingVisitor{name: name, visits: map[int]int{}, releases: map[int]int{}, order: order}
}

func (v *countingVisitor) Name() string { return v.name }

func (v *countingVisitor) Visit(a *Arena) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.order != nil {
		*v.order = append(*v.order, fmt.Sprintf("visit %s %d", v.name, a.ID))
	}
	if v.panicVisit {
		panic("visitor " + v.name + " panics")
	}
	if v.failVisit != nil {
		return v.failVisit
	}
	v.visits[a.ID]++
	a.SetHandle(v, v.name+fmt.Sprint(a.ID))
	return nil
}

func (v *countingVisitor) Release(a *Arena) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.order != nil {
		*v.order = append(*v.order, fmt.Sprintf("release %s %d", v.name, a.ID))
	}
	if v.visits[a.ID] == 0 {
		return fmt.Errorf("release of arena %d never visited", a.ID)
	}
	v.releases[a.ID]++
	a.DeleteHandle(v)
	return nil
}

func (v *countingVisitor) totals() (visits, releases int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for id, n := range v.visits {
		if n != 1 {
			return -1, -1
		}
		visits += n
		releases += v.releases[id]
	}
	return visits, releases
}

// newTestPool builds a pool whose invariants are checked and which is closed,
// leak free, when the test ends.
func newTestPool(t testing.TB, src Source, opts ...Option) *Pool {
	t.Helper()
	p, err := New(src, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Check(); err != nil {
			t.Errorf("Check at cleanup: %v", err)
		}
		if err := p.Close(); err != nil {
			t.Errorf("Close at cleanup: %v", err)
		}
	})
	return p
}

func mustAlloc(t testing.TB, p *Pool, n int) Block {
	t.Helper()
	b, err := p.Alloc(n)
	if err != nil {
		t.Fatalf("Alloc(%d): %v", n, err)
	}
	return b
}

func mustFree(t testing.TB, b Block) {
	t.Helper()
	if err := b.Free(); err != nil {
		t.Fatalf("Free(%#x): %v", b.Addr(), err)
	}
}

func mustCheck(t testing.TB, p *Pool) {
	t.Helper()
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}
}

// arenaOf is the arena holding a block of a pool.
func arenaOf(b Block) (*Arena, bool) {
	if b.pool == nil {
		return nil, false
	}
	return b.pool.ArenaOf(b.addr)
}
