package alloc

import (
	"fmt"
	"math/bits"
)

// Defaults of a pool built without options.
const (
	// defaultAlignment is the alignment of every block, and the smallest
	// block, in bytes.
	defaultAlignment = 256
	// defaultInitialArena is the size of a pool's first arena.
	defaultInitialArena = 2 << 20
	// defaultMaxArena is the size beyond which arenas stop doubling. A
	// request larger than this still gets an arena of its own.
	defaultMaxArena = 1 << 30
	// maxAlignment bounds withAlignment (a huge page).
	maxAlignment = 1 << 21
)

type config struct {
	name      string
	visitors  []Visitor
	align     int
	initArena int
	initSet   bool // initArena given by WithInitialArena
	maxArena  int
	limit     int64
	budget    *Budget
}

// Option configures a pool built by New.
type Option func(*config) error

// WithVisitors sets the visitors told about every arena, in order; they are
// released in the reverse order. They are fixed for the pool's life.
func WithVisitors(v ...Visitor) Option {
	return func(c *config) error {
		for i, x := range v {
			if x == nil {
				return fmt.Errorf("%w: visitor %d is nil", ErrBadOption, i)
			}
		}
		c.visitors = append(c.visitors, v...)
		return nil
	}
}

// withAlignment sets the alignment of every block, a power of two from 1 to
// 2 MiB (default 256). It is also the smallest block and the granularity of
// splitting.
func withAlignment(n int) Option {
	return func(c *config) error {
		if n <= 0 || n > maxAlignment || bits.OnesCount(uint(n)) != 1 {
			return fmt.Errorf("%w: alignment %d is not a power of two in [1, %d]", ErrBadOption, n, maxAlignment)
		}
		c.align = n
		return nil
	}
}

// WithInitialArena sets the size of the first arena (default 2 MiB). Each
// later arena is twice the previous one, up to the maximum arena size.
func WithInitialArena(bytes int) Option {
	return func(c *config) error {
		if bytes <= 0 || bytes > maxAlloc {
			return fmt.Errorf("%w: initial arena of %d bytes", ErrBadOption, bytes)
		}
		c.initArena, c.initSet = bytes, true
		return nil
	}
}

// WithMaxArena sets the size at which arenas stop doubling (default 1 GiB):
// a larger maximum means fewer arenas, so fewer registrations, for a pool
// that grows large. A request larger than the maximum still gets an arena
// of its own. Without WithInitialArena, the first arena is no larger than
// this.
func WithMaxArena(bytes int) Option {
	return func(c *config) error {
		if bytes <= 0 || bytes > maxAlloc {
			return fmt.Errorf("%w: maximum arena of %d bytes", ErrBadOption, bytes)
		}
		c.maxArena = bytes
		return nil
	}
}

// WithLimit caps the bytes the pool reserves from its source, the sum of its
// arenas' sizes (default 0: no limit).
func WithLimit(bytes int64) Option {
	return func(c *config) error {
		if bytes < 0 {
			return fmt.Errorf("%w: limit of %d bytes", ErrBadOption, bytes)
		}
		c.limit = bytes
		return nil
	}
}

// WithName names the pool in errors, stats and logs.
func WithName(name string) Option {
	return func(c *config) error {
		c.name = name
		return nil
	}
}
