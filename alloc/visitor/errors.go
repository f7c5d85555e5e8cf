package visitor

import "errors"

// ErrMemlockLimit: mlock refused because of RLIMIT_MEMLOCK (ENOMEM or EPERM
// without CAP_IPC_LOCK). The message gives the limit's soft and hard values
// and the arena's size. It is wrapped with the arena and the errno; match it
// with errors.Is.
var ErrMemlockLimit = errors.New("visitor: locked-memory limit (RLIMIT_MEMLOCK) too low")

// Errors that the message explains and no caller acts on: each is wrapped
// with the arena and the cause.
var (
	// errMlock: mlock or munlock failed for another reason.
	errMlock = errors.New("visitor: mlock failed")
	// errNotHostMemory: a host-only visitor was given an arena of GPU memory.
	errNotHostMemory = errors.New("visitor: arena is not host memory")
	// errNotShareable: an arena with no file descriptor to share (not from a
	// memfd source).
	errNotShareable = errors.New("visitor: arena has no file descriptor to share")
	// errExport: duplicating, naming or mapping an exported descriptor failed.
	errExport = errors.New("visitor: export failed")
	// errAlreadyVisited: Visit called twice for one arena (the visitor given
	// twice to a pool).
	errAlreadyVisited = errors.New("visitor: arena already visited")
	// errNotVisited: Release of an arena the visitor never visited.
	errNotVisited = errors.New("visitor: arena not visited")
)
