package collective

import "unsafe"

// vecBlock is the elements the vector kernels take at a time; the rest
// of a slice goes through the scalar loop.
const vecBlock = 32

// addF32 adds src into dst (dst[i] += src[i]), with AVX2 where the CPU
// has it: the same IEEE 754 single-precision additions in the same
// operand order as the scalar loop, so the same bits, NaNs included.
func addF32(dst, src []byte) {
	d, s := as[float32](dst), as[float32](src)
	s = s[:len(d)]
	n := len(d) &^ (vecBlock - 1)
	if hasVec && n > 0 && !partlyOverlap(d, s) {
		addF32Vec(d[:n], s[:n])
		d, s = d[n:], s[n:]
	}
	for i := range d {
		d[i] += s[i]
	}
}

// divF32 divides every element by n, with AVX2 where the CPU has it
// (division, not a multiply by the reciprocal, so the same bits as the
// scalar loop).
func divF32(b []byte, n int) {
	d := as[float32](b)
	div := float32(n)
	m := len(d) &^ (vecBlock - 1)
	if hasVec && m > 0 {
		divF32Vec(d[:m], div)
		d = d[m:]
	}
	for i := range d {
		d[i] /= div
	}
}

// partlyOverlap reports whether d and s share memory without being the
// same slice: there the scalar loop's element-by-element order matters.
func partlyOverlap(d, s []float32) bool {
	if len(d) == 0 {
		return false
	}
	dp, sp := uintptr(unsafe.Pointer(&d[0])), uintptr(unsafe.Pointer(&s[0]))
	size := uintptr(len(d)) * 4
	return dp != sp && dp < sp+size && sp < dp+size
}
