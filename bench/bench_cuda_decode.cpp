// bench_cuda_decode: the GEMV part of one decode step of DeepSeek-V4.1-Flash, as one rank of an
// 8-GPU tensor-parallel server holds it, on one GPU, replayed as a CUDA graph for 1..8 rows,
// against the memory floor (bytes the step must read / device-to-device copy bandwidth measured
// here). Also per-kernel rows (GB/s beside the copy bandwidth) and the sampler.
//
// TP8 plan (per rank, per backbone layer; model-arch.md dims):
//   attention wq_a [1280, 5120] split by output rows: 160 rows (then all-gather, q_norm)
//             wq_b [32768, 1280] by heads: 64/8 = 8 heads = 4096 rows
//             wkv  [512, 5120] replicated (1 KV head: KV is replicated)
//             wo_a [8 groups x 1024, 4096]: group g on rank g = the rank's 8 heads: [1024, 4096]
//             wo_b [5120, 8192] split along K: [5120, 1024] (then all-reduce)
//   indexer   wq_b [32 x 128, 1280] by heads: 4 heads = [512, 1280], on the 8 index layers
//   shared expert: intermediate 2304 / 8 = 288: w1|w3 stacked [576, 5120], w2 [5120, 288]
//   routed experts: all 384 experts, each sliced 2304 / 8 = 288 (w1/w3 [288, 5120] FP4,
//             w2 [5120, 288] FP4); the rows' top-6 (random, distinct per row) are run.
//   engram wkv [25600, 6144] split by rows: [3200, 6144] on layers 1 and 14.
// Included per step: activation FP8 quantization before every GEMV (stands in for the norm /
// epilogue kernels that would produce it), all the FP8 GEMVs above, shared-expert SwiGLU, routed
// MoE (w13 + SwiGLU + quant, w2, combine).
// Not included: attention itself, the indexer scoring/top-k, compressor (BF16), mHC (FP32
// hc_fn), router GEMV (BF16), embedding/head (BF16 vocab slice), DSpark layers, NCCL
// collectives, norms and RoPE. The floor counts exactly the bytes of the included GEMVs.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#ifndef UF_HAVE_CUDA
int main() {
  std::printf("bench_cuda_decode: built without the CUDA backend\n");
  return 0;
}
#else

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#include "cuda/gemv.h"
#include "cuda/moe.h"
#include "cuda/sampling.h"
#include "cuda_bench_util.h"

using namespace uf::cuda;

namespace {

constexpr int kDim = 5120, kQRank = 160, kQLora = 1280, kWqB = 4096, kKv = 512;
constexpr int kWoA = 1024, kWoAIn = 4096, kWoBIn = 1024, kInter = 288, kExperts = 384;
constexpr int kTopk = 6, kIdxQ = 512, kEngramRows = 3200, kEngramIn = 6144;
constexpr float kSwigluLimit = 10.0f;

uint64_t g_seed = 1;

struct Arena {
  std::vector<void*> ptrs;
  size_t bytes = 0;
  uint8_t* bytes_of(size_t n) {
    void* p = nullptr;
    UF_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 16)));
    ptrs.push_back(p);
    bytes += n;
    return static_cast<uint8_t*>(p);
  }
  ~Arena() {
    for (void* p : ptrs) cudaFree(p);
  }
};

struct Fp8W {
  Fp8WeightView v;
  size_t bytes() const { return size_t(v.n) * v.k + size_t((v.n + 31) / 32) * (v.k / 32); }
};

Fp8W make_fp8(Arena& a, int n, int k) {
  uint8_t* w = a.bytes_of(size_t(n) * k);
  uint8_t* s = a.bytes_of(size_t((n + 31) / 32) * (k / 32));
  fill_random_e4m3(w, size_t(n) * k, g_seed++, nullptr);
  fill_random_bytes(s, size_t((n + 31) / 32) * (k / 32), g_seed++, 118, 124, nullptr);
  return {{w, s, n, k}};
}

struct Experts {
  Fp4ExpertsView v;
  // Bytes of one expert's slice (weights + scales).
  static size_t expert_bytes() {
    return 2 * (size_t(kInter) * kDim / 2 + size_t(kInter) * kDim / 32) +
           size_t(kDim) * kInter / 2 + size_t(kDim) * kInter / 32;
  }
};

