package collective

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"
)

// randomFloats returns n float32s, some of them zeros of both signs,
// infinities, NaNs with payloads and subnormals.
func randomFloats(rng *rand.Rand, n int) []float32 {
	special := []float32{0, float32(math.Copysign(0, -1)), float32(math.Inf(1)), float32(math.Inf(-1)),
		math.Float32frombits(0x7fc00001), math.Float32frombits(0xff800123), math.Float32frombits(1), math.MaxFloat32}
	v := make([]float32, n)
	for i := range v {
		if rng.IntN(10) == 0 {
			v[i] = special[rng.IntN(len(special))]
		} else {
			v[i] = math.Float32frombits(rng.Uint32())
		}
	}
	return v
}

func f32Bytes(v []float32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), 4*len(v))
}

// TestVectorFloat32: addF32 and divF32 give the scalar loops' bits for
// every length around the vector block, every start alignment and random
// values with specials; where the CPU has no AVX2 they are the scalar
// loops, and the test says so.
func TestVectorFloat32(t *testing.T) {
	if !hasVec {
		t.Log("this CPU (or GOARCH) has no AVX2: addF32 and divF32 run the scalar loop only")
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for n := 0; n <= 200; n++ {
		for _, off := range []int{0, 1, 3} {
			a := randomFloats(rng, n+off)
			b := randomFloats(rng, n+off)
			want := append([]float32(nil), a...)
			addTo[float32](f32Bytes(want[off:]), f32Bytes(b[off:]))
			got := append([]float32(nil), a...)
			addF32(f32Bytes(got[off:]), f32Bytes(b[off:]))
			for i := range got {
				if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
					t.Fatalf("add, %d elements at offset %d: element %d is %#x, want %#x (%v + %v)", n, off, i, math.Float32bits(got[i]), math.Float32bits(want[i]), a[i], b[i])
				}
			}
			for _, ranks := range []int{2, 3, 8, 32, 1 << 20} {
				want := append([]float32(nil), a...)
				divFloat[float32](f32Bytes(want[off:]), ranks)
				got := append([]float32(nil), a...)
				divF32(f32Bytes(got[off:]), ranks)
				for i := range got {
					if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
						t.Fatalf("divide by %d, %d elements at offset %d: element %d is %#x, want %#x", ranks, n, off, i, math.Float32bits(got[i]), math.Float32bits(want[i]))
					}
				}
			}
		}
	}
}

// TestVectorFloat64: addF64 gives the scalar loop's bits for every
// length around the vector block, start alignments, and random values
// with specials (NaNs with payloads, infinities, subnormals).
func TestVectorFloat64(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	special := []float64{0, math.Copysign(0, -1), math.Inf(1), math.Inf(-1),
		math.Float64frombits(0x7ff8000000000001), math.Float64frombits(0xfff0000000000123), math.Float64frombits(1), math.MaxFloat64}
	random := func(n int) []float64 {
		v := make([]float64, n)
		for i := range v {
			if rng.IntN(10) == 0 {
				v[i] = special[rng.IntN(len(special))]
			} else {
				v[i] = math.Float64frombits(rng.Uint64())
			}
		}
		return v
	}
	f64Bytes := func(v []float64) []byte {
		return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), 8*len(v))
	}
	for n := 0; n <= 100; n++ {
		for _, off := range []int{0, 1, 3} {
			a, b := random(n+off), random(n+off)
			want := append([]float64(nil), a...)
			addTo[float64](f64Bytes(want[off:]), f64Bytes(b[off:]))
			got := append([]float64(nil), a...)
			addF64(f64Bytes(got[off:]), f64Bytes(b[off:]))
			for i := range got {
				if math.Float64bits(got[i]) != math.Float64bits(want[i]) {
					t.Fatalf("%d elements at offset %d: element %d is %#x, want %#x", n, off, i, math.Float64bits(got[i]), math.Float64bits(want[i]))
				}
			}
		}
	}
}

// TestVectorFloat32Overlap: a destination that overlaps its source in
// part is added element by element, as the scalar loop does.
func TestVectorFloat32Overlap(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	a := randomFloats(rng, 300)
	for _, shift := range []int{-5, -1, 0, 1, 7} {
		lo, hi := 10, 10+shift
		want := append([]float32(nil), a...)
		addTo[float32](f32Bytes(want[lo:lo+256]), f32Bytes(want[hi:hi+256]))
		got := append([]float32(nil), a...)
		addF32(f32Bytes(got[lo:lo+256]), f32Bytes(got[hi:hi+256]))
		for i := range got {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("source shifted by %d: element %d is %#x, want %#x", shift, i, math.Float32bits(got[i]), math.Float32bits(want[i]))
			}
		}
	}
}

