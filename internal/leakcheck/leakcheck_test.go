package leakcheck

import (
	"testing"

	"golang.org/x/sys/unix"
)

func TestMemfdsCountsOpenMemfds(t *testing.T) {
	before, err := Memfds()
	if err != nil {
		t.Skipf("cannot read /proc/self/fd: %v", err)
	}
	fd, err := unix.MemfdCreate("leakcheck-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	during, err := Memfds()
	unix.Close(fd)
	if err != nil || during != before+1 {
		t.Fatalf("with one more memfd open: %d (before %d), %v", during, before, err)
	}
	if after, _ := Memfds(); after != before {
		t.Fatalf("after closing it: %d, want %d", after, before)
	}
}
