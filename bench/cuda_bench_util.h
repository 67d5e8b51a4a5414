#pragma once
// Timing helpers shared by the bench_cuda_* kernel benchmarks: a launch sequence is captured once
// as a CUDA graph and replayed; the figure is the median replay time (events around each replay,
// after untimed warm-up replays), so launch overhead and one-off effects stay out of it.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "cuda/cuda_check.h"

namespace uf::bench {

inline float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// body()'s launches on `s`, captured (global mode: the benchmarks run on one thread).
template <typename F>
cudaGraphExec_t capture_graph(cudaStream_t s, F&& body) {
  cudaGraph_t g;
  UF_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  body();
  UF_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t exec;
  UF_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  UF_CUDA_CHECK(cudaGraphDestroy(g));
  return exec;
}

// Median microseconds of one replay of `exec` over `reps` replays, after `warm` untimed ones.
inline float median_replay_us(cudaGraphExec_t exec, cudaStream_t s, int reps, int warm = 3) {
  cudaEvent_t a, b;
  UF_CUDA_CHECK(cudaEventCreate(&a));
  UF_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warm; ++i) UF_CUDA_CHECK(cudaGraphLaunch(exec, s));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    UF_CUDA_CHECK(cudaEventRecord(a, s));
    UF_CUDA_CHECK(cudaGraphLaunch(exec, s));
    UF_CUDA_CHECK(cudaEventRecord(b, s));
    UF_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    UF_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.f);
  }
  UF_CUDA_CHECK(cudaEventDestroy(a));
  UF_CUDA_CHECK(cudaEventDestroy(b));
  return median(t);
}

// capture_graph + median_replay_us, the graph destroyed after.
template <typename F>
float time_graph_us(cudaStream_t s, int reps, F&& body, int warm = 3) {
  cudaGraphExec_t exec = capture_graph(s, body);
  const float us = median_replay_us(exec, s, reps, warm);
  UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
  return us;
}

}  // namespace uf::bench
