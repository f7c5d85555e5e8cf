// Package cudatest opens the CUDA driver for tests: it skips the test with
// the reason when libcuda.so.1 is missing, and fails it instead when
// GDRLINK_REQUIRE_GPU=1 says a GPU should be there.
package cudatest

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/gdrlink/gdrlink/internal/cuda"
)

// Required reports whether GDRLINK_REQUIRE_GPU=1 is set.
func Required() bool { return os.Getenv("GDRLINK_REQUIRE_GPU") == "1" }

// SkipIfNoDriver skips (or fails, under GDRLINK_REQUIRE_GPU=1) when err says
// the driver is missing, and fails on any other error.
func SkipIfNoDriver(t testing.TB, err error) {
	t.Helper()
	if err == nil {
		return
	}
	if errors.Is(err, cuda.ErrNoDriver) {
		if Required() {
			t.Fatalf("GDRLINK_REQUIRE_GPU=1 but there is no usable CUDA driver: %v", err)
		}
		t.Skipf("no usable CUDA driver (libcuda.so.1 missing, no GPU, or the driver too old): %v", err)
	}
	t.Fatal(err)
}

// Context opens the driver and retains the primary context of GPU 0, both
// released when the test ends.
func Context(t testing.TB) *cuda.Context {
	t.Helper()
	d, err := cuda.Open("")
	SkipIfNoDriver(t, err)
	t.Cleanup(func() { _ = d.Close() })
	dev, err := d.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	c, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("CUDA context close: %v", err)
		}
	})
	return c
}

// StandIn builds the stand-in driver (internal/cuda/testdata/fakecuda.c: a
// libcuda.so.1 look-alike that keeps "device memory" in host memory) and
// returns its path, for tests of the binding's plumbing on hosts without a
// GPU. It skips when there is no C compiler or no source tree.
func StandIn(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	src := filepath.Join(filepath.Dir(file), "..", "testdata", "fakecuda.c")
	if _, err := os.Stat(src); !ok || err != nil {
		t.Skipf("stand-in driver source not found (%s): not run from a source tree", src)
	}
	cc, err := exec.LookPath("cc")
	if err != nil {
		if cc, err = exec.LookPath("gcc"); err != nil {
			t.Skip("no C compiler (cc, gcc; Debian package gcc) to build the stand-in driver")
		}
	}
	lib := filepath.Join(t.TempDir(), "libfakecuda.so")
	if out, err := exec.Command(cc, "-shared", "-fPIC", "-o", lib, src).CombinedOutput(); err != nil {
		t.Fatalf("building the stand-in driver: %v\n%s", err, out)
	}
	return lib
}
