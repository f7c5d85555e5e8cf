// Package leakcheck finds resources that tests leave behind. It is for
// TestMain functions: RunMain runs the tests and fails the run when more
// memfd descriptors are open after them than before.
package leakcheck

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// Memfds counts this process's open descriptors that name a memfd.
func Memfds() (int, error) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return 0, err
	}
	n := 0
	for _, e := range ents {
		if link, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(link, "/memfd:") {
			n++
		}
	}
	return n, nil
}

// RunMain runs m and returns its exit code, turned into 1 when the tests
// passed but left memfd descriptors open. Where /proc cannot be read, no
// leak is claimed.
func RunMain(m *testing.M) int {
	before, err := Memfds()
	code := m.Run()
	if after, err2 := Memfds(); code == 0 && err == nil && err2 == nil && after > before {
		fmt.Fprintf(os.Stderr, "leak: %d memfd descriptors open after the tests, %d before\n", after, before)
		code = 1
	}
	return code
}
