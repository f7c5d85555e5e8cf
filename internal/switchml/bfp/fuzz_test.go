package bfp

import (
	"encoding/binary"
	"math"
	"testing"
)

// FuzzSum reads two workers' binary32 blocks from the input, all-reduces
// them and checks the documented bound (or NaN for a non-finite block).
func FuzzSum(f *testing.F) {
	f.Add([]byte{0, 0, 0x80, 0x3f, 0, 0, 0x80, 0xbf})
	f.Add([]byte{0xff, 0xff, 0x7f, 0x7f, 0xff, 0xff, 0x7f, 0x7f})
	f.Add([]byte{1, 0, 0, 0, 0, 0, 0xc0, 0x7f})
	f.Fuzz(func(t *testing.T, data []byte) {
		n := len(data) / 8
		if n == 0 {
			return
		}
		c, _ := NewCodec(2)
		blocks := [][]float32{make([]float32, n), make([]float32, n)}
		finite := true
		for i := range 2 * n {
			x := math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
			blocks[i%2][i/2] = x
			finite = finite && !math.IsNaN(float64(x)) && !math.IsInf(float64(x), 0)
		}
		if !finite {
			res := allReduce32(t, c, blocks)
			for _, v := range res.out {
				if !math.IsNaN(float64(v)) {
					t.Fatalf("non-finite input gave %g", v)
				}
			}
			return
		}
		checkBound(t, c, blocks, allReduce32(t, c, blocks))
	})
}
