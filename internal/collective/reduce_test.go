package collective

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/gdrlink/gdrlink/tensor"
)

// Every half converts to float32 and back to itself; NaNs stay NaNs.
func TestHalfRoundTrip(t *testing.T) {
	for _, h := range []half{halfF16, halfBF16} {
		for i := range 1 << 16 {
			f := h.to(uint16(i))
			if math.IsNaN(float64(f)) {
				if !math.IsNaN(float64(h.to(h.from(f)))) {
					t.Fatalf("NaN %#04x does not stay NaN", i)
				}
				continue
			}
			if got := h.from(f); got != uint16(i) {
				t.Fatalf("%#04x → %v → %#04x", i, f, got)
			}
		}
	}
}

// Rounding to half is to nearest, ties to even: checked against float64
// arithmetic on the halves on either side of values between them.
func TestHalfRounding(t *testing.T) {
	for _, h := range []half{halfF16, halfBF16} {
		for i := range 1<<15 - 1 {
			lo, hi := h.to(uint16(i)), h.to(uint16(i+1))
			if math.IsInf(float64(hi), 0) || math.IsNaN(float64(hi)) {
				continue
			}
			mid := float32((float64(lo) + float64(hi)) / 2)
			want := uint16(i)
			if i&1 == 1 {
				want = uint16(i + 1)
			}
			if float64(mid) == (float64(lo)+float64(hi))/2 {
				if got := h.from(mid); got != want {
					t.Fatalf("tie %v between %#04x and %#04x → %#04x, want %#04x", mid, i, i+1, got, want)
				}
			}
			above := math.Nextafter32(mid, hi)
			if got := h.from(above); got != uint16(i+1) && above < hi {
				t.Fatalf("%v just above the middle of %#04x and %#04x → %#04x", above, i, i+1, got)
			}
			below := math.Nextafter32(mid, lo)
			if got := h.from(below); got != uint16(i) && below > lo {
				t.Fatalf("%v just below the middle of %#04x and %#04x → %#04x", below, i, i+1, got)
			}
		}
	}
	if got := f16ToF32(f32ToF16(1e30)); !math.IsInf(float64(got), 1) {
		t.Fatalf("1e30 as float16: %v, want +Inf", got)
	}
}

func TestParseAbort(t *testing.T) {
	for _, tc := range []struct {
		text string
		rank int
		ok   bool
	}{
		{abortText(3, errString("x")).Error(), 3, true},
		{"rendezvous: error from peer: rank 2 for \"k\" step 1: code 5: " + abortText(0, errString("y")).Error(), 0, true},
		{abortMarker + "8: too big", -1, false},
		{abortMarker + "-1: negative", -1, false},
		{abortMarker + "+1: signed", -1, false},
		{abortMarker + "99999999999999999999: huge", -1, false},
		{abortMarker + "2", -1, false},
		{"nothing here", -1, false},
	} {
		r, ok := parseAbort(tc.text, 8)
		if r != tc.rank || ok != tc.ok {
			t.Errorf("%q: %d %v, want %d %v", tc.text, r, ok, tc.rank, tc.ok)
		}
	}
}

type errString string

func (e errString) Error() string { return string(e) }

func FuzzParseAbort(f *testing.F) {
	f.Add(abortText(3, errString("lost")).Error(), 8)
	f.Add(abortMarker+"x:", 4)
	f.Fuzz(func(t *testing.T, text string, size int) {
		r, ok := parseAbort(text, size)
		if ok && (r < 0 || r >= size || !strings.Contains(text, abortMarker)) {
			t.Fatalf("%q of %d: rank %d", text, size, r)
		}
		if !ok && r != -1 {
			t.Fatalf("%q: not ok but rank %d", text, r)
		}
	})
}

// addDiv gives the bits of add over the whole followed by div, for every
// element type that divides, on lengths around its block (vector heads
// and scalar tails in each block) and with an aliased source.
func TestAddDivMatchesAddThenDiv(t *testing.T) {
	for _, dt := range []tensor.DType{tensor.Float32, tensor.Float64, tensor.Float16, tensor.BFloat16, tensor.Int32, tensor.Uint8, tensor.Complex64} {
		k, err := kernelFor(dt)
		if err != nil {
			t.Fatal(err)
		}
		es := dt.Size()
		for _, elems := range []int{1, 31, addDivBlock / es, addDivBlock/es + 7, 3*addDivBlock/es + 33} {
			n := elems * es
			dst, src := make([]byte, n), make([]byte, n)
			rng := rand.New(rand.NewPCG(uint64(elems), uint64(es)))
			for i := range dst {
				dst[i], src[i] = byte(rng.Uint32()), byte(rng.Uint32())
			}
			if dt == tensor.Float32 {
				// Sums that round: halves of odd values, and a NaN.
				v, w := as[float32](dst), as[float32](src)
				for i := range v {
					v[i], w[i] = float32(rng.NormFloat64()*1e3), float32(rng.NormFloat64())
				}
				v[0] = float32(math.NaN())
			}
			want := slices.Clone(dst)
			k.add(want, src)
			k.div(want, 3)
			got := slices.Clone(dst)
			k.addDiv(got, src, 3)
			if i := firstByteDiff(got, want); i >= 0 {
				t.Fatalf("%s, %d elements: addDiv differs from add then div at byte %d", dt, elems, i)
			}
			self := slices.Clone(dst)
			k.add(self, self)
			k.div(self, 7)
			alias := slices.Clone(dst)
			k.addDiv(alias, alias, 7)
			if i := firstByteDiff(alias, self); i >= 0 {
				t.Fatalf("%s, %d elements, source = destination: differs at byte %d", dt, elems, i)
			}
		}
	}
}

func firstByteDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// BenchmarkAddDivFloat32: Average's last addition into an owned chunk,
// as add over the whole then div (a second pass) against addDiv (block by
// block, the division from the cache), dividing by 4 (a multiply by the
// reciprocal: divF32) and by 3 (a division), same run, on the chunks of a
// 4-rank 1 MiB and 64 MiB AllReduce.
func BenchmarkAddDivFloat32(b *testing.B) {
	k, err := kernelFor(tensor.Float32)
	if err != nil {
		b.Fatal(err)
	}
	for _, size := range []int{256 << 10, 16 << 20} {
		d, s := make([]byte, size), make([]byte, size)
		for _, c := range []struct {
			name string
			f    func()
		}{
			{"add-then-div/by4", func() { k.add(d, s); k.div(d, 4) }},
			{"addDiv/by4", func() { k.addDiv(d, s, 4) }},
			{"add-then-div/by3", func() { k.add(d, s); k.div(d, 3) }},
			{"addDiv/by3", func() { k.addDiv(d, s, 3) }},
		} {
			b.Run(fmt.Sprintf("%s/%dKiB", c.name, size>>10), func(b *testing.B) {
				b.SetBytes(int64(size))
				for b.Loop() {
					c.f()
				}
			})
		}
	}
}
