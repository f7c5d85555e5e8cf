// Package nvml reads GPU facts through NVIDIA's management library
// (libnvidia-ml.so.1, loaded at run time by github.com/NVIDIA/go-nvml) and
// returns them as plain data, for package gdr and for the GPU visitor's BAR1
// check. Where the library is absent, or the program was built without cgo,
// every call returns an error wrapping ErrNotAvailable.
package nvml

import (
	"fmt"

	"github.com/gdrlink/gdrlink/internal/sysfs"
)

// ErrNotAvailable: NVML cannot be used here (no libnvidia-ml.so.1, no
// driver, or a build without cgo). It wraps gdr's ErrNotSupported (the same
// value as sysfs.ErrNotSupported): a node without NVML is missing it.
var ErrNotAvailable = fmt.Errorf("%w: NVML not available", sysfs.ErrNotSupported)

// GPU is what NVML says of one GPU. Optional values are pointers: nil means
// NVML could not tell.
type GPU struct {
	// Index is the GPU's NVML index.
	Index int
	// Name is the product name ("NVIDIA H100 80GB HBM3"), "" when unknown.
	Name string
	// PCIBusID is the canonical PCI address ("0000:3b:00.0"), "" when
	// unknown.
	PCIBusID string
	// NUMANode is the GPU's NUMA node.
	NUMANode *int
	// BAR1Total and BAR1Free are the BAR1 aperture in bytes.
	BAR1Total, BAR1Free *uint64
	// PersistenceMode reports whether the driver keeps the GPU initialized.
	PersistenceMode *bool
}

// Link is what NVML says of a pair of GPUs.
type Link struct {
	// A and B are the GPUs' indexes, A < B.
	A, B int
	// Path is their common ancestor as `nvidia-smi topo -m` names it (LOC,
	// PIX, PXB, PHB, NODE, SYS), "?" when NVML could not tell.
	Path string
	// NVLinks is the number of NVLinks between them.
	NVLinks int
}

// Inventory is every GPU NVML sees, with the driver's versions and the
// topology between GPU pairs.
type Inventory struct {
	// DriverVersion is the kernel driver's version ("550.54.15").
	DriverVersion string
	// CUDAVersion is the CUDA version the driver supports ("12.4").
	CUDAVersion string
	GPUs        []GPU
	Links       []Link
}

// GPUs asks NVML, loaded from libraryPath ("" for the dynamic loader's
// search), for its GPUs. It initializes NVML and shuts it down before
// returning, so it holds nothing between calls.
func GPUs(libraryPath string) (Inventory, error) { return gpus(libraryPath) }

// cudaVersion formats NVML's integer CUDA version (12040) as "12.4".
func cudaVersion(v int) string {
	if v <= 0 {
		return ""
	}
	return fmt.Sprintf("%d.%d", v/1000, v%1000/10)
}

// topologyPath names NVML's topology levels as `nvidia-smi topo -m` does.
func topologyPath(level int) string {
	switch level {
	case 0:
		return "LOC"
	case 10:
		return "PIX"
	case 20:
		return "PXB"
	case 30:
		return "PHB"
	case 40:
		return "NODE"
	case 50:
		return "SYS"
	}
	return "?"
}
