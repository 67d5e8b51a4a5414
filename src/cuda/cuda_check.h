#pragma once
// Error checks for the CUDA backend. They throw uf::core::Error (core/error.h) with a sentence
// naming the call or argument and the site. This header stays free of fmt so that nvcc-compiled
// files can use it (fmt's compile-time format checks do not build under nvcc).

#include <cuda_runtime.h>

namespace uf::cuda {

[[noreturn]] void throw_cuda_error(const char* call, const char* file, int line, cudaError_t err);
// printf-style message; throws uf::core::Error when cond is false.
void require(bool cond, const char* format, ...) __attribute__((format(printf, 2, 3)));

}  // namespace uf::cuda

#define UF_CUDA_CHECK(call)                                                  \
  do {                                                                       \
    const cudaError_t uf_cuda_err_ = (call);                                 \
    if (uf_cuda_err_ != cudaSuccess)                                         \
      ::uf::cuda::throw_cuda_error(#call, __FILE__, __LINE__, uf_cuda_err_); \
  } while (0)
