package gdr

import (
	"errors"
	"fmt"

	"github.com/gdrlink/gdrlink/internal/cuda"
	"github.com/gdrlink/gdrlink/internal/nvml"
	"github.com/gdrlink/gdrlink/internal/sysfs"
)

// nvmlSource lists the GPUs NVML sees, with the driver's versions and the
// topology between GPU pairs.
type nvmlSource struct {
	// path is where libnvidia-ml is loaded from ("" for the default).
	path string
}

// Name implements gpuSource.
func (nvmlSource) Name() string { return "nvml" }

// GPUs implements gpuSource.
func (s nvmlSource) GPUs() (gpuInventory, error) {
	n, err := nvml.GPUs(s.path)
	if err != nil {
		return gpuInventory{}, err
	}
	inv := gpuInventory{Driver: GPUDriverFacts{DriverVersion: n.DriverVersion, CUDAVersion: n.CUDAVersion}}
	for _, g := range n.GPUs {
		inv.GPUs = append(inv.GPUs, GPUFacts{Index: g.Index, Name: g.Name, PCIBusID: g.PCIBusID, NUMANode: g.NUMANode,
			BAR1Total: g.BAR1Total, BAR1Free: g.BAR1Free, PersistenceMode: g.PersistenceMode, Source: "nvml"})
	}
	for _, l := range n.Links {
		inv.Topology = append(inv.Topology, GPUTopology{A: l.A, B: l.B, Path: pathTypeOf(l.Path), NVLinks: l.NVLinks})
	}
	return inv, nil
}

// cudaSource adds, through the CUDA driver, the device attributes NVML does
// not have (GPUDirect RDMA and dma-buf support).
type cudaSource struct {
	// path is where libcuda is loaded from ("" for the default).
	path string
}

// Name implements gpuSource.
func (cudaSource) Name() string { return "cuda" }

// GPUs implements gpuSource.
func (s cudaSource) GPUs() (gpuInventory, error) {
	var inv gpuInventory
	d, err := cuda.Open(s.path)
	if errors.Is(err, cuda.ErrNoDriver) {
		return inv, fmt.Errorf("%w: %v", ErrNotSupported, err)
	}
	if err != nil {
		return inv, err
	}
	defer d.Close()
	if v := d.Version(); v > 0 {
		inv.Driver.CUDAVersion = fmt.Sprintf("%d.%d", v/1000, v%1000/10)
	}
	n, err := d.DeviceCount()
	if err != nil {
		return inv, err
	}
	for i := 0; i < n; i++ {
		dev, err := d.Device(i)
		if err != nil {
			return inv, err
		}
		f, err := dev.Facts()
		if err != nil {
			return inv, err
		}
		addr, err := sysfs.ParsePCIAddress(f.PCIBusID)
		if err != nil {
			return inv, fmt.Errorf("cuda: device %d: %w", i, err)
		}
		gdrOK, dmabuf := f.GPUDirectRDMA, f.DMABuf
		inv.GPUs = append(inv.GPUs, GPUFacts{Index: i, Name: f.Name, PCIBusID: addr, GDRSupported: &gdrOK, DMABufSupported: &dmabuf, Source: "cuda"})
	}
	return inv, nil
}
