// bench_cuda_dense: the dense GEMVs of a decode step: DenseMma (kernels/dense_mma.h, tensor
// cores) with its automatic plan ("new": the resident cluster kernel where it fits, session 7)
// against its legacy kernels ("old": DenseMmaPath::kLegacy, session 6) and against dense_rows
// (ops/linear.cu, fp32 FMAs), at T = 1, 2, 4, 5, 7, 8 rows:
//   head     bf16 [129280, 5120]  (LinearKind::kF32, one call a step)
//   head/8   bf16 [16160, 5120]   (a TP8 rank's split head)
//   router   bf16 [384, 5120]     (ffn.gate, BF16 on disk: spec/model-arch.md)
//   wo_a     fp8  [1024, 4096]    (32x32 E8M0 block scales; one group of a TP8 rank, bf16 out)
//   markov   bf16 [129280, 256]   (DSpark Markov head)
// Each timing is the median CUDA-graph replay of `copies` calls on distinct weight copies (>= 600
// MB in all, so L2 holds none of a small weight), divided by the copy count; 200 replays by
// default. GB/s = bytes of the weight (+ scales, x, y) / time; floor = those bytes at 4.1 TB/s.
// C = the automatic plan's resident cluster size (0: the legacy kernel serves the call); c2 / c4
// / c8 = the resident kernel forced to that cluster size ("-": it cannot serve the shape).
// "bits": new and every forced cluster size bitwise equal to old (the tests assert it;
// tests/cuda/test_dense_mma.cpp); "agree": old within 2^-12 of max |y| of dense_rows.
//
// "prefill": wo_a FP8 and a BF16 [1024, 4096] at T = 512 / 2048 rows, the prefill kernel against
// the full-K kernel per 8-row chunk (set_dense_mma_prefill), us and TFLOP/s.
//
//   bench_cuda_dense [--reps N] [--only NAME]

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#ifndef UF_HAVE_CUDA
int main() {
  std::printf("bench_cuda_dense: built without the CUDA backend\n");
  return 0;
}
#else

#include <cuda_runtime.h>

#include "core/dtypes.h"
#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#include "cuda/gemv.h"
#include "cuda/kernels/dense_mma.h"
#include "cuda/ops/linear_kernels.h"
#include "cuda_bench_util.h"

using namespace uf::cuda;
using uf::model::WFormat;

namespace {

constexpr double kFloorBytesPerSec = 4.1e12;

struct Shape {
  const char* name;
  WFormat f;
  int64_t rows, cols;
  bool round;
};

}  // namespace

