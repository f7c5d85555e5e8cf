/*
 * A stand-in for libcuda.so.1 that keeps "device memory" in host memory, for
 * testing the run-time binding without a GPU: argument order, output
 * pointers, 32-bit results, per-thread current context and the 64-byte IPC
 * handle passed by value. It is not a simulator of anything but the ABI.
 * Built by the test with: cc -shared -fPIC -o libfakecuda.so fakecuda.c
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;

enum { KIND_FREE, KIND_DEVICE, KIND_HOSTALLOC, KIND_REGISTERED };
struct range { uintptr_t base; size_t size; int kind; int sync; };
static struct range ranges[256];
static __thread void *current;
static int retained[2];

static struct range *find(uintptr_t p, size_t n) {
	for (int i = 0; i < 256; i++)
		if (ranges[i].kind != KIND_FREE && p >= ranges[i].base && p + n <= ranges[i].base + ranges[i].size)
			return &ranges[i];
	return NULL;
}
static int add(uintptr_t p, size_t n, int kind) {
	for (int i = 0; i < 256; i++)
		if (ranges[i].kind == KIND_FREE) { ranges[i] = (struct range){p, n, kind, 0}; return 0; }
	return 2;
}
#define NEED_CTX if (!current) return 201 /* CUDA_ERROR_INVALID_CONTEXT */

CUresult cuInit(unsigned flags) {
	const char *r = getenv("FAKECUDA_INIT_RESULT");
	if (r) return atoi(r);
	return getenv("FAKECUDA_NO_DEVICE") ? 100 : (flags ? 1 : 0);
}
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuGetErrorName(CUresult r, const char **s) {
	if (r == 2) { *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0; }
	return 1;
}
CUresult cuDeviceGetCount(int *n) { *n = 2; return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
	if (ordinal < 0 || ordinal > 1) return 101;
	*d = 100 + ordinal; return 0;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) { snprintf(name, len, "Fake GPU %d", d - 100); return 0; }
