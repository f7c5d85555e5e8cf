// Package visitor holds ready alloc.Visitors: memory-region registration with
// a verbs provider (MemoryRegistration, GPUMemoryRegions), CUDA host
// registration (CUDAHostRegister), page locking (Mlock), counting and
// logging (Stats), and export of memfd arenas to on-node peers
// (IPCExporter). Each runs once per arena, when the pool creates it and when
// the pool releases it, and attaches a handle to the arena that a helper of
// this package fetches back (MemoryRegionOf, LockedOf, StatsOf,
// IPCExportOf...), from the arena that alloc.Pool.ArenaOf finds for any
// address inside it.
//
// A visitor fails with an error wrapping one of this package's sentinels and,
// for a failed system call, the errno too, so that both errors.Is(err,
// ErrMemlockLimit) and errors.Is(err, unix.ENOMEM) hold. Visit of an arena
// already visited fails with ErrAlreadyVisited, Release of one never visited
// with ErrNotVisited.
package visitor
