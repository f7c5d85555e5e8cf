package nvml

import (
	"errors"
	"os"
	"testing"

	"github.com/gdrlink/gdrlink/gdr"
)

func TestSource(t *testing.T) {
	var s Source
	inv, err := s.GPUs()
	if errors.Is(err, ErrNotAvailable) {
		if !errors.Is(err, gdr.ErrNotSupported) {
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
		if _, err := gdr.ParsePCIAddress(g.PCIBusID); err != nil {
			t.Errorf("GPU%d: bus id %q: %v", g.Index, g.PCIBusID, err)
		}
	}
	t.Logf("%+v", inv)
}

func TestMissingLibrary(t *testing.T) {
	s := Source{LibraryPath: "/nonexistent/libnvidia-ml.so.1"}
	if _, err := s.GPUs(); !errors.Is(err, ErrNotAvailable) {
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
	for lvl, want := range map[int]gdr.PathType{0: gdr.PathLOC, 10: gdr.PathPIX, 20: gdr.PathPXB, 30: gdr.PathPHB, 40: gdr.PathNODE, 50: gdr.PathSYS, 7: gdr.PathUnknown} {
		if got := topologyPath(lvl); got != want {
			t.Errorf("level %d: %s, want %s", lvl, got, want)
		}
	}
}

func ExampleSource() {
	var s Source
	if _, err := s.GPUs(); errors.Is(err, gdr.ErrNotSupported) {
		// No NVML here: fall back to the PCI tree.
		return
	}
}
