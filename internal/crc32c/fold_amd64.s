#include "textflag.h"

// func foldAVX512(crc uint32, p []byte, k *foldConsts, out *[16]byte)
//
// Folds p (a multiple of 256 bytes, at least 256) into 16 bytes whose
// CRC-32C, taken from a zero state, is the state after p from the state
// crc (see fold.go). Sixteen 128-bit lanes in four ZMM registers each
// carry one 16-byte column of every 256-byte block: each block folds the
// lanes 2048 bits forward (two carry-less products and the next data,
// XORed in one VPTERNLOGD), then the lanes fold into the last one.
TEXT ·foldAVX512(SB), NOSPLIT, $0-48
	MOVL crc+0(FP), AX
	MOVQ p_base+8(FP), SI
	MOVQ p_len+16(FP), CX
	MOVQ k+32(FP), DX
	MOVQ out+40(FP), DI

	VMOVDQU64 0(SI), Z0
	VMOVDQU64 64(SI), Z1
	VMOVDQU64 128(SI), Z2
	VMOVDQU64 192(SI), Z3
	VMOVD     AX, X4
	VPXORQ    Z4, Z0, Z0
	VBROADCASTI32X4 0(DX), Z16
	ADDQ $256, SI
	SUBQ $256, CX
	JZ   reduce

loop:
	VPCLMULQDQ $0x00, Z16, Z0, Z4
	VPCLMULQDQ $0x11, Z16, Z0, Z0
	VPCLMULQDQ $0x00, Z16, Z1, Z5
	VPCLMULQDQ $0x11, Z16, Z1, Z1
	VPCLMULQDQ $0x00, Z16, Z2, Z6
	VPCLMULQDQ $0x11, Z16, Z2, Z2
	VPCLMULQDQ $0x00, Z16, Z3, Z7
	VPCLMULQDQ $0x11, Z16, Z3, Z3
	VPTERNLOGD $0x96, 0(SI), Z4, Z0
	VPTERNLOGD $0x96, 64(SI), Z5, Z1
	VPTERNLOGD $0x96, 128(SI), Z6, Z2
	VPTERNLOGD $0x96, 192(SI), Z7, Z3
	ADDQ $256, SI
	SUBQ $256, CX
	JNZ  loop

reduce:
	// Z0, Z1 and Z2 fold 1536, 1024 and 512 bits forward into Z3.
	VBROADCASTI32X4 16(DX), Z16
	VPCLMULQDQ $0x00, Z16, Z0, Z4
	VPCLMULQDQ $0x11, Z16, Z0, Z5
	VPTERNLOGD $0x96, Z4, Z5, Z3
	VBROADCASTI32X4 32(DX), Z16
	VPCLMULQDQ $0x00, Z16, Z1, Z4
	VPCLMULQDQ $0x11, Z16, Z1, Z5
	VPTERNLOGD $0x96, Z4, Z5, Z3
	VBROADCASTI32X4 48(DX), Z16
	VPCLMULQDQ $0x00, Z16, Z2, Z4
	VPCLMULQDQ $0x11, Z16, Z2, Z5
	VPTERNLOGD $0x96, Z4, Z5, Z3

	// Z3's lanes 0, 1 and 2 fold 384, 256 and 128 bits forward into
	// lane 3 (whose constants are zero, so its product is zero).
	VMOVDQU64  64(DX), Z16
	VPCLMULQDQ $0x00, Z16, Z3, Z4
	VPCLMULQDQ $0x11, Z16, Z3, Z5
	VPXORQ     Z4, Z5, Z4
	VEXTRACTI32X4 $3, Z3, X0
	VEXTRACTI32X4 $1, Z4, X1
	VEXTRACTI32X4 $2, Z4, X2
	VPXOR X4, X0, X0
	VPXOR X1, X0, X0
	VPXOR X2, X0, X0
	VMOVDQU X0, 0(DI)
	VZEROUPPER
	RET
