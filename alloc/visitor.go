package alloc

// Visitor is told about every arena of a pool: Visit once when the arena is
// created, before any tensor from it is handed out, and Release once before
// the arena's memory is freed. Visitors are fixed when the pool is built, so
// none can miss an arena.
//
// Visit may attach handles to the arena with Arena.SetHandle. If Visit fails,
// the pool calls Release on the visitors that already visited that arena, in
// reverse order, frees the region and returns the error: nothing stays half
// registered. A visitor must be safe for use by several pools at once.
type Visitor interface {
	// Name says what the visitor does ("mlock", "verbs-mr:rxe0").
	Name() string
	// Visit is called once when an arena is created.
	Visit(a *Arena) error
	// Release is called once before an arena is released.
	Release(a *Arena) error
}

// VisitorFuncs adapts two functions to a Visitor.
type VisitorFuncs struct {
	VisitorName string
	OnVisit     func(a *Arena) error
	OnRelease   func(a *Arena) error
}

// Name implements Visitor.
func (v VisitorFuncs) Name() string { return v.VisitorName }

// Visit implements Visitor.
func (v VisitorFuncs) Visit(a *Arena) error {
	if v.OnVisit == nil {
		return nil
	}
	return v.OnVisit(a)
}

// Release implements Visitor.
func (v VisitorFuncs) Release(a *Arena) error {
	if v.OnRelease == nil {
		return nil
	}
	return v.OnRelease(a)
}
