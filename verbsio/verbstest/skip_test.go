package verbstest_test

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/verbsio"
	"github.com/gdrlink/gdrlink/verbsio/verbstest"
)

// absent is a provider whose device is never there.
type absent struct{}

func (absent) Name() string { return "verbstest-absent" }
func (absent) Devices() ([]verbsio.DeviceInfo, error) {
	return nil, fmt.Errorf("%w: no such hardware in this test", verbsio.ErrNoDevice)
}
func (absent) Open(verbsio.Config) (verbsio.Device, error) {
	return nil, fmt.Errorf("%w: no such hardware in this test", verbsio.ErrNoDevice)
}

func init() { verbsio.Register(absent{}) }

const innerEnv = "VERBSTEST_INNER"

// TestAbsentDevice runs the suite, in a child process, against a provider
// with no device: it must skip and say why, and fail instead when the
// harness's RequireEnv variable says the hardware must be there.
func TestAbsentDevice(t *testing.T) {
	if os.Getenv(innerEnv) == "1" {
		verbstest.Run(t, verbstest.Harness{Provider: "verbstest-absent", RequireEnv: "GDRLINK_REQUIRE_TESTHW"})
		return
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	run := func(extra ...string) (string, error) {
		cmd := exec.Command(exe, "-test.run=^TestAbsentDevice$", "-test.v")
		cmd.Env = append(append(os.Environ(), innerEnv+"=1"), extra...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := run("GDRLINK_REQUIRE_TESTHW=0")
	if err != nil || !strings.Contains(out, "--- SKIP") || !strings.Contains(out, "no such hardware") {
		t.Errorf("without the requirement: %v, want a skip giving the reason:\n%s", err, out)
	}
	out, err = run("GDRLINK_REQUIRE_TESTHW=1")
	if err == nil || !strings.Contains(out, "--- FAIL") || !strings.Contains(out, "GDRLINK_REQUIRE_TESTHW=1") {
		t.Errorf("with the requirement: %v, want a failure naming it:\n%s", err, out)
	}
}
