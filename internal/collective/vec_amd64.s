#include "textflag.h"

// func addF32AVX2(dst, src *float32, n int)
//
// dst[i] = dst[i] + src[i] for i < n, n a multiple of 32: four 8-float
// YMM adds an iteration, dst the first operand as in the scalar loop.
TEXT ·addF32AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	SHRQ $5, CX
	JZ   done

loop:
	VMOVUPS 0(DI), Y0
	VMOVUPS 32(DI), Y1
	VMOVUPS 64(DI), Y2
	VMOVUPS 96(DI), Y3
	VADDPS  0(SI), Y0, Y0
	VADDPS  32(SI), Y1, Y1
	VADDPS  64(SI), Y2, Y2
	VADDPS  96(SI), Y3, Y3
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, DI
	ADDQ    $128, SI
	DECQ    CX
	JNZ     loop

done:
	VZEROUPPER
	RET

// func divF32AVX2(d *float32, n int, div float32)
//
// d[i] = d[i] / div for i < n, n a multiple of 32.
TEXT ·divF32AVX2(SB), NOSPLIT, $0-20
	MOVQ  d+0(FP), DI
	MOVQ  n+8(FP), CX
	VBROADCASTSS div+16(FP), Y4
	SHRQ  $5, CX
	JZ    ddone

dloop:
	VMOVUPS 0(DI), Y0
	VMOVUPS 32(DI), Y1
	VMOVUPS 64(DI), Y2
	VMOVUPS 96(DI), Y3
	VDIVPS  Y4, Y0, Y0
	VDIVPS  Y4, Y1, Y1
	VDIVPS  Y4, Y2, Y2
	VDIVPS  Y4, Y3, Y3
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, DI
	DECQ    CX
	JNZ     dloop

ddone:
	VZEROUPPER
	RET

// func scaleF32AVX2(d *float32, n int, f float32)
//
// d[i] = d[i] * f for i < n, n a multiple of 32.
TEXT ·scaleF32AVX2(SB), NOSPLIT, $0-20
	MOVQ  d+0(FP), DI
	MOVQ  n+8(FP), CX
	VBROADCASTSS f+16(FP), Y4
	SHRQ  $5, CX
	JZ    sdone

