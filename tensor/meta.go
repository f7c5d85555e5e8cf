package tensor

import "fmt"

// Meta is what a receiver must know to allocate a tensor before its bytes
// arrive: element type, shape, whether it is dead (a placeholder with no
// value), and the number of bytes that will be written. For DMAable types
// ByteSize is NumElements*DType.Size(); for String tensors it is the size of
// the wire encoding.
type Meta struct {
	DType    DType
	Shape    Shape
	IsDead   bool
	ByteSize int64
}

// MetaFor returns the meta-data of a live DMAable tensor of the given type and
// shape, with ByteSize computed.
func MetaFor(dt DType, shape Shape) (Meta, error) {
	m := Meta{DType: dt, Shape: shape.Clone()}
	if !dt.Valid() {
		return m, fmt.Errorf("%w: %d", ErrBadDType, uint8(dt))
	}
	if !dt.DMAable() {
		return m, fmt.Errorf("%w: %s needs its encoding's size", ErrNotDMAable, dt)
	}
	n, err := shape.NumElements()
	if err != nil {
		return m, err
	}
	if n > 0 && int64(dt.Size()) > (1<<62)/n {
		return m, fmt.Errorf("%w: %v of %s overflows", ErrBadShape, shape, dt)
	}
	m.ByteSize = n * int64(dt.Size())
	return m, nil
}

// Validate checks that the meta-data is self-consistent: a valid type, a
// valid shape, a non-negative byte size that matches type and shape for
// DMAable types, and a zero byte size for dead tensors.
func (m Meta) Validate() error {
	if !m.DType.Valid() {
		return fmt.Errorf("%w: %d", ErrBadDType, uint8(m.DType))
	}
	n, err := m.Shape.NumElements()
	if err != nil {
		return err
	}
	if m.ByteSize < 0 {
		return fmt.Errorf("%w: byte size %d", ErrSizeMismatch, m.ByteSize)
	}
	if m.IsDead {
		if m.ByteSize != 0 {
			return fmt.Errorf("%w: dead tensor with %d bytes", ErrSizeMismatch, m.ByteSize)
		}
		return nil
	}
	if m.DType.DMAable() {
		sz := int64(m.DType.Size())
		if n > 0 && sz > (1<<62)/n || n*sz != m.ByteSize {
			return fmt.Errorf("%w: %s%v is not %d bytes", ErrSizeMismatch, m.DType, m.Shape, m.ByteSize)
		}
	}
	return nil
}

// Equal reports whether two meta-data are the same.
func (m Meta) Equal(o Meta) bool {
	return m.DType == o.DType && m.IsDead == o.IsDead && m.ByteSize == o.ByteSize && m.Shape.Equal(o.Shape)
}

// String prints the meta-data for people: "float32[2 3] 24 B".
func (m Meta) String() string {
	if m.IsDead {
		return fmt.Sprintf("%s%v dead", m.DType, m.Shape)
	}
	return fmt.Sprintf("%s%v %d B", m.DType, m.Shape, m.ByteSize)
}
