package crc32c

import (
	"encoding/binary"
	"hash/crc32"
	"math/bits"
	"math/rand/v2"
	"testing"
)

// polyNormal is the Castagnoli polynomial without its x^32 term, bit j
// the coefficient of x^j.
const polyNormal = 0x1EDC6F41

// xPowMod returns x^e mod P, bit j the coefficient of x^j.
func xPowMod(e int) uint32 {
	r := uint32(1)
	for range e {
		top := r & (1 << 31)
		r <<= 1
		if top != 0 {
			r ^= polyNormal
		}
	}
	return r
}

// foldConstant returns the pair of constants that fold a 128-bit chunk d
// bits forward (fold.go): rev64(x^(63+d) mod P), rev64(x^(d-1) mod P).
func foldConstant(d int) (lo, hi uint64) {
	rev64 := func(k uint32) uint64 { return uint64(bits.Reverse32(k)) << 32 }
	return rev64(xPowMod(63 + d)), rev64(xPowMod(d - 1))
}

// clmul is the carry-less product of a and b.
func clmul(a, b uint64) (lo, hi uint64) {
	for i := range 64 {
		if b>>i&1 != 0 {
			lo ^= a << i
			if i > 0 {
				hi ^= a >> (64 - i)
			}
		}
	}
	return lo, hi
}

// foldModel is foldBlocks in portable Go, one 16-byte chunk at a time,
// so that the arithmetic is checked on any CPU.
func foldModel(crc uint32, p []byte, out *[16]byte) {
	klo, khi := foldConstant(128)
	lo := binary.LittleEndian.Uint64(p) ^ uint64(crc)
	hi := binary.LittleEndian.Uint64(p[8:])
	for off := 16; off < len(p); off += 16 {
		a0, a1 := clmul(lo, klo)
		b0, b1 := clmul(hi, khi)
		lo = a0 ^ b0 ^ binary.LittleEndian.Uint64(p[off:])
		hi = a1 ^ b1 ^ binary.LittleEndian.Uint64(p[off+8:])
	}
	binary.LittleEndian.PutUint64(out[:], lo)
	binary.LittleEndian.PutUint64(out[8:], hi)
}

// finish is Update's end: the CRC of the folded chunk r from a zero
// state, then the bytes after it.
func finish(r *[16]byte, tail []byte) uint32 {
	state := ^crc32.Update(^uint32(0), table, r[:])
	return crc32.Update(^state, table, tail)
}

// TestFoldConstants: the constants foldAVX512 reads are x^(63+d) and
// x^(d-1) mod P, bit-reversed, for the distances it folds.
func TestFoldConstants(t *testing.T) {
	for _, c := range []struct {
		d    int
		have [2]uint64
	}{
		{2048, consts.k2048}, {1536, consts.k1536}, {1024, consts.k1024}, {512, consts.k512},
		{384, consts.lanes[0]}, {256, consts.lanes[1]}, {128, consts.lanes[2]},
	} {
		lo, hi := foldConstant(c.d)
		if c.have != [2]uint64{lo, hi} {
			t.Errorf("fold by %d bits: constants %#x, want %#x", c.d, c.have, [2]uint64{lo, hi})
		}
	}
	if consts.lanes[3] != [2]uint64{} {
		t.Errorf("lane 3's constants %#x, want zero (it folds into itself)", consts.lanes[3])
	}
}

func randomBytes(seed uint64, n int) []byte {
	rng := rand.New(rand.NewPCG(seed, seed+1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// TestFoldModel: the folding arithmetic, in portable Go, gives
// hash/crc32's CRC for any length and starting value.
func TestFoldModel(t *testing.T) {
	buf := randomBytes(5, 4096)
	rng := rand.New(rand.NewPCG(7, 8))
	for n := 256; n <= len(buf); n += 256 {
		for _, tail := range []int{0, 1, 15, 16, 255} {
			if n+tail > len(buf) {
				continue
			}
			crc := rng.Uint32()
			var r [16]byte
			foldModel(^crc, buf[:n], &r)
			if got, want := finish(&r, buf[n:n+tail]), crc32.Update(crc, table, buf[:n+tail]); got != want {
				t.Fatalf("%d bytes folded, %d after, from %#x: %#x, want %#x", n, tail, crc, got, want)
			}
		}
	}
}

// TestUpdateFolded: Update, on the folded path, equals hash/crc32 for
// lengths around FoldMin and the block size, every alignment of the
// start, and random starting values; and the AVX-512 fold equals the
// portable model.
func TestUpdateFolded(t *testing.T) {
	if !hasFold {
		t.Skip("the folded CRC-32C is not run: this CPU (or GOARCH) lacks AVX-512 with VPCLMULQDQ; TestFoldModel checks its arithmetic")
	}
	buf := randomBytes(9, 1<<20+300)
	rng := rand.New(rand.NewPCG(11, 12))
	lens := []int{FoldMin - 1, FoldMin, FoldMin + 1, 1279, 1280, 1281, 4096, 65535, 1 << 20}
	for range 300 {
		lens = append(lens, FoldMin+rng.IntN(20000))
	}
	for _, n := range lens {
		for _, off := range []int{0, 1, 7, 63, 64 + rng.IntN(200)} {
			p := buf[off : off+n]
			crc := rng.Uint32()
			if got, want := Update(crc, p), crc32.Update(crc, table, p); got != want {
				t.Fatalf("%d bytes at offset %d from %#x: %#x, want %#x", n, off, crc, got, want)
			}
		}
	}
	for _, n := range []int{256, 512, 768, 4096, 65536} {
		var asm, model [16]byte
		foldBlocks(0x12345678, buf[3:3+n], &asm)
		foldModel(0x12345678, buf[3:3+n], &model)
		// The two fold in different orders, so their 128-bit chunks may
		// differ by a multiple of P; their CRCs may not.
		if finish(&asm, nil) != finish(&model, nil) {
			t.Fatalf("%d bytes: AVX-512 fold %x and model %x have different CRCs", n, asm, model)
		}
	}
}

// FuzzUpdate: Update equals hash/crc32 for any bytes, split anywhere.
func FuzzUpdate(f *testing.F) {
	f.Add([]byte("123456789"), uint32(0), 0)
	f.Add(randomBytes(13, 3000), uint32(0xdeadbeef), 1100)
	f.Fuzz(func(t *testing.T, b []byte, crc uint32, cut int) {
		if cut < 0 || cut > len(b) {
			cut = len(b)
		}
		want := crc32.Update(crc, table, b)
		if got := Update(Update(crc, b[:cut]), b[cut:]); got != want {
			t.Fatalf("%d bytes cut at %d from %#x: %#x, want %#x", len(b), cut, crc, got, want)
		}
	})
}