int main(int argc, char** argv) {
  int reps = 200;
  const char* only = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
  }
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs; median of %d graph replays; floor at %.1f TB/s\n", prop.name,
              sms, reps, kFloorBytesPerSec * 1e-12);
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  const Shape shapes[] = {{"head", WFormat::kBF16, 129280, 5120, false},
                          {"head/8", WFormat::kBF16, 16160, 5120, false},
                          {"router", WFormat::kBF16, 384, 5120, false},
                          {"wo_a", WFormat::kFP8, 1024, 4096, true},
                          {"markov", WFormat::kBF16, 129280, 256, false}};
  constexpr int kTmax = 8;
  constexpr double kMinTotalBytes = 600e6;
  // x: bf16 values (DenseMma's contract), the largest K.
  const int64_t kx = 5120;
  std::vector<float> hx(size_t(kTmax) * kx);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& v : hx) v = uf::core::round_bf16(nd(rng));
  float* x = nullptr;
  UF_CUDA_CHECK(cudaMalloc(&x, hx.size() * sizeof(float)));
  UF_CUDA_CHECK(cudaMemcpy(x, hx.data(), hx.size() * sizeof(float), cudaMemcpyHostToDevice));
  const size_t ymax = size_t(kTmax) * 129280;
  float* ybuf[4] = {};  // new, old, dense_rows, forced cluster
  for (float*& y : ybuf) UF_CUDA_CHECK(cudaMalloc(&y, ymax * sizeof(float)));

  std::printf("\n%-7s %2s %3s %2s %7s %6s %4s %8s %6s %8s %6s %6s %8s %6s %6s %6s %4s %s\n",
              "shape", "T", "S", "C", "MB", "copies", "", "floor us", "new us", "GB/s", "old us",
              "GB/s", "old/new", "rows us", "c2 us", "c4 us", "c8 us", "bits agree");
  uint64_t seed = 1;
  for (const Shape& sh : shapes) {
    if (only && std::strcmp(only, sh.name) != 0) continue;
    const bool fp8 = sh.f == WFormat::kFP8;
    const size_t data_bytes = size_t(sh.rows) * size_t(sh.cols) * (fp8 ? 1 : 2);
    const size_t scale_bytes = fp8 ? size_t((sh.rows + 31) / 32) * size_t(sh.cols / 32) : 0;
    const int copies =
        std::max(1, int(std::ceil(kMinTotalBytes / double(data_bytes + scale_bytes))));
    std::vector<DeviceWeight> ws;
    std::vector<void*> allocs;
    for (int c = 0; c < copies; ++c) {
      DeviceWeight w;
      w.format = sh.f;
      w.rows = sh.rows;
      w.cols = sh.cols;
      void* d = nullptr;
      UF_CUDA_CHECK(cudaMalloc(&d, data_bytes));
      allocs.push_back(d);
      if (fp8) {
        fill_random_e4m3(static_cast<uint8_t*>(d), data_bytes, seed++, s);
        void* sc = nullptr;
        UF_CUDA_CHECK(cudaMalloc(&sc, scale_bytes));
        allocs.push_back(sc);
        fill_random_bytes(static_cast<uint8_t*>(sc), scale_bytes, seed++, 118, 122, s);
        w.scale = static_cast<const uint8_t*>(sc);
      } else {
        fill_random_bf16(static_cast<uint16_t*>(d), data_bytes / 2, seed++, 0.05f, s);
      }
      w.data = static_cast<const uint8_t*>(d);
      ws.push_back(w);
    }
    UF_CUDA_CHECK(cudaStreamSynchronize(s));
    const DenseMma mma_new(ws[0], sms);
    const DenseMma mma_old(ws[0], sms, DenseMmaPath::kLegacy);
    const int64_t N = sh.rows, K = sh.cols;
    for (int T : {1, 2, 4, 5, 7, 8}) {
      const double bytes = double(data_bytes + scale_bytes) + double(T) * double(K + N) * 4.0;
      auto time_plan = [&](const DenseMma& plan, float* y) {
        return uf::bench::time_graph_us(s, reps,
                                        [&] {
                                          for (const DeviceWeight& w : ws)
                                            plan.run(w, 0, N, x, K, T, y, N, sh.round, s);
                                        }) /
               float(copies);
      };
      auto download = [&](const float* y) {
        std::vector<float> v(size_t(T) * size_t(N));
        UF_CUDA_CHECK(cudaMemcpy(v.data(), y, v.size() * 4, cudaMemcpyDeviceToHost));
        return v;
      };
      auto bitwise = [](const std::vector<float>& a, const std::vector<float>& b) {
        return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
      };
      const float us_new = time_plan(mma_new, ybuf[0]);
      const float us_old = time_plan(mma_old, ybuf[1]);
      const float us_rows =
          uf::bench::time_graph_us(s, reps,
                                   [&] {
                                     for (const DeviceWeight& w : ws)
                                       ops_detail::dense_rows(w, 0, N, x, K, T, ybuf[2], N,
                                                              sh.round, s);
                                   }) /
          float(copies);
      // Every graph ended on the last copy: compare.
      const std::vector<float> a = download(ybuf[0]), b = download(ybuf[1]), r = download(ybuf[2]);
      bool bits = bitwise(a, b);
      char forced[3][16];
      const int cls[3] = {2, 4, 8};
      for (int i = 0; i < 3; ++i) {
        const DenseMma plan(ws[0], sms, DenseMmaPath::kAuto, cls[i]);
        if (plan.resident_cluster(N) == 0) {
          std::snprintf(forced[i], sizeof(forced[i]), "-");
          continue;
        }
        std::snprintf(forced[i], sizeof(forced[i]), "%.2f", double(time_plan(plan, ybuf[3])));
        bits = bits && bitwise(download(ybuf[3]), b);
      }
      float ymax_abs = 0, dmax = 0;
      bool finite = true;
      for (size_t i = 0; i < b.size(); ++i) {
        finite = finite && std::isfinite(b[i]) && std::isfinite(r[i]);
        ymax_abs = std::max(ymax_abs, std::fabs(r[i]));
        dmax = std::max(dmax, std::fabs(b[i] - r[i]));
      }
      const bool agree = finite && dmax <= 0x1p-12f * ymax_abs;
      std::printf(
          "%-7s %2d %3d %2d %7.1f %6d %4s %8.2f %6.2f %8.0f %6.2f %6.0f %7.2fx %6.2f %6s %6s %6s "
          "%4s %s\n",
          sh.name, T, mma_new.splits(N), mma_new.resident_cluster(N), bytes * 1e-6, copies, "",
          bytes / kFloorBytesPerSec * 1e6, us_new, bytes / (double(us_new) * 1e-6) * 1e-9, us_old,
          bytes / (double(us_old) * 1e-6) * 1e-9, us_old / us_new, us_rows, forced[0], forced[1],
          forced[2], bits ? "yes" : "NO", agree ? "yes" : "NO");
    }
    for (void* p : allocs) UF_CUDA_CHECK(cudaFree(p));
  }
  // Prefill chunks (m > 8): dense_mma_prefill_kernel ("new", the default) against the full-K
  // kernel per 8-row chunk ("old", set_dense_mma_prefill(false)) at T = 512 and 2048 rows, one
  // weight (re-read from L2 by every CTA either way), bf16 out; "bits": new == old bitwise.
  std::printf("\n%-10s %5s %9s %8s %9s %8s %8s %s\n", "prefill", "T", "old us", "TFLOP/s", "new us",
              "TFLOP/s", "old/new", "bits");
  const Shape pshapes[] = {{"wo_a fp8", WFormat::kFP8, 1024, 4096, true},
                           {"bf16 1024", WFormat::kBF16, 1024, 4096, true}};
  for (const Shape& sh : pshapes) {
    const bool fp8 = sh.f == WFormat::kFP8;
    const int64_t N = sh.rows, K = sh.cols;
    DeviceWeight w;
    w.format = sh.f;
    w.rows = N;
    w.cols = K;
    const size_t data_bytes = size_t(N) * size_t(K) * (fp8 ? 1 : 2);
    void* d = nullptr;
    void* sc = nullptr;
    UF_CUDA_CHECK(cudaMalloc(&d, data_bytes));
    if (fp8) {
      const size_t scale_bytes = size_t((N + 31) / 32) * size_t(K / 32);
      fill_random_e4m3(static_cast<uint8_t*>(d), data_bytes, seed++, s);
      UF_CUDA_CHECK(cudaMalloc(&sc, scale_bytes));
      fill_random_bytes(static_cast<uint8_t*>(sc), scale_bytes, seed++, 118, 122, s);
      w.scale = static_cast<const uint8_t*>(sc);
    } else {
      fill_random_bf16(static_cast<uint16_t*>(d), data_bytes / 2, seed++, 0.05f, s);
    }
    w.data = static_cast<const uint8_t*>(d);
    const DenseMma plan(w, sms);
    for (const int T : {512, 2048}) {
      std::vector<float> hpx(size_t(T) * size_t(K));
      for (float& v : hpx) v = uf::core::round_bf16(nd(rng));
      float* px = nullptr;
      float* py[2] = {};
      UF_CUDA_CHECK(cudaMalloc(&px, hpx.size() * sizeof(float)));
      UF_CUDA_CHECK(cudaMemcpy(px, hpx.data(), hpx.size() * sizeof(float), cudaMemcpyHostToDevice));
      for (float*& y : py) UF_CUDA_CHECK(cudaMalloc(&y, size_t(T) * size_t(N) * sizeof(float)));
      auto time_path = [&](bool on, float* y) {
        set_dense_mma_prefill(on);
        const float us = uf::bench::time_graph_us(
            s, std::min(reps, 50), [&] { plan.run(w, 0, N, px, K, T, y, N, sh.round, s); });
        set_dense_mma_prefill(true);
        return us;
      };
      const float us_old = time_path(false, py[1]), us_new = time_path(true, py[0]);
      std::vector<float> a(size_t(T) * size_t(N)), b(a.size());
      UF_CUDA_CHECK(cudaMemcpy(a.data(), py[0], a.size() * 4, cudaMemcpyDeviceToHost));
      UF_CUDA_CHECK(cudaMemcpy(b.data(), py[1], b.size() * 4, cudaMemcpyDeviceToHost));
      const bool bits = std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
      const double flop = 2.0 * double(T) * double(N) * double(K);
      std::printf("%-10s %5d %9.2f %8.1f %9.2f %8.1f %7.2fx %s\n", sh.name, T, us_old,
                  flop / (double(us_old) * 1e-6) * 1e-12, us_new,
                  flop / (double(us_new) * 1e-6) * 1e-12, us_old / us_new, bits ? "yes" : "NO");
      UF_CUDA_CHECK(cudaFree(px));
      for (float* y : py) UF_CUDA_CHECK(cudaFree(y));
    }
    UF_CUDA_CHECK(cudaFree(d));
    if (sc) UF_CUDA_CHECK(cudaFree(sc));
  }

  UF_CUDA_CHECK(cudaFree(x));
  for (float* y : ybuf) UF_CUDA_CHECK(cudaFree(y));
  UF_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

#endif
