package bfp

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"
)

// TestHalfRoundTrip checks every binary16 and bfloat16 bit pattern: decoding
// is exact, so encoding the decoded value gives the pattern back (NaNs give
// a NaN).
func TestHalfRoundTrip(t *testing.T) {
	for i := range 1 << 16 {
		h := uint16(i)
		v := F16ToFloat64(h)
		if math.IsNaN(v) {
			if g := Float64ToF16(v); g&0x7c00 != 0x7c00 || g&0x3ff == 0 {
				t.Fatalf("f16 NaN %#04x encoded back as %#04x", h, g)
			}
			continue
		}
		if g := Float64ToF16(v); g != h {
			t.Fatalf("f16 %#04x = %g encoded back as %#04x", h, v, g)
		}
		b := float64(BF16ToFloat32(h))
		if math.IsNaN(b) {
			continue
		}
		if g := Float64ToBF16(b); g != h {
			t.Fatalf("bf16 %#04x = %g encoded back as %#04x", h, b, g)
		}
	}
}

// finite returns the finite non-negative values of a 16-bit format, sorted,
// with their patterns.
func finite(decode func(uint16) float64) ([]float64, []uint16) {
	var vs []float64
	var hs []uint16
	for i := range 1 << 15 {
		v := decode(uint16(i))
		if math.IsNaN(v) || math.IsInf(v, 0) {
			continue
		}
		vs = append(vs, v)
		hs = append(hs, uint16(i))
	}
	sort.Sort(byValue{vs, hs})
	return vs, hs
}

type byValue struct {
	v []float64
	h []uint16
}

func (b byValue) Len() int           { return len(b.v) }
func (b byValue) Less(i, j int) bool { return b.v[i] < b.v[j] }
func (b byValue) Swap(i, j int) {
	b.v[i], b.v[j] = b.v[j], b.v[i]
	b.h[i], b.h[j] = b.h[j], b.h[i]
}

// nearest is the reference rounding by search: the nearest finite value,
// ties to the even pattern; beyond the largest finite value plus half a
// step, infinity.
func nearest(vs []float64, hs []uint16, inf uint16, v float64) uint16 {
	var sign uint16
	if math.Signbit(v) {
		sign = 0x8000
	}
	a := math.Abs(v)
	i := sort.SearchFloat64s(vs, a)
	if i == len(vs) {
		top, step := vs[len(vs)-1], vs[len(vs)-1]-vs[len(vs)-2]
		if a-top >= step/2 { // ties go to the even "next" value, infinity
			return sign | inf
		}
		return sign | hs[len(hs)-1]
	}
	if vs[i] == a || i == 0 {
		return sign | hs[i]
	}
	lo, hi := vs[i-1], vs[i]
	switch dl, dh := a-lo, hi-a; {
	case dl < dh:
		return sign | hs[i-1]
	case dh < dl:
		return sign | hs[i]
	case hs[i-1]&1 == 0:
		return sign | hs[i-1]
	default:
		return sign | hs[i]
	}
}

// TestHalfRounding compares the encoders with the search-based reference on
// random values and on every midpoint between neighbours.
func TestHalfRounding(t *testing.T) {
	for _, f := range []struct {
		name   string
		decode func(uint16) float64
		encode func(float64) uint16
		inf    uint16
	}{
		{"f16", F16ToFloat64, Float64ToF16, 0x7c00},
		{"bf16", func(h uint16) float64 { return float64(BF16ToFloat32(h)) }, Float64ToBF16, 0x7f80},
	} {
		vs, hs := finite(f.decode)
		check := func(v float64) {
			want := nearest(vs, hs, f.inf, v)
			if got := f.encode(v); got != want {
				t.Fatalf("%s(%g): %#04x, want %#04x", f.name, v, got, want)
			}
		}
		for i := 1; i < len(vs); i++ {
			mid := (vs[i-1] + vs[i]) / 2
			check(mid)
			check(-mid)
			check(math.Nextafter(mid, 0))
			check(math.Nextafter(mid, math.Inf(1)))
		}
		top := vs[len(vs)-1]
		step := top - vs[len(vs)-2]
		for _, v := range []float64{top + step/2, math.Nextafter(top+step/2, 0), top * 4, math.MaxFloat64, 0} {
			check(v)
			check(-v)
		}
		r := rand.New(rand.NewPCG(1, 2))
		for range 200000 {
			v := math.Ldexp(r.Float64(), r.IntN(300)-160)
			check(v)
		}
	}
}
