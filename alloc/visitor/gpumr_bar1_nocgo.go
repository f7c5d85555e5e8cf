//go:build !cgo

package visitor

import (
	"errors"
)

// nvmlBAR1 cannot ask NVML in a build without cgo (go-nvml needs it).
func nvmlBAR1(busID string) (free, total int64, err error) {
	return 0, 0, errors.New("NVML unavailable: built without cgo")
}
