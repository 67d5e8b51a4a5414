// bench_cuda_router: the MoE router of a decode chunk alone (ops/moe_ops.cu, moe_router_run):
// gate bf16 [384, 5120] (ffn.gate), sqrt-softplus scores, top-6 routing, FP8 quantisation of x,
// at T = 1, 4, 7, 8 rows, three variants side by side:
//   new   moe_router2_kernel (DeviceMoe's default since session 7)
//   prev  moe_router_kernel (the one-launch router it replaced; set_moe_router_variant(1))
//   leg   dense_rows gate GEMV + route_quant_kernel (DeviceMoe::set_legacy's path, 2 launches)
// "us": the median CUDA-graph replay of `copies` calls on distinct gate copies (>= 600 MB in all,
// so L2 holds none of them), divided by the copy count (back-to-back calls: PDL lets a call's
// gate loads overlap the previous call, as in the decode graph behind the previous kernel);
// "1call": the median replay of a graph of ONE call (gate warm in L2: launch + latency). GB/s =
// (gate + x) bytes / us; floor = those bytes at 4.1 TB/s. "bits": new and prev bitwise equal to
// leg in scores, expert ids and weights, FP8 codes and scales (the tests assert it:
// tests/cuda/test_ops_moe_router.cpp).
//
//   bench_cuda_router [--reps N]

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifndef UF_HAVE_CUDA
int main() {
  std::printf("bench_cuda_router: built without the CUDA backend\n");
  return 0;
}
#else

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#include "cuda/device_weights.h"
#include "cuda/ops/moe.h"
#include "cuda_bench_util.h"

using namespace uf::cuda;

namespace {

constexpr double kFloorBytesPerSec = 4.1e12;
constexpr int kVariants = 3;
const char* const kNames[kVariants] = {"new", "prev", "leg"};

struct Outs {  // one variant's outputs
  float* scores = nullptr;
  float* probs = nullptr;
  int* counter = nullptr;
  int32_t* gi = nullptr;
  float* gw = nullptr;
  uint8_t* codes = nullptr;
  float* xs = nullptr;
};

template <typename T>
std::vector<T> to_host(const T* p, size_t n) {
  std::vector<T> v(n);
  UF_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 200;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; median of %d graph replays; floor at %.1f TB/s\n", prop.name,
              prop.multiProcessorCount, reps, kFloorBytesPerSec * 1e-12);
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  const int E = 384, K = 6, D = 5120;
  MoeShape shape;
  shape.dim = D;
  shape.inter = 32;
  shape.n_experts = E;
  shape.top_k = K;
  shape.score_func = "sqrtsoftplus";
  shape.gate_temp = 1.f;
  shape.route_scale = 2.5f;
  const size_t gate_bytes = size_t(E) * D * 2;
  const int copies = std::max(1, int(std::ceil(600e6 / double(gate_bytes))));
  std::vector<DeviceWeight> ws;
  std::vector<void*> allocs;
  for (int c = 0; c < copies; ++c) {
    void* d = nullptr;
    UF_CUDA_CHECK(cudaMalloc(&d, gate_bytes));
    allocs.push_back(d);
    fill_random_bf16(static_cast<uint16_t*>(d), gate_bytes / 2, 100 + uint64_t(c), 0.02f, s);
    DeviceWeight w;
    w.format = uf::model::WFormat::kBF16;
    w.rows = E;
    w.cols = D;
    w.data = static_cast<const uint8_t*>(d);
    ws.push_back(w);
  }
  float *x = nullptr, *bias = nullptr;
  UF_CUDA_CHECK(cudaMalloc(&x, size_t(8) * D * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&bias, size_t(E) * sizeof(float)));
  fill_random_f32(x, size_t(8) * D, 7, 2.f, s);
  fill_random_f32(bias, size_t(E), 8, 0.05f, s);
  Outs o[kVariants];
  for (Outs& v : o) {
    UF_CUDA_CHECK(cudaMalloc(&v.scores, size_t(8) * E * sizeof(float)));
    UF_CUDA_CHECK(cudaMalloc(&v.probs, size_t(8) * E * sizeof(float)));
    UF_CUDA_CHECK(cudaMalloc(&v.counter, sizeof(int)));
    UF_CUDA_CHECK(cudaMemset(v.counter, 0, sizeof(int)));
    UF_CUDA_CHECK(cudaMalloc(&v.gi, size_t(8) * K * sizeof(int32_t)));
    UF_CUDA_CHECK(cudaMalloc(&v.gw, size_t(8) * K * sizeof(float)));
    UF_CUDA_CHECK(cudaMalloc(&v.codes, size_t(8) * D));
    UF_CUDA_CHECK(cudaMalloc(&v.xs, size_t(8) * D / 32 * sizeof(float)));
  }
  UF_CUDA_CHECK(cudaStreamSynchronize(s));

