package gorgonia

import (
	"fmt"
	"unsafe"

	"github.com/gdrlink/gdrlink/tensor"
)

// boolView views a Bool tensor's bytes as []bool after checking that every
// byte is 0 or 1 (a Go bool must be; bytes from a peer need not be).
func boolView(t *tensor.Tensor) ([]bool, error) {
	b, err := t.Bytes()
	if err != nil {
		return nil, err
	}
	for i, v := range b {
		if v > 1 {
			return nil, fmt.Errorf("%w: bool element %d holds byte %d", ErrDType, i, v)
		}
	}
	return unsafe.Slice((*bool)(unsafe.Pointer(unsafe.SliceData(b))), len(b)), nil
}
