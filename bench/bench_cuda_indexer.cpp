// bench_cuda_indexer: the sparse indexer's device ops (cuda/ops/attention.h) at the TP8-rank
// decode shapes: 4 index heads of 128, top-512, candidate pool 2048 blocks of 8, compress ratio
// 4, so width = context / 4 entries: 2048 (8k), 32768 (128k), 262144 (1M); T = 1..8 rows that
// all score one key bank (the decode / verify case). Each op is captured 20 times in a CUDA graph
// and the graph replayed 10 times (200 calls); us per call beside the bytes the op must move and
// the floor at 4.1 TB/s. "no-ws us": the selection called without a workspace (eager): the
// one-CTA-per-row kernels where rounds would need one (128k, 1M), else the same one-round path.
//
// Bytes: index_scores reads the bf16 key bank once (width x 128 x 2) and writes T x width scores;
// topk_select reads T x width scores; candidate_mask reads T x width scores and writes T x width
// keep bytes. At 8k the whole bank fits in L2, so replays read it from there. index_scores runs
// on the tensor cores (the default) and on the fp32 kernel (set_index_scores_mma(false)).

#include <algorithm>
#include <cstdio>
#include <vector>

#ifndef UF_HAVE_CUDA
int main() {
  std::printf("bench_cuda_indexer: built without the CUDA backend\n");
  return 0;
}
#else

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#include "cuda/ops/attention.h"

using namespace uf::cuda;

namespace {

constexpr int kHi = 4, kHd = 128, kTopk = 512, kCandBlocks = 2048, kCandBlock = 8;
constexpr double kFloorBw = 4.1e12;
constexpr int kCallsPerGraph = 20, kReplays = 10;

template <typename F>
double graph_us(cudaStream_t s, F&& body) {
  cudaGraph_t g;
  UF_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kCallsPerGraph; ++i) body();
  UF_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t exec;
  UF_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  UF_CUDA_CHECK(cudaGraphDestroy(g));
  UF_CUDA_CHECK(cudaGraphLaunch(exec, s));  // warm-up
  cudaEvent_t a, b;
  UF_CUDA_CHECK(cudaEventCreate(&a));
  UF_CUDA_CHECK(cudaEventCreate(&b));
  UF_CUDA_CHECK(cudaEventRecord(a, s));
  for (int r = 0; r < kReplays; ++r) UF_CUDA_CHECK(cudaGraphLaunch(exec, s));
  UF_CUDA_CHECK(cudaEventRecord(b, s));
  UF_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0.f;
  UF_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  UF_CUDA_CHECK(cudaEventDestroy(a));
  UF_CUDA_CHECK(cudaEventDestroy(b));
  UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
  return 1e3 * double(ms) / double(kCallsPerGraph * kReplays);
}

template <typename F>
double eager_us(cudaStream_t s, int calls, F&& body) {
  body();  // warm-up
  cudaEvent_t a, b;
  UF_CUDA_CHECK(cudaEventCreate(&a));
  UF_CUDA_CHECK(cudaEventCreate(&b));
  UF_CUDA_CHECK(cudaEventRecord(a, s));
  for (int i = 0; i < calls; ++i) body();
  UF_CUDA_CHECK(cudaEventRecord(b, s));
  UF_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0.f;
  UF_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  UF_CUDA_CHECK(cudaEventDestroy(a));
  UF_CUDA_CHECK(cudaEventDestroy(b));
  return 1e3 * double(ms) / double(calls);
}

template <typename T>
T* dev_alloc(size_t n) {
  T* p = nullptr;
  UF_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

void row(const char* op, int width, int T, double us, double bytes, double legacy_us) {
  const double floor_us = bytes / kFloorBw * 1e6;
  std::printf("%-15s %7d %2d %10.2f %10.0f %8.0f %9.2f %7.1fx", op, width, T, us, bytes,
              bytes / (us * 1e-6) / 1e9, floor_us, us / floor_us);
  if (legacy_us > 0) std::printf(" %10.1f", legacy_us);
  std::printf("\n");
}

}  // namespace

