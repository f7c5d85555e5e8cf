package onnode

import (
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// newMemfd makes a memfd of size bytes mapped read-write in this process.
func newMemfd(name string, size int) (fd int, mem []byte, err error) {
	fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC)
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
	return fd, mem, nil
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
