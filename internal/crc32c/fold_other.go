//go:build !amd64

package crc32c

// hasFold is false: the folded CRC has only an amd64 implementation.
const hasFold = false

func foldBlocks(crc uint32, p []byte, out *[16]byte) {
	panic("crc32c: no folded CRC on this architecture")
}
