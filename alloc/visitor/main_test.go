package visitor

import (
	"fmt"
	"os"
	"os/exec"
	"testing"

	"github.com/gdrlink/gdrlink/internal/leakcheck"
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
	os.Exit(leakcheck.RunMain(m))
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
