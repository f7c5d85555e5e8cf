// Package alloc is gdrlink's pool allocator: a best-fit-with-coalescing
// (BFC) pool that carves tensors out of a few large arenas.
//
// Arenas come from a Source (anonymous mmap or memfd memory off the Go heap
// here; pinned host and GPU memory from other sources). Every arena is shown
// to the pool's visitors exactly once when it is created, before any block of
// it is handed out, and once more before it is released. A visitor that
// registers the arena with an RDMA NIC therefore registers each byte once,
// however many tensors later live there, and attaches its handle (an lkey and
// rkey) to the arena; Pool.ArenaOf finds the arena, and so the handle, from
// any address inside it.
//
// Inside an arena the pool keeps chunks: a chunk never spans two arenas, so
// one registration always covers it. Free chunks sit in size-class bins
// sorted by size and address; an allocation takes the smallest chunk that
// fits, splits off the rest, and a free merges the chunk with free
// neighbours. When no chunk fits the pool grows by a new arena, doubling the
// arena size from WithInitialArena up to WithMaxArena (1 GiB by default),
// within WithLimit.
//
// Chunks are integer indices into one slice, not pointers, so the garbage
// collector has nothing to scan; a Block remembers its chunk's index and
// generation, so freeing a stale Block fails with ErrDoubleFree instead of
// freeing somebody else's memory. Pool.Check walks the whole structure and
// reports the first broken invariant.
package alloc
