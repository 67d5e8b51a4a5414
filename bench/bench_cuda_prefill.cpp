// bench_cuda_prefill: the FP8 linears of one TP8 rank at prefill sizes (T = 64, 512 rows): the
// prefill GEMM (act_quant_fp8_rows + fp8_gemm_prefill, what DeviceLinear::apply runs for T > 8)
// against the decode GEMV run by chunks of 8 rows (Fp8Gemv::run_fused, the path before the GEMM).
// Prints us per call, TFLOP/s (2 T N K), the weight bytes / time (GB/s), the speedup, and whether
// the two outputs are bitwise equal (they must be: the GEMM keeps the GEMV's split order).
// Second section: the GEMM kernels alone on pre-quantised rows (M = 512, 2048), legacy (the
// emulated e4m3 mma.sync, fp8_gemm_set_legacy(true)) against the f16 kernel (the default): us per
// call from graph replay, TFLOP/s (2 M N K), the speedup over legacy and whether the outputs are
// bitwise equal. Third section: the bf16 GEMM (DeviceLinear's default prefill path) with each CTA
// tile, and its activation QDQ.
// Runs in seconds: bench_cuda_prefill [iterations, default 20].

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#ifndef UF_HAVE_CUDA
int main() {
  std::printf("bench_cuda_prefill: built without the CUDA backend\n");
  return 0;
}
#else

#include <cuda_runtime.h>

#include <cstring>

#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#include "cuda/gemv.h"
#include "cuda/prefill_gemm.h"
#include "cuda_bench_util.h"

using namespace uf::cuda;

namespace {

struct Shape {
  const char* name;
  int n, k;
};

// bench_cuda_decode's TP8 rank plan.
constexpr Shape kShapes[] = {
    {"wq_a|wkv-ish [1280,5120]", 1280, 5120},
    {"wq_b [4096,1280]", 4096, 1280},
    {"wkv [512,5120]", 512, 5120},
    {"wo_b [5120,1024]", 5120, 1024},
    {"shared w13 [576,5120]", 576, 5120},
    {"wo_a [1024,4096]", 1024, 4096},
    {"engram wkv [3200,6144]", 3200, 6144},
    {"engram full [25600,6144]", 25600, 6144},
};

template <typename F>
float time_us(F&& f, int iters) {
  cudaEvent_t a, b;
  UF_CUDA_CHECK(cudaEventCreate(&a));
  UF_CUDA_CHECK(cudaEventCreate(&b));
  f();  // warm-up
  UF_CUDA_CHECK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) f();
  UF_CUDA_CHECK(cudaEventRecord(b));
  UF_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  UF_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  UF_CUDA_CHECK(cudaEventDestroy(a));
  UF_CUDA_CHECK(cudaEventDestroy(b));
  return ms * 1000.f / float(iters);
}

// us per call of f: a CUDA graph of iters calls (cuda_bench_util.h: median of 5 replays).
template <typename F>
float graph_us(F&& f, int iters) {
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  f(s);  // warm-up outside the capture (function attributes)
  UF_CUDA_CHECK(cudaStreamSynchronize(s));
  const float us = uf::bench::time_graph_us(s, 5, [&] {
    for (int i = 0; i < iters; ++i) f(s);
  });
  UF_CUDA_CHECK(cudaStreamDestroy(s));
  return us / float(iters);
}

