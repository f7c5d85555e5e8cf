package main

import (
	"errors"
	"fmt"

	"github.com/gdrlink/gdrlink/gdr"
	"github.com/gdrlink/gdrlink/internal/cuda"
)

// cudaSource is a gdr.GPUSource over the CUDA driver: it adds the device
// attributes NVML does not have (GPUDirect RDMA and dma-buf support).
type cudaSource struct {
	// path is where libcuda is loaded from ("" for the default).
	path string
}

// Name implements gdr.GPUSource.
func (cudaSource) Name() string { return "cuda" }

// GPUs implements gdr.GPUSource.
func (s cudaSource) GPUs() (gdr.GPUInventory, error) {
	var inv gdr.GPUInventory
	d, err := cuda.Open(s.path)
	if errors.Is(err, cuda.ErrNoDriver) {
		return inv, fmt.Errorf("%w: %v", gdr.ErrNotSupported, err)
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
		addr, err := gdr.ParsePCIAddress(f.PCIBusID)
		if err != nil {
			return inv, fmt.Errorf("cuda: device %d: %w", i, err)
		}
		gdrOK, dmabuf := f.GPUDirectRDMA, f.DMABuf
		inv.GPUs = append(inv.GPUs, gdr.GPUFacts{Index: i, Name: f.Name, PCIBusID: addr, GDRSupported: &gdrOK, DMABufSupported: &dmabuf, Source: "cuda"})
	}
	return inv, nil
}