int main() {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("bench_cuda_indexer: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; index heads %d x %d, top-%d, candidate pool %d x %d\n",
              prop.name, prop.multiProcessorCount, kHi, kHd, kTopk, kCandBlocks, kCandBlock);
  std::printf("%-15s %7s %2s %10s %10s %8s %9s %8s %10s\n", "op", "width", "T", "us/call", "bytes",
              "GB/s", "floor us", "x floor", "no-ws us");
  constexpr int kMaxT = 8, kMaxWidth = 262144;
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint16_t* bank = dev_alloc<uint16_t>(size_t(kMaxWidth) * kHd);  // bf16, as sessions store it
  float* q = dev_alloc<float>(size_t(kMaxT) * kHi * kHd);
  float* w = dev_alloc<float>(size_t(kMaxT) * kHi);
  fill_random_bf16(bank, size_t(kMaxWidth) * kHd, 1, 1.f, s);
  fill_random_f32(q, size_t(kMaxT) * kHi * kHd, 2, 1.f, s);
  fill_random_f32(w, size_t(kMaxT) * kHi, 3, 0.1f, s);
  const uint16_t** keys = dev_alloc<const uint16_t*>(kMaxT);
  int32_t* vis = dev_alloc<int32_t>(kMaxT);
  int32_t* wid = dev_alloc<int32_t>(kMaxT);
  float* score = dev_alloc<float>(size_t(kMaxT) * kMaxWidth);
  uint8_t* keep = dev_alloc<uint8_t>(size_t(kMaxT) * kMaxWidth);
  int32_t* out = dev_alloc<int32_t>(size_t(kMaxT) * kTopk);
  const size_t ws_bytes =
      std::max(topk_select_workspace_bytes(kMaxT, kMaxWidth, kTopk),
               candidate_mask_workspace_bytes(kMaxT, kMaxWidth, kCandBlocks, kCandBlock));
  void* ws = dev_alloc<uint8_t>(ws_bytes);
  const std::vector<const uint16_t*> kp(kMaxT, bank);
  UF_CUDA_CHECK(cudaMemcpy(keys, kp.data(), sizeof(void*) * kMaxT, cudaMemcpyHostToDevice));

  for (const int width : {2048, 32768, 262144}) {
    const std::vector<int32_t> v(kMaxT, width);
    UF_CUDA_CHECK(cudaMemcpy(vis, v.data(), 4 * kMaxT, cudaMemcpyHostToDevice));
    UF_CUDA_CHECK(cudaMemcpy(wid, v.data(), 4 * kMaxT, cudaMemcpyHostToDevice));
    for (const int T : {1, 2, 4, 7, 8}) {
      if (width == 32768 && T != 1 && T != 7) continue;
      auto scores = [&] { index_scores(q, w, T, kHi, kHd, keys, vis, wid, width, score, s); };
      set_index_scores_mma(false);  // the fp32 kernel (the CPU's order), for comparison
      const double us_f = graph_us(s, scores);
      set_index_scores_mma(true);
      const double us_s = graph_us(s, scores);
      scores();  // realistic scores (bf16, ties) for the selections
      const double us_t =
          graph_us(s, [&] { topk_select(score, T, width, wid, kTopk, vis, out, s, ws); });
      const double us_m = graph_us(s, [&] {
        candidate_mask(score, T, width, wid, vis, kCandBlocks, kCandBlock, keep, s, ws);
      });
      const int legacy_calls = width >= 262144 ? 3 : 20;
      const double leg_t =
          eager_us(s, legacy_calls, [&] { topk_select(score, T, width, wid, kTopk, vis, out, s); });
      const double leg_m = eager_us(s, legacy_calls, [&] {
        candidate_mask(score, T, width, wid, vis, kCandBlocks, kCandBlock, keep, s);
      });
      const double sc_bytes = double(width) * kHd * 2 + double(T) * width * 4;  // bf16 keys
      row("index_scores", width, T, us_s, sc_bytes, 0);
      row("  (fp32 kernel)", width, T, us_f, sc_bytes, 0);
      row("topk_select", width, T, us_t, double(T) * width * 4, leg_t);
      row("candidate_mask", width, T, us_m, double(T) * width * 5, leg_m);
    }
  }
  UF_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaFree(bank);
  cudaFree(q);
  cudaFree(w);
  cudaFree(keys);
  cudaFree(vis);
  cudaFree(wid);
  cudaFree(score);
  cudaFree(keep);
  cudaFree(out);
  cudaFree(ws);
  UF_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

#endif
