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
			for _, ranks := range []int{3, 8} {
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
