package bfp

import (
	"errors"
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
)

func TestHeadroom(t *testing.T) {
	for _, c := range []struct{ n, h int }{{1, 0}, {2, 1}, {3, 2}, {4, 2}, {5, 3}, {31, 5}, {32, 5}, {33, 6}, {128, 7}} {
		k, err := NewCodec(c.n)
		if err != nil {
			t.Fatal(err)
		}
		if k.Headroom() != c.h {
			t.Errorf("workers %d: headroom %d, want %d", c.n, k.Headroom(), c.h)
		}
		// n*M must fit in an int32, whatever the signs.
		if m := int64(c.n) * int64(k.MaxSignificand()); m > math.MaxInt32 {
			t.Errorf("workers %d: %d*%d = %d overflows", c.n, c.n, k.MaxSignificand(), m)
		}
	}
	for _, n := range []int{0, -1, MaxWorkers + 1} {
		if _, err := NewCodec(n); !errors.Is(err, ErrWorkers) {
			t.Errorf("NewCodec(%d): %v, want ErrWorkers", n, err)
		}
	}
}

// TestNeverSaturates quantises, for every exponent byte and headroom, the
// largest binary32 magnitude that byte covers: it must fit.
func TestNeverSaturates(t *testing.T) {
	for n := 1; n <= MaxWorkers; n = n*2 + 1 {
		c, _ := NewCodec(n)
		for exp := 1; exp < 255; exp++ {
			top := math.Float32frombits(uint32(exp)<<23 | 0x7fffff)
			if exp == 0 {
				top = math.Float32frombits(0x7fffff)
			}
			if Exponent32([]float32{top}) != uint8(exp) {
				t.Fatalf("exponent of %g is %d, want %d", top, Exponent32([]float32{top}), exp)
			}
			q := make([]int32, 2)
			if err := c.Quantize32(q, []float32{top, -top}, uint8(exp)); err != nil {
				t.Fatalf("workers %d byte %d: %v", n, exp, err)
			}
			if q[0] != -q[1] || q[0] <= 0 {
				t.Fatalf("workers %d byte %d: significands %v", n, exp, q)
			}
			if float64(top) >= math.Ldexp(1, exp-126) {
				t.Fatalf("byte %d: %g is not below 2^%d", exp, top, exp-126)
			}
		}
	}
}

// exact returns the exact real sum of vs.
func exact(vs []float64) *big.Float {
	s := new(big.Float).SetPrec(2048)
	for _, v := range vs {
		s.Add(s, new(big.Float).SetPrec(2048).SetFloat64(v))
	}
	return s
}

// run quantises each worker's block with the shared exponent, sums the
// significands as the aggregator does (int32 adds) and dequantises.
type run struct {
	exp uint8
	sum []int32
	out []float32
}

func allReduce32(t *testing.T, c Codec, blocks [][]float32) run {
	t.Helper()
	var exp uint8
	for _, b := range blocks {
		exp = max(exp, Exponent32(b))
	}
	n := len(blocks[0])
	sum := make([]int32, n)
	wide := make([]int64, n)
	q := make([]int32, n)
	for _, b := range blocks {
		if err := c.Quantize32(q, b, exp); err != nil {
			t.Fatal(err)
		}
		for i := range q {
			if q[i] > c.MaxSignificand() || q[i] < -c.MaxSignificand() {
				t.Fatalf("significand %d beyond ±%d", q[i], c.MaxSignificand())
			}
			sum[i] += q[i]
			wide[i] += int64(q[i])
		}
	}
	for i := range sum {
		if int64(sum[i]) != wide[i] {
			t.Fatalf("element %d: int32 sum %d overflowed (exact %d)", i, sum[i], wide[i])
		}
	}
	out := make([]float32, n)
	if err := c.Dequantize32(out, sum, exp); err != nil {
		t.Fatal(err)
	}
	return run{exp, sum, out}
}