  std::printf("\ngate bf16 [%d, %d], top-%d, %d copies (%.0f MB)\n", E, D, K, copies,
              double(gate_bytes) * copies * 1e-6);
  std::printf("%2s %8s %8s %8s %6s %8s %6s %8s %6s %9s %8s %8s %s\n", "T", "floor us", "new us",
              "GB/s", "prev us", "GB/s", "leg us", "GB/s", "prev/new", "new 1call", "prev 1c",
              "leg 1c", "bits");
  for (int T : {1, 4, 7, 8}) {
    const double bytes = double(gate_bytes) + double(T) * D * 4.0;
    float us[kVariants], one[kVariants];
    for (int v = 0; v < kVariants; ++v) {
      const Outs& q = o[v];
      auto call = [&](const DeviceWeight& w) {
        moe_router_run(v, shape, w, bias, x, T, q.scores, q.probs, q.counter, q.gi, q.gw, q.codes,
                       q.xs, s);
      };
      one[v] = uf::bench::time_graph_us(s, reps, [&] { call(ws[0]); });
      us[v] = uf::bench::time_graph_us(s, reps,
                                       [&] {
                                         for (const DeviceWeight& w : ws) call(w);
                                       }) /
              float(copies);
    }
    // Every graph ended on the last copy: compare (the single-call graphs ran before on copy 0).
    bool bits = true;
    for (int v = 0; v < kVariants; ++v) {
      const Outs& q = o[v];
      moe_router_run(v, shape, ws.back(), bias, x, T, q.scores, q.probs, q.counter, q.gi, q.gw,
                     q.codes, q.xs, s);
    }
    UF_CUDA_CHECK(cudaStreamSynchronize(s));
    auto same = [&](auto get, size_t n) {
      const auto ref = to_host(get(o[2]), n);
      for (int v = 0; v < 2; ++v) {
        const auto a = to_host(get(o[v]), n);
        if (std::memcmp(a.data(), ref.data(), n * sizeof(ref[0])) != 0) return false;
      }
      return true;
    };
    bits = bits && same([](const Outs& q) { return q.scores; }, size_t(T) * E);
    bits = bits && same([](const Outs& q) { return q.gi; }, size_t(T) * K);
    bits = bits && same([](const Outs& q) { return q.gw; }, size_t(T) * K);
    bits = bits && same([](const Outs& q) { return q.codes; }, size_t(T) * D);
    bits = bits && same([](const Outs& q) { return q.xs; }, size_t(T) * D / 32);
    auto gbs = [&](float u) { return bytes / (double(u) * 1e-6) * 1e-9; };
    std::printf("%2d %8.2f %8.2f %8.0f %6.2f %8.0f %6.2f %8.0f %7.2fx %9.2f %8.2f %8.2f %s\n", T,
                bytes / kFloorBytesPerSec * 1e6, us[0], gbs(us[0]), us[1], gbs(us[1]), us[2],
                gbs(us[2]), us[1] / us[0], one[0], one[1], one[2], bits ? "yes" : "NO");
  }
  for (void* p : allocs) UF_CUDA_CHECK(cudaFree(p));
  for (Outs& v : o)
    for (void* p :
         {static_cast<void*>(v.scores), static_cast<void*>(v.probs), static_cast<void*>(v.counter),
          static_cast<void*>(v.gi), static_cast<void*>(v.gw), static_cast<void*>(v.codes),
          static_cast<void*>(v.xs)})
      UF_CUDA_CHECK(cudaFree(p));
  UF_CUDA_CHECK(cudaFree(x));
  UF_CUDA_CHECK(cudaFree(bias));
  UF_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

#endif
