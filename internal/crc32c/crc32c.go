// Package crc32c computes the CRC-32C (Castagnoli) of large buffers on
// several cores: the buffer is cut into parts whose CRCs are taken at once
// and combined into the CRC of the whole, the same value hash/crc32 gives.
package crc32c

import (
	"hash/crc32"
	"runtime"
	"sync"
)

var table = crc32.MakeTable(crc32.Castagnoli)

// poly is the Castagnoli polynomial, bit-reversed (as hash/crc32 uses it).
const poly = crc32.Castagnoli

// MinPart is the smallest part a buffer is cut into: below twice this a
// buffer is checksummed on the calling goroutine alone, where starting
// goroutines would cost more than they save.
const MinPart = 2 << 20

// Checksum returns the CRC-32C of b, as crc32.Checksum(b,
// crc32.MakeTable(crc32.Castagnoli)) does, using up to GOMAXPROCS cores
// for buffers of at least 2·MinPart bytes.
func Checksum(b []byte) uint32 {
	parts := min(runtime.GOMAXPROCS(0), len(b)/MinPart)
	if parts < 2 {
		return Update(0, b)
	}
	crcs := make([]uint32, parts)
	bound := func(i int) int { return len(b) * i / parts }
	var wg sync.WaitGroup
	for i := 1; i < parts; i++ {
		wg.Go(func() { crcs[i] = Update(0, b[bound(i):bound(i+1)]) })
	}
	crcs[0] = Update(0, b[:bound(1)])
	wg.Wait()
	crc := crcs[0]
	for i := 1; i < parts; i++ {
		crc = Combine(crc, crcs[i], int64(bound(i+1)-bound(i)))
	}
	return crc
}

// Combine returns the CRC-32C of A followed by B, given crcA of A, crcB of
// B and B's length in bytes. It appends lenB zero bytes to A's CRC by
// squaring the matrix of the CRC's shift register over GF(2), a number of
// squarings logarithmic in lenB, and adds crcB.
func Combine(crcA, crcB uint32, lenB int64) uint32 {
	if lenB <= 0 {
		return crcA
	}
	// odd shifts the register by one zero bit; even and odd then shift
	// by 2, 4, 8, ... bits in turn.
	var even, odd [32]uint32
	odd[0] = poly
	for i, row := 1, uint32(1); i < 32; i, row = i+1, row<<1 {
		odd[i] = row
	}
	square(&even, &odd) // two zero bits
	square(&odd, &even) // four zero bits
	for {
		// Each round shifts by the next bit of lenB's byte count (a
		// byte being 8 bits, the first square gives one zero byte).
		square(&even, &odd)
		if lenB&1 != 0 {
			crcA = times(&even, crcA)
		}
		if lenB >>= 1; lenB == 0 {
			break
		}
		square(&odd, &even)
		if lenB&1 != 0 {
			crcA = times(&odd, crcA)
		}
		if lenB >>= 1; lenB == 0 {
			break
		}
	}
	return crcA ^ crcB
}

// times multiplies vector v by matrix m over GF(2).
func times(m *[32]uint32, v uint32) uint32 {
	var sum uint32
	for i := 0; v != 0; i, v = i+1, v>>1 {
		if v&1 != 0 {
			sum ^= m[i]
		}
	}
	return sum
}

// square sets sq to m·m over GF(2).
func square(sq, m *[32]uint32) {
	for i := range 32 {
		sq[i] = times(m, m[i])
	}
}