// BenchmarkAddFloat32: the ring's float32 add, scalar loop against the
// vector kernel, on 512 KiB (a 2-rank 1 MiB AllReduce's chunk), same run.
func BenchmarkAddFloat32(b *testing.B) {
	for _, size := range []int{4 << 10, 512 << 10} {
		n := size / 4
		d, s := f32Bytes(make([]float32, n)), f32Bytes(make([]float32, n))
		for _, k := range []struct {
			name string
			f    func(d, s []byte)
		}{{"scalar", addTo[float32]}, {"vector", addF32}} {
			b.Run(fmt.Sprintf("%s/%dKiB", k.name, size>>10), func(b *testing.B) {
				b.SetBytes(int64(size))
				for b.Loop() {
					k.f(d, s)
				}
			})
		}
	}
}

// addHalf adds 16-bit floats through float32, rounding each sum to
// nearest even: the kernel of both half types before addF16 and addBF16,
// a reference for their tests.
func addHalf(h half, dst, src []byte) {
	d, s := as[uint16](dst), as[uint16](src)
	s = s[:len(d)]
	for i := range d {
		d[i] = h.from(h.to(d[i]) + h.to(s[i]))
	}
}

func u16Bytes(v []uint16) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), 2*len(v))
}

// randomHalves returns n 16-bit floats: random bits (NaNs with payloads,
// infinities, subnormals and the largest finite values among them), and
// one in eight from special.
func randomHalves(rng *rand.Rand, n int, special []uint16) []uint16 {
	v := make([]uint16, n)
	for i := range v {
		if rng.IntN(8) == 0 {
			v[i] = special[rng.IntN(len(special))]
		} else {
			v[i] = uint16(rng.Uint32())
		}
	}
	return v
}

// specialBF16 and specialF16 are zeros, infinities, NaNs (quiet and
// signaling, with payloads), the smallest subnormal, the largest finite
// values and 1 and the next value up, of each half type.
var (
	specialBF16 = []uint16{0, 0x8000, 0x7f80, 0xff80, 0x7fc1, 0xff81, 0x7f81, 0x0001, 0x7f7f, 0xff7f, 0x3f80, 0x3f81}
	specialF16  = []uint16{0, 0x8000, 0x7c00, 0xfc00, 0x7e01, 0xfd01, 0x7c01, 0x0001, 0x8001, 0x03ff, 0x7bff, 0xfbff, 0x3c00, 0x3c01}
)

// checkHalfAdd checks that add (addBF16 or addF16) of b into a gives
// ref's bits for every element, and addHalf's with h wherever the two
// operands are not both NaN.
func checkHalfAdd(t *testing.T, what string, a, b []uint16, add func(d, s []byte), ref func(d, s uint16) uint16, h half, isNaN func(uint16) bool) {
	t.Helper()
	viaHalf := append([]uint16(nil), a...)
	addHalf(h, u16Bytes(viaHalf), u16Bytes(b))
	got := append([]uint16(nil), a...)
	add(u16Bytes(got), u16Bytes(b))
	for i := range got {
		if want := ref(a[i], b[i]); got[i] != want {
			t.Fatalf("%s: element %d: %#04x + %#04x is %#04x, want %#04x", what, i, a[i], b[i], got[i], want)
		}
		if !(isNaN(a[i]) && isNaN(b[i])) && got[i] != viaHalf[i] {
			t.Fatalf("%s: element %d: %#04x + %#04x is %#04x, addHalf's %#04x", what, i, a[i], b[i], got[i], viaHalf[i])
		}
	}
}

// TestVectorBF16: addBF16 gives the bits of a float64 reference (the
// sum of two bfloat16s is exact in float64, then rounded to float32 and
// to bfloat16 as the kernels do; a NaN gives dst's, else src's, quiet)
// for every length around the vector block, every start alignment,
// random values with specials, and every pair of two exponent bands
// exhaustively (ties, carries into the exponent, overflow to infinity);
// and addHalf's bits wherever the two are not both NaN.
func TestVectorBF16(t *testing.T) {
	if !hasVec {
		t.Log("this CPU (or GOARCH) has no AVX2: addBF16 runs the scalar loop only")
	}
	check := func(what string, a, b []uint16) {
		t.Helper()
		checkHalfAdd(t, what, a, b, addBF16, refAddBF16, halfBF16, isNaNBF16)
	}
	rng := rand.New(rand.NewPCG(5, 6))
	for n := 0; n <= 100; n++ {
		for _, off := range []int{0, 1, 5} {
			a, b := randomHalves(rng, n+off, specialBF16), randomHalves(rng, n+off, specialBF16)
			check(fmt.Sprintf("%d elements at offset %d", n, off), a[off:], b[off:])
		}
	}
	// Every bfloat16 with the exponent of 1.0 and near the top, added to
	// every other of its band: 2 x 256 x 256 sums.
	for _, hi := range []uint16{0x3f80, 0x7f00} {
		var a, b []uint16
		for x := range 256 {
			for y := range 256 {
				a = append(a, hi|uint16(x&0x7f)|uint16(x&0x80)<<8)
				b = append(b, hi|uint16(y&0x7f)|uint16(y&0x80)<<8)
			}
		}
		check(fmt.Sprintf("band %#04x", hi), a, b)
	}
}

func isNaNBF16(h uint16) bool { return h&0x7fff > 0x7f80 }

