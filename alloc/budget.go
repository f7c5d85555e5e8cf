package alloc

import (
	"fmt"
	"sync"
)

// Budget is a byte limit that several pools share (WithBudget): the sum of
// the arenas they reserve never exceeds it, as one pool's WithLimit bounds
// its own. A program that keeps tensors of different owners in different
// pools (so that a key to one pool's arenas reaches no other's tensors)
// bounds them all at once with one Budget. It is safe for concurrent use.
type Budget struct {
	name  string
	limit int64

	mu       sync.Mutex
	reserved int64
}

// NewBudget returns a budget of limit bytes (at least 1), named in errors.
func NewBudget(name string, limit int64) (*Budget, error) {
	if limit < 1 {
		return nil, fmt.Errorf("%w: budget %q of %d bytes", ErrBadOption, name, limit)
	}
	return &Budget{name: name, limit: limit}, nil
}

// Limit is the budget's byte limit.
func (b *Budget) Limit() int64 { return b.limit }

// Reserved is the bytes its pools' arenas hold now.
func (b *Budget) Reserved() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.reserved
}

func (b *Budget) room() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.limit - b.reserved
}

// take reserves n bytes if they fit.
func (b *Budget) take(n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if n > b.limit-b.reserved {
		return false
	}
	b.reserved += n
	return true
}

func (b *Budget) give(n int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reserved -= n
}

func (b *Budget) describe() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return fmt.Sprintf("budget %q (%d of %d bytes reserved by its pools)", b.name, b.reserved, b.limit)
}

// WithBudget makes the pool's arenas count against b, shared with the
// other pools given b; the pool's own WithLimit, if any, still applies.
func WithBudget(b *Budget) Option {
	return func(c *config) error {
		if b == nil {
			return fmt.Errorf("%w: nil budget", ErrBadOption)
		}
		c.budget = b
		return nil
	}
}
