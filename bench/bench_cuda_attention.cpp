// bench_cuda_attention: sparse_attn (cuda/ops/attention.h) at the decode shapes of one TP8 rank:
// 8 heads, head_dim 512, one shared KV head; the verify step (128 window slots + 512 top-k
// entries of a 2048-entry compressed cache, i.e. 8k context) at T = 1, 2, 4, 7, 8, the
// window-only layers (k = 0) at the same T, and the DSpark draft (T = 5, 133 window slots); and
// prefill chunks of 64 and 512 rows (128 window slots + 512 top-k), where the fast path runs in
// groups of kPrefillGroup rows (its scratch grows with the rows).
// Rows sit at consecutive positions, so their windows overlap as in a verify step; top-k ids are
// random per row. Each timing replays a CUDA graph of one call per layer copy (--copies, default
// 24, ~100 MB: the caches do not stay in L2 between calls, as in a forward where the weights
// stream through it), median of --reps replays, divided by the copies. The fast chunked path
// (split scratch: the decode callers) is timed against the reference path (one CTA per (row,
// head)); fast: the default (the chunk records of 16 slots on the tensor cores, one kernel + the
// merge), cpu16: the CPU-order records (scores + P.V kernels + the merge, set_sparse_attn_chunk_mma
// (false)), c32: those with chunks of 32; mma: sparse_attn_mma (tensor cores, all rows in one
// launch: what CudaModel::attend runs for prefill spans), timed for the prefill shapes only. The
// last column: outputs of the fast path that differ from the reference path (the CPU's arithmetic;
// the tensor-core records round p against their chunk's max, so many outputs differ by a bf16 ulp)
// and the largest difference, a sanity line only (tests/cuda/test_ops_attention.cpp is the check).
// bytes = distinct KV rows touched x hd x (4: window, 2: top-k bf16) + q + out; GB/s = bytes /
// time; floor = bytes at 4.1 TB/s.
//
//   bench_cuda_attention [--reps N] [--copies N]

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#ifndef UF_HAVE_CUDA
int main() {
  std::printf("bench_cuda_attention: built without the CUDA backend\n");
  return 0;
}
#else

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#include "cuda/ops/attention.h"
#include "cuda_bench_util.h"

using namespace uf::cuda;

namespace {

constexpr int kH = 8, kHd = 512, kWindow = 128, kEntries = 2048, kMaxT = 512;
constexpr int kPrefillGroup = 64;           // rows per fast-path call of the prefill shapes
constexpr double kFloorBytesPerUs = 4.1e6;  // 4.1 TB/s

struct Layer {
  float* ring = nullptr;    // [kWindow + kMaxT, kHd]
  uint16_t* ckv = nullptr;  // [kEntries, kHd] bf16, as sessions store it
};

struct Shape {
  const char* name;
  int T, n_window, k;
};

}  // namespace

