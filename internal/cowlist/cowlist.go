// Package cowlist is a copy-on-write list: readers load a snapshot without
// a lock (a completion queue's poll loop walking its queue pairs), writers
// (queue pairs attached and detached) copy it.
package cowlist

import "sync/atomic"

// List is a copy-on-write list of distinct items. The zero value is empty
// and ready to use.
type List[T comparable] struct {
	p atomic.Pointer[[]T]
}

// Load returns the current snapshot; callers must not change it.
func (l *List[T]) Load() []T {
	if s := l.p.Load(); s != nil {
		return *s
	}
	return nil
}

// Add puts x in the list unless it is there already.
func (l *List[T]) Add(x T) {
	for {
		old := l.p.Load()
		var cur []T
		if old != nil {
			cur = *old
		}
		for _, y := range cur {
			if y == x {
				return
			}
		}
		next := append(append(make([]T, 0, len(cur)+1), cur...), x)
		if l.p.CompareAndSwap(old, &next) {
			return
		}
	}
}

// Remove takes x out of the list.
func (l *List[T]) Remove(x T) {
	for {
		old := l.p.Load()
		if old == nil {
			return
		}
		next := make([]T, 0, len(*old))
		for _, y := range *old {
			if y != x {
				next = append(next, y)
			}
		}
		if l.p.CompareAndSwap(old, &next) {
			return
		}
	}
}
