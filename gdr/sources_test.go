package gdr

import (
	"errors"
	"os"
	"testing"
)

func TestCUDASource(t *testing.T) {
	inv, err := cudaSource{}.GPUs()
	if errors.Is(err, ErrNotSupported) {
		if os.Getenv("GDRLINK_REQUIRE_GPU") == "1" {
			t.Fatalf("GDRLINK_REQUIRE_GPU=1 but no CUDA driver: %v", err)
		}
		t.Skipf("no CUDA driver here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range inv.GPUs {
		if g.GDRSupported == nil || g.DMABufSupported == nil || g.PCIBusID == "" {
			t.Errorf("GPU%d without attributes: %+v", g.Index, g)
		}
	}
	if _, err := (cudaSource{path: "/nonexistent/libcuda.so.1"}).GPUs(); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("missing libcuda: %v", err)
	}
}