int main(int argc, char** argv) {
  int reps = 20, copies = 24;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--copies") && i + 1 < argc) copies = std::atoi(argv[++i]);
  }
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("bench_cuda_attention: no CUDA device\n");
    return 0;
  }
  cudaStream_t stream;
  UF_CUDA_CHECK(cudaStreamCreate(&stream));
  std::vector<Layer> layers(static_cast<size_t>(copies));
  uint64_t seed = 1;
  const int ring_rows = kWindow + kMaxT;
  for (auto& L : layers) {
    UF_CUDA_CHECK(cudaMalloc(&L.ring, size_t(ring_rows) * kHd * sizeof(float)));
    UF_CUDA_CHECK(cudaMalloc(&L.ckv, size_t(kEntries) * kHd * sizeof(uint16_t)));
    fill_random_f32(L.ring, size_t(ring_rows) * kHd, seed++, 1.f, stream);
    fill_random_bf16(L.ckv, size_t(kEntries) * kHd, seed++, 1.f, stream);
  }
  float *q, *out, *sink, *scratch;
  const int max_slots = kWindow + 512 + 8;
  UF_CUDA_CHECK(cudaMalloc(&q, size_t(kMaxT) * kH * kHd * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&out, size_t(kMaxT) * kH * kHd * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&sink, size_t(kH) * sizeof(float)));
  const size_t scratch_floats = sparse_attn_scratch_floats(kPrefillGroup, kH, kHd, max_slots);
  UF_CUDA_CHECK(cudaMalloc(&scratch, scratch_floats * sizeof(float)));
  fill_random_f32(q, size_t(kMaxT) * kH * kHd, seed++, 2.f, stream);
  fill_random_f32(sink, size_t(kH), seed++, 1.f, stream);

  const Shape shapes[] = {
      {"verify k=512", 1, kWindow, 512},    {"verify k=512", 2, kWindow, 512},
      {"verify k=512", 4, kWindow, 512},    {"verify k=512", 7, kWindow, 512},
      {"verify k=512", 8, kWindow, 512},    {"window k=0", 1, kWindow, 0},
      {"window k=0", 2, kWindow, 0},        {"window k=0", 4, kWindow, 0},
      {"window k=0", 7, kWindow, 0},        {"window k=0", 8, kWindow, 0},
      {"draft 133", 5, kWindow + 5, 0},     {"prefill k=512", 64, kWindow, 512},
      {"prefill k=512", 512, kWindow, 512},
  };
  std::printf("sparse_attn, H=%d hd=%d, %d layer copies, median of %d graph replays\n", kH, kHd,
              copies, reps);
  std::printf("%-14s %3s %6s %10s %9s %8s %10s %8s %8s %8s %8s %8s\n", "shape", "T", "slots",
              "bytes", "floor_us", "fast_us", "fast_GB/s", "cpu16_us", "c32_us", "ref_us",
              "speedup", "mma_us");
  std::mt19937 rng(7);
  for (const Shape& sh : shapes) {
    const int T = sh.T, W = sh.n_window, k = sh.k;
    // Per copy: window pointers (row t at position P + t sees the W latest ring rows) and top-k.
    std::vector<const float**> dwin(static_cast<size_t>(copies));
    std::vector<int32_t*> dtopk(static_cast<size_t>(copies));
    double kv_bytes = 0;
    for (int c = 0; c < copies; ++c) {
      const Layer& L = layers[size_t(c)];
      std::vector<const float*> win(size_t(T) * W);
      std::vector<int32_t> topk(size_t(T) * std::max(k, 1), -1);
      std::set<const float*> distinct;         // window rows (fp32)
      std::set<const uint16_t*> distinct_ckv;  // top-k rows (bf16)
      for (int t = 0; t < T; ++t) {
        for (int j = 0; j < W; ++j) {
          const float* p = L.ring + int64_t((t + j) % ring_rows) * kHd;
          win[size_t(t) * W + j] = p;
          distinct.insert(p);
        }
        std::vector<int32_t> ids(kEntries);
        for (int i = 0; i < kEntries; ++i) ids[size_t(i)] = i;
        std::shuffle(ids.begin(), ids.end(), rng);
        std::sort(ids.begin(), ids.begin() + k);
        for (int j = 0; j < k; ++j) {
          topk[size_t(t) * k + j] = ids[size_t(j)];
          distinct_ckv.insert(L.ckv + int64_t(ids[size_t(j)]) * kHd);
        }
      }
      if (c == 0)
        kv_bytes = double(distinct.size()) * kHd * 4 + double(distinct_ckv.size()) * kHd * 2;
      UF_CUDA_CHECK(cudaMalloc(&dwin[size_t(c)], win.size() * sizeof(const float*)));
      UF_CUDA_CHECK(cudaMemcpy(dwin[size_t(c)], win.data(), win.size() * sizeof(const float*),
                               cudaMemcpyHostToDevice));
      UF_CUDA_CHECK(cudaMalloc(&dtopk[size_t(c)], topk.size() * sizeof(int32_t)));
      UF_CUDA_CHECK(cudaMemcpy(dtopk[size_t(c)], topk.data(), topk.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice));
    }
    const float scale = float(std::pow(double(kHd), -0.5));
    // One layer copy: the reference path in one call, the fast path in groups of rows.
    auto run_one = [&](int c, float* split) {
      const int group = split ? kPrefillGroup : T;
      for (int t0 = 0; t0 < T; t0 += group) {
        const int n = std::min(group, T - t0);
        const int64_t qo = int64_t(t0) * kH * kHd;
        sparse_attn(q + qo, n, kH, kHd, dwin[size_t(c)] + int64_t(t0) * W, W,
                    k > 0 ? dtopk[size_t(c)] + int64_t(t0) * k : nullptr, k, layers[size_t(c)].ckv,
                    sink, scale, out + qo, stream, nullptr, split);
      }
    };
    auto run_all = [&](float* split) {
      for (int c = 0; c < copies; ++c) run_one(c, split);
    };
    // The default records, the CPU-order ones with chunks of 16, and of 32.
    double us[3];
    const int chunk[3] = {0, 0, 32};
    for (int v = 0; v < 3; ++v) {
      sparse_attn_chunk_override(chunk[v]);
      set_sparse_attn_chunk_mma(v == 0);
      cudaGraphExec_t g = uf::bench::capture_graph(stream, [&] { run_all(scratch); });
      us[v] = uf::bench::median_replay_us(g, stream, reps) / copies;
      UF_CUDA_CHECK(cudaGraphExecDestroy(g));
    }
    sparse_attn_chunk_override(0);
    set_sparse_attn_chunk_mma(true);
    const double fast_us = us[0];
    cudaGraphExec_t ref = uf::bench::capture_graph(stream, [&] { run_all(nullptr); });
    const double ref_us = uf::bench::median_replay_us(ref, stream, reps) / copies;
    double mma_us = -1;  // prefill shapes only
    if (T > 8) {
      cudaGraphExec_t g = uf::bench::capture_graph(stream, [&] {
        for (int c = 0; c < copies; ++c)
          sparse_attn_mma(q, T, kH, kHd, dwin[size_t(c)], W, k > 0 ? dtopk[size_t(c)] : nullptr, k,
                          layers[size_t(c)].ckv, sink, scale, out, stream);
      });
      mma_us = uf::bench::median_replay_us(g, stream, reps) / copies;
      UF_CUDA_CHECK(cudaGraphExecDestroy(g));
    }
    const double bytes = kv_bytes + 2.0 * double(T) * kH * kHd * 4;  // KV rows + q + out
    // Sanity (the tests are the real check): copy 0 on both paths, outputs differing in bf16.
    const size_t n_out = size_t(T) * kH * kHd;
    std::vector<float> o_fast(n_out), o_ref(n_out);
    run_one(0, scratch);
    UF_CUDA_CHECK(
        cudaMemcpyAsync(o_fast.data(), out, n_out * sizeof(float), cudaMemcpyDeviceToHost, stream));
    run_one(0, nullptr);
    UF_CUDA_CHECK(
        cudaMemcpyAsync(o_ref.data(), out, n_out * sizeof(float), cudaMemcpyDeviceToHost, stream));
    UF_CUDA_CHECK(cudaStreamSynchronize(stream));
    size_t n_diff = 0;
    double max_abs = 0;
    for (size_t i = 0; i < n_out; ++i) {
      n_diff += o_fast[i] != o_ref[i];
      max_abs = std::max(max_abs, std::fabs(double(o_fast[i]) - o_ref[i]));
    }
    std::printf(
        "%-14s %3d %6d %10.0f %9.2f %8.2f %10.0f %8.2f %8.2f %8.2f %7.1fx %8.2f   "
        "vs ref %zu/%zu differ (%.2f%%), max %.2e\n",
        sh.name, T, W + k, bytes, bytes / kFloorBytesPerUs, fast_us, bytes / fast_us / 1e3, us[1],
        us[2], ref_us, ref_us / fast_us, mma_us, n_diff, n_out,
        100.0 * double(n_diff) / double(n_out), max_abs);
    UF_CUDA_CHECK(cudaGraphExecDestroy(ref));
    for (int c = 0; c < copies; ++c) {
      UF_CUDA_CHECK(cudaFree(dwin[size_t(c)]));
      UF_CUDA_CHECK(cudaFree(dtopk[size_t(c)]));
    }
  }
  for (auto& L : layers) {
    UF_CUDA_CHECK(cudaFree(L.ring));
    UF_CUDA_CHECK(cudaFree(L.ckv));
  }
  UF_CUDA_CHECK(cudaFree(q));
  UF_CUDA_CHECK(cudaFree(out));
  UF_CUDA_CHECK(cudaFree(sink));
  UF_CUDA_CHECK(cudaFree(scratch));
  UF_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
#endif
