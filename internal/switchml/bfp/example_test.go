package bfp_test

import (
	"fmt"

	"github.com/gdrlink/gdrlink/internal/switchml/bfp"
)

// Two workers all-reduce one block: each quantises with the shared exponent
// (the maximum of their own), the aggregator adds the significands, and each
// worker dequantises the same sum to the same bits.
func Example() {
	c, _ := bfp.NewCodec(2)
	a := []float32{1.5, -2, 0.25}
	b := []float32{0.5, 8, -0.25}
	exp := max(bfp.Exponent32(a), bfp.Exponent32(b))

	qa, qb := make([]int32, 3), make([]int32, 3)
	_ = c.Quantize32(qa, a, exp)
	_ = c.Quantize32(qb, b, exp)
	sum := make([]int32, 3)
	for i := range sum {
		sum[i] = qa[i] + qb[i] // all the aggregator does
	}
	out := make([]float32, 3)
	_ = c.Dequantize32(out, sum, exp)
	fmt.Println(out, "error bound", c.SumErrorBound(exp, 2))
	// Output: [2 6 0] error bound 1.4901161193847656e-08
}
