//go:build cgo && linux

package nvml

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
)

// NVML is initialised once per process and never shut down: a second
// inventory (or a BAR1 query per arena) reuses it. go-nvml's calls bind to
// the first NVML a process loads (on a GPU node, the real one, by an earlier
// test), so the stand-in is counted in a process of its own.
func TestInitialisedOncePerProcess(t *testing.T) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		if cc, err = exec.LookPath("gcc"); err != nil {
			t.Skip("no C compiler (cc, gcc; Debian package gcc) to build the stand-in libnvidia-ml")
		}
	}
	lib := filepath.Join(t.TempDir(), "libfakenvml.so")
	if out, err := exec.Command(cc, "-shared", "-fPIC", "-o", lib, "testdata/fakenvml.c").CombinedOutput(); err != nil {
		t.Fatalf("building the stand-in libnvidia-ml: %v\n%s", err, out)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestInitialisedOnceInProcess$", "-test.v")
	cmd.Env = append(os.Environ(), "GDRLINK_TEST_FAKE_NVML="+lib)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestInitialisedOnceInProcess") {
		t.Fatalf("%v\n%s", err, out)
	}
}

// TestInitialisedOnceInProcess is TestInitialisedOncePerProcess's counter,
// in a process of its own.
func TestInitialisedOnceInProcess(t *testing.T) {
	lib := os.Getenv("GDRLINK_TEST_FAKE_NVML")
	if lib == "" {
		t.Skip("run by TestInitialisedOncePerProcess")
	}
	for i := 0; i < 3; i++ {
		inv, err := GPUs(lib)
		if err != nil {
			t.Fatal(err)
		}
		if inv.DriverVersion != "999.1" || len(inv.GPUs) != 0 {
			t.Fatalf("inventory from the stand-in: %+v", inv)
		}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	h, err := purego.Dlopen(lib, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		t.Fatal(err)
	}
	count := func(name string) int32 {
		p, err := purego.Dlsym(h, name)
		if err != nil {
			t.Fatal(err)
		}
		// p is the address of a C global (off the Go heap).
		return *(*int32)(*(*unsafe.Pointer)(unsafe.Pointer(&p)))
	}
	if n, s := count("fake_inits"), count("fake_shutdowns"); n != 1 || s != 0 {
		t.Fatalf("3 inventories initialised NVML %d times and shut it down %d times, want 1 and 0", n, s)
	}
}
