package visitor_test

import (
	"fmt"

	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/alloc/visitor"
)

// Lock every arena of a pool in RAM once, instead of every tensor.
func ExampleNewMlock() {
	pool, err := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithVisitors(visitor.NewMlock()), alloc.WithInitialArena(1<<20))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	b, err := pool.Alloc(4096)
	if err != nil {
		fmt.Println(err) // ErrMemlockLimit says which limit to raise
		return
	}
	defer b.Free()
	// The pool handed out a block, so every byte of its arenas is locked.
	fmt.Println("locked bytes:", pool.Stats().Reserved)
	// Output: locked bytes: 1048576
}

// Count the arenas a pool creates; with a logger at debug level each visit
// and release is logged too.
func ExampleNewStats() {
	stats := visitor.NewStats(nil)
	pool, _ := alloc.New(alloc.NewMmapSource(alloc.MmapOptions{}),
		alloc.WithVisitors(stats), alloc.WithInitialArena(1<<20))
	for range 100 {
		b, _ := pool.Alloc(64 << 10)
		b.Free()
	}
	pool.Close()
	fmt.Println(stats)
	// Output: 1 arenas visited (1.0 MiB), 1 released (1.0 MiB), 0 live (0 B)
}

// Export the arenas of a memfd pool so that an on-node peer maps them.
func ExampleNewIPCExport() {
	pool, _ := alloc.New(alloc.NewMemfdSource("peers", alloc.MmapOptions{}),
		alloc.WithVisitors(visitor.NewIPCExport()))
	defer pool.Close()
	b, _ := pool.Alloc(4096)
	defer b.Free()
	copy(b.Bytes(), "shared")

	arena, _ := pool.ArenaOf(b.Addr())
	export, _ := visitor.IPCExportOf(arena)
	off := b.Addr() - export.Base
	// The peer receives export.FD (SCM_RIGHTS or /proc/PID/fd) and maps it.
	peer, err := visitor.MapExport(export.FD, export.Size)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer peer.Close()
	fmt.Println(string(peer.Bytes()[off : off+6]))
	// Output: shared
}