// refAddBF16 is the reference of TestVectorBF16.
func refAddBF16(d, s uint16) uint16 {
	switch {
	case isNaNBF16(d):
		return d | 0x40
	case isNaNBF16(s):
		return s | 0x40
	}
	sum := float32(float64(bf16ToF32(d)) + float64(bf16ToF32(s)))
	return f32ToBF16(sum)
}

// BenchmarkAddBF16: the ring's bfloat16 add, the scalar loop against the
// vector kernel, on 256 Ki elements (512 KiB), same run.
func BenchmarkAddBF16(b *testing.B) {
	n := 256 << 10
	rng := rand.New(rand.NewPCG(7, 8))
	d, s := u16Bytes(randomHalves(rng, n, specialBF16)), u16Bytes(randomHalves(rng, n, specialBF16))
	for _, k := range []struct {
		name string
		f    func(d, s []byte)
	}{{"scalar", func(d, s []byte) { addHalf(halfBF16, d, s) }}, {"vector", addBF16}} {
		b.Run(k.name, func(b *testing.B) {
			b.SetBytes(int64(2 * n))
			for b.Loop() {
				k.f(d, s)
			}
		})
	}
}

func isNaNF16(h uint16) bool { return h&0x7fff > 0x7c00 }

// refAddF16 is the reference of TestVectorF16: the sum of two halves is
// exact in float64; rounded to float32 as the kernels add, then to a half
// by f32ToF16; a NaN gives the quiet NaN of dst's sign, else src's.
func refAddF16(d, s uint16) uint16 {
	switch {
	case isNaNF16(d):
		return d&0x8000 | 0x7e00
	case isNaNF16(s):
		return s&0x8000 | 0x7e00
	}
	return f32ToF16(float32(float64(f16ToF32(d)) + float64(f16ToF32(s))))
}

// TestVectorF16: addF16 gives the reference's bits (and addHalf's
// wherever the two are not both NaN) for every length around the vector
// block, every start alignment, random values with specials, every half
// added to a few others, and every pair of two exponent bands (ties,
// subnormal sums, overflow to infinity).
func TestVectorF16(t *testing.T) {
	if !hasF16 {
		t.Log("this CPU (or GOARCH) has no AVX2 with F16C: addF16 runs the scalar loop only")
	}
	check := func(what string, a, b []uint16) {
		t.Helper()
		checkHalfAdd(t, what, a, b, addF16, refAddF16, halfF16, isNaNF16)
	}
	rng := rand.New(rand.NewPCG(9, 10))
	for n := 0; n <= 60; n++ {
		for _, off := range []int{0, 1, 3} {
			a, b := randomHalves(rng, n+off, specialF16), randomHalves(rng, n+off, specialF16)
			check(fmt.Sprintf("%d elements at offset %d", n, off), a[off:], b[off:])
		}
	}
	for _, other := range []uint16{0, 0x8000, 0x3c00, 0x0001, 0x7bff, 0xfbff, 0x7c00} {
		a, b := make([]uint16, 1<<16), make([]uint16, 1<<16)
		for i := range a {
			a[i], b[i] = uint16(i), other
		}
		check(fmt.Sprintf("every half + %#04x", other), a, b)
		check(fmt.Sprintf("%#04x + every half", other), b, a)
	}
	for _, hi := range []uint16{0x0000, 0x3c00, 0x7800} {
		var a, b []uint16
		for x := range 2048 {
			for y := 0; y < 2048; y += 7 {
				a = append(a, hi|uint16(x&0x3ff)|uint16(x&0x400)<<5)
				b = append(b, hi|uint16(y&0x3ff)|uint16(y&0x400)<<5)
			}
		}
		check(fmt.Sprintf("band %#04x", hi), a, b)
	}
}

// BenchmarkAddF16: the ring's float16 add, the scalar loop against the
// vector kernel, on 256 Ki elements (512 KiB), same run.
func BenchmarkAddF16(b *testing.B) {
	n := 256 << 10
	rng := rand.New(rand.NewPCG(7, 8))
	d, s := u16Bytes(randomHalves(rng, n, specialF16)), u16Bytes(randomHalves(rng, n, specialF16))
	for _, k := range []struct {
		name string
		f    func(d, s []byte)
	}{{"scalar", func(d, s []byte) { addHalf(halfF16, d, s) }}, {"vector", addF16}} {
		b.Run(k.name, func(b *testing.B) {
			b.SetBytes(int64(2 * n))
			for b.Loop() {
				k.f(d, s)
			}
		})
	}
}

// BenchmarkAddFloat64: the ring's float64 add, scalar loop against the
// vector kernel, on 512 KiB, same run.
func BenchmarkAddFloat64(b *testing.B) {
	n := 64 << 10
	d, s := make([]byte, 8*n), make([]byte, 8*n)
	for _, k := range []struct {
		name string
		f    func(d, s []byte)
	}{{"scalar", addTo[float64]}, {"vector", addF64}} {
		b.Run(k.name, func(b *testing.B) {
			b.SetBytes(int64(8 * n))
			for b.Loop() {
				k.f(d, s)
			}
		})
	}
}
