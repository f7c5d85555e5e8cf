/* A stand-in for libnvidia-ml.so.1 with no GPU: it counts nvmlInit_v2 and
   nvmlShutdown calls so that tests can check NVML is initialised once per
   process. Only the functions GPUs calls on a node without GPUs exist. */
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
