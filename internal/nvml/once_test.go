//go:build cgo && linux

package nvml

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
)

// NVML is initialised once per process and never shut down: a second
// inventory (or a BAR1 query per arena) reuses it.
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
