package verbstest

import (
	"testing"

	"golang.org/x/sys/unix"
)

// mmap maps n bytes of anonymous memory off the Go heap, unmapped at cleanup.
func mmap(t testing.TB, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatalf("mmap %d bytes: %v", n, err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
	return b
}

// pattern fills b with bytes that depend on seed and position.
func pattern(b []byte, seed byte) {
	for i := range b {
		b[i] = seed ^ byte(i) ^ byte(i>>8)*31
	}
}
