package alloc

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// TestMain fails the run when tests leave memfd descriptors open: every
// region a memfd source makes must be freed, closing its descriptor.
func TestMain(m *testing.M) {
	before, err := openMemfds()
	code := m.Run()
	if after, err2 := openMemfds(); code == 0 && err == nil && err2 == nil && after > before {
		fmt.Fprintf(os.Stderr, "leak: %d memfd descriptors open after the tests, %d before\n", after, before)
		code = 1
	}
	os.Exit(code)
}

// openMemfds counts this process's descriptors that name a memfd.
func openMemfds() (int, error) {
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
