package offheap

import (
	"testing"

	"golang.org/x/sys/unix"
)

func TestBytesAddrRoundTrip(t *testing.T) {
	m, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	m[100] = 42
	b := Bytes(Addr(m)+100, 8)
	if len(b) != 8 || b[0] != 42 {
		t.Fatalf("Bytes(Addr(m)+100, 8) = len %d, first %d; want 8 and 42", len(b), b[0])
	}
	b[1] = 7
	if m[101] != 7 {
		t.Fatalf("a write through the view did not reach the mapping")
	}
	if Bytes(Addr(m), 0) != nil || Addr(nil) != 0 {
		t.Fatalf("empty views: Bytes(_, 0) must be nil and Addr(nil) 0")
	}
}
