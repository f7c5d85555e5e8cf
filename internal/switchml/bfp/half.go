package bfp

import "math"

// The quiet NaNs written for a non-finite block.
const (
	f16NaN  uint16 = 0x7e00
	bf16NaN uint16 = 0x7fc0
)

// F16ToFloat64 returns the value of an IEEE binary16 number, exactly.
func F16ToFloat64(h uint16) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	e, m := int(h>>10&0x1f), float64(h&0x3ff)
	switch e {
	case 0x1f:
		if m != 0 {
			return math.NaN()
		}
		return math.Inf(int(sign))
	case 0:
		return sign * math.Ldexp(m, -24)
	default:
		return sign * math.Ldexp(1024+m, e-25)
	}
}

// BF16ToFloat32 returns the value of a bfloat16 number, exactly.
func BF16ToFloat32(b uint16) float32 { return math.Float32frombits(uint32(b) << 16) }

// Float64ToF16 rounds v to the nearest IEEE binary16 number, ties to even,
// subnormals included; beyond the largest finite value it gives ±Inf, and a
// NaN gives a quiet NaN.
func Float64ToF16(v float64) uint16 {
	return roundTo(v, 10, -14, 15)
}

// Float64ToBF16 rounds v to the nearest bfloat16 number, ties to even, with
// the same rules as Float64ToF16.
func Float64ToBF16(v float64) uint16 {
	return roundTo(v, 7, -126, 127)
}

// roundTo rounds v into a binary format of 16 bits with mbits fraction bits
// and normal exponents emin..emax, correctly: the float64 significand is
// shifted right with round to nearest, ties to even, on the bits shifted
// out (one rounding from the float64 value).
func roundTo(v float64, mbits, emin, emax int) uint16 {
	b := math.Float64bits(v)
	sign := uint16(b>>48) & 0x8000
	ebits := 15 - mbits
	inf := uint16(1<<ebits-1) << mbits
	e := int(b >> 52 & 0x7ff)
	m := b & (1<<52 - 1)
	switch e {
	case 0x7ff:
		if m != 0 {
			return inf | 1<<(mbits-1) // quiet NaN
		}
		return sign | inf
	case 0:
		return sign // float64 subnormals are far below half the smallest target subnormal
	}
	m |= 1 << 52
	e -= 1023 // v = m * 2^(e-52)
	shift := 52 - mbits
	if e < emin {
		shift += emin - e // subnormal in the target: a fixed step of 2^(emin-mbits)
	}
	if shift > 53 {
		return sign // below half the smallest subnormal
	}
	q := m >> shift
	rem, half := m&(1<<shift-1), uint64(1)<<(shift-1)
	if rem > half || rem == half && q&1 == 1 {
		q++
	}
	if e < emin {
		// q counts steps of 2^(emin-mbits); q == 1<<mbits is the
		// smallest normal number, whose encoding it is.
		return sign | uint16(q)
	}
	if q == 1<<(mbits+1) { // rounded up to the next power of two
		q >>= 1
		e++
	}
	if e > emax {
		return sign | inf
	}
	return sign | uint16(e-emin+1)<<mbits | uint16(q-1<<mbits)
}
