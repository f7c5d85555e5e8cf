package onnode

import (
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/internal/offheap"
	"github.com/gdrlink/gdrlink/verbsio"
)

// TestArenaMappings registers arenas mapped the way alloc's memory sources
// map them (this package does not import alloc; verbsio's layering test
// says why): memfd arenas, sealed against resizing and mapped MAP_SHARED,
// are file-backed (peers map them), anonymous private ones are not, whether
// detected or passed with registerMemoryFD.
func TestArenaMappings(t *testing.T) {
	n, _ := loopback(t, Options{}, 0)
	const size = 2 << 20
	for _, c := range []struct {
		name   string
		memfd  bool
		useFD  bool
		backed bool
	}{
		{"memfd detected", true, false, true},
		{"memfd with fd", true, true, true},
		{"mmap", false, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			fd, flags := -1, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS
			if c.memfd {
				var err error
				if fd, err = unix.MemfdCreate("gdrlink-onnode-test", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING); err != nil {
					t.Fatal(err)
				}
				defer unix.Close(fd)
				if err := unix.Ftruncate(fd, size); err != nil {
					t.Fatal(err)
				}
				if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
					t.Logf("sealing refused: %v", err)
				}
				flags = unix.MAP_SHARED
			}
			mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, flags)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Munmap(mem)
			var mr verbsio.MemoryRegion
			if c.useFD {
				mr, err = n.pd.(*pd).registerMemoryFD(offheap.Addr(mem), size, rw, fd, 0)
			} else {
				mr, err = n.pd.RegisterMemory(offheap.Addr(mem), size, rw)
			}
			if err != nil {
				t.Fatal(err)
			}
			defer mr.Close()
			if got := mr.(*memoryRegion).FileBacked(); got != c.backed {
				t.Fatalf("file-backed %v, want %v", got, c.backed)
			}
		})
	}
}
