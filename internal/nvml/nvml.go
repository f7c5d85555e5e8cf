// Package nvml reads GPU facts through NVIDIA's management library
// (libnvidia-ml.so.1, loaded at run time by github.com/NVIDIA/go-nvml) and
// returns them as plain data for package gdr. Where the library is absent,
// or the program was built without cgo, every call returns an error wrapping
// ErrNotAvailable, which wraps gdr.ErrNotSupported.
package nvml

import (
	"fmt"

	"github.com/gdrlink/gdrlink/gdr"
)

// ErrNotAvailable: NVML cannot be used here (no libnvidia-ml.so.1, no
// driver, or a build without cgo).
var ErrNotAvailable = fmt.Errorf("%w: NVML not available", gdr.ErrNotSupported)

// Source is a gdr.GPUSource backed by NVML. It initializes NVML on each call
// to GPUs and shuts it down before returning, so it holds nothing between
// calls.
type Source struct {
	// LibraryPath overrides where libnvidia-ml is loaded from; "" uses the
	// dynamic loader's search.
	LibraryPath string
}

// Name implements gdr.GPUSource.
func (s *Source) Name() string { return "nvml" }

// GPUs implements gdr.GPUSource: every GPU NVML sees, with the driver and
// CUDA versions and the topology between GPU pairs.
func (s *Source) GPUs() (gdr.GPUInventory, error) { return s.gpus() }

// cudaVersion formats NVML's integer CUDA version (12040) as "12.4".
func cudaVersion(v int) string {
	if v <= 0 {
		return ""
	}
	return fmt.Sprintf("%d.%d", v/1000, v%1000/10)
}

// topologyPath maps NVML's topology levels to gdr path types.
func topologyPath(level int) gdr.PathType {
	switch level {
	case 0:
		return gdr.PathLOC
	case 10:
		return gdr.PathPIX
	case 20:
		return gdr.PathPXB
	case 30:
		return gdr.PathPHB
	case 40:
		return gdr.PathNODE
	case 50:
		return gdr.PathSYS
	}
	return gdr.PathUnknown
}
