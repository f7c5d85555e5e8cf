// Package gorgonia views gdrlink pool tensors as gorgonia.org/tensor Dense
// tensors without copying: the Dense's backing array is the pool tensor's
// memory, so a write through either is seen by the other, and a Dense
// computed on by gorgonia can be sent, received or all-reduced by gdrlink
// as it is.
//
// Host tensors (tensor.Host and tensor.PinnedHost) become Dense tensors of
// gorgonia's default engine with Dense. GPU tensors cannot: gorgonia's
// default engine reads and writes its backing array with the CPU. DeviceDense
// builds a Dense whose memory is the GPU tensor's device pointer under an
// engine the caller gives, one whose memory is not accessible to the CPU
// (AllocAccessible false), such as gorgonia.org/cu's; Memory gives the
// device pointer and size alone, as gorgonia's engines take them.
//
// A view is valid until the pool tensor is released; the pool tensor, not
// the Dense, owns the memory.
package gorgonia

import (
	"errors"
	"fmt"
	"math"

	"github.com/gdrlink/gdrlink/tensor"
	gt "gorgonia.org/tensor"
)

// Errors of this package, each wrapped with the tensor's detail.
var (
	// ErrDType: the tensor's element type has no gorgonia.org/tensor
	// counterpart (float16, bfloat16, string).
	ErrDType = errors.New("gorgonia: element type has no gorgonia dtype")
	// ErrShape: a shape gorgonia cannot view: no elements (a zero
	// dimension), a dead tensor, or a dimension that overflows int.
	ErrShape = errors.New("gorgonia: shape cannot be viewed")
	// ErrDevice: a GPU tensor given to Dense, a host tensor given to
	// DeviceDense, or an engine that would touch device memory with the CPU.
	ErrDevice = errors.New("gorgonia: tensor is on the wrong device for this view")
)

// DType is the gorgonia dtype of a gdrlink element type, or an error
// wrapping ErrDType when gorgonia has none: gorgonia.org/tensor has no
// 16-bit floats (view those with tensor.View as uint16 bits instead) and its
// strings are Go strings, not bytes.
func DType(dt tensor.DType) (gt.Dtype, error) {
	switch dt {
	case tensor.Bool:
		return gt.Bool, nil
	case tensor.Int8:
		return gt.Int8, nil
	case tensor.Int16:
		return gt.Int16, nil
	case tensor.Int32:
		return gt.Int32, nil
	case tensor.Int64:
		return gt.Int64, nil
	case tensor.Uint8:
		return gt.Uint8, nil
	case tensor.Uint16:
		return gt.Uint16, nil
	case tensor.Uint32:
		return gt.Uint32, nil
	case tensor.Uint64:
		return gt.Uint64, nil
	case tensor.Float32:
		return gt.Float32, nil
	case tensor.Float64:
		return gt.Float64, nil
	case tensor.Complex64:
		return gt.Complex64, nil
	case tensor.Complex128:
		return gt.Complex128, nil
	}
	return gt.Dtype{}, fmt.Errorf("%w: %s", ErrDType, dt)
}

// shape converts a gdrlink shape to gorgonia's, refusing what gorgonia
// cannot hold: dead and empty tensors. A scalar (rank 0) becomes shape (1),
// as gorgonia gives a one-element backing array.
func shape(m tensor.Meta) ([]int, error) {
	if m.IsDead {
		return nil, fmt.Errorf("%w: %s is dead", ErrShape, m)
	}
	dims := make([]int, len(m.Shape))
	for i, d := range m.Shape {
		if d <= 0 || d > math.MaxInt32 {
			return nil, fmt.Errorf("%w: dimension %d of %v", ErrShape, i, m.Shape)
		}
		dims[i] = int(d)
	}
	if len(dims) == 0 {
		dims = []int{1}
	}
	return dims, nil
}

