package onnode

import (
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/verbsio"
)

// Seals of the memfds this package hands to peers. A peer could otherwise
// shrink a file that this process has mapped (its next access would be
// SIGBUS) or map the region table writable.
const (
	// sealsShared: the ring and the write counters, which peers map
	// read-write.
	sealsShared = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
	// sealsTable: the region table, which peers may only read: no new
	// writable mapping of it (the owner's, made before sealing, stays).
	sealsTable = sealsShared | unix.F_SEAL_FUTURE_WRITE
)

// newMemfd makes a memfd of size bytes mapped read-write in this process,
// then adds seals (0: none, and the file stays unsealable). A kernel
// without F_SEAL_FUTURE_WRITE (before Linux 5.1) gets the other seals.
func newMemfd(name string, size int, seals int) (fd int, mem []byte, err error) {
	flags := unix.MFD_CLOEXEC
	if seals != 0 {
		flags |= unix.MFD_ALLOW_SEALING
	}
	fd, err = unix.MemfdCreate(name, flags)
	if err != nil {
		return -1, nil, fmt.Errorf("memfd_create %s: %w", name, err)
	}
	if err = unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return -1, nil, fmt.Errorf("ftruncate memfd %s to %d: %w", name, size, err)
	}
	mem, err = unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return -1, nil, fmt.Errorf("mmap memfd %s: %w", name, err)
	}
	if seals != 0 {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals)
		if err == unix.EINVAL && seals&unix.F_SEAL_FUTURE_WRITE != 0 {
			_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals&^unix.F_SEAL_FUTURE_WRITE)
		}
		if err != nil {
			unix.Munmap(mem)
			unix.Close(fd)
			return -1, nil, fmt.Errorf("sealing memfd %s: %w", name, err)
		}
	}
	return fd, mem, nil
}

// checkSealed fails unless fd, a file a peer passed, is sealed against
// shrinking: this process maps it, and a peer that could shrink it could
// make this process's next access to the mapping a SIGBUS.
func checkSealed(fd int, what string) error {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fmt.Errorf("%w: onnode peer %s is not a sealable memfd: %w", verbsio.ErrBadFrame, what, err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return fmt.Errorf("%w: onnode peer %s is not sealed against shrinking (seals %#x)", verbsio.ErrBadFrame, what, seals)
	}
	return nil
}

// u64 is the 8-byte word at off of shared memory, for atomic access.
func u64(mem []byte, off int) *uint64 { return (*uint64)(unsafe.Pointer(&mem[off])) }

// u32 is the 4-byte word at off of shared memory, for atomic access.
func u32(mem []byte, off int) *uint32 { return (*uint32)(unsafe.Pointer(&mem[off])) }

func load64(mem []byte, off int) uint64     { return atomic.LoadUint64(u64(mem, off)) }
func store64(mem []byte, off int, v uint64) { atomic.StoreUint64(u64(mem, off), v) }

// findFD returns a new close-on-exec descriptor of this process's open file
// with the given device and inode, or -1.
func findFD(dev uint64, ino uint64) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		var st unix.Stat_t
		if unix.Fstat(n, &st) != nil || st.Ino != ino || st.Dev != dev {
			continue
		}
		nfd, err := unix.FcntlInt(uintptr(n), unix.F_DUPFD_CLOEXEC, 0)
		if err == nil {
			return nfd
		}
	}
	return -1
}
