// Package cudatest opens the CUDA driver for tests: it skips the test with
// the reason when libcuda.so.1 is missing, and fails it instead when
// GDRLINK_REQUIRE_GPU=1 says a GPU should be there.
package cudatest

import (
	"errors"
	"os"
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
			t.Fatalf("GDRLINK_REQUIRE_GPU=1 but the CUDA driver is missing: %v", err)
		}
		t.Skipf("libcuda.so.1 not found: %v", err)
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
