package visitor

import "errors"

// Errors of this package's visitors. Each is wrapped with the arena and the
// cause; match them with errors.Is.
var (
	// ErrMemlockLimit: mlock refused because of RLIMIT_MEMLOCK (ENOMEM or
	// EPERM without CAP_IPC_LOCK). The message gives the limit's soft and
	// hard values and the arena's size.
	ErrMemlockLimit = errors.New("visitor: locked-memory limit (RLIMIT_MEMLOCK) too low")
	// ErrMlock: mlock or munlock failed for another reason.
	ErrMlock = errors.New("visitor: mlock failed")
	// ErrNotHostMemory: a host-only visitor was given an arena of GPU memory.
	ErrNotHostMemory = errors.New("visitor: arena is not host memory")
	// ErrNotShareable: an arena with no file descriptor to share (not from a
	// memfd source).
	ErrNotShareable = errors.New("visitor: arena has no file descriptor to share")
	// ErrExport: duplicating, naming or mapping an exported descriptor failed.
	ErrExport = errors.New("visitor: export failed")
	// ErrAlreadyVisited: Visit called twice for one arena (the visitor given
	// twice to a pool).
	ErrAlreadyVisited = errors.New("visitor: arena already visited")
	// ErrNotVisited: Release of an arena the visitor never visited.
	ErrNotVisited = errors.New("visitor: arena not visited")
)
