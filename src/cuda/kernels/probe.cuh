#pragma once
// Device side of cuda/probe.h. In a kernel:
//   UF_PROBE_OPEN(rec, kTagGemv);   // thread 0 of the first and the last CTA opens a record
//   UF_PROBE_OPEN_IF(rec2, kTagX, cond);  // a record of the calling thread when cond holds
//   UF_PROBE_OPEN_TAG_IF(rec3, expr, cond);  // the same, the tag computed
//   UF_PROBE_MARK(rec, 0);          // %globaltimer into point 0 (any thread holding rec)
// Without UF_PROBE both expand to nothing (rec is not even declared), so production kernels carry
// no trace of them.

#include <cstdint>

#include "cuda/kernels/common.cuh"
#include "cuda/probe.h"

#if defined(UF_PROBE) && UF_PROBE
namespace {
__device__ uf::cuda::probe::Record* g_probe_records;
__device__ unsigned* g_probe_count;
__device__ int g_probe_capacity;

void probe_attach_unit(void* records, unsigned* count, int capacity) {
  cudaMemcpyToSymbol(g_probe_records, &records, sizeof(void*));
  cudaMemcpyToSymbol(g_probe_count, &count, sizeof(void*));
  cudaMemcpyToSymbol(g_probe_capacity, &capacity, sizeof(int));
}
[[maybe_unused]] const int g_probe_registered = uf::cuda::probe::register_unit(probe_attach_unit);

__device__ __forceinline__ uf::cuda::probe::Record* probe_open(uint32_t tag, bool want) {
  if (!want || g_probe_records == nullptr) return nullptr;
  const unsigned i = atomicAdd(g_probe_count, 1u);
  if (int(i) >= g_probe_capacity) return nullptr;
  uf::cuda::probe::Record* r = g_probe_records + i;
  r->tag = tag;
  r->block = blockIdx.x;
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  r->sm = sm;
  return r;
}
}  // namespace
#define UF_PROBE_OPEN(rec, tag)              \
  uf::cuda::probe::Record* rec = probe_open( \
      uf::cuda::probe::tag, threadIdx.x == 0 && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1))
// A record opened by the calling thread when `cond` holds (e.g. the CTA that finishes last).
#define UF_PROBE_OPEN_IF(rec, tag, cond) \
  uf::cuda::probe::Record* rec = probe_open(uf::cuda::probe::tag, (cond))
// The same with the tag an expression (e.g. chosen by a template parameter).
#define UF_PROBE_OPEN_TAG_IF(rec, tag_expr, cond) \
  uf::cuda::probe::Record* rec = probe_open((tag_expr), (cond))
#define UF_PROBE_MARK(rec, point)                                   \
  do {                                                              \
    if (rec) (rec)->t[point] = uf::cuda::detail::global_timer_ns(); \
  } while (0)
#else
#define UF_PROBE_OPEN(rec, tag) \
  do {                          \
  } while (0)
#define UF_PROBE_OPEN_IF(rec, tag, cond) \
  do {                                   \
  } while (0)
#define UF_PROBE_OPEN_TAG_IF(rec, tag_expr, cond) \
  do {                                            \
  } while (0)
#define UF_PROBE_MARK(rec, point) \
  do {                            \
  } while (0)
#endif