sloop:
	VMOVUPS 0(DI), Y0
	VMOVUPS 32(DI), Y1
	VMOVUPS 64(DI), Y2
	VMOVUPS 96(DI), Y3
	VMULPS  Y4, Y0, Y0
	VMULPS  Y4, Y1, Y1
	VMULPS  Y4, Y2, Y2
	VMULPS  Y4, Y3, Y3
	VMOVUPS Y0, 0(DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, DI
	DECQ    CX
	JNZ     sloop

sdone:
	VZEROUPPER
	RET

// func addBF16AVX2(dst, src *uint16, n int)
//
// dst[i] = bf16(f32(dst[i]) + f32(src[i])) for i < n, n a multiple of 16,
// as addBF16One does: widen by a shift, add in float32 (dst the first
// operand, so a NaN dst wins), round to nearest even by adding 0x7fff plus
// the kept half's low bit. A NaN sum needs no case of its own: the CPU
// returns a NaN operand made quiet, or its default NaN, whose low 16 bits
// are zero (a widened bfloat16's are), so the rounding carries nothing
// and keeps the quiet upper half, as f32ToBF16's NaN case gives.
TEXT ·addBF16AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	SHRQ $4, CX
	JZ   bdone
	MOVL $1, AX
	VMOVD AX, X15
	VPBROADCASTD X15, Y15 // 1
	MOVL $0x7fff, AX
	VMOVD AX, X14
	VPBROADCASTD X14, Y14 // rounding bias

bloop:
	// Elements 0..7 into Y4.
	VPMOVZXWD 0(DI), Y0
	VPMOVZXWD 0(SI), Y1
	VPSLLD    $16, Y0, Y0
	VPSLLD    $16, Y1, Y1
	VADDPS    Y1, Y0, Y0
	VPSRLD    $16, Y0, Y2
	VPAND     Y15, Y2, Y3
	VPADDD    Y14, Y0, Y4
	VPADDD    Y3, Y4, Y4
	VPSRLD    $16, Y4, Y4
	// Elements 8..15 into Y7.
	VPMOVZXWD 16(DI), Y0
	VPMOVZXWD 16(SI), Y1
	VPSLLD    $16, Y0, Y0
	VPSLLD    $16, Y1, Y1
	VADDPS    Y1, Y0, Y0
	VPSRLD    $16, Y0, Y2
	VPAND     Y15, Y2, Y3
	VPADDD    Y14, Y0, Y7
	VPADDD    Y3, Y7, Y7
	VPSRLD    $16, Y7, Y7
	// Pack to 16 words: VPACKUSDW interleaves the 128-bit lanes,
	// VPERMQ puts them back in order.
	VPACKUSDW Y7, Y4, Y8
	VPERMQ    $0xD8, Y8, Y8
	VMOVDQU   Y8, 0(DI)
	ADDQ      $32, DI
	ADDQ      $32, SI
	DECQ      CX
	JNZ       bloop

bdone:
	VZEROUPPER
	RET

// func addF16F16C(dst, src *uint16, n int)
//
// dst[i] = f16(f32(dst[i]) + f32(src[i])) for i < n, n a multiple of 8,
// as addF16One does: widen exactly (VCVTPH2PS), add in float32 with dst
// first, make a NaN sum the canonical quiet NaN of its sign (f32ToF16
// keeps no payload), and round to nearest even (VCVTPS2PH, mode 0),
// overflowing to infinity.
TEXT ·addF16F16C(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	SHRQ $3, CX
	JZ   hdone
	MOVL $0x7fffffff, AX
	VMOVD AX, X13
	VPBROADCASTD X13, Y13 // all but the sign
	MOVL $0x7f800000, AX
	VMOVD AX, X12
	VPBROADCASTD X12, Y12 // infinity
	MOVL $0x80000000, AX
	VMOVD AX, X14
	VPBROADCASTD X14, Y14 // the sign
	MOVL $0x7fc00000, AX
	VMOVD AX, X11
	VPBROADCASTD X11, Y11 // the quiet NaN

hloop:
	VCVTPH2PS 0(DI), Y0
	VCVTPH2PS 0(SI), Y1
	VADDPS    Y1, Y0, Y0
	VPAND     Y13, Y0, Y5
	VPCMPGTD  Y12, Y5, Y5
	VPAND     Y14, Y0, Y6
	VPOR      Y11, Y6, Y6
	VPBLENDVB Y5, Y6, Y0, Y0
	VCVTPS2PH $0, Y0, 0(DI)
	ADDQ      $16, DI
	ADDQ      $16, SI
	DECQ      CX
	JNZ       hloop

hdone:
	VZEROUPPER
	RET

// func addF64AVX2(dst, src *float64, n int)
//
// dst[i] = dst[i] + src[i] for i < n, n a multiple of 16: four 4-double
// YMM adds an iteration, dst the first operand as in the scalar loop.
TEXT ·addF64AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	SHRQ $4, CX
	JZ   fdone

floop:
	VMOVUPD 0(DI), Y0
	VMOVUPD 32(DI), Y1
	VMOVUPD 64(DI), Y2
	VMOVUPD 96(DI), Y3
	VADDPD  0(SI), Y0, Y0
	VADDPD  32(SI), Y1, Y1
	VADDPD  64(SI), Y2, Y2
	VADDPD  96(SI), Y3, Y3
	VMOVUPD Y0, 0(DI)
	VMOVUPD Y1, 32(DI)
	VMOVUPD Y2, 64(DI)
	VMOVUPD Y3, 96(DI)
	ADDQ    $128, DI
	ADDQ    $128, SI
	DECQ    CX
	JNZ     floop

fdone:
	VZEROUPPER
	RET
