// Package bfp converts gradient blocks to and from block floating point, the
// form in which SwitchML workers hand gradients to an aggregator that can only
// add integers and take maxima.
//
// A block travels as 32-bit integer significands and one 8-bit exponent byte.
// Every worker must quantise a block with the same exponent, so that adding
// significands adds values: the shared exponent is the maximum of the
// workers' own exponents (SwitchML learns it one block ahead: a worker sends
// the exponent of its next block with the current one, and the aggregator's
// reply carries the maximum). This package gives the two halves: Exponent*
// says which exponent byte a worker's block needs, Quantize* and Dequantize*
// convert with a given (shared) byte.
//
// # The exponent byte
//
// The byte is the largest IEEE binary32 biased exponent field among the
// block's elements (float16 and bfloat16 elements are widened to binary32
// exactly first). With e = byte - 126, every element x of the block satisfies
// |x| < 2^e; byte 0 stands for every block whose elements are all below 2^-126
// (zeros and binary32 subnormals). Byte 255, [NonFinite], marks a block that
// holds a NaN or an infinity. Because the aggregator takes the maximum, one
// worker's non-finite block makes the shared byte 255 and every worker
// dequantises that whole block to NaN: a poisoned gradient stays visible (as
// an automatic-mixed-precision loss scaler expects) instead of turning into
// arbitrary numbers. Such a block quantises to zeros, so it still completes
// the protocol.
//
// # Headroom
//
// A codec for n workers keeps h = ceil(log2 n) bits of headroom: each
// significand q satisfies |q| <= M = 2^(31-h) - 1, so the sum of n of them
// is at most n*M <= 2^h * (2^(31-h) - 1) = 2^31 - 2^h in magnitude and fits
// in an int32 whatever the signs. The significand of x is
// q = RoundToEven(x * 2^(31-h-e)); |x| < 2^e gives |x * 2^(31-h-e)| < 2^(31-h),
// and because a binary32 value has 24 significant bits, the largest such
// product is 2^(31-h) - 2^(7-h), which for h <= 7 is an integer at most M:
// quantising with an exponent at least the block's own never saturates. So
// [MaxWorkers] is 128.
//
// # Error bound
//
// Let u = 2^(e+h-31) be the unit of the shared exponent e. Each significand
// is x/u rounded to the nearest integer, off by at most 1/2, so the integer
// sum S of n workers' significands satisfies |S*u - T| <= n*u/2, where T is
// the exact (real) sum of the workers' values. S*u is computed exactly in
// float64 and rounded once, to nearest even, into the output format, adding at
// most half a unit in the last place of the result (float32, float16 or
// bfloat16). The bound is absolute, relative to the block's largest
// magnitude: elements far smaller than the block's largest keep only the bits
// above u (a wide dynamic range inside one block costs precision, as in
// SwitchML). A result beyond the output format's range becomes ±Inf, as a
// floating-point sum would.
//
// # Determinism
//
// Dequantisation is a pure function of the integer sum, the shared exponent
// byte and the codec: one exact float64 scaling by a power of two and one
// correctly rounded conversion, with no fused or reordered arithmetic. Every
// worker that receives the same sums produces bitwise identical results.
//
// int32 tensors need no quantisation: their values are the significands, and
// the aggregator's sum is exact while it fits in an int32 (it wraps, in two's
// complement, beyond).
package bfp

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
)

// NonFinite is the exponent byte of a block that holds a NaN or an infinity.
const NonFinite uint8 = 255

// MaxWorkers is the largest worker count a [Codec] supports with the error
// bound of the package documentation (h <= 7 bits of headroom).
const MaxWorkers = 128

// Errors of the package.
var (
	// ErrWorkers means a worker count outside 1..MaxWorkers.
	ErrWorkers = errors.New("bfp: worker count out of range")
	// ErrLength means source and destination of different lengths.
	ErrLength = errors.New("bfp: source and destination lengths differ")
	// ErrRange means an element did not fit under the exponent byte given to
	// Quantize (its significand was saturated) or was not finite while the
	// byte was (it was quantised to 0).
	ErrRange = errors.New("bfp: element out of range for the exponent")
)

// Codec quantises and dequantises blocks for a fixed number of workers. The
// zero value is not usable; make one with [NewCodec].
type Codec struct {
	workers  int
	headroom int
}

