package tensor

import (
	"fmt"
	"unsafe"
)

// Element is a Go type that a host tensor's elements can be viewed as with
// View. Bool is absent on purpose: a Go bool must hold 0 or 1, which bytes
// from a peer need not; view Bool tensors with Bytes.
type Element interface {
	int8 | int16 | int32 | int64 | uint8 | uint16 | uint32 | uint64 |
		float32 | float64 | complex64 | complex128
}

// DTypeOf is the element type whose elements are T (Uint16 for uint16).
func DTypeOf[T Element]() DType {
	var z T
	switch any(z).(type) {
	case int8:
		return Int8
	case int16:
		return Int16
	case int32:
		return Int32
	case int64:
		return Int64
	case uint8:
		return Uint8
	case uint16:
		return Uint16
	case uint32:
		return Uint32
	case uint64:
		return Uint64
	case float32:
		return Float32
	case float64:
		return Float64
	case complex64:
		return Complex64
	case complex128:
		return Complex128
	}
	return Invalid
}

// viewable reports whether a tensor of type dt may be viewed as T: its own
// Go type, or uint16 for the 16-bit floats, which Go has no type for.
func viewable[T Element](dt DType) bool {
	want := DTypeOf[T]()
	return dt == want || want == Uint16 && (dt == Float16 || dt == BFloat16)
}

// View returns a host tensor's elements as a []T sharing the tensor's memory
// (so it is valid until the tensor is released). T must be the tensor's
// element type, or uint16 for Float16 and BFloat16 tensors (raw bits). It
// fails with ErrBadDType for another T, ErrNotDMAable for GPU memory,
// ErrReleased after Release, and ErrMisaligned when the buffer's address is
// not aligned for T. An empty or dead tensor gives an empty slice.
func View[T Element](t *Tensor) ([]T, error) {
	if !viewable[T](t.meta.DType) {
		return nil, fmt.Errorf("%w: %s tensor viewed as %s", ErrBadDType, t.meta.DType, DTypeOf[T]())
	}
	b, err := t.Bytes()
	if err != nil {
		return nil, err
	}
	if len(b) == 0 {
		return []T{}, nil
	}
	var z T
	p := unsafe.Pointer(unsafe.SliceData(b))
	if uintptr(p)%unsafe.Alignof(z) != 0 {
		return nil, fmt.Errorf("%w: address %p is not %d-byte aligned for %s", ErrMisaligned, p, unsafe.Alignof(z), t.meta.DType)
	}
	return unsafe.Slice((*T)(p), len(b)/int(unsafe.Sizeof(z))), nil
}
