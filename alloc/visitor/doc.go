// Package visitor holds ready alloc.Visitors: memory-region registration with
// a verbs provider (NewMemoryRegistration, NewGPUMemoryRegions), CUDA host
// registration (NewCUDAHostRegister), page locking (NewMlock), counting and
// logging (NewStats), and export of memfd arenas to on-node peers
// (NewIPCExport). Each runs once per arena, when the pool creates it and when
// the pool releases it, and attaches a handle to the arena that a helper of
// this package fetches back (MemoryRegionOf, IPCExportOf), from the arena
// that alloc.Pool.ArenaOf finds for any address inside it.
//
// The visitors that need the CUDA driver take a GPU by its CUDA ordinal and
// retain its primary context themselves, only while they need it.
//
// A visitor fails with an error that says which arena and why, wrapping the
// cause: a failed system call's errno (so that errors.Is(err, unix.ENOMEM)
// holds), the driver's or the provider's error, and for the conditions a
// caller can act on one of this package's sentinels (ErrMemlockLimit,
// ErrBAR1Exhausted, ErrGPURegistration, ErrNoRegion).
package visitor
