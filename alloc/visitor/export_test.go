package visitor

import (
	"slices"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/allocseam"
)

// NewTestArena wraps a region in an arena outside any pool, so that a
// visitor can be tested on its own.
func NewTestArena(id int, r *alloc.Region) *alloc.Arena {
	return allocseam.NewArena.(func(int, *alloc.Region) *alloc.Arena)(id, r)
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
