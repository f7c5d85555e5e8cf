package visitor

import (
	"errors"
	"fmt"

	"github.com/dustin/go-humanize"
	"github.com/gdrlink/gdrlink/alloc"
	"github.com/gdrlink/gdrlink/internal/offheap"
	"golang.org/x/sys/unix"
)

// mlock is the visitor NewMlock returns. It attaches a locked handle.
type mlock struct{}

// locked is the handle mlock attaches to an arena.
type locked struct {
	// Bytes is the number of bytes locked.
	Bytes int
}

type lockedKey struct{}

// NewMlock returns a visitor that locks every page of each arena in RAM
// (mlock) when the arena is created and unlocks it (munlock) before it is
// released, so that the kernel never swaps or migrates memory a NIC or a GPU
// copy engine may be reading. Locking counts against RLIMIT_MEMLOCK unless
// the process has CAP_IPC_LOCK: an arena beyond the limit fails with an
// error wrapping ErrMemlockLimit and the errno.
func NewMlock() alloc.Visitor { return &mlock{} }

// Name is "mlock".
func (*mlock) Name() string { return "mlock" }

// Visit locks the arena's pages.
func (*mlock) Visit(a *alloc.Arena) error {
	if _, ok := a.Handle(lockedKey{}); ok {
		return fmt.Errorf("%w: mlock of %s", errAlreadyVisited, a)
	}
	mem := hostBytes(a)
	if mem == nil {
		return fmt.Errorf("%w: cannot mlock %s", errNotHostMemory, a)
	}
	if err := unix.Mlock(mem); err != nil {
		return mlockError(a, err)
	}
	a.SetHandle(lockedKey{}, locked{Bytes: len(mem)})
	return nil
}

// Release unlocks the arena's pages.
func (*mlock) Release(a *alloc.Arena) error {
	h, ok := a.Handle(lockedKey{})
	if !ok {
		return fmt.Errorf("%w: munlock of %s", errNotVisited, a)
	}
	a.DeleteHandle(lockedKey{})
	mem := hostBytes(a)
	if err := unix.Munlock(mem[:h.(locked).Bytes]); err != nil {
		return fmt.Errorf("%w: munlock of %s: %w", errMlock, a, err)
	}
	return nil
}

// lockedOf returns the mlock handle of an arena, if Mlock visited it.
func lockedOf(a *alloc.Arena) (locked, bool) {
	h, ok := a.Handle(lockedKey{})
	if !ok {
		return locked{}, false
	}
	l, ok := h.(locked)
	return l, ok
}

// mlockError explains a failed mlock. ENOMEM and EPERM mostly mean the
// locked-memory limit: the error names it with its values.
func mlockError(a *alloc.Arena, err error) error {
	if !errors.Is(err, unix.ENOMEM) && !errors.Is(err, unix.EPERM) {
		return fmt.Errorf("%w: mlock of %s: %w", errMlock, a, err)
	}
	var lim unix.Rlimit
	limits := "unknown"
	if gerr := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); gerr == nil {
		limits = fmt.Sprintf("soft %s, hard %s", rlimitString(lim.Cur), rlimitString(lim.Max))
	} else {
		limits = fmt.Sprintf("unreadable (%v)", gerr)
	}
	return fmt.Errorf("%w: mlock of %s (%s) failed: RLIMIT_MEMLOCK is %s; raise it (ulimit -l, LimitMEMLOCK= in a systemd unit, --ulimit memlock= for a container) or grant CAP_IPC_LOCK: %w",
		ErrMemlockLimit, a, humanize.IBytes(uint64(a.Size())), limits, err)
}

func rlimitString(v uint64) string {
	if v == unix.RLIM_INFINITY {
		return "unlimited"
	}
	return fmt.Sprintf("%s (%d bytes)", humanize.IBytes(v), v)
}

// hostBytes is the memory of a host arena, nil for GPU memory.
func hostBytes(a *alloc.Arena) []byte {
	if a.Device().IsGPU() || a.Size() == 0 {
		return nil
	}
	return offheap.Bytes(a.Base(), a.Size())
}
