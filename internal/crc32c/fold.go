package crc32c

import "hash/crc32"

// The folded CRC (amd64 with AVX-512 and VPCLMULQDQ): hash/crc32 takes
// the CRC-32C with the CPU's CRC32 instruction, 8 bytes at a time, at
// 11-14 GB/s on one core here; carry-less multiplies fold 64 bytes at a
// time instead.
//
// The arithmetic, over GF(2) polynomials modulo the Castagnoli
// polynomial P. A reflected CRC's state after a message M, from the
// state S, is (S·x^|M| + M·x^32) mod P, M's first bit being its highest
// coefficient; XORing S into M's first 32 bits gives M', whose state
// from zero is the same. Cut M' into 128-bit chunks: a chunk X followed,
// D bits after its start, by a chunk Y may be replaced by Y + X·x^D
// reduced to 128 bits, and the message's state does not change. Folding
// every chunk forward so leaves one 128-bit chunk R followed by the
// bytes after it, and the state is the CRC of those from zero.
//
// In a register, bit i of a 16-byte little-endian load is the message's
// bit i, the coefficient of x^(127-i): registers hold polynomials
// bit-reversed. Splitting X into its first 64 bits Xh (the register's low
// quadword) and its last Xl, X·x^D = Xh·x^(64+D) + Xl·x^D. A carry-less
// product of two bit-reversed 64-bit values is the bit-reversed product
// times x in the 128-bit register, so the constants are
// rev64(x^(63+D) mod P) for the low quadword and rev64(x^(D-1) mod P) for
// the high one (foldConstant; TestFoldConstants recomputes them).

// foldConsts are the constants foldAVX512 reads, each a pair {low
// quadword's, high quadword's} for a fold of D bits.
type foldConsts struct {
	k2048 [2]uint64    // one 256-byte block to the next
	k1536 [2]uint64    // the first 64-byte register of the last block into the fourth
	k1024 [2]uint64    // the second into the fourth
	k512  [2]uint64    // the third into the fourth
	lanes [4][2]uint64 // the fourth register's lanes 0, 1, 2 into lane 3 (384, 256, 128 bits); lane 3 zero
}

var consts = foldConsts{
	k2048: [2]uint64{0xe9a5d8be00000000, 0x1426a81500000000},
	k1536: [2]uint64{0x7ccbbbf200000000, 0x31c9460800000000},
	k1024: [2]uint64{0x6577b24500000000, 0x7417153f00000000},
	k512:  [2]uint64{0x1c19243b00000000, 0x75bba45b00000000},
	lanes: [4][2]uint64{
		{0xa46ef4aa00000000, 0x6051243f00000000},
		{0x33ccbbbc00000000, 0xa2158b3400000000},
		{0x3743f7bd00000000, 0x3171d43000000000},
	},
}

// FoldMin is the shortest buffer the folded CRC takes: below it,
// hash/crc32's is as fast.
const FoldMin = 1024

// Update returns the CRC-32C of p appended to data whose CRC-32C is crc,
// as crc32.Update(crc, crc32.MakeTable(crc32.Castagnoli), p) does, folding
// with AVX-512 carry-less multiplies where the CPU has them (on one core).
func Update(crc uint32, p []byte) uint32 {
	if !hasFold || len(p) < FoldMin {
		return crc32.Update(crc, table, p)
	}
	n := len(p) &^ 255
	var r [16]byte
	foldBlocks(^crc, p[:n], &r)
	state := ^crc32.Update(^uint32(0), table, r[:]) // r's CRC from a zero state
	return crc32.Update(^state, table, p[n:])
}