// NewCodec returns a codec whose significands leave room for the sum of
// workers blocks in an int32.
func NewCodec(workers int) (Codec, error) {
	if workers < 1 || workers > MaxWorkers {
		return Codec{}, fmt.Errorf("%w: %d, want 1..%d", ErrWorkers, workers, MaxWorkers)
	}
	return Codec{workers: workers, headroom: bits.Len(uint(workers - 1))}, nil
}

// Workers is the worker count the codec was made for.
func (c Codec) Workers() int { return c.workers }

// Headroom is h, the bits each significand leaves free for the sum.
func (c Codec) Headroom() int { return c.headroom }

// MaxSignificand is M = 2^(31-h) - 1, the largest magnitude of a significand.
func (c Codec) MaxSignificand() int32 { return int32(1)<<(31-c.headroom) - 1 }

// Unit is u = 2^(e+h-31) for exponent byte exp (e = exp - 126): the value of
// significand 1. It is NaN for [NonFinite].
func (c Codec) Unit(exp uint8) float64 {
	if exp == NonFinite {
		return math.NaN()
	}
	return math.Ldexp(1, int(exp)-157+c.headroom)
}

// SumErrorBound is n*u/2, the bound on |S*u - T| for the sum S of the
// significands of n workers' blocks quantised with exp, before the final
// rounding into the output format.
func (c Codec) SumErrorBound(exp uint8, n int) float64 {
	return float64(n) * c.Unit(exp) / 2
}

// Exponent32 returns the exponent byte block needs: the largest biased
// exponent field of its elements, or NonFinite.
func Exponent32(block []float32) uint8 {
	var m uint32
	for _, x := range block {
		m = max(m, math.Float32bits(x)>>23&0xff)
	}
	return uint8(m)
}

// ExponentBF16 returns the exponent byte of a block of bfloat16 values (the
// high 16 bits of binary32).
func ExponentBF16(block []uint16) uint8 {
	var m uint16
	for _, x := range block {
		m = max(m, x>>7&0xff)
	}
	return uint8(m)
}

// ExponentF16 returns the exponent byte of a block of IEEE binary16 values.
func ExponentF16(block []uint16) uint8 {
	var m uint16
	for _, x := range block {
		m = max(m, x&0x7c00)
	}
	switch {
	case m == 0x7c00:
		return NonFinite
	case m == 0:
		// Zeros and subnormals: below 2^-14, byte of 2^-15 <= |x| < 2^-14
		// at most; a subnormal's own binary32 field is smaller still, and
		// the exact field only matters as an upper bound.
		var top uint16
		for _, x := range block {
			top = max(top, x&0x3ff)
		}
		if top == 0 {
			return 0
		}
		return uint8(math.Float32bits(float32(top)*0x1p-24) >> 23)
	default:
		return uint8(m>>10) + 112
	}
}

// scale returns 2^(31-h-e) for exponent byte exp.
func (c Codec) scale(exp uint8) float64 {
	return math.Ldexp(1, 157-c.headroom-int(exp))
}

// Quantize32 writes the significands of src under exponent byte exp to dst.
// With exp NonFinite it writes zeros. An element that does not fit (the
// exponent is smaller than the block needs) saturates to ±MaxSignificand, a
// non-finite element under a finite exponent becomes 0; either way the whole
// of dst is written and the error wraps ErrRange.
func (c Codec) Quantize32(dst []int32, src []float32, exp uint8) error {
	if len(dst) != len(src) {
		return fmt.Errorf("%w: %d significands for %d values", ErrLength, len(dst), len(src))
	}
	if exp == NonFinite {
		clear(dst)
		return nil
	}
	s := c.scale(exp)
	limit := float64(c.MaxSignificand())
	bad := 0
	for i, x := range src {
		v := roundEven(float64(float64(x) * s))
		if !(math.Abs(v) <= limit) { // also catches NaN
			bad++
			v = saturate(v, limit)
		}
		dst[i] = int32(v)
	}
	if bad > 0 {
		return fmt.Errorf("%w: %d of %d elements under exponent byte %d", ErrRange, bad, len(src), exp)
	}
	return nil
}