// checkBound checks, element by element, |S*u - T| <= n*u/2 against the
// exact sum T, and that the output is S*u correctly rounded to binary32.
func checkBound(t *testing.T, c Codec, blocks [][]float32, r run) {
	t.Helper()
	u := c.Unit(r.exp)
	bound := new(big.Float).SetPrec(2048).SetFloat64(c.SumErrorBound(r.exp, len(blocks)))
	vs := make([]float64, len(blocks))
	for i := range r.sum {
		for w, b := range blocks {
			vs[w] = float64(b[i])
		}
		T := exact(vs)
		su := new(big.Float).SetPrec(2048).SetFloat64(float64(r.sum[i]) * u)
		if float64(r.sum[i])*u != math.Ldexp(float64(r.sum[i]), int(r.exp)-157+c.Headroom()) {
			t.Fatalf("S*u not exact")
		}
		d := new(big.Float).SetPrec(2048).Sub(su, T)
		if d.Abs(d).Cmp(bound) > 0 {
			t.Fatalf("element %d: |S*u - T| = %g above n*u/2 = %g (values %v)", i, d, bound, vs)
		}
		want, _ := su.Float32()
		if math.Float32bits(want) != math.Float32bits(r.out[i]) && !(want == 0 && r.out[i] == 0) {
			t.Fatalf("element %d: output %g, want %g (S*u correctly rounded)", i, r.out[i], want)
		}
	}
}

func randomBlocks(r *rand.Rand, workers, n int, gen func() float32) [][]float32 {
	bs := make([][]float32, workers)
	for w := range bs {
		bs[w] = make([]float32, n)
		for i := range bs[w] {
			bs[w][i] = gen()
		}
	}
	return bs
}

// TestSumBound checks the documented bound on random and adversarial data.
func TestSumBound(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	gens := map[string]func() float32{
		"normal":  func() float32 { return float32(r.NormFloat64()) },
		"tiny":    func() float32 { return float32(r.NormFloat64() * 1e-40) },
		"huge":    func() float32 { return float32(r.NormFloat64() * 1e37) },
		"maxmag":  func() float32 { return math.MaxFloat32 },
		"minmag":  func() float32 { return -math.MaxFloat32 },
		"zero":    func() float32 { return 0 },
		"negzero": func() float32 { return float32(math.Copysign(0, -1)) },
		"wide": func() float32 {
			return float32(math.Ldexp(r.NormFloat64(), r.IntN(250)-125))
		},
		"subnormal": func() float32 { return math.Float32frombits(r.Uint32() & 0x807fffff) },
		"bits": func() float32 {
			for {
				x := math.Float32frombits(r.Uint32())
				if !math.IsNaN(float64(x)) && !math.IsInf(float64(x), 0) {
					return x
				}
			}
		},
	}
	for name, gen := range gens {
		for _, workers := range []int{1, 2, 3, 8, 32, 128} {
			c, _ := NewCodec(workers)
			blocks := randomBlocks(r, workers, 64, gen)
			res := allReduce32(t, c, blocks)
			checkBound(t, c, blocks, res)
			if name == "maxmag" && workers > 1 && !math.IsInf(float64(res.out[0]), 1) {
				t.Errorf("%d workers of MaxFloat32 sum to %g, want +Inf", workers, res.out[0])
			}
			if (name == "zero" || name == "negzero") && (res.exp != 0 || math.Float32bits(res.out[0]) != 0) {
				t.Errorf("zeros: exponent %d, result %g", res.exp, res.out[0])
			}
		}
	}
}

// TestCancellation: the exact sum is 0 (x and -x on two workers), and so
// must the block floating point sum be, exactly.
func TestCancellation(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	c, _ := NewCodec(2)
	a := make([]float32, 256)
	b := make([]float32, 256)
	for i := range a {
		a[i] = float32(math.Ldexp(r.NormFloat64(), r.IntN(60)-30))
		b[i] = -a[i]
	}
	res := allReduce32(t, c, [][]float32{a, b})
	for i, v := range res.out {
		if v != 0 {
			t.Fatalf("element %d: %g, want 0", i, v)
		}
	}
}

