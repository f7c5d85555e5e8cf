package nvml

import (
	"errors"
	"os"
	"testing"

	"github.com/gdrlink/gdrlink/internal/sysfs"
)

func TestGPUs(t *testing.T) {
	inv, err := GPUs("")
	if errors.Is(err, ErrNotAvailable) {
		if !errors.Is(err, sysfs.ErrNotSupported) {
			t.Fatalf("%v does not wrap gdr.ErrNotSupported", err)
		}
		if os.Getenv("GDRLINK_REQUIRE_GPU") == "1" {
			t.Fatalf("GDRLINK_REQUIRE_GPU=1 but NVML is not available: %v", err)
		}
		t.Skipf("no NVML here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range inv.GPUs {
		if _, err := sysfs.ParsePCIAddress(g.PCIBusID); err != nil {
			t.Errorf("GPU%d: bus id %q: %v", g.Index, g.PCIBusID, err)
		}
	}
	t.Logf("%+v", inv)
}

func TestMissingLibrary(t *testing.T) {
	if _, err := GPUs("/nonexistent/libnvidia-ml.so.1"); !errors.Is(err, ErrNotAvailable) {
		t.Fatalf("GPUs with a missing library: %v, want ErrNotAvailable", err)
	}
}

func TestConversions(t *testing.T) {
	if v := cudaVersion(12040); v != "12.4" {
		t.Fatal(v)
	}
	if v := cudaVersion(0); v != "" {
		t.Fatal(v)
	}
	for lvl, want := range map[int]string{0: "LOC", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS", 7: "?"} {
		if got := topologyPath(lvl); got != want {
			t.Errorf("level %d: %s, want %s", lvl, got, want)
		}
	}
}

func ExampleGPUs() {
	if _, err := GPUs(""); errors.Is(err, ErrNotAvailable) {
		// No NVML here: fall back to the PCI tree.
		return
	}
}