// roundEven rounds v to an integer, ties to even: adding and subtracting
// 1.5*2^52 leaves the fraction to the default IEEE rounding (to nearest,
// ties to even), which equals math.RoundToEven for |v| < 2^51 and is 2-3
// times as fast. Larger magnitudes come back far beyond any significand
// limit (and infinities and NaN as themselves), which the callers report.
// The callers convert the product explicitly so that it is rounded before
// the addition (a fused multiply-add is not allowed across it).
func roundEven(v float64) float64 {
	const magic = 0x1.8p52
	return (v + magic) - magic
}

func saturate(v, limit float64) float64 {
	switch {
	case v > limit:
		return limit
	case v < -limit:
		return -limit
	default:
		return 0 // NaN
	}
}

// QuantizeBF16 is Quantize32 for bfloat16 values.
//
// The per-format loops are written out on purpose: one loop taking the
// widening as a function value runs QuantizeBF16 at two thirds the speed
// (0.87 against 1.3 GB/s, BenchmarkQuantizeBF16), the call not inlined.
func (c Codec) QuantizeBF16(dst []int32, src []uint16, exp uint8) error {
	if len(dst) != len(src) {
		return fmt.Errorf("%w: %d significands for %d values", ErrLength, len(dst), len(src))
	}
	if exp == NonFinite {
		clear(dst)
		return nil
	}
	s := c.scale(exp)
	limit := float64(c.MaxSignificand())
	bad := 0
	for i, x := range src {
		v := roundEven(float64(float64(math.Float32frombits(uint32(x)<<16)) * s))
		if !(math.Abs(v) <= limit) {
			bad++
			v = saturate(v, limit)
		}
		dst[i] = int32(v)
	}
	if bad > 0 {
		return fmt.Errorf("%w: %d of %d elements under exponent byte %d", ErrRange, bad, len(src), exp)
	}
	return nil
}

// QuantizeF16 is Quantize32 for IEEE binary16 values.
func (c Codec) QuantizeF16(dst []int32, src []uint16, exp uint8) error {
	if len(dst) != len(src) {
		return fmt.Errorf("%w: %d significands for %d values", ErrLength, len(dst), len(src))
	}
	if exp == NonFinite {
		clear(dst)
		return nil
	}
	s := c.scale(exp)
	limit := float64(c.MaxSignificand())
	bad := 0
	for i, x := range src {
		v := roundEven(float64(F16ToFloat64(x) * s))
		if !(math.Abs(v) <= limit) {
			bad++
			v = saturate(v, limit)
		}
		dst[i] = int32(v)
	}
	if bad > 0 {
		return fmt.Errorf("%w: %d of %d elements under exponent byte %d", ErrRange, bad, len(src), exp)
	}
	return nil
}

// Dequantize32 writes the values of the significand sums sum under exponent
// byte exp to dst, each rounded once to the nearest binary32 (ties to even).
// With exp NonFinite every value is NaN.
func (c Codec) Dequantize32(dst []float32, sum []int32, exp uint8) error {
	if len(dst) != len(sum) {
		return fmt.Errorf("%w: %d values for %d significands", ErrLength, len(dst), len(sum))
	}
	if exp == NonFinite {
		nan := float32(math.NaN())
		for i := range dst {
			dst[i] = nan
		}
		return nil
	}
	u := c.Unit(exp)
	for i, q := range sum {
		dst[i] = float32(float64(q) * u)
	}
	return nil
}

// DequantizeBF16 is Dequantize32 into bfloat16, rounded once to nearest even.
func (c Codec) DequantizeBF16(dst []uint16, sum []int32, exp uint8) error {
	if len(dst) != len(sum) {
		return fmt.Errorf("%w: %d values for %d significands", ErrLength, len(dst), len(sum))
	}
	if exp == NonFinite {
		for i := range dst {
			dst[i] = bf16NaN
		}
		return nil
	}
	u := c.Unit(exp)
	for i, q := range sum {
		dst[i] = Float64ToBF16(float64(q) * u)
	}
	return nil
}

// DequantizeF16 is Dequantize32 into IEEE binary16, rounded once to nearest
// even (subnormal results included).
func (c Codec) DequantizeF16(dst []uint16, sum []int32, exp uint8) error {
	if len(dst) != len(sum) {
		return fmt.Errorf("%w: %d values for %d significands", ErrLength, len(dst), len(sum))
	}
	if exp == NonFinite {
		for i := range dst {
			dst[i] = f16NaN
		}
		return nil
	}
	u := c.Unit(exp)
	for i, q := range sum {
		dst[i] = Float64ToF16(float64(q) * u)
	}
	return nil
}