// TestNonFinite: one worker's NaN or Inf makes the shared byte NonFinite,
// every worker quantises to zeros and dequantises the block to NaN.
func TestNonFinite(t *testing.T) {
	c, _ := NewCodec(4)
	for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))} {
		blocks := randomBlocks(rand.New(rand.NewPCG(7, 8)), 4, 16, func() float32 { return 1.5 })
		blocks[2][5] = bad
		res := allReduce32(t, c, blocks)
		if res.exp != NonFinite {
			t.Fatalf("%g: shared byte %d, want NonFinite", bad, res.exp)
		}
		for i, s := range res.sum {
			if s != 0 {
				t.Fatalf("%g: sum[%d] = %d, want 0", bad, i, s)
			}
		}
		for _, v := range res.out {
			if !math.IsNaN(float64(v)) {
				t.Fatalf("%g: result %g, want NaN", bad, v)
			}
		}
		f16 := make([]uint16, 16)
		bf := make([]uint16, 16)
		_ = c.DequantizeF16(f16, res.sum, res.exp)
		_ = c.DequantizeBF16(bf, res.sum, res.exp)
		if !math.IsNaN(F16ToFloat64(f16[0])) || !math.IsNaN(float64(BF16ToFloat32(bf[0]))) {
			t.Fatalf("16-bit results %#04x %#04x, want NaN", f16[0], bf[0])
		}
	}
	if ExponentF16([]uint16{0x3c00, 0x7c00}) != NonFinite || ExponentBF16([]uint16{0x3f80, 0x7fc1}) != NonFinite {
		t.Fatal("16-bit non-finite blocks not marked")
	}
}

// TestQuantizeRange: an exponent too small for the block, or a NaN under a
// finite exponent, is reported, and dst is still written (saturated, 0).
func TestQuantizeRange(t *testing.T) {
	c, _ := NewCodec(2)
	q := make([]int32, 3)
	err := c.Quantize32(q, []float32{4, -4, 1}, Exponent32([]float32{1}))
	if !errors.Is(err, ErrRange) {
		t.Fatalf("err %v, want ErrRange", err)
	}
	if q[0] != c.MaxSignificand() || q[1] != -c.MaxSignificand() {
		t.Fatalf("saturated to %v, want ±%d", q[:2], c.MaxSignificand())
	}
	err = c.Quantize32(q, []float32{float32(math.NaN()), 1, 1}, Exponent32([]float32{1}))
	if !errors.Is(err, ErrRange) || q[0] != 0 {
		t.Fatalf("NaN under finite byte: %v, q %v", err, q)
	}
	if err := c.Quantize32(q, make([]float32, 2), 0); !errors.Is(err, ErrLength) {
		t.Fatalf("length mismatch: %v", err)
	}
	if err := c.Dequantize32(make([]float32, 2), q, 0); !errors.Is(err, ErrLength) {
		t.Fatalf("length mismatch: %v", err)
	}
}

