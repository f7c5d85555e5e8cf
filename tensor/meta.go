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
	m := Meta{DType: dt, Shape: shape.clone()}
	if !dt.valid() {
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
// DMAable types or is at least the shortest encoding of that many strings
// for String tensors, and a zero byte size for dead tensors.
func (m Meta) Validate() error {
	if !m.DType.valid() {
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
		return nil
	}
	// A String tensor's encoding holds a version byte, the count, and at
	// least one length byte per element.
	if least := minStringsLen(n); uint64(m.ByteSize) < least {
		return fmt.Errorf("%w: encoding of %d strings needs at least %d bytes, meta-data says %d", ErrSizeMismatch, n, least, m.ByteSize)
	}
	return nil
}

// metaForStrings returns the meta-data of a live String tensor of the given
// shape holding vals, with ByteSize the size of their wire encoding.
func metaForStrings(shape Shape, vals []string) (Meta, error) {
	m := Meta{DType: String, Shape: shape.clone()}
	n, err := shape.NumElements()
	if err != nil {
		return m, err
	}
	if int64(len(vals)) != n {
		return m, fmt.Errorf("%w: shape %v needs %d strings, got %d", ErrSizeMismatch, shape, n, len(vals))
	}
	m.ByteSize = int64(stringsEncodedLen(vals))
	return m, nil
}

// minStringsLen is the size of the shortest encoding of n strings (all empty).
func minStringsLen(n int64) uint64 {
	return 1 + uint64(uvarintLen(uint64(n))) + uint64(n)
}

// Equal reports whether two meta-data are the same.
func (m Meta) Equal(o Meta) bool {
	return m.DType == o.DType && m.IsDead == o.IsDead && m.ByteSize == o.ByteSize && m.Shape.equal(o.Shape)
}

// String prints the meta-data for people: "float32[2 3] 24 B".
func (m Meta) String() string {
	if m.IsDead {
		return fmt.Sprintf("%s%v dead", m.DType, m.Shape)
	}
	return fmt.Sprintf("%s%v %d B", m.DType, m.Shape, m.ByteSize)
}