Experts make_experts(Arena& a) {
  const size_t w13 = size_t(kExperts) * kInter * kDim / 2,
               s13 = size_t(kExperts) * kInter * kDim / 32;
  const size_t w2 = size_t(kExperts) * kDim * kInter / 2,
               s2 = size_t(kExperts) * kDim * kInter / 32;
  Experts e{};
  uint8_t* p[6] = {a.bytes_of(w13), a.bytes_of(s13), a.bytes_of(w13),
                   a.bytes_of(s13), a.bytes_of(w2),  a.bytes_of(s2)};
  const size_t sz[6] = {w13, s13, w13, s13, w2, s2};
  for (int i = 0; i < 6; ++i) {
    if (i % 2 == 0)
      fill_random_bytes(p[i], sz[i], g_seed++, 0, 255, nullptr);
    else
      fill_random_bytes(p[i], sz[i], g_seed++, 118, 124, nullptr);
  }
  e.v = {p[0], p[1], p[2], p[3], p[4], p[5], kExperts, kDim, kInter};
  return e;
}

// Weights that share an input are stacked along N at load time, one GEMV each:
// wq_a | wkv (input x), wq_b | indexer wq_b (input qr, index layers), w1 | w3 (shared expert).
struct Layer {
  Fp8W wq_a_kv, wq_b, wo_a, wo_b, sh_w13, sh_w2;
  bool has_index = false, has_engram = false;
  Fp8W engram;
  Experts experts;
  int* topk_idx = nullptr;  // [8][6]
  float* topk_w = nullptr;
};

// Activation scratch: bf16 inputs (random, fixed) and their quantized forms.
struct Act {
  uint16_t* x;
  uint8_t* codes;
  float* scales;
  int k;
};

Act make_act(Arena& a, int k) {
  Act r{reinterpret_cast<uint16_t*>(a.bytes_of(size_t(8) * k * 2)), a.bytes_of(size_t(8) * k),
        reinterpret_cast<float*>(a.bytes_of(size_t(8) * k / 32 * 4)), k};
  fill_random_bf16(r.x, size_t(8) * k, g_seed++, 2.0f, nullptr);
  return r;
}

// Memory ceilings, from 2 GiB buffers: cudaMemcpy device-to-device and a 16-byte-vector copy
// kernel (bytes read plus bytes written), and a read-only kernel (bytes read).
struct Ceilings {
  double memcpy_gbs, copy_gbs, read_gbs;
};

Ceilings measure_ceilings(cudaStream_t s) {
  const size_t n = size_t(2) << 30;
  void *src, *dst;
  UF_CUDA_CHECK(cudaMalloc(&src, n));
  UF_CUDA_CHECK(cudaMalloc(&dst, n));
  unsigned* sink;
  UF_CUDA_CHECK(cudaMalloc(&sink, 4));
  fill_random_bytes(static_cast<uint8_t*>(src), n, 99, 0, 255, s);
  auto time_of = [&](auto&& body) {
    cudaGraphExec_t exec = uf::bench::capture_graph(s, body);
    const float us = uf::bench::median_replay_us(exec, s, 20);
    UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
    return us;
  };
  Ceilings c{};
  c.memcpy_gbs =
      2.0 * n /
      (time_of([&] { UF_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s)); }) *
       1e-6) /
      1e9;
  c.copy_gbs = 2.0 * n / (time_of([&] { device_copy(dst, src, n, s); }) * 1e-6) / 1e9;
  c.read_gbs = double(n) / (time_of([&] { device_read(src, n, sink, s); }) * 1e-6) / 1e9;
  cudaFree(src);
  cudaFree(dst);
  cudaFree(sink);
  return c;
}

void run_gemv(const Fp8Gemv& g, const Fp8W& w, const Act& a, int m, float* out, cudaStream_t s,
              bool quant) {
  if (quant) act_quant_fp8_bf16(a.x, m, a.k, a.codes, a.scales, s);
  g.run(w.v, QuantActView{a.codes, a.scales, m, a.k}, out, nullptr, s);
}

}  // namespace

