package tensor

import "errors"

// Errors of this package. Each is wrapped with the detail that caused it; match
// them with errors.Is.
var (
	// ErrBadDType: an element type that does not exist.
	ErrBadDType = errors.New("tensor: invalid dtype")
	// ErrBadShape: a negative dimension, too many dimensions, or an element
	// count that overflows.
	ErrBadShape = errors.New("tensor: invalid shape")
	// ErrSizeMismatch: a buffer or byte size that does not match dtype and shape.
	ErrSizeMismatch = errors.New("tensor: size does not match dtype and shape")
	// ErrTruncated: encoded input that ends before it should.
	ErrTruncated = errors.New("tensor: truncated encoding")
	// ErrOversized: encoded input that claims more than it may hold or than the
	// caller allows.
	ErrOversized = errors.New("tensor: oversized encoding")
	// ErrCorrupt: encoded input that is inconsistent with itself (bad version,
	// trailing bytes, counts that do not add up).
	ErrCorrupt = errors.New("tensor: inconsistent encoding")
	// ErrNotDMAable: a byte view asked of a tensor whose elements are not bytes.
	ErrNotDMAable = errors.New("tensor: not DMAable")
	// ErrMisaligned: a typed view of bytes whose address is not aligned for
	// the element type.
	ErrMisaligned = errors.New("tensor: misaligned buffer")
	// ErrReleased: a tensor used after Release.
	ErrReleased = errors.New("tensor: used after release")
)