CUresult cuDeviceGetAttribute(int *pi, int attr, CUdevice d) { *pi = attr * 1000 + (d - 100); return 0; }
CUresult cuDeviceGetPCIBusId(char *id, int len, CUdevice d) { snprintf(id, len, "0000:3B:%02X.0", d - 100); return 0; }
CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) { *b = (size_t)80 << 30; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) { retained[d - 100]++; *ctx = (void *)(uintptr_t)(0xC000 + d); return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { return retained[d - 100]-- > 0 ? 0 : 201; }
CUresult cuCtxSetCurrent(void *ctx) { current = ctx; return 0; }
CUresult cuCtxSynchronize(void) { NEED_CTX; return 0; }
/* fake_flushes counts flushes to the owner of the current context; another
   target or scope is refused as the real driver refuses unknown values. */
int fake_flushes;
CUresult cuFlushGPUDirectRDMAWrites(int target, int scope) {
	NEED_CTX;
	if (target != 0 || (scope != 100 && scope != 200)) return 1;
	fake_flushes++;
	return 0;
}
CUresult cuMemGetInfo_v2(size_t *f, size_t *t) { NEED_CTX; *f = (size_t)79 << 30; *t = (size_t)80 << 30; return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
	void *m;
	NEED_CTX;
	if (n > ((size_t)1 << 34)) return 2;
	if (posix_memalign(&m, 256, n)) return 2;
	*p = (CUdeviceptr)(uintptr_t)m;
	return add((uintptr_t)m, n, KIND_DEVICE);
}
CUresult cuMemFree_v2(CUdeviceptr p) {
	struct range *r = find(p, 0);
	NEED_CTX;
	if (!r || r->base != p || r->kind != KIND_DEVICE) return 1;
	free((void *)(uintptr_t)p); r->kind = KIND_FREE; return 0;
}
CUresult cuMemHostAlloc(void **pp, size_t n, unsigned flags) {
	NEED_CTX;
	if (posix_memalign(pp, 4096, n)) return 2;
	return add((uintptr_t)*pp, n, KIND_HOSTALLOC);
}
CUresult cuMemFreeHost(void *p) {
	struct range *r = find((uintptr_t)p, 0);
	if (!r || r->kind != KIND_HOSTALLOC) return 1;
	free(p); r->kind = KIND_FREE; return 0;
}
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
	struct range *r = find((uintptr_t)p, 0);
	NEED_CTX;
	if (r && r->kind == KIND_DEVICE) return 1;
	if (r) return 712;
	return add((uintptr_t)p, n, KIND_REGISTERED);
}
CUresult cuMemHostUnregister(void *p) {
	struct range *r = find((uintptr_t)p, 0);
	if (!r || r->kind != KIND_REGISTERED) return 713;
	r->kind = KIND_FREE; return 0;
}
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned flags) {
	if (flags) return 1;
	*d = (CUdeviceptr)(uintptr_t)p; return 0;
}
CUresult cuStreamCreate(void **s, unsigned flags) { NEED_CTX; *s = malloc(8); *(unsigned *)*s = flags; return 0; }
CUresult cuStreamDestroy_v2(void *s) { free(s); return 0; }
CUresult cuStreamSynchronize(void *s) { return s ? 0 : 400; }
CUresult cuStreamQuery(void *s) { return s ? 0 : 400; }
struct event { int queries; };
CUresult cuEventCreate(void **e, unsigned flags) { NEED_CTX; *e = calloc(1, sizeof(struct event)); return 0; }
CUresult cuEventRecord(void *e, void *s) { ((struct event *)e)->queries = 0; return 0; }
CUresult cuEventQuery(void *e) { return ((struct event *)e)->queries++ == 0 ? 600 : 0; }
CUresult cuEventSynchronize(void *e) { ((struct event *)e)->queries = 1; return 0; }
CUresult cuEventDestroy_v2(void *e) { free(e); return 0; }
CUresult cuEventElapsedTime_v2(float *ms, void *a, void *b) { *ms = 1.5f; return 0; }
static CUresult copy(uintptr_t dev, void *dst, const void *src, size_t n) {
	NEED_CTX;
	struct range *r = find(dev, n);
	if (!r || r->kind != KIND_DEVICE) return 1;
	memmove(dst, src, n); return 0;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { return copy(d, (void *)(uintptr_t)d, s, n); }
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { return copy(s, d, (void *)(uintptr_t)s, n); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *st) { return st ? copy(d, (void *)(uintptr_t)d, s, n) : 400; }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, void *st) { return st ? copy(s, d, (void *)(uintptr_t)s, n) : 400; }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) {
	if (!st) return 400;
	if (!find(s, n)) return 1;
	return copy(d, (void *)(uintptr_t)d, (void *)(uintptr_t)s, n);
}
/* Peer access only from a lower device to the next one (100 -> 101), so
   that both answers and the argument order are checked. */
CUresult cuDeviceCanAccessPeer(int *can, CUdevice a, CUdevice b) { *can = b == a + 1; return 0; }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
	NEED_CTX;
	if (!find(d, n)) return 1;
	memset((void *)(uintptr_t)d, v, n); return 0;
}
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
	struct range *r = find(p, 0);
	NEED_CTX;
	if (!r) return 1;
	switch (attr) {
	case 2: *(unsigned *)data = r->kind == KIND_DEVICE ? 2 : 1; return 0;
	case 6: *(unsigned *)data = r->sync; return 0;
	case 8: *(unsigned *)data = 0; return 0;
	case 9: *(int *)data = 0; return 0;
	}
	return 1;
}
CUresult cuPointerSetAttribute(const void *v, int attr, CUdeviceptr p) {
	struct range *r = find(p, 0);
	NEED_CTX;
	if (!r || r->kind != KIND_DEVICE || attr != 6) return 1;
	r->sync = *(const unsigned *)v; return 0;
}
CUresult cuMemGetHandleForAddressRange(void *h, CUdeviceptr p, size_t n, int type, unsigned long long flags) {
	struct range *r = find(p, n);
	NEED_CTX;
	if (type != 1 || flags != 0 || !r || r->kind != KIND_DEVICE) return 1;
	*(int *)h = open("/dev/null", O_RDONLY | O_CLOEXEC);
	return 0;
}
CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
	NEED_CTX;
	if (!find(p, 0)) return 1;
	for (int i = 0; i < 64; i++) h->reserved[i] = (char)(i * 3 + 1);
	memcpy(h->reserved + 8, &p, sizeof p);
	return 0;
}
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
	NEED_CTX;
	if (flags != 1 || h.reserved[0] != 1 || h.reserved[63] != (char)(63 * 3 + 1)) return 1;
	memcpy(p, h.reserved + 8, sizeof *p);
	return 0;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr p) { return 0; }
