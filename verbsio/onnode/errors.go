package onnode

import "errors"

// Errors of this provider, besides the verbsio sentinels it wraps.
var (
	// ErrCrossMemory: the kernel refused process_vm_writev or process_vm_readv
	// into the peer (EPERM: no right to ptrace it; ESRCH: no such process).
	// The error also matches the errno. With MechVM, Connect fails with it;
	// a write it fails moves the queue pair to the error state, and later
	// posts return it wrapped with verbsio.ErrQPState.
	ErrCrossMemory = errors.New("onnode: cross-process memory access refused")
	// errNotShared: a region was registered as file-backed but its memory is
	// not a shared mapping of that file.
	errNotShared = errors.New("onnode: memory is not a shared file mapping")
)
