//go:build !cgo || !linux

package nvml

import "fmt"

func gpus(string) (Inventory, error) {
	return Inventory{}, fmt.Errorf("%w: built without cgo", ErrNotAvailable)
}

// BAR1 cannot ask NVML in a build without cgo (go-nvml needs it).
func BAR1(busID string) (free, total int64, err error) {
	return 0, 0, fmt.Errorf("%w: built without cgo", ErrNotAvailable)
}

// C2C cannot ask NVML in a build without cgo (go-nvml needs it).
func C2C(busID string) (bool, error) {
	return false, fmt.Errorf("%w: built without cgo", ErrNotAvailable)
}
