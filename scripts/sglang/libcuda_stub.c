/* A stand-in libcuda.so.1 for machines without an NVIDIA driver (scripts/setup_sglang.sh).
 *
 * sgl_kernel's CUDA wheel links against libcuda.so.1 and fails to load without it, although on CPU
 * (SGLANG_USE_CPU_ENGINE=1, attention_backend=torch_native) none of its CUDA kernels run. Every
 * function here reports that there is no device, so anything that does try to use the driver gets
 * an error instead of a crash. Not for a machine with a GPU: there the real driver is used.
 */
#include <stddef.h>

typedef int CUresult;
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_NOT_SUPPORTED 801

CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDriverGetVersion(int *version) { if (version) *version = 0; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDeviceGetCount(int *count) { if (count) *count = 0; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDeviceGet(int *device, int ordinal) { (void)device; (void)ordinal; return CUDA_ERROR_NO_DEVICE; }
CUresult cuGetErrorString(CUresult error, const char **str) {
  (void)error; if (str) *str = "no CUDA driver (miles libcuda stand-in)"; return 0;
}
CUresult cuGetErrorName(CUresult error, const char **str) {
  (void)error; if (str) *str = "CUDA_ERROR_NO_DEVICE"; return 0;
}
CUresult cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
  (void)data; (void)attribute; (void)ptr; return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
  (void)symbol; (void)version; (void)flags; if (pfn) *pfn = NULL; return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
  (void)symbol; (void)version; (void)flags; if (pfn) *pfn = NULL; if (status) *status = 1;
  return CUDA_ERROR_NOT_SUPPORTED;
}
