package visitor

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// helperEnv names the helper a re-executed test binary runs instead of the
// tests.
const helperEnv = "GDRLINK_VISITOR_HELPER"

var helpers = map[string]func() error{
	"mlock-limit": helperMlockLimit,
	"map-export":  helperMapExport,
}

func TestMain(m *testing.M) {
	if name := os.Getenv(helperEnv); name != "" {
		h, ok := helpers[name]
		if !ok {
			fmt.Fprintf(os.Stderr, "unknown helper %q\n", name)
			os.Exit(2)
		}
		if err := h(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	before, err := openMemfds()
	code := m.Run()
	if after, err2 := openMemfds(); code == 0 && err == nil && err2 == nil && after > before {
		fmt.Fprintf(os.Stderr, "leak: %d memfd descriptors open after the tests, %d before\n", after, before)
		code = 1
	}
	os.Exit(code)
}

// openMemfds counts this process's descriptors that name a memfd (the
// regions of memfd sources and their exported duplicates).
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

// helperCmd re-executes the test binary as helper name.
func helperCmd(t *testing.T, name string, env ...string) *exec.Cmd {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(append(os.Environ(), helperEnv+"="+name), env...)
	return cmd
}
