//go:build cgo && linux

package nvml

import (
	"fmt"
	"sync"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/gdrlink/gdrlink/internal/sysfs"
)

func cstr(b []uint8) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

func gpus(libraryPath string) (Inventory, error) {
	var inv Inventory
	lib, err := session(libraryPath)
	if err != nil {
		return inv, err
	}
	if v, ret := lib.SystemGetDriverVersion(); ret == gonvml.SUCCESS {
		inv.DriverVersion = v
	}
	if v, ret := lib.SystemGetCudaDriverVersion(); ret == gonvml.SUCCESS {
		inv.CUDAVersion = cudaVersion(v)
	}
	n, ret := lib.DeviceGetCount()
	if ret != gonvml.SUCCESS {
		return inv, fmt.Errorf("nvml: device count: %s", ret.Error())
	}
	devs := make([]gonvml.Device, 0, n)
	for i := 0; i < n; i++ {
		d, ret := lib.DeviceGetHandleByIndex(i)
		if ret != gonvml.SUCCESS {
			return inv, fmt.Errorf("nvml: device %d: %s", i, ret.Error())
		}
		devs = append(devs, d)
		g := GPU{Index: i}
		if v, ret := d.GetName(); ret == gonvml.SUCCESS {
			g.Name = v
		}
		if p, ret := d.GetPciInfo(); ret == gonvml.SUCCESS {
			if a, err := sysfs.ParsePCIAddress(cstr(p.BusId[:])); err == nil {
				g.PCIBusID = a
			}
		}
		if v, ret := d.GetNumaNodeId(); ret == gonvml.SUCCESS && v >= 0 {
			g.NUMANode = &v
		}
		if m, ret := d.GetBAR1MemoryInfo(); ret == gonvml.SUCCESS {
			total, free := m.Bar1Total, m.Bar1Free
			g.BAR1Total, g.BAR1Free = &total, &free
		}
		if v, ret := d.GetPersistenceMode(); ret == gonvml.SUCCESS {
			on := v == gonvml.FEATURE_ENABLED
			g.PersistenceMode = &on
		}
		inv.GPUs = append(inv.GPUs, g)
	}
	for a := 0; a < n; a++ {
		for b := a + 1; b < n; b++ {
			t := Link{A: a, B: b, Path: "?"}
			if lvl, ret := devs[a].GetTopologyCommonAncestor(devs[b]); ret == gonvml.SUCCESS {
				t.Path = topologyPath(int(lvl))
			}
			for l := 0; l < gonvml.NVLINK_MAX_LINKS; l++ {
				st, ret := devs[a].GetNvLinkState(l)
				if ret != gonvml.SUCCESS || st != gonvml.FEATURE_ENABLED {
					continue
				}
				if p, ret := devs[a].GetNvLinkRemotePciInfo(l); ret == gonvml.SUCCESS {
					if addr, err := sysfs.ParsePCIAddress(cstr(p.BusId[:])); err == nil && addr == inv.GPUs[b].PCIBusID {
						t.NVLinks++
					}
				}
			}
			inv.Links = append(inv.Links, t)
		}
	}
	return inv, nil
}

// BAR1 reads the BAR1 aperture of the GPU at a PCI address
// (nvmlDeviceGetBAR1MemoryInfo): the bytes of it free and in all. A NIC
// reaches GPU memory through BAR1.
func BAR1(busID string) (free, total int64, err error) {
	lib, err := session("")
	if err != nil {
		return 0, 0, err
	}
	dev, r := lib.DeviceGetHandleByPciBusId(busID)
	if r != gonvml.SUCCESS {
		return 0, 0, fmt.Errorf("nvmlDeviceGetHandleByPciBusId(%s): %s", busID, r.Error())
	}
	m, r := dev.GetBAR1MemoryInfo()
	if r != gonvml.SUCCESS {
		return 0, 0, fmt.Errorf("nvmlDeviceGetBAR1MemoryInfo(%s): %s", busID, r.Error())
	}
	return int64(m.Bar1Free), int64(m.Bar1Total), nil
}

// C2C reports whether the GPU at a PCI address reaches the CPU over a
// chip-to-chip link (Grace Hopper and later), as NCCL reads it:
// nvmlDeviceGetC2cModeInfoV's isC2cEnabled. An NVML without the function
// (a driver older than C2C) or a GPU that answers NOT_SUPPORTED has none.
func C2C(busID string) (bool, error) { return c2c("", busID) }

func c2c(libraryPath, busID string) (bool, error) {
	lib, err := session(libraryPath)
	if err != nil {
		return false, err
	}
	dev, r := lib.DeviceGetHandleByPciBusId(busID)
	if r != gonvml.SUCCESS {
		return false, fmt.Errorf("nvmlDeviceGetHandleByPciBusId(%s): %s", busID, r.Error())
	}
	if lib.Extensions().LookupSymbol("nvmlDeviceGetC2cModeInfoV") != nil {
		return false, nil // optional: this NVML predates C2C
	}
	info, r := dev.GetC2cModeInfoV().V1()
	switch r {
	case gonvml.SUCCESS:
		return info.IsC2cEnabled != 0, nil
	case gonvml.ERROR_NOT_SUPPORTED:
		return false, nil
	}
	return false, fmt.Errorf("nvmlDeviceGetC2cModeInfoV(%s): %s", busID, r.Error())
}

// sessions holds NVML as this process initialized it, by library path. NVML
// is initialized once per process and never shut down (a driver library, once
// loaded, stays loaded): this is the package's one piece of process-wide
// state. Conclusive failures (no library, no kernel driver) are kept too;
// any other failure is not, so a later call tries again.
var sessions struct {
	mu  sync.Mutex
	lib map[string]gonvml.Interface
	err map[string]error
}

// session returns NVML loaded from libraryPath ("" for the dynamic loader's
// search) and initialized, doing both on the first call for that path.
func session(libraryPath string) (gonvml.Interface, error) {
	sessions.mu.Lock()
	defer sessions.mu.Unlock()
	if lib, ok := sessions.lib[libraryPath]; ok {
		return lib, nil
	}
	if err, ok := sessions.err[libraryPath]; ok {
		return nil, err
	}
	if sessions.lib == nil {
		sessions.lib, sessions.err = make(map[string]gonvml.Interface), make(map[string]error)
	}
	var opts []gonvml.LibraryOption
	if libraryPath != "" {
		opts = append(opts, gonvml.WithLibraryPath(libraryPath))
	}
	lib := gonvml.New(opts...)
	switch ret := lib.Init(); ret {
	case gonvml.SUCCESS:
	case gonvml.ERROR_LIBRARY_NOT_FOUND:
		err := fmt.Errorf("%w: libnvidia-ml.so.1 not found", ErrNotAvailable)
		sessions.err[libraryPath] = err
		return nil, err
	case gonvml.ERROR_DRIVER_NOT_LOADED:
		err := fmt.Errorf("%w: the NVIDIA kernel driver is not loaded", ErrNotAvailable)
		sessions.err[libraryPath] = err
		return nil, err
	default:
		return nil, fmt.Errorf("nvml: init: %s", ret.Error())
	}
	sessions.lib[libraryPath] = lib
	return lib, nil
}
