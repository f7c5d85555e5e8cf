package collective

import "golang.org/x/sys/cpu"

// hasVec reports whether this CPU runs the AVX2 float32 and bfloat16
// kernels; hasF16 whether it also runs the float16 one (F16C).
var (
	hasVec = cpu.X86.HasAVX2
	hasF16 = cpu.X86.HasAVX2 && cpu.X86.HasF16C
)

// addF32AVX2 adds src into dst, n elements, n a multiple of 32.
//
//go:noescape
func addF32AVX2(dst, src *float32, n int)

// divF32AVX2 divides n elements of d by div, n a multiple of 32.
//
//go:noescape
func divF32AVX2(d *float32, n int, div float32)

// scaleF32AVX2 multiplies n elements of d by f, n a multiple of 32.
//
//go:noescape
func scaleF32AVX2(d *float32, n int, f float32)

// addBF16AVX2 adds src into dst as bfloat16s, n elements, n a multiple
// of 16.
//
//go:noescape
func addBF16AVX2(dst, src *uint16, n int)

// addF16F16C adds src into dst as IEEE halves, n elements, n a multiple
// of 8.
//
//go:noescape
func addF16F16C(dst, src *uint16, n int)

func addF16Vec(d, s []uint16) { addF16F16C(&d[0], &s[0], len(d)) }

func addBF16Vec(d, s []uint16) { addBF16AVX2(&d[0], &s[0], len(d)) }

// addF64AVX2 adds src into dst, n elements, n a multiple of 16.
//
//go:noescape
func addF64AVX2(dst, src *float64, n int)

func addF64Vec(d, s []float64) { addF64AVX2(&d[0], &s[0], len(d)) }

func addF32Vec(d, s []float32) { addF32AVX2(&d[0], &s[0], len(d)) }

func divF32Vec(d []float32, div float32) { divF32AVX2(&d[0], len(d), div) }

func scaleF32Vec(d []float32, f float32) { scaleF32AVX2(&d[0], len(d), f) }
