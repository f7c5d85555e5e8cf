package crc32c

import "golang.org/x/sys/cpu"

// hasFold reports whether this CPU runs foldAVX512: AVX-512 with its
// carry-less multiply (VPCLMULQDQ), enabled by the operating system.
var hasFold = cpu.X86.HasAVX512F && cpu.X86.HasAVX512VL && cpu.X86.HasAVX512VPCLMULQDQ && cpu.X86.HasPCLMULQDQ

// foldAVX512 folds p, a multiple of 256 bytes and at least 256, from the
// CRC state crc (hash/crc32's value inverted) into the 16 bytes out: see
// foldBlocks.
//
//go:noescape
func foldAVX512(crc uint32, p []byte, k *foldConsts, out *[16]byte)

func foldBlocks(crc uint32, p []byte, out *[16]byte) { foldAVX512(crc, p, &consts, out) }
