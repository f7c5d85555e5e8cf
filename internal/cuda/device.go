package cuda

import (
	"fmt"
	"strings"
	"unsafe"
)

// Attribute is a CUdevice_attribute.
type Attribute int32

// Device attributes this package names (cuda.h's CUdevice_attribute).
const (
	AttrPCIBusID                    Attribute = 33
	AttrPCIDeviceID                 Attribute = 34
	AttrAsyncEngineCount            Attribute = 40
	AttrUnifiedAddressing           Attribute = 41
	AttrPCIDomainID                 Attribute = 50
	AttrComputeCapabilityMajor      Attribute = 75
	AttrComputeCapabilityMinor      Attribute = 76
	AttrCanMapHostMemory            Attribute = 19
	AttrHostRegisterSupported       Attribute = 99
	AttrVirtualMemoryManagement     Attribute = 102
	AttrHandleTypePOSIXFD           Attribute = 103
	AttrGPUDirectRDMASupported      Attribute = 116
	AttrGPUDirectRDMAFlushWrites    Attribute = 117
	AttrGPUDirectRDMAWritesOrdering Attribute = 118
	AttrDMABufSupported             Attribute = 124
)

// Device is one CUDA device (a CUdevice and its ordinal).
type Device struct {
	drv     *Driver
	ordinal int
	handle  int32
}

// Device returns the device of the given ordinal.
func (d *Driver) Device(ordinal int) (Device, error) {
	if d.isClosed() {
		return Device{}, ErrClosed
	}
	var h int32
	if err := d.call(symDeviceGet, fmt.Sprintf("ordinal %d", ordinal), uintptr(unsafe.Pointer(&h)), uintptr(ordinal)); err != nil {
		return Device{}, err
	}
	return Device{drv: d, ordinal: ordinal, handle: h}, nil
}

// Ordinal is the device's number in this process (after CUDA_VISIBLE_DEVICES).
func (v Device) Ordinal() int { return v.ordinal }

// String prints "gpu:N".
func (v Device) String() string { return fmt.Sprintf("gpu:%d", v.ordinal) }

// Name is the device's marketing name ("NVIDIA H100 80GB HBM3").
func (v Device) Name() (string, error) {
	buf := make([]byte, 256)
	if err := v.drv.call(symDeviceGetName, v.String(), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), uintptr(v.handle)); err != nil {
		return "", err
	}
	return cString(buf), nil
}

// Attribute reads one device attribute.
func (v Device) Attribute(a Attribute) (int, error) {
	var x int32
	if err := v.drv.call(symDeviceGetAttribute, fmt.Sprintf("attribute %d of %s", a, v), uintptr(unsafe.Pointer(&x)), uintptr(a), uintptr(v.handle)); err != nil {
		return 0, err
	}
	return int(x), nil
}

// PCIBusID is the device's PCI address as the driver prints it
// ("0000:3B:00.0"), lower-cased so it matches sysfs names.
func (v Device) PCIBusID() (string, error) {
	buf := make([]byte, 64)
	if err := v.drv.call(symDeviceGetPCIBusID, v.String(), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), uintptr(v.handle)); err != nil {
		return "", err
	}
	return strings.ToLower(cString(buf)), nil
}

// TotalMem is the device's memory in bytes.
func (v Device) TotalMem() (int64, error) {
	var n uint64
	if err := v.drv.call(symDeviceTotalMem, v.String(), uintptr(unsafe.Pointer(&n)), uintptr(v.handle)); err != nil {
		return 0, err
	}
	return int64(n), nil
}

// Facts are what gdrlink's GPUDirect policy needs to know about a device.
type Facts struct {
	Ordinal int
	Name    string
	// PCIBusID is the device's PCI address ("0000:3b:00.0").
	PCIBusID string
	// TotalMem is the device memory in bytes.
	TotalMem int64
	// ComputeCapability is major*10+minor (90 for an H100).
	ComputeCapability int
	// GPUDirectRDMA is CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED: the
	// device can expose its memory to third-party PCIe devices.
	GPUDirectRDMA bool
	// DMABuf is CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: device memory can be
	// exported as a dma-buf (cuMemGetHandleForAddressRange).
	DMABuf bool
	// FlushWritesOptions is CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS
	// (a bit mask of CUflushGPUDirectRDMAWritesOptions).
	FlushWritesOptions int
	// WritesOrdering is CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING
	// (0 none, 100 owner, 200 all devices).
	WritesOrdering int
	// AsyncEngines is the number of copy engines.
	AsyncEngines int
	// DriverVersion is cuDriverGetVersion's answer.
	DriverVersion int
}

// Facts reads the device's facts in one go.
func (v Device) Facts() (Facts, error) {
	f := Facts{Ordinal: v.ordinal, DriverVersion: v.drv.version}
	var err error
	if f.Name, err = v.Name(); err != nil {
		return f, err
	}
	if f.PCIBusID, err = v.PCIBusID(); err != nil {
		return f, err
	}
	if f.TotalMem, err = v.TotalMem(); err != nil {
		return f, err
	}
	ints := []struct {
		a   Attribute
		dst *int
	}{
		{AttrComputeCapabilityMajor, new(int)}, {AttrComputeCapabilityMinor, new(int)},
		{AttrGPUDirectRDMASupported, new(int)}, {AttrDMABufSupported, new(int)},
		{AttrGPUDirectRDMAFlushWrites, &f.FlushWritesOptions}, {AttrGPUDirectRDMAWritesOrdering, &f.WritesOrdering},
		{AttrAsyncEngineCount, &f.AsyncEngines},
	}
	for _, x := range ints {
		n, err := v.Attribute(x.a)
		if err != nil {
			return f, err
		}
		*x.dst = n
	}
	f.ComputeCapability = *ints[0].dst*10 + *ints[1].dst
	f.GPUDirectRDMA = *ints[2].dst != 0
	f.DMABuf = *ints[3].dst != 0
	return f, nil
}

// CanAccessPeer reports whether v can access peer's memory directly
// (cuDeviceCanAccessPeer); a device can always access its own.
func (v Device) CanAccessPeer(peer Device) (bool, error) {
	if v.handle == peer.handle {
		return true, nil
	}
	var x int32
	if err := v.drv.call(symDeviceCanAccessPeer, fmt.Sprintf("%s and %s", v, peer), uintptr(unsafe.Pointer(&x)), uintptr(v.handle), uintptr(peer.handle)); err != nil {
		return false, err
	}
	return x != 0, nil
}

// DeviceByPCIBusID returns the device with the given PCI bus id
// ("0000:3b:00.0", any case), found among this process's visible devices:
// ordinals differ between processes under CUDA_VISIBLE_DEVICES, bus ids do
// not. It fails with ErrBadArgument when no visible device has it.
func (d *Driver) DeviceByPCIBusID(bus string) (Device, error) {
	n, err := d.DeviceCount()
	if err != nil {
		return Device{}, err
	}
	for i := 0; i < n; i++ {
		v, err := d.Device(i)
		if err != nil {
			return Device{}, err
		}
		if b, err := v.PCIBusID(); err == nil && strings.EqualFold(b, bus) {
			return v, nil
		}
	}
	return Device{}, fmt.Errorf("%w: no visible CUDA device has PCI bus id %q", ErrBadArgument, bus)
}
