package tcp

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gdrlink/gdrlink/verbsio"
)

// checkMapped asks the kernel whether every page of [addr, addr+n) is
// mapped (mincore fails with ENOMEM otherwise), as ibv_reg_mr would find
// when pinning.
func checkMapped(addr uintptr, n int) error {
	if n <= 0 {
		return fmt.Errorf("%w: length %d", verbsio.ErrBadAddress, n)
	}
	if addr == 0 || addr+uintptr(n) < addr {
		return fmt.Errorf("%w: [%#x+%d)", verbsio.ErrBadAddress, addr, n)
	}
	page := uintptr(unix.Getpagesize())
	start := addr &^ (page - 1)
	end := (addr + uintptr(n) + page - 1) &^ (page - 1)
	vec := make([]byte, (end-start)/page)
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, start, end-start, uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return fmt.Errorf("%w: [%#x+%d) is not mapped: %w", verbsio.ErrBadAddress, addr, n, errno)
	}
	return nil
}

// slices returns the sub-slices covering bytes [off, off+n) of bufs.
func slices(bufs [][]byte, off, n int) [][]byte {
	var out [][]byte
	for _, b := range bufs {
		if n == 0 {
			break
		}
		if off >= len(b) {
			off -= len(b)
			continue
		}
		b = b[off:]
		off = 0
		if len(b) > n {
			b = b[:n]
		}
		out = append(out, b)
		n -= len(b)
	}
	return out
}

func totalLen(bufs [][]byte) int {
	n := 0
	for _, b := range bufs {
		n += len(b)
	}
	return n
}