int main(int argc, char** argv) {
  int layers = 40, reps = 20;
  bool kernels_only = false;
  std::vector<int> rows_list = {1, 2, 4, 7, 8};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--layers") && i + 1 < argc) layers = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--kernels-only")) kernels_only = true;  // skip step and sampler
  }
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  const Ceilings ceil = measure_ceilings(s);
  // The floor uses the best measured copy rate (read + write bytes over time).
  const double bw = std::max(ceil.memcpy_gbs, ceil.copy_gbs);
  std::printf(
      "copy bandwidth (read + write): cudaMemcpy D2D %.0f GB/s, copy kernel %.0f GB/s; "
      "read-only kernel %.0f GB/s\nfloor bandwidth used below: %.0f GB/s\n",
      ceil.memcpy_gbs, ceil.copy_gbs, ceil.read_gbs, bw);

  // ---- Per-kernel rows: one shape, many weight copies so that L2 holds none of them ----
  std::printf("\n%-28s %4s %9s %9s %7s\n", "kernel (weights)", "M", "us", "GB/s", "of copy");
  {
    const int shapes[][2] = {{32768, 1280}, {5120, 8192}, {4096, 5120}, {4096, 1280}, {5120, 1024}};
    for (const auto& sh : shapes) {
      Arena a;
      const int n = sh[0], k = sh[1];
      const size_t one = size_t(n) * k;
      const int copies = int(std::max<size_t>(4, (size_t(600) << 20) / one));
      std::vector<Fp8W> ws;
      for (int c = 0; c < copies; ++c) ws.push_back(make_fp8(a, n, k));
      Act act = make_act(a, k);
      float* out = reinterpret_cast<float*>(a.bytes_of(size_t(8) * n * 4));
      Fp8Gemv g(n, k, sms);
      UF_CUDA_CHECK(cudaDeviceSynchronize());  // fills ran on the legacy stream
      act_quant_fp8_bf16(act.x, 8, k, act.codes, act.scales, s);
      for (int m : {1, 8}) {
        cudaGraphExec_t exec = uf::bench::capture_graph(s, [&] {
          for (auto& w : ws) run_gemv(g, w, act, m, out, s, false);
        });
        const float us = uf::bench::median_replay_us(exec, s, reps) / copies;
        UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
        const double gbs = double(ws[0].bytes()) / (us * 1e-6) / 1e9;
        char name[64];
        std::snprintf(name, sizeof(name), "fp8_gemv %dx%d s%d", n, k, g.splits());
        std::printf("%-28s %4d %9.2f %9.0f %6.0f%%\n", name, m, us, gbs, 100.0 * gbs / bw);
      }
    }
    // Routed MoE of one layer (the rank's slices), several layers' experts rotated.
    Arena a;
    const int copies = 6;
    std::vector<Experts> ex;
    for (int c = 0; c < copies; ++c) ex.push_back(make_experts(a));
    Act act = make_act(a, kDim);
    UF_CUDA_CHECK(cudaDeviceSynchronize());
    act_quant_fp8_bf16(act.x, 8, kDim, act.codes, act.scales, s);
    float* out = reinterpret_cast<float*>(a.bytes_of(size_t(8) * kDim * 4));
    int* idx = reinterpret_cast<int*>(a.bytes_of(8 * kTopk * 4));
    float* wts = reinterpret_cast<float*>(a.bytes_of(8 * kTopk * 4));
    std::mt19937 rng(5);
    std::vector<int> hidx;
    std::vector<float> hw(8 * kTopk, 0.25f);
    for (int t = 0; t < 8; ++t) {
      std::vector<int> perm(kExperts);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      hidx.insert(hidx.end(), perm.begin(), perm.begin() + kTopk);
    }
    UF_CUDA_CHECK(cudaMemcpy(idx, hidx.data(), hidx.size() * 4, cudaMemcpyHostToDevice));
    UF_CUDA_CHECK(cudaMemcpy(wts, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
    MoeFp4 moe(kDim, kInter, kTopk, sms);
    for (int m : {1, 8}) {
      std::vector<int> uniq(hidx.begin(), hidx.begin() + m * kTopk);
      std::sort(uniq.begin(), uniq.end());
      uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
      cudaGraphExec_t exec = uf::bench::capture_graph(s, [&] {
        for (auto& e : ex)
          moe.run(e.v, QuantActView{act.codes, act.scales, m, kDim}, idx, wts, kSwigluLimit, out,
                  s);
      });
      const float us = uf::bench::median_replay_us(exec, s, reps) / copies;
      UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
      const double gbs = double(uniq.size() * Experts::expert_bytes()) / (us * 1e-6) / 1e9;
      char name[64];
      std::snprintf(name, sizeof(name), "moe_fp4 %zu experts s%d", uniq.size(), moe.w13_splits());
      std::printf("%-28s %4d %9.2f %9.0f %6.0f%%\n", name, m, us, gbs, 100.0 * gbs / bw);
    }
  }

  if (kernels_only) return 0;

  // ---- The decode step ----
  Arena arena;
  std::vector<Layer> L(layers);
  std::mt19937 rng(7);
  for (int l = 0; l < layers; ++l) {
    Layer& y = L[l];
    y.has_index = l == 2 || l == 8 || l == 14 || l == 20 || (l >= 24 && l <= 36 && l % 4 == 0);
    y.wq_a_kv = make_fp8(arena, kQRank + kKv, kDim);
    y.wq_b = make_fp8(arena, kWqB + (y.has_index ? kIdxQ : 0), kQLora);
    y.wo_a = make_fp8(arena, kWoA, kWoAIn);
    y.wo_b = make_fp8(arena, kDim, kWoBIn);
    y.sh_w13 = make_fp8(arena, 2 * kInter, kDim);
    y.sh_w2 = make_fp8(arena, kDim, kInter);
    y.has_engram = l == 1 || l == 14;
    if (y.has_engram) y.engram = make_fp8(arena, kEngramRows, kEngramIn);
    y.experts = make_experts(arena);
    std::vector<int> hidx;
    for (int t = 0; t < 8; ++t) {
      std::vector<int> perm(kExperts);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      hidx.insert(hidx.end(), perm.begin(), perm.begin() + kTopk);
    }
    std::vector<float> hw(8 * kTopk, 1.5f / kTopk);
    y.topk_idx = reinterpret_cast<int*>(arena.bytes_of(hidx.size() * 4));
    y.topk_w = reinterpret_cast<float*>(arena.bytes_of(hw.size() * 4));
    UF_CUDA_CHECK(cudaMemcpy(y.topk_idx, hidx.data(), hidx.size() * 4, cudaMemcpyHostToDevice));
    UF_CUDA_CHECK(cudaMemcpy(y.topk_w, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
  }
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  std::printf("\nweights of %d layers on this rank: %.2f GB\n", layers, arena.bytes / 1e9);

  Act a_x = make_act(arena, kDim), a_q = make_act(arena, kQLora), a_o = make_act(arena, kWoAIn);
  Act a_o2 = make_act(arena, kWoBIn), a_x2 = make_act(arena, kDim),
      a_e = make_act(arena, kEngramIn);
  uint8_t* h_codes = arena.bytes_of(8 * kInter);
  float* h_scales = reinterpret_cast<float*>(arena.bytes_of(8 * kInter / 32 * 4));
  float* out = reinterpret_cast<float*>(arena.bytes_of(size_t(8) * 32768 * 4));
  float* gu = reinterpret_cast<float*>(arena.bytes_of(size_t(8) * 2 * kInter * 4));
  Fp8Gemv g_wq_a_kv(kQRank + kKv, kDim, sms), g_wq_b(kWqB, kQLora, sms);
  Fp8Gemv g_wq_b_idx(kWqB + kIdxQ, kQLora, sms);
  Fp8Gemv g_wo_a(kWoA, kWoAIn, sms), g_wo_b(kDim, kWoBIn, sms), g_sh13(2 * kInter, kDim, sms);
  Fp8Gemv g_sh2(kDim, kInter, sms), g_eng(kEngramRows, kEngramIn, sms);
  MoeFp4 moe(kDim, kInter, kTopk, sms);
  UF_CUDA_CHECK(cudaDeviceSynchronize());

  std::printf("\n%4s %10s %10s %10s %8s %8s\n", "rows", "step us", "bytes MB", "floor us",
              "x floor", "GB/s");
  for (int m : rows_list) {
    double bytes = 0;
    cudaGraphExec_t exec = uf::bench::capture_graph(s, [&] {
      for (int l = 0; l < layers; ++l) {
        Layer& y = L[l];
        if (y.has_engram) run_gemv(g_eng, y.engram, a_e, m, out, s, true);
        run_gemv(g_wq_a_kv, y.wq_a_kv, a_x, m, out, s, true);
        run_gemv(y.has_index ? g_wq_b_idx : g_wq_b, y.wq_b, a_q, m, out, s, true);
        run_gemv(g_wo_a, y.wo_a, a_o, m, out, s, true);
        run_gemv(g_wo_b, y.wo_b, a_o2, m, out, s, true);
        run_gemv(g_sh13, y.sh_w13, a_x2, m, gu, s, true);
        swiglu_quant_fp8(gu, m, kInter, kSwigluLimit, h_codes, h_scales, s);
        g_sh2.run(y.sh_w2.v, QuantActView{h_codes, h_scales, m, kInter}, out, nullptr, s);
        moe.run(y.experts.v, QuantActView{a_x2.codes, a_x2.scales, m, kDim}, y.topk_idx, y.topk_w,
                kSwigluLimit, out, s);
      }
    });
    // Bytes the step must read: every included weight once, the distinct experts of the rows.
    for (int l = 0; l < layers; ++l) {
      const Layer& y = L[l];
      bytes += y.wq_a_kv.bytes() + y.wq_b.bytes() + y.wo_a.bytes() + y.wo_b.bytes() +
               y.sh_w13.bytes() + y.sh_w2.bytes();
      if (y.has_engram) bytes += y.engram.bytes();
      std::vector<int> h(m * kTopk);
      UF_CUDA_CHECK(cudaMemcpy(h.data(), y.topk_idx, h.size() * 4, cudaMemcpyDeviceToHost));
      std::sort(h.begin(), h.end());
      bytes += double(std::unique(h.begin(), h.end()) - h.begin()) * Experts::expert_bytes();
    }
    const float us = uf::bench::median_replay_us(exec, s, reps);
    UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
    const double floor_us = bytes / (bw * 1e9) * 1e6;
    std::printf("%4d %10.1f %10.1f %10.1f %8.2f %8.0f\n", m, us, bytes / 1e6, floor_us,
                us / floor_us, bytes / (us * 1e-6) / 1e9);
  }

  // ---- Sampler: 8 rows x 129280 ----
  {
    Arena a;
    const int V = 129280;
    float* logits = reinterpret_cast<float*>(a.bytes_of(size_t(8) * V * 4));
    uint16_t* tmp = reinterpret_cast<uint16_t*>(a.bytes_of(size_t(8) * V * 2));
    fill_random_bf16(tmp, size_t(8) * V, 3, 4.0f, s);
    std::vector<uint16_t> hb(size_t(8) * V);
    UF_CUDA_CHECK(cudaMemcpy(hb.data(), tmp, hb.size() * 2, cudaMemcpyDeviceToHost));
    std::vector<float> hl(hb.size());
    for (size_t i = 0; i < hb.size(); ++i) {
      uint32_t bits = uint32_t(hb[i]) << 16;
      std::memcpy(&hl[i], &bits, 4);
    }
    UF_CUDA_CHECK(cudaMemcpy(logits, hl.data(), hl.size() * 4, cudaMemcpyHostToDevice));
    auto* ss = reinterpret_cast<unsigned long long*>(a.bytes_of(16));
    const unsigned long long hs[2] = {1, 2};
    UF_CUDA_CHECK(cudaMemcpy(ss, hs, 16, cudaMemcpyHostToDevice));
    int32_t* tok = reinterpret_cast<int32_t*>(a.bytes_of(32));
    for (int m : {1, 8}) {
      cudaGraphExec_t exec = uf::bench::capture_graph(
          s, [&] { sample_top_p(logits, m, V, 1.0f, 0.95f, ss, tok, nullptr, s); });
      const float us = uf::bench::median_replay_us(exec, s, reps);
      UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
      std::printf("\nsample_top_p rows=%d V=%d T=1 top_p=0.95: %.1f us", m, V, us);
    }
    std::printf("\n");
  }
  UF_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

#endif  // UF_HAVE_CUDA
