package tensor

import (
	"fmt"
	"sync/atomic"
)

// Buffer is memory that holds a tensor's bytes, usually a block of a pool
// arena (alloc.Block implements it). Its memory is off the Go heap, so a NIC
// may read and write it.
type Buffer interface {
	// Bytes is the buffer's memory. For GPU memory it is nil: use Addr.
	Bytes() []byte
	// Addr is the address of the first byte (a device pointer for GPU memory).
	Addr() uintptr
	// Len is the buffer's size in bytes; at least the tensor's byte size.
	Len() int
	// Device is where the memory lives.
	Device() Device
	// Free returns the memory to where it came from. It is called once, by
	// Tensor.Release.
	Free() error
}

// Tensor is a typed, shaped view of a Buffer, or, for String tensors, a slice
// of Go strings with no Buffer. A Tensor is owned by one goroutine at a time;
// Release returns its Buffer.
type Tensor struct {
	meta     Meta
	buf      Buffer
	strs     []string
	released atomic.Bool
}

// New returns a tensor of meta's type and shape over buf. The buffer must be
// large enough for meta.ByteSize; dead tensors may have a nil buffer.
func New(meta Meta, buf Buffer) (*Tensor, error) {
	if err := meta.Validate(); err != nil {
		return nil, err
	}
	if !meta.DType.DMAable() && !meta.IsDead {
		return nil, fmt.Errorf("%w: use NewStrings for %s tensors", ErrNotDMAable, meta.DType)
	}
	if meta.ByteSize > 0 && (buf == nil || int64(buf.Len()) < meta.ByteSize) {
		have := 0
		if buf != nil {
			have = buf.Len()
		}
		return nil, fmt.Errorf("%w: %s needs %d bytes, buffer has %d", ErrSizeMismatch, meta, meta.ByteSize, have)
	}
	return &Tensor{meta: Meta{DType: meta.DType, Shape: meta.Shape.clone(), IsDead: meta.IsDead, ByteSize: meta.ByteSize}, buf: buf}, nil
}

// NewStrings returns a String tensor of the given shape holding vals, which
// must have exactly as many elements as the shape. Its ByteSize is the size of
// its wire encoding.
func NewStrings(shape Shape, vals []string) (*Tensor, error) {
	m, err := metaForStrings(shape, vals)
	if err != nil {
		return nil, err
	}
	return &Tensor{meta: m, strs: vals}, nil
}

// Dead returns a dead tensor: meta-data with no value and no bytes.
func Dead(dt DType, shape Shape) *Tensor {
	return &Tensor{meta: Meta{DType: dt, Shape: shape.clone(), IsDead: true}}
}

// Meta returns the tensor's meta-data: element type, shape, whether it is
// dead, and the byte size a transfer of it carries. Its Shape is the
// tensor's own; callers must not modify it.
func (t *Tensor) Meta() Meta { return t.meta }

// Buffer is the memory under a DMAable tensor; nil for String and dead tensors.
func (t *Tensor) Buffer() Buffer { return t.buf }

// Device is where the tensor's bytes live; Host for String tensors.
func (t *Tensor) Device() Device {
	if t.buf == nil {
		return Host
	}
	return t.buf.Device()
}

// Bytes is the tensor's bytes (ByteSize of them) for host tensors. It fails
// for String tensors, GPU tensors and released tensors.
func (t *Tensor) Bytes() ([]byte, error) {
	if t.released.Load() {
		return nil, ErrReleased
	}
	if !t.meta.DType.DMAable() {
		return nil, fmt.Errorf("%w: %s", ErrNotDMAable, t.meta.DType)
	}
	if t.meta.ByteSize == 0 {
		return []byte{}, nil
	}
	b := t.buf.Bytes()
	if b == nil {
		return nil, fmt.Errorf("%w: %s memory has no host view", ErrNotDMAable, t.buf.Device())
	}
	return b[:t.meta.ByteSize], nil
}

// Addr is the address of the tensor's first byte, 0 when it has no buffer.
func (t *Tensor) Addr() uintptr {
	if t.buf == nil {
		return 0
	}
	return t.buf.Addr()
}

// Strings returns the elements of a String tensor.
func (t *Tensor) Strings() ([]string, error) {
	if t.released.Load() {
		return nil, ErrReleased
	}
	if t.meta.DType != String {
		return nil, fmt.Errorf("%w: %s tensor has no strings", ErrBadDType, t.meta.DType)
	}
	return t.strs, nil
}

// Release frees the tensor's buffer. A second Release returns ErrReleased and
// frees nothing.
func (t *Tensor) Release() error {
	if t.released.Swap(true) {
		return ErrReleased
	}
	if t.buf == nil {
		return nil
	}
	return t.buf.Free()
}
