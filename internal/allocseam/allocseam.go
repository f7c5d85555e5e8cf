// Package allocseam lets the module's own tests and benchmarks reach what
// package alloc keeps out of its public API. Package alloc fills the
// variables when it is initialized; code that imports alloc can then use them
// (alloc cannot be imported here: it imports this package).
package allocseam

// NewArena is alloc's func(id int, r *alloc.Region) *alloc.Arena: it wraps a
// region in an arena outside any pool, so that a visitor can be tested on its
// own.
var NewArena any
