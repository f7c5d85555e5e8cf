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
