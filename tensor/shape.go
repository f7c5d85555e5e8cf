package tensor

import (
	"fmt"
	"math"
	"math/bits"
	"strings"
)

// MaxRank is the largest number of dimensions a shape may have.
const MaxRank = 32

// Shape is a tensor's dimensions, outermost first. A nil or empty shape is a
// scalar (one element).
type Shape []int64

// NumElements is the product of the dimensions, or an error wrapping
// ErrBadShape for a negative dimension, too many dimensions, or overflow.
func (s Shape) NumElements() (int64, error) {
	if len(s) > MaxRank {
		return 0, fmt.Errorf("%w: rank %d > %d", ErrBadShape, len(s), MaxRank)
	}
	n := uint64(1)
	for i, d := range s {
		if d < 0 {
			return 0, fmt.Errorf("%w: dimension %d is %d", ErrBadShape, i, d)
		}
		hi, lo := bits.Mul64(n, uint64(d))
		if hi != 0 || lo > math.MaxInt64 {
			return 0, fmt.Errorf("%w: %v has too many elements", ErrBadShape, s)
		}
		n = lo
	}
	return int64(n), nil
}

// Equal reports whether two shapes have the same dimensions.
func (s Shape) equal(o Shape) bool {
	if len(s) != len(o) {
		return false
	}
	for i := range s {
		if s[i] != o[i] {
			return false
		}
	}
	return true
}

// Clone returns a copy that shares no memory with s.
func (s Shape) clone() Shape {
	if s == nil {
		return nil
	}
	return append(Shape(make([]int64, 0, len(s))), s...)
}

// String prints the shape as [2 3 4].
func (s Shape) String() string {
	var b strings.Builder
	b.WriteByte('[')
	for i, d := range s {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprint(&b, d)
	}
	b.WriteByte(']')
	return b.String()
}