// Dense returns a gorgonia Dense of t's dtype and shape whose backing array
// is t's memory. t must be a live host tensor (tensor.Host or
// tensor.PinnedHost) of a type DType accepts, with at least one element.
// A Bool tensor's bytes are checked to be 0 or 1 when the view is made (a
// Go bool must be); bytes received into it later are not checked again.
// Errors wrap ErrDType, ErrShape, ErrDevice, or tensor's own
// (tensor.ErrReleased, tensor.ErrMisaligned).
func Dense(t *tensor.Tensor) (*gt.Dense, error) {
	m := t.Meta()
	dt, err := DType(m.DType)
	if err != nil {
		return nil, err
	}
	dims, err := shape(m)
	if err != nil {
		return nil, err
	}
	if t.Device().Kind == tensor.GPU {
		return nil, fmt.Errorf("%w: %s tensor on %s: use DeviceDense", ErrDevice, m.DType, t.Device())
	}
	var back any
	switch dt {
	case gt.Bool:
		back, err = boolView(t)
	case gt.Int8:
		back, err = tensor.View[int8](t)
	case gt.Int16:
		back, err = tensor.View[int16](t)
	case gt.Int32:
		back, err = tensor.View[int32](t)
	case gt.Int64:
		back, err = tensor.View[int64](t)
	case gt.Uint8:
		back, err = tensor.View[uint8](t)
	case gt.Uint16:
		back, err = tensor.View[uint16](t)
	case gt.Uint32:
		back, err = tensor.View[uint32](t)
	case gt.Uint64:
		back, err = tensor.View[uint64](t)
	case gt.Float32:
		back, err = tensor.View[float32](t)
	case gt.Float64:
		back, err = tensor.View[float64](t)
	case gt.Complex64:
		back, err = tensor.View[complex64](t)
	case gt.Complex128:
		back, err = tensor.View[complex128](t)
	}
	if err != nil {
		return nil, fmt.Errorf("gorgonia: view of %s: %w", m, err)
	}
	return gt.New(gt.WithShape(dims...), gt.WithBacking(back)), nil
}

// Memory is a pool tensor's memory as gorgonia's engines take it: an
// address (a device pointer for GPU tensors) and a size in bytes.
type Memory struct {
	Ptr  uintptr
	Size uintptr
}

// Uintptr is the address of the first byte.
func (m Memory) Uintptr() uintptr { return m.Ptr }

// MemSize is the size in bytes.
func (m Memory) MemSize() uintptr { return m.Size }

var _ gt.Memory = Memory{}

// MemoryOf returns t's memory as a gorgonia tensor.Memory: for a GPU tensor
// its device pointer, which gorgonia.org/cu and other device engines take
// as they are (device pointers are uintptr on both sides). It fails with
// tensor.ErrReleased after Release and ErrShape for dead or empty tensors.
func MemoryOf(t *tensor.Tensor) (Memory, error) {
	m := t.Meta()
	if _, err := shape(m); err != nil {
		return Memory{}, err
	}
	if t.Addr() == 0 {
		return Memory{}, fmt.Errorf("%w: %s has no memory", ErrShape, m)
	}
	if _, err := t.Bytes(); err != nil && t.Device().Kind != tensor.GPU {
		return Memory{}, err
	}
	return Memory{Ptr: t.Addr(), Size: uintptr(m.ByteSize)}, nil
}

// DeviceDense returns a Dense of t's dtype and shape over a GPU tensor's
// device memory, bound to engine e, which must be a device engine: one
// whose memory the CPU cannot access (e.AllocAccessible() false), such as
// gorgonia.org/cu's. Gorgonia then runs its operations on that engine;
// methods that read the backing array with the CPU (Data, At, String) must
// not be called on it. Errors wrap ErrDevice for a host tensor or an engine
// that would dereference device memory on the CPU, and ErrDType or
// ErrShape as for Dense.
func DeviceDense(t *tensor.Tensor, e gt.Engine) (*gt.Dense, error) {
	m := t.Meta()
	dt, err := DType(m.DType)
	if err != nil {
		return nil, err
	}
	dims, err := shape(m)
	if err != nil {
		return nil, err
	}
	if t.Device().Kind != tensor.GPU {
		return nil, fmt.Errorf("%w: %s tensor on %s: use Dense", ErrDevice, m.DType, t.Device())
	}
	if e == nil || e.AllocAccessible() {
		return nil, fmt.Errorf("%w: engine %T reads memory with the CPU; a GPU tensor needs a device engine", ErrDevice, e)
	}
	mem, err := MemoryOf(t)
	if err != nil {
		return nil, err
	}
	return gt.New(gt.Of(dt), gt.WithShape(dims...), gt.WithEngine(e), gt.FromMemory(mem.Ptr, mem.Size)), nil
}
