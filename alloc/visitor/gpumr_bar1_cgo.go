//go:build cgo

package visitor

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// nvmlBAR1 reads the BAR1 aperture of the GPU at a PCI address through NVML
// (nvmlDeviceGetBAR1MemoryInfo). go-nvml loads libnvidia-ml at run time but
// needs cgo, hence the build tag.
func nvmlBAR1(busID string) (free, total int64, err error) {
	if r := nvml.Init(); r != nvml.SUCCESS {
		return 0, 0, fmt.Errorf("nvmlInit: %s", nvml.ErrorString(r))
	}
	defer nvml.Shutdown()
	dev, r := nvml.DeviceGetHandleByPciBusId(busID)
	if r != nvml.SUCCESS {
		return 0, 0, fmt.Errorf("nvmlDeviceGetHandleByPciBusId(%s): %s", busID, nvml.ErrorString(r))
	}
	m, r := dev.GetBAR1MemoryInfo()
	if r != nvml.SUCCESS {
		return 0, 0, fmt.Errorf("nvmlDeviceGetBAR1MemoryInfo(%s): %s", busID, nvml.ErrorString(r))
	}
	return int64(m.Bar1Free), int64(m.Bar1Total), nil
}