// The GEMM kernels alone: legacy / f16 at the rank-slice shapes, M = 512 and 2048 (wkv and the
// shared expert's w1 | w3 take the small-grid blocks).
void kernel_section(int iters, int sms) {
  constexpr Shape kKernelShapes[] = {
      {"wq_a|wkv [1792,5120]", 1792, 5120},   {"wq_b [4096,1280]", 4096, 1280},
      {"wo_b [5120,1024]", 5120, 1024},       {"shared w2 [5120,288]", 5120, 288},
      {"engram wkv [3200,6144]", 3200, 6144}, {"engram full [25600,6144]", 25600, 6144},
      {"wkv [512,5120]", 512, 5120},          {"shared w13 [576,5120]", 576, 5120},
  };
  constexpr int kKernels = 2;  // legacy, f16
  std::printf(
      "\nGEMM kernels alone (graph replay of %d calls, pre-quantised rows; x = speedup "
      "over legacy)\n",
      iters);
  std::printf("%-26s %4s | %8s %6s", "shape", "M", "legacy", "TF/s");
  std::printf(" | %8s %6s %5s", "f16 us", "TF/s", "x");
  std::printf(" | bitwise\n");
  uint64_t seed = 1000;
  for (const Shape& s : kKernelShapes) {
    const int mmax = 2048;
    const size_t wbytes = size_t(s.n) * s.k, sbytes = size_t((s.n + 31) / 32) * (s.k / 32);
    uint8_t *w = nullptr, *ws = nullptr, *codes = nullptr;
    float *x = nullptr, *scales = nullptr, *y[kKernels] = {};
    UF_CUDA_CHECK(cudaMalloc(&w, wbytes));
    UF_CUDA_CHECK(cudaMalloc(&ws, sbytes));
    UF_CUDA_CHECK(cudaMalloc(&x, sizeof(float) * mmax * s.k));
    UF_CUDA_CHECK(cudaMalloc(&codes, size_t(mmax) * s.k));
    UF_CUDA_CHECK(cudaMalloc(&scales, sizeof(float) * mmax * (s.k / 32)));
    for (auto& p : y) UF_CUDA_CHECK(cudaMalloc(&p, sizeof(float) * mmax * s.n));
    fill_random_e4m3(w, wbytes, seed++, nullptr);
    fill_random_bytes(ws, sbytes, seed++, 118, 124, nullptr);
    fill_random_f32(x, size_t(mmax) * s.k, seed++, 4.f, nullptr);
    act_quant_fp8_rows(x, s.k, mmax, s.k, codes, scales, nullptr);
    UF_CUDA_CHECK(cudaDeviceSynchronize());
    const Fp8Gemv plan(s.n, s.k, sms);
    const Fp8WeightView wv{w, ws, s.n, s.k};
    for (int m : {512, 2048}) {
      float us[kKernels];
      for (int v = 0; v < kKernels; ++v) {
        fp8_gemm_set_legacy(v == 0);
        us[v] = graph_us(
            [&](cudaStream_t st) {
              fp8_gemm_prefill(wv, QuantActView{codes, scales, m, s.k}, plan.kb_per_split(), y[v],
                               true, st);
            },
            iters);
      }
      fp8_gemm_set_legacy(false);
      UF_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> o[kKernels];
      bool same = true;
      for (int v = 0; v < kKernels; ++v) {
        o[v].resize(size_t(m) * s.n);
        UF_CUDA_CHECK(cudaMemcpy(o[v].data(), y[v], o[v].size() * 4, cudaMemcpyDeviceToHost));
        same = same && std::memcmp(o[0].data(), o[v].data(), o[0].size() * 4) == 0;
      }
      const double tf = 2.0 * m * double(s.n) * s.k * 1e-6;
      std::printf("%-26s %4d | %8.1f %6.1f", s.name, m, us[0], tf / us[0]);
      for (int v = 1; v < kKernels; ++v)
        std::printf(" | %8.1f %6.1f %5.2f", us[v], tf / us[v], us[0] / us[v]);
      std::printf(" | %s\n", same ? "yes" : "NO");
    }
    cudaFree(w);
    cudaFree(ws);
    cudaFree(x);
    cudaFree(codes);
    cudaFree(scales);
    for (auto* p : y) cudaFree(p);
  }
}

