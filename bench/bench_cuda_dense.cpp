// bench_cuda_dense: the dense GEMVs of a decode step that used dense_rows (ops/linear.cu, fp32
// FMAs) against DenseMma (kernels/dense_mma.h, tensor cores), at T = 1, 2, 4, 5, 7, 8 rows:
//   head     bf16 [129280, 5120]  (LinearKind::kF32, one call a step)
//   head/8   bf16 [16160, 5120]   (a TP8 rank's split head)
//   router   bf16 [384, 5120]     (ffn.gate, BF16 on disk: spec/model-arch.md)
//   wo_a     fp8  [1024, 4096]    (32x32 E8M0 block scales; one group of a TP8 rank, bf16 out)
//   markov   bf16 [129280, 256]   (DSpark Markov head)
// Each timing is the median CUDA-graph replay of `copies` calls on distinct weight copies (so L2
// holds none of a small weight), divided by the copy count; 200 replays by default. GB/s = bytes
// of the weight (+ scales, x, y) / time; floor = those bytes at 4.1 TB/s. The last column checks
// that both paths agree within 2^-12 of max |y| (a sanity line; the real tests are
// tests/cuda/test_dense_mma.cpp).
//
//   bench_cuda_dense [--reps N]

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
  int copies;
};

}  // namespace

int main(int argc, char** argv) {
  int reps = 200;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs; median of %d graph replays; floor at %.1f TB/s\n", prop.name,
              sms, reps, kFloorBytesPerSec * 1e-12);
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  const Shape shapes[] = {{"head", WFormat::kBF16, 129280, 5120, false, 1},
                          {"head/8", WFormat::kBF16, 16160, 5120, false, 1},
                          {"router", WFormat::kBF16, 384, 5120, false, 16},
                          {"wo_a", WFormat::kFP8, 1024, 4096, true, 16},
                          {"markov", WFormat::kBF16, 129280, 256, false, 2}};
  constexpr int kTmax = 8;
  // x: bf16 values (DenseMma's contract), the largest K.
  const int64_t kx = 5120;
  std::vector<float> hx(size_t(kTmax) * kx);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& v : hx) v = uf::core::round_bf16(nd(rng));
  float *x = nullptr, *y0 = nullptr, *y1 = nullptr;
  UF_CUDA_CHECK(cudaMalloc(&x, hx.size() * sizeof(float)));
  UF_CUDA_CHECK(cudaMemcpy(x, hx.data(), hx.size() * sizeof(float), cudaMemcpyHostToDevice));
  const size_t ymax = size_t(kTmax) * 129280;
  UF_CUDA_CHECK(cudaMalloc(&y0, ymax * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&y1, ymax * sizeof(float)));

  std::printf("\n%-7s %2s %3s %10s %9s %8s %9s %8s %9s %8s %s\n", "shape", "T", "S", "MB",
              "floor us", "mma us", "GB/s", "rows us", "GB/s", "speedup", "agree");
  uint64_t seed = 1;
  for (const Shape& sh : shapes) {
    const bool fp8 = sh.f == WFormat::kFP8;
    const size_t data_bytes = size_t(sh.rows) * size_t(sh.cols) * (fp8 ? 1 : 2);
    const size_t scale_bytes = fp8 ? size_t((sh.rows + 31) / 32) * size_t(sh.cols / 32) : 0;
    std::vector<DeviceWeight> ws;
    std::vector<void*> allocs;
    for (int c = 0; c < sh.copies; ++c) {
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
    const DenseMma mma(ws[0], sms);
    const int64_t N = sh.rows, K = sh.cols;
    for (int T : {1, 2, 4, 5, 7, 8}) {
      const double bytes = double(data_bytes + scale_bytes) + double(T) * double(K + N) * 4.0;
      const float us_mma =
          uf::bench::time_graph_us(s, reps,
                                   [&] {
                                     for (const DeviceWeight& w : ws)
                                       mma.run(w, 0, N, x, K, T, y0, N, sh.round, s);
                                   }) /
          float(sh.copies);
      const float us_rows =
          uf::bench::time_graph_us(s, reps,
                                   [&] {
                                     for (const DeviceWeight& w : ws)
                                       ops_detail::dense_rows(w, 0, N, x, K, T, y1, N, sh.round, s);
                                   }) /
          float(sh.copies);
      // Both graphs ended on the last copy: compare.
      std::vector<float> a(size_t(T) * size_t(N)), b(a.size());
      UF_CUDA_CHECK(cudaMemcpy(a.data(), y0, a.size() * 4, cudaMemcpyDeviceToHost));
      UF_CUDA_CHECK(cudaMemcpy(b.data(), y1, b.size() * 4, cudaMemcpyDeviceToHost));
      float ymax_abs = 0, dmax = 0;
      bool finite = true;
      for (size_t i = 0; i < a.size(); ++i) {
        finite = finite && std::isfinite(a[i]) && std::isfinite(b[i]);
        ymax_abs = std::max(ymax_abs, std::fabs(b[i]));
        dmax = std::max(dmax, std::fabs(a[i] - b[i]));
      }
      const bool agree = finite && dmax <= 0x1p-12f * ymax_abs;
      std::printf("%-7s %2d %3d %10.1f %9.2f %8.2f %9.0f %8.2f %9.0f %7.2fx %s\n", sh.name, T,
                  mma.splits(N), bytes * 1e-6, bytes / kFloorBytesPerSec * 1e6, us_mma,
                  bytes / (double(us_mma) * 1e-6) * 1e-9, us_rows,
                  bytes / (double(us_rows) * 1e-6) * 1e-9, us_rows / us_mma, agree ? "yes" : "NO");
    }
    for (void* p : allocs) UF_CUDA_CHECK(cudaFree(p));
  }
  UF_CUDA_CHECK(cudaFree(x));
  UF_CUDA_CHECK(cudaFree(y0));
  UF_CUDA_CHECK(cudaFree(y1));
  UF_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

#endif
