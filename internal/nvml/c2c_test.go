//go:build cgo && linux

package nvml

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
)

// TestC2C reads C2C through stand-in NVMLs: one whose GPU says C2C is on,
// one that says off, and one without nvmlDeviceGetC2cModeInfoV at all (a
// driver older than C2C), which reads as no C2C rather than an error or a
// crash. An unknown bus id is an error. go-nvml's calls bind to the first
// NVML a process loads, so each stand-in is read in a process of its own.
func TestC2C(t *testing.T) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		if cc, err = exec.LookPath("gcc"); err != nil {
			t.Skip("no C compiler (cc, gcc; Debian package gcc) to build the stand-in libnvidia-ml")
		}
	}
	for _, c := range []struct {
		name string
		def  []string
		want bool
	}{
		{"c2c-on", []string{"-DFAKE_C2C=1"}, true},
		{"c2c-off", []string{"-DFAKE_C2C=0"}, false},
		{"no-symbol", nil, false},
	} {
		lib := filepath.Join(t.TempDir(), "libfakenvml-"+c.name+".so")
		args := append([]string{"-shared", "-fPIC", "-o", lib}, c.def...)
		if out, err := exec.Command(cc, append(args, "testdata/fakenvml.c")...).CombinedOutput(); err != nil {
			t.Fatalf("building the stand-in libnvidia-ml: %v\n%s", err, out)
		}
		cmd := exec.Command(os.Args[0], "-test.run=^TestC2CInProcess$", "-test.v")
		cmd.Env = append(os.Environ(), "GDRLINK_TEST_FAKE_NVML="+lib, "GDRLINK_TEST_WANT_C2C="+strconv.FormatBool(c.want))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("%s: %v\n%s", c.name, err, out)
		}
	}
}

// TestC2CInProcess is TestC2C's reader, in a process of its own.
func TestC2CInProcess(t *testing.T) {
	lib := os.Getenv("GDRLINK_TEST_FAKE_NVML")
	if lib == "" {
		t.Skip("run by TestC2C")
	}
	want, _ := strconv.ParseBool(os.Getenv("GDRLINK_TEST_WANT_C2C"))
	got, err := c2c(lib, "0000:01:00.0")
	if err != nil || got != want {
		t.Fatalf("C2C %v, %v; want %v", got, err, want)
	}
	if _, err := c2c(lib, "0000:77:00.0"); err == nil {
		t.Fatal("no error for a bus id with no GPU")
	}
}