// The bf16 GEMM (DeviceLinear's default prefill path: act_qdq_fp8_bf16_rows + bf16_gemm on the
// weight's bf16 copy) at the same shapes: the GEMM alone with each CTA tile and the automatic
// choice, the activation QDQ alone, and the split count; us per call from graph replay.
void bf16_section(int iters) {
  constexpr Shape kShapes16[] = {
      {"wq_a [1280,5120]", 1280, 5120},       {"wkv [512,5120]", 512, 5120},
      {"wq_b [4096,1280]", 4096, 1280},       {"wo_b [5120,1024]", 5120, 1024},
      {"shared w1 [288,5120]", 288, 5120},    {"shared w2 [5120,288]", 5120, 288},
      {"engram wkv [3200,6144]", 3200, 6144}, {"wo_a [1024,4096]", 1024, 4096},
  };
  std::printf("\nbf16 GEMM (graph replay of %d calls; TF/s = 2 M N K / time)\n", iters);
  std::printf("%-24s %4s %6s | %8s %6s | %8s %6s | %8s %6s | %7s\n", "shape", "M", "splits",
              "small us", "TF/s", "large us", "TF/s", "auto us", "TF/s", "qdq us");
  uint64_t seed = 5000;
  for (const Shape& s : kShapes16) {
    const int mmax = 2048;
    uint16_t *w = nullptr, *a = nullptr;
    float *x = nullptr, *y = nullptr;
    UF_CUDA_CHECK(cudaMalloc(&w, sizeof(uint16_t) * s.n * s.k));
    UF_CUDA_CHECK(cudaMalloc(&a, sizeof(uint16_t) * mmax * s.k));
    UF_CUDA_CHECK(cudaMalloc(&x, sizeof(float) * mmax * s.k));
    UF_CUDA_CHECK(cudaMalloc(&y, sizeof(float) * mmax * s.n));
    fill_random_f32(x, size_t(mmax) * s.k, seed++, 4.f, nullptr);
    act_qdq_fp8_bf16_rows(x, s.k, mmax, s.k, a, nullptr);
    // Any bf16 bits will do for timing: the activations' QDQ values as the weight too.
    UF_CUDA_CHECK(
        cudaMemcpy(w, a, sizeof(uint16_t) * std::min(s.n, mmax) * s.k, cudaMemcpyDeviceToDevice));
    UF_CUDA_CHECK(cudaDeviceSynchronize());
    for (int m : {512, 2048}) {
      float us[3];
      for (int tile = 1; tile <= 3; ++tile) {
        bf16_gemm_force_tile(tile % 3);
        us[tile - 1] = graph_us(
            [&](cudaStream_t st) { bf16_gemm(a, w, m, s.n, s.k, y, s.n, true, st); }, iters);
      }
      bf16_gemm_force_tile(0);
      const float qdq =
          graph_us([&](cudaStream_t st) { act_qdq_fp8_bf16_rows(x, s.k, m, s.k, a, st); }, iters);
      const double tf = 2.0 * m * double(s.n) * s.k * 1e-6;
      std::printf("%-24s %4d %6d | %8.1f %6.1f | %8.1f %6.1f | %8.1f %6.1f | %7.1f\n", s.name, m,
                  bf16_gemm_splits(s.n, s.k), us[0], tf / us[0], us[1], tf / us[1], us[2],
                  tf / us[2], qdq);
    }
    cudaFree(w);
    cudaFree(a);
    cudaFree(x);
    cudaFree(y);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::max(1, std::atoi(argv[1])) : 20;
  const int sms = device_sm_count();
  std::printf("%-28s %5s %10s %8s %8s | %10s %8s | %7s %s\n", "shape", "T", "gemm us", "TFLOP/s",
              "w GB/s", "gemv8 us", "TFLOP/s", "speedup", "bitwise");
  uint64_t seed = 1;
  for (const Shape& s : kShapes) {
    const size_t wbytes = size_t(s.n) * s.k, sbytes = size_t((s.n + 31) / 32) * (s.k / 32);
    uint8_t *w = nullptr, *ws = nullptr, *codes = nullptr;
    float *x = nullptr, *scales = nullptr, *y0 = nullptr, *y1 = nullptr;
    const int tmax = 512;
    UF_CUDA_CHECK(cudaMalloc(&w, wbytes));
    UF_CUDA_CHECK(cudaMalloc(&ws, sbytes));
    UF_CUDA_CHECK(cudaMalloc(&x, sizeof(float) * tmax * s.k));
    UF_CUDA_CHECK(cudaMalloc(&codes, size_t(tmax) * s.k));
    UF_CUDA_CHECK(cudaMalloc(&scales, sizeof(float) * tmax * (s.k / 32)));
    UF_CUDA_CHECK(cudaMalloc(&y0, sizeof(float) * tmax * s.n));
    UF_CUDA_CHECK(cudaMalloc(&y1, sizeof(float) * tmax * s.n));
    fill_random_e4m3(w, wbytes, seed++, nullptr);
    fill_random_bytes(ws, sbytes, seed++, 118, 124, nullptr);
    fill_random_f32(x, size_t(tmax) * s.k, seed++, 4.f, nullptr);
    const Fp8Gemv plan(s.n, s.k, sms);
    const Fp8WeightView wv{w, ws, s.n, s.k};
    for (int T : {64, 512}) {
      auto gemm = [&] {
        act_quant_fp8_rows(x, s.k, T, s.k, codes, scales, nullptr);
        fp8_gemm_prefill(wv, QuantActView{codes, scales, T, s.k}, plan.kb_per_split(), y0, true,
                         nullptr);
      };
      auto gemv = [&] {
        for (int t0 = 0; t0 < T; t0 += kMaxDecodeRows)
          plan.run_fused(wv, x + size_t(t0) * s.k, s.k, std::min(kMaxDecodeRows, T - t0),
                         y1 + size_t(t0) * s.n, true, nullptr, nullptr);
      };
      const float us_gemm = time_us(gemm, iters), us_gemv = time_us(gemv, iters);
      UF_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> a(size_t(T) * s.n), b(a.size());
      UF_CUDA_CHECK(cudaMemcpy(a.data(), y0, a.size() * 4, cudaMemcpyDeviceToHost));
      UF_CUDA_CHECK(cudaMemcpy(b.data(), y1, b.size() * 4, cudaMemcpyDeviceToHost));
      const bool same = std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
      const double flop = 2.0 * T * double(s.n) * s.k;
      std::printf("%-28s %5d %10.1f %8.1f %8.0f | %10.1f %8.1f | %7.2f %s\n", s.name, T, us_gemm,
                  flop / us_gemm * 1e-6, double(wbytes) / us_gemm * 1e-3, us_gemv,
                  flop / us_gemv * 1e-6, us_gemv / us_gemm, same ? "yes" : "NO");
    }
    cudaFree(w);
    cudaFree(ws);
    cudaFree(x);
    cudaFree(codes);
    cudaFree(scales);
    cudaFree(y0);
    cudaFree(y1);
  }
  kernel_section(std::max(iters, 20), sms);
  bf16_section(std::max(iters, 20));
  return 0;
}

#endif
