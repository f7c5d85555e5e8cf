//go:build !cgo || !linux

package nvml

import (
	"fmt"

	"github.com/gdrlink/gdrlink/gdr"
)

func (s *Source) gpus() (gdr.GPUInventory, error) {
	return gdr.GPUInventory{}, fmt.Errorf("%w: built without cgo", ErrNotAvailable)
}
