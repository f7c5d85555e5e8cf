package collective

import "unsafe"

// vecBlock is the elements the vector kernels take at a time; the rest
// of a slice goes through the scalar loop.
const vecBlock = 32

// vecHead runs vec, when ok, on the longest head of d and s that is a
// multiple of block elements (unless the two overlap in part, where the
// scalar loop's order matters), and returns what is left for the scalar
// loop.
func vecHead[T float32 | float64 | uint16](d, s []T, block int, ok bool, vec func(d, s []T)) ([]T, []T) {
	n := len(d) &^ (block - 1)
	if !ok || n == 0 || partlyOverlap(d, s) {
		return d, s
	}
	vec(d[:n], s[:n])
	return d[n:], s[n:]
}

// addF32 adds src into dst (dst[i] += src[i]), with AVX2 where the CPU
// has it: the same IEEE 754 single-precision additions in the same
// operand order as the scalar loop, so the same bits, NaNs included.
func addF32(dst, src []byte) {
	d, s := as[float32](dst), as[float32](src)
	d, s = vecHead(d, s[:len(d)], vecBlock, hasVec, addF32Vec)
	for i := range d {
		d[i] += s[i]
	}
}

// addF64 is addF32 for float64 (16 elements a vector step).
func addF64(dst, src []byte) {
	d, s := as[float64](dst), as[float64](src)
	d, s = vecHead(d, s[:len(d)], f64Block, hasVec, addF64Vec)
	for i := range d {
		d[i] += s[i]
	}
}

// f64Block is the elements addF64's vector kernel takes at a time.
const f64Block = 16

// divF32 divides every element by n, with AVX2 where the CPU has it,
// giving the scalar division's bits: by a power of two it multiplies by
// the reciprocal, which is exact (x·2⁻ᵏ is the real number both the
// quotient and the product round, correctly, to the same float, NaNs,
// infinities and subnormals included) and several times faster than a
// vector division; by any other n it divides.
func divF32(b []byte, n int) {
	d := as[float32](b)
	div := float32(n)
	m := len(d) &^ (vecBlock - 1)
	if hasVec && m > 0 {
		if n > 0 && n&(n-1) == 0 {
			scaleF32Vec(d[:m], 1/div)
		} else {
			divF32Vec(d[:m], div)
		}
		d = d[m:]
	}
	for i := range d {
		d[i] /= div
	}
}

// addBF16 adds bfloat16s: dst[i] = bf16(f32(dst[i]) + f32(src[i])),
// rounded to nearest even, with AVX2 where the CPU has it. A NaN operand
// gives its quiet form, dst's when both are NaN (as the CPU's float32
// addition with dst first does; addHalf's operand order is the
// compiler's), so the vector and scalar paths give the same bits.
func addBF16(dst, src []byte) {
	d, s := as[uint16](dst), as[uint16](src)
	d, s = vecHead(d, s[:len(d)], bf16Block, hasVec, addBF16Vec)
	for i := range d {
		d[i] = addBF16One(d[i], s[i])
	}
}

// addBF16One is addBF16 of one element.
func addBF16One(d, s uint16) uint16 {
	switch {
	case d&0x7fff > 0x7f80:
		return d | 0x40
	case s&0x7fff > 0x7f80:
		return s | 0x40
	}
	return f32ToBF16(bf16ToF32(d) + bf16ToF32(s))
}

// addF16 adds IEEE halves: dst[i] = f16(f32(dst[i]) + f32(src[i])),
// rounded to nearest even, with AVX2 and F16C where the CPU has them. A
// NaN operand gives the quiet NaN of dst's sign when dst is NaN, else of
// src's (f32ToF16 keeps no payload), so the vector and scalar paths give
// the same bits.
func addF16(dst, src []byte) {
	d, s := as[uint16](dst), as[uint16](src)
	d, s = vecHead(d, s[:len(d)], f16Block, hasF16, addF16Vec)
	for i := range d {
		d[i] = addF16One(d[i], s[i])
	}
}

// f16Block is the elements addF16's vector kernel takes at a time.
const f16Block = 8

// addF16One is addF16 of one element.
func addF16One(d, s uint16) uint16 {
	switch {
	case d&0x7fff > 0x7c00:
		return d&0x8000 | 0x7e00
	case s&0x7fff > 0x7c00:
		return s&0x8000 | 0x7e00
	}
	return f32ToF16(f16ToF32(d) + f16ToF32(s))
}

// bf16Block is the elements addBF16's vector kernel takes at a time.
const bf16Block = 16

// partlyOverlap reports whether d and s share memory without being the
// same slice: there the scalar loop's element-by-element order matters.
func partlyOverlap[T float32 | float64 | uint16](d, s []T) bool {
	if len(d) == 0 {
		return false
	}
	dp, sp := uintptr(unsafe.Pointer(&d[0])), uintptr(unsafe.Pointer(&s[0]))
	size := uintptr(len(d)) * unsafe.Sizeof(d[0])
	return dp != sp && dp < sp+size && sp < dp+size
}
