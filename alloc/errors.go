package alloc

import (
	"errors"

	"github.com/gdrlink/gdrlink/internal/closed"
)

// Errors of this package. Each is wrapped with the detail that caused it (the
// size, the address, the pool's state); match them with errors.Is.
var (
	// ErrDoubleFree: a block freed twice, or a stale Block of a chunk that
	// was freed and handed out again.
	ErrDoubleFree = errors.New("alloc: block already freed")
	// ErrNotOwned: an address or block that the pool did not hand out (outside
	// its arenas, or inside a block but not at its start), or a region that a
	// source did not make.
	ErrNotOwned = errors.New("alloc: not owned by this pool")
	// ErrPoolExhausted: an allocation that would take the pool beyond its
	// byte limit, or that the source could not back with a new arena. The
	// message carries the request, the pool's usage and a bin summary.
	ErrPoolExhausted = errors.New("alloc: pool exhausted")
	// ErrClosed: a pool or source used after Close. It is the one closed error of every layer
	// (the same value as gdrlink.ErrClosed and verbsio.ErrClosed), so
	// errors.Is matches it whichever layer noticed.
	ErrClosed = closed.Err
	// ErrLeaked: blocks still allocated when the pool was closed; the message
	// counts them and their bytes.
	ErrLeaked = errors.New("alloc: blocks leaked")
	// ErrVisitor: a visitor failed to visit or release an arena; the message
	// names the visitor and the arena, and the visitor's error is wrapped too.
	ErrVisitor = errors.New("alloc: visitor failed")
	// ErrBadSize: an allocation or region size that is zero, negative or
	// too large to represent.
	ErrBadSize = errors.New("alloc: invalid size")
	// ErrBadOption: an option out of range (an arena size that is not
	// positive, a maximum arena below the initial one).
	ErrBadOption = errors.New("alloc: invalid option")
)

// Errors that say a source or the pool itself is broken: the message says
// what, and no caller has anything to do but report it.
var (
	// errBadRegion: a region from a source that is smaller than asked, at
	// address zero, or overlapping an arena of the pool.
	errBadRegion = errors.New("alloc: invalid region from source")
	// errCorrupt: Pool.Check found a broken invariant.
	errCorrupt = errors.New("alloc: pool invariant broken")
)
