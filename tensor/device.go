package tensor

import "fmt"

// DeviceKind says which memory a tensor's bytes live in.
type DeviceKind uint8

// Device kinds.
const (
	// CPU is pageable host memory.
	CPU DeviceKind = iota
	// PinnedHost is page-locked host memory that a GPU can copy to and from
	// asynchronously.
	PinnedHost
	// GPU is device memory of the GPU with the device's Index.
	GPU
)

// String names the kind.
func (k DeviceKind) String() string {
	switch k {
	case CPU:
		return "cpu"
	case PinnedHost:
		return "pinned"
	case GPU:
		return "gpu"
	}
	return fmt.Sprintf("DeviceKind(%d)", uint8(k))
}

// Device is where a tensor's bytes live: a kind and, for GPUs, an ordinal.
type Device struct {
	Kind  DeviceKind
	Index int
}

// Host is the device of pageable host memory.
var Host = Device{Kind: CPU}

// GPUDevice returns the device of GPU ordinal i.
func GPUDevice(i int) Device { return Device{Kind: GPU, Index: i} }

// IsGPU reports whether d is device memory.
func (d Device) IsGPU() bool { return d.Kind == GPU }

// String prints the device as "cpu", "pinned" or "gpu:N".
func (d Device) String() string {
	if d.Kind == GPU {
		return fmt.Sprintf("gpu:%d", d.Index)
	}
	return d.Kind.String()
}
