package visitor

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/tensor"
)

// regionSource is a source of one region that a test made: a real mapping,
// or an address range nothing will touch. It refuses the first refuse
// requests. Freeing the region is left to the test.
type regionSource struct {
	r      *alloc.Region
	refuse int
	out    bool
}

// errRefused is regionSource's refusal.
var errRefused = errors.New("test region refused")

func (s *regionSource) Name() string          { return "test-region" }
func (s *regionSource) Device() tensor.Device { return s.r.Device }
func (s *regionSource) Close() error          { return nil }

func (s *regionSource) Alloc(size int) (*alloc.Region, error) {
	switch {
	case s.refuse > 0:
		s.refuse--
		return nil, errRefused
	case s.out || size > s.r.Size:
		return nil, fmt.Errorf("test region [%#x+%d] cannot give %d bytes", s.r.Base, s.r.Size, size)
	}
	s.out = true
	return s.r, nil
}

func (s *regionSource) Free(r *alloc.Region) error {
	if !s.out || r != s.r {
		return fmt.Errorf("test region [%#x+%d]: freeing a region it did not give", s.r.Base, s.r.Size)
	}
	s.out = false
	return nil
}

// loneArena makes r the one arena of a pool without visitors, so that a
// visitor can be tested on that arena by itself; the arena's ID is id (the
// pool numbers arenas from 0 and a refused growth uses a number up, so the
// source refuses id times first). The pool touches none of r's memory; r's
// size must be a multiple of 256 bytes, the pool's alignment. done closes
// the pool; r stays the caller's to free.
func loneArena(id int, r *alloc.Region) (a *alloc.Arena, done func() error, err error) {
	p, err := alloc.New(&regionSource{r: r, refuse: id}, alloc.WithInitialArena(r.Size))
	if err != nil {
		return nil, nil, err
	}
	for range id {
		if _, err := p.Alloc(r.Size); !errors.Is(err, errRefused) {
			return nil, nil, errors.Join(fmt.Errorf("refused growth: %v", err), p.Close())
		}
	}
	b, err := p.Alloc(r.Size)
	if err != nil {
		return nil, nil, errors.Join(err, p.Close())
	}
	done = func() error { return errors.Join(b.Free(), p.Close()) }
	a, ok := p.ArenaOf(b.Addr())
	switch {
	case !ok:
		return nil, nil, errors.Join(fmt.Errorf("no arena holds block %#x", b.Addr()), done())
	case a.ID != id:
		return nil, nil, errors.Join(fmt.Errorf("%s, want ID %d", a, id), done())
	}
	return a, done, nil
}

// testArena is loneArena for a test: the pool is closed when the test ends.
func testArena(t testing.TB, id int, r *alloc.Region) *alloc.Arena {
	t.Helper()
	a, done, err := loneArena(id, r)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := done(); err != nil {
			t.Error(err)
		}
	})
	return a
}

// ArenasOf lists, in order, the distinct arenas of a pool holding blocks.
func ArenasOf(p *alloc.Pool, blocks []alloc.Block) []*alloc.Arena {
	var out []*alloc.Arena
	for _, b := range blocks {
		a, ok := p.ArenaOf(b.Addr())
		if ok && !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	return out
}