// TestSixteenBit runs bfloat16 and binary16 blocks through the same path and
// checks the bound and the single rounding of the result against the
// search-based reference rounding.
func TestSixteenBit(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	fvs, fhs := finite(F16ToFloat64)
	bvs, bhs := finite(func(h uint16) float64 { return float64(BF16ToFloat32(h)) })
	for _, workers := range []int{1, 2, 5, 32} {
		c, _ := NewCodec(workers)
		for _, scale := range []float64{1e-6, 1, 5e3} {
			f16 := make([][]uint16, workers)
			bf := make([][]uint16, workers)
			var fexp, bexp uint8
			for w := range workers {
				f16[w] = make([]uint16, 64)
				bf[w] = make([]uint16, 64)
				for i := range 64 {
					v := r.NormFloat64() * scale
					f16[w][i] = Float64ToF16(v)
					bf[w][i] = Float64ToBF16(v)
				}
				fexp = max(fexp, ExponentF16(f16[w]))
				bexp = max(bexp, ExponentBF16(bf[w]))
			}
			for _, k := range []struct {
				name   string
				blocks [][]uint16
				exp    uint8
				quant  func([]int32, []uint16, uint8) error
				deq    func([]uint16, []int32, uint8) error
				decode func(uint16) float64
				vs     []float64
				hs     []uint16
				inf    uint16
			}{
				{"f16", f16, fexp, c.QuantizeF16, c.DequantizeF16, F16ToFloat64, fvs, fhs, 0x7c00},
				{"bf16", bf, bexp, c.QuantizeBF16, c.DequantizeBF16, func(h uint16) float64 { return float64(BF16ToFloat32(h)) }, bvs, bhs, 0x7f80},
			} {
				// The 16-bit exponent byte must equal the binary32 one.
				for _, b := range k.blocks {
					w := make([]float32, len(b))
					for i := range b {
						w[i] = float32(k.decode(b[i]))
					}
					var own uint8
					if k.name == "f16" {
						own = ExponentF16(b)
					} else {
						own = ExponentBF16(b)
					}
					if own != Exponent32(w) {
						t.Fatalf("%s exponent byte %d, binary32 %d", k.name, own, Exponent32(w))
					}
				}
				sum := make([]int32, 64)
				q := make([]int32, 64)
				for _, b := range k.blocks {
					if err := k.quant(q, b, k.exp); err != nil {
						t.Fatal(err)
					}
					for i := range q {
						sum[i] += q[i]
					}
				}
				out := make([]uint16, 64)
				if err := k.deq(out, sum, k.exp); err != nil {
					t.Fatal(err)
				}
				u := c.Unit(k.exp)
				for i := range sum {
					vs := make([]float64, workers)
					for w := range workers {
						vs[w] = k.decode(k.blocks[w][i])
					}
					d := new(big.Float).SetPrec(2048).SetFloat64(float64(sum[i]) * u)
					d.Sub(d, exact(vs))
					if f, _ := d.Abs(d).Float64(); f > c.SumErrorBound(k.exp, workers) {
						t.Fatalf("%s element %d: error %g above %g", k.name, i, f, c.SumErrorBound(k.exp, workers))
					}
					if want := nearest(k.vs, k.hs, k.inf, float64(sum[i])*u); out[i] != want && !(out[i]&0x7fff == 0 && want&0x7fff == 0) {
						t.Fatalf("%s element %d: %#04x, want %#04x", k.name, i, out[i], want)
					}
				}
			}
		}
	}
}

// TestDeterministic: dequantising the same sums twice, or in another order,
// gives identical bits (the check that each result is the correctly rounded
// S*u, in TestSumBound, is what makes it hold on every platform).
func TestDeterministic(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	c, _ := NewCodec(32)
	sum := make([]int32, 1024)
	for i := range sum {
		sum[i] = int32(r.Uint32())
	}
	for _, exp := range []uint8{0, 1, 100, 126, 200, 254} {
		a := make([]float32, len(sum))
		b := make([]float32, len(sum))
		_ = c.Dequantize32(a, sum, exp)
		for i := len(sum) - 1; i >= 0; i-- {
			_ = c.Dequantize32(b[i:i+1], sum[i:i+1], exp)
		}
		for i := range a {
			if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
				t.Fatalf("byte %d element %d: %x then %x", exp, i, math.Float32bits(a[i]), math.Float32bits(b[i]))
			}
			want, _ := new(big.Float).SetPrec(2048).SetFloat64(math.Ldexp(float64(sum[i]), int(exp)-157+c.Headroom())).Float32()
			if math.Float32bits(a[i]) != math.Float32bits(want) && !(a[i] == 0 && want == 0) {
				t.Fatalf("byte %d element %d: %g, want %g", exp, i, a[i], want)
			}
		}
	}
}
