package bfp

import (
	"math/rand/v2"
	"testing"
	"unsafe"
)

// The benchmarks convert one 1 MiB message of binary32 gradients (256 Ki
// elements) in 256-element (1 KiB) blocks, the larger SwitchML slot; Memcpy
// copies the same bytes, the baseline any conversion is measured against.
const benchElems = 256 << 10

func benchData() ([]float32, []int32) {
	r := rand.New(rand.NewPCG(1, 1))
	x := make([]float32, benchElems)
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	return x, make([]int32, benchElems)
}

func BenchmarkMemcpy(b *testing.B) {
	x, q := benchData()
	src := unsafe.Slice((*int32)(unsafe.Pointer(&x[0])), len(x))
	b.SetBytes(benchElems * 4)
	for b.Loop() {
		copy(q, src)
	}
}

func BenchmarkExponent32(b *testing.B) {
	x, _ := benchData()
	b.SetBytes(benchElems * 4)
	var e uint8
	for b.Loop() {
		for i := 0; i < len(x); i += 256 {
			e ^= Exponent32(x[i : i+256])
		}
	}
	_ = e
}

func BenchmarkQuantize32(b *testing.B) {
	x, q := benchData()
	c, _ := NewCodec(32)
	exp := Exponent32(x) // the worst block's, so that no element saturates
	b.SetBytes(benchElems * 4)
	for b.Loop() {
		for i := 0; i < len(x); i += 256 {
			if err := c.Quantize32(q[i:i+256], x[i:i+256], exp); err != nil {
				b.Fatal(err)
			}
		}
	}
}

func BenchmarkDequantize32(b *testing.B) {
	x, q := benchData()
	c, _ := NewCodec(32)
	_ = c.Quantize32(q, x, Exponent32(x))
	b.SetBytes(benchElems * 4)
	for b.Loop() {
		for i := 0; i < len(x); i += 256 {
			_ = c.Dequantize32(x[i:i+256], q[i:i+256], 130)
		}
	}
}

func BenchmarkQuantizeBF16(b *testing.B) {
	x, q := benchData()
	h := make([]uint16, len(x))
	for i := range x {
		h[i] = Float64ToBF16(float64(x[i]))
	}
	c, _ := NewCodec(32)
	exp := ExponentBF16(h)
	b.SetBytes(benchElems * 2)
	for b.Loop() {
		for i := 0; i < len(x); i += 256 {
			_ = c.QuantizeBF16(q[i:i+256], h[i:i+256], exp)
		}
	}
}

func BenchmarkDequantizeF16(b *testing.B) {
	x, q := benchData()
	c, _ := NewCodec(32)
	_ = c.Quantize32(q, x, Exponent32(x))
	h := make([]uint16, len(x))
	b.SetBytes(benchElems * 2)
	for b.Loop() {
		for i := 0; i < len(x); i += 256 {
			_ = c.DequantizeF16(h[i:i+256], q[i:i+256], 130)
		}
	}
}
