#include "cuda/cuda_check.h"

#include <cstdarg>
#include <cstdio>

#include "core/error.h"

namespace uf::cuda {

void throw_cuda_error(const char* call, const char* file, int line, cudaError_t err) {
  core::fail("CUDA call {} failed at {}:{}: {} ({})", call, file, line, cudaGetErrorString(err),
             cudaGetErrorName(err));
}

void require(bool cond, const char* format, ...) {
  if (cond) return;
  char buf[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buf, sizeof(buf), format, args);
  va_end(args);
  throw core::Error(buf);
}

}  // namespace uf::cuda
