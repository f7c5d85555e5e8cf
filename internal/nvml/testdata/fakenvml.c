/* A stand-in for libnvidia-ml.so.1 with no GPU: it counts nvmlInit_v2 and
   nvmlShutdown calls so that tests can check NVML is initialised once per
   process. Only the functions GPUs calls on a node without GPUs exist, and
   for C2C one GPU at 0000:01:00.0 (nvmlDeviceGetC2cModeInfoV only when built
   with -DFAKE_C2C=1 or -DFAKE_C2C=0, its isC2cEnabled). */
#include <string.h>

int fake_inits, fake_shutdowns;

int nvmlInit_v2(void) { fake_inits++; return 0; }
int nvmlInit(void) { fake_inits++; return 0; }
int nvmlInitWithFlags(unsigned flags) { (void)flags; fake_inits++; return 0; }
int nvmlShutdown(void) { fake_shutdowns++; return 0; }
const char *nvmlErrorString(int r) { (void)r; return "fake"; }
int nvmlSystemGetDriverVersion(char *v, unsigned n) { strncpy(v, "999.1", n); return 0; }
int nvmlSystemGetCudaDriverVersion(int *v) { *v = 13000; return 0; }
int nvmlSystemGetCudaDriverVersion_v2(int *v) { *v = 13000; return 0; }
int nvmlDeviceGetCount_v2(unsigned *n) { *n = 0; return 0; }
int nvmlDeviceGetCount(unsigned *n) { *n = 0; return 0; }

int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **dev) {
	static int gpu;
	if (strcmp(bus, "0000:01:00.0") != 0) return 6; /* NVML_ERROR_NOT_FOUND */
	*dev = &gpu;
	return 0;
}
int nvmlDeviceGetHandleByPciBusId(const char *bus, void **dev) { return nvmlDeviceGetHandleByPciBusId_v2(bus, dev); }
#ifdef FAKE_C2C
int nvmlDeviceGetC2cModeInfoV(void *dev, unsigned *isC2cEnabled) { (void)dev; *isC2cEnabled = FAKE_C2C; return 0; }
#endif
