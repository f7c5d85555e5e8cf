package collective

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/gdrlink/gdrlink/tensor"
)

// number is an element type the ring adds natively.
type number interface {
	int8 | int16 | int32 | int64 | uint8 | uint16 | uint32 | uint64 |
		float32 | float64 | complex64 | complex128
}

// as views b as elements of T. b's address is aligned for T: it is an
// offset of whole elements into a pool block.
func as[T number](b []byte) []T {
	if len(b) == 0 {
		return nil
	}
	var z T
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/int(unsafe.Sizeof(z)))
}

// addTo adds src into dst, element by element: dst[i] = dst[i] + src[i].
func addTo[T number](dst, src []byte) {
	d, s := as[T](dst), as[T](src)
	s = s[:len(d)]
	for i := range d {
		d[i] += s[i]
	}
}

// divFloat divides every element by n.
func divFloat[T float32 | float64](b []byte, n int) {
	d := as[T](b)
	div := T(n)
	for i := range d {
		d[i] /= div
	}
}

// divComplex divides every element by n.
func divComplex[T complex64 | complex128](b []byte, n int) {
	d := as[T](b)
	div := T(complex(float64(n), 0))
	for i := range d {
		d[i] /= div
	}
}

// divInt divides every element by n, truncating toward zero.
func divInt[T int8 | int16 | int32 | int64 | uint8 | uint16 | uint32 | uint64](b []byte, n int) {
	d := as[T](b)
	div := T(n)
	for i := range d {
		d[i] /= div
	}
}

// half is a 16-bit float format: its conversions to and from float32.
type half struct {
	to   func(uint16) float32
	from func(float32) uint16
}

var (
	halfF16  = half{f16ToF32, f32ToF16}
	halfBF16 = half{bf16ToF32, f32ToBF16}
)

func divHalf(h half, b []byte, n int) {
	d := as[uint16](b)
	for i := range d {
		d[i] = h.from(h.to(d[i]) / float32(n))
	}
}

// kernel is what a reduction does to one element type.
type kernel struct {
	add func(dst, src []byte)
	div func(b []byte, n int)
}

// addDivBlock is the bytes addDiv adds and divides at a time: a multiple of
// every element size, and small enough for the first level of cache.
const addDivBlock = 16 << 10

// addDiv adds src into dst and divides the sums by n, a block at a time,
// so that the division reads from the cache what the addition just wrote:
// the same operations on every element, in the same order, as add over
// the whole followed by div, so the same bits.
func (k kernel) addDiv(dst, src []byte, n int) {
	for off := 0; off < len(dst); off += addDivBlock {
		end := min(off+addDivBlock, len(dst))
		k.add(dst[off:end], src[off:end])
		k.div(dst[off:end], n)
	}
}

// kernelFor returns the kernel of dt, or an error for types that do not
// add (bool, string).
func kernelFor(dt tensor.DType) (kernel, error) {
	switch dt {
	case tensor.Int8:
		return kernel{addTo[int8], divInt[int8]}, nil
	case tensor.Int16:
		return kernel{addTo[int16], divInt[int16]}, nil
	case tensor.Int32:
		return kernel{addTo[int32], divInt[int32]}, nil
	case tensor.Int64:
		return kernel{addTo[int64], divInt[int64]}, nil
	case tensor.Uint8:
		return kernel{addTo[uint8], divInt[uint8]}, nil
	case tensor.Uint16:
		return kernel{addTo[uint16], divInt[uint16]}, nil
	case tensor.Uint32:
		return kernel{addTo[uint32], divInt[uint32]}, nil
	case tensor.Uint64:
		return kernel{addTo[uint64], divInt[uint64]}, nil
	case tensor.Float32:
		return kernel{addF32, divF32}, nil
	case tensor.Float64:
		return kernel{addF64, divFloat[float64]}, nil
	case tensor.Complex64:
		return kernel{addTo[complex64], divComplex[complex64]}, nil
	case tensor.Complex128:
		return kernel{addTo[complex128], divComplex[complex128]}, nil
	case tensor.Float16:
		return kernel{addF16, func(b []byte, n int) { divHalf(halfF16, b, n) }}, nil
	case tensor.BFloat16:
		return kernel{addBF16, func(b []byte, n int) { divHalf(halfBF16, b, n) }}, nil
	}
	return kernel{}, fmt.Errorf("%w: %s tensors cannot be reduced", ErrBadArgument, dt)
}

// bf16ToF32 widens a bfloat16: its bits are a float32's upper half.
func bf16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// f32ToBF16 rounds a float32 to the nearest bfloat16, ties to even; NaNs
// stay NaNs (quiet).
func f32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return uint16(b>>16) | 0x40
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// f16ToF32 widens an IEEE 754 half.
func f16ToF32(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f: // inf, NaN
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	case exp == 0 && man == 0:
		return math.Float32frombits(sign)
	case exp == 0: // subnormal: man × 2^-24
		f := float32(man) * (1.0 / (1 << 24))
		if sign != 0 {
			f = -f
		}
		return f
	}
	return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
}

// f32ToF16 rounds a float32 to the nearest IEEE 754 half, ties to even,
// overflowing to infinity; NaNs stay NaNs (quiet).
func f32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	man := b & 0x7fffff
	switch {
	case exp == 0xff:
		if man != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	case exp-127 > 15:
		return sign | 0x7c00
	case exp-127 >= -14: // normal half
		e := uint32(exp-127+15) << 10
		v := e | man>>13
		rem := man & 0x1fff
		if rem > 0x1000 || rem == 0x1000 && v&1 == 1 {
			v++ // may carry into the exponent, up to infinity: right
		}
		return sign | uint16(v)
	case exp-127 < -25:
		return sign // below half the smallest subnormal
	}
	// Subnormal half: the value is m × 2^(exp-150) with the implicit bit,
	// and a half subnormal counts units of 2^-24.
	m := man | 0x800000
	shift := uint32(-(exp - 127) - 14 + 13) // 14..24+
	v := m >> shift
	rem := m & (1<<shift - 1)
	halfway := uint32(1) << (shift - 1)
	if rem > halfway || rem == halfway && v&1 == 1 {
		v++
	}
	return sign | uint16(v)
}
