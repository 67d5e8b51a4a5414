// bench_cuda_mhc: the decode step's mHC glue kernels (ops/mhc.cu) at a TP8 rank's real dims
// (hc 4, dim 5120, 20 Sinkhorn iterations, fn F32 [24, 20480]) for T = 1, 2, 4, 7, 8 rows:
//   hc_post_mixes   (expand of the sublayer output into the streams + the next mixes' partials),
//   hc_mix_pre_norm (the mixes' finish + Sinkhorn, collapse + rms_norm),
//   the pair as layer() calls them,
//   hc_mixes_finish and hc_pre_norm (hc_mix_pre_norm's halves alone: a step may fork the finish).
// Each figure is the median over --reps replays of a CUDA graph of --copies calls, each call with
// its own fn (300 copies x 2 MB = 600 MB >> L2, so fn comes from HBM as in a real step; the streams
// and partials were written by the previous call, so they are L2-warm as in the step), divided by
// --copies. Every call reads X and writes R (no chain through the stream: values stay finite
// whatever the random post / comb), the pair's collapse reads R. Bytes: everything the call reads
// and writes once; floor = bytes / 4.1 TB/s. Every figure is measured three times: with the
// session-6 kernels (set_mhc_legacy_kernels(true): "old"), the current ones ("new") and the current
// ones with 2 row groups in hc_post_mixes ("g2", set_mhc_post_groups(2)), printed side by side (the
// outputs are bitwise the same: tests/cuda/test_ops_mhc_fused.cpp).
// "moe fold": the FFN's tail of a decode step, MoE combine + hc_post_mixes (moe_combine_rows over
// the 6 routed slots and the shared expert's as a 7th, the decode combine's reads and adds, then
// hc_post_mixes on its output) against hc_post_mixes_moe (the combine folded into the expand,
// bitwise the same: tests/cuda/test_mhc_combine_fold.cpp), top-6 of 384 experts, the slots
// L2-warm as after the expert kernels; current kernels, 2 row groups.
// "prefill": hc_post_mixes (the decode kernels, 2 row groups) against hc_post_mixes_mma (the
// prefill expand with the mixes on the bf16 tensor cores, ops/mhc_prefill.h) at prefill row
// counts (--prefill-rows, default 16,64,512,2048), 8 fn copies; floor = the expand's stream bytes
// (R and x read, out written) / 4.1 TB/s.
//
//   bench_cuda_mhc [--reps N] [--copies N] [--rows 1,2,4,7,8] [--prefill-rows 16,64,512,2048]

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifndef UF_HAVE_CUDA
int main() {
  std::printf("bench_cuda_mhc: built without the CUDA backend\n");
  return 0;
}
#else

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#include "cuda/device_weights.h"
#include "cuda/moe.h"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/mhc_prefill.h"
#include "cuda_bench_util.h"

using namespace uf::cuda;

namespace {

constexpr int kHc = 4, kDim = 5120, kIters = 20, kTmax = 8;
constexpr int kMix = (2 + kHc) * kHc;
constexpr int kTopK = 6, kExperts = 384;  // the MoE of the "moe fold" case
constexpr double kHbm = 4.1e12;           // bytes / s

struct Buffers {
  std::vector<void*> ptrs;
  float* floats(size_t n) {
    void* p = nullptr;
    UF_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 4) * sizeof(float)));
    ptrs.push_back(p);
    return static_cast<float*>(p);
  }
  ~Buffers() {
    for (void* p : ptrs) cudaFree(p);
  }
};

DeviceWeight f32_weight(float* p, int64_t rows, int64_t cols) {
  DeviceWeight w;
  w.format = uf::model::WFormat::kF32;
  w.rows = rows;
  w.cols = cols;
  w.data = reinterpret_cast<const uint8_t*>(p);
  return w;
}

// old: the session-6 kernels; new: the current ones (hc_post_mixes with 4 row groups a block, the
// default); g2: the current ones with 2 row groups (set_mhc_post_groups(2)).
void line(const char* what, int T, float old_us, float new_us, float g2_us, double bytes) {
  const double floor_us = bytes / kHbm * 1e6;
  std::printf(
      "%-16s T=%d  old %7.2f  new %7.2f (%5.2fx)  g2 %7.2f (%5.2fx) us/call  %8.1f KB  new %7.1f "
      "GB/s  floor %5.2f us (new %4.1fx)\n",
      what, T, old_us, new_us, old_us / new_us, g2_us, old_us / g2_us, bytes / 1024.0,
      bytes / (new_us * 1e-6) / 1e9, floor_us, new_us / floor_us);
}

}  // namespace

std::vector<int> parse_rows(const char* q, int max) {
  std::vector<int> rows;
  while (*q) {
    const int r = std::atoi(q);
    if (r >= 1 && r <= max) rows.push_back(r);
    while (*q && *q != ',') ++q;
    if (*q == ',') ++q;
  }
  return rows;
}

// The prefill expand: hc_post_mixes vs hc_post_mixes_mma at prefill row counts.
void bench_prefill(const HcShape& p, const std::vector<int>& rows, int reps, cudaStream_t s) {
  if (rows.empty()) return;
  constexpr int kCopies = 8;
  const int Tmax = *std::max_element(rows.begin(), rows.end());
  const size_t n = size_t(p.hc) * p.dim, fn_n = size_t(kMix) * n;
  Buffers b;
  uint64_t seed = 1000;
  DeviceArena arena;
  std::vector<DeviceWeight> fn;
  std::vector<HcFnTerms> terms;
  for (int c = 0; c < kCopies; ++c) {
    float* f = b.floats(fn_n);
    fill_random_f32(f, fn_n, seed++, 0.02f, s);
    UF_CUDA_CHECK(cudaStreamSynchronize(s));
    fn.push_back(f32_weight(f, kMix, int64_t(n)));
    terms.push_back(hc_fn_terms(p, fn.back(), arena));
  }
  float* X = b.floats(size_t(Tmax) * n);
  float* R = b.floats(size_t(Tmax) * n);
  float* y = b.floats(size_t(Tmax) * p.dim);
  float* post = b.floats(size_t(Tmax) * p.hc);
  float* comb = b.floats(size_t(Tmax) * p.hc * p.hc);
  float* partial = b.floats(hc_mixes_scratch_floats(p, Tmax));
  fill_random_f32(X, size_t(Tmax) * n, seed++, 1.0f, s);
  fill_random_f32(y, size_t(Tmax) * p.dim, seed++, 1.0f, s);
  fill_random_f32(post, size_t(Tmax) * p.hc, seed++, 1.0f, s);
  fill_random_f32(comb, size_t(Tmax) * p.hc * p.hc, seed++, 0.5f, s);
  UF_CUDA_CHECK(cudaStreamSynchronize(s));
  for (int T : rows) {
    const float t_rows = uf::bench::time_graph_us(s, reps, [&] {
      for (int c = 0; c < kCopies; ++c)
        hc_post_mixes(p, y, X, post, comb, T, R, fn[size_t(c)], partial, s);
    });
    const float t_gemm = uf::bench::time_graph_us(s, reps, [&] {
      for (int c = 0; c < kCopies; ++c)
        hc_post_mixes_mma(p, y, X, post, comb, T, R, terms[size_t(c)], partial, s);
    });
    const double bytes = double(T) * (2.0 * double(n) + p.dim) * 4;
    const double floor_us = bytes / kHbm * 1e6;
    std::printf(
        "prefill expand   T=%4d  hc_post_mixes %8.2f  mma %8.2f us/call (%5.2fx)  floor %6.2f "
        "us (mma %4.1fx)\n",
        T, t_rows / kCopies, t_gemm / kCopies, t_rows / t_gemm, floor_us,
        t_gemm / kCopies / floor_us);
  }
}

int main(int argc, char** argv) {
  int reps = 200, copies = 300;
  std::vector<int> rows = {1, 2, 4, 7, 8}, prefill_rows = {16, 64, 512, 2048};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--copies") && i + 1 < argc) copies = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--rows") && i + 1 < argc) rows = parse_rows(argv[++i], kTmax);
    if (!std::strcmp(argv[i], "--prefill-rows") && i + 1 < argc)
      prefill_rows = parse_rows(argv[++i], 8192);
  }
  reps = std::max(reps, 1);
  copies = std::max(copies, 1);
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; mHC hc %d dim %d sinkhorn %d, fn F32 [%d, %d], %d copies\n",
              prop.name, prop.multiProcessorCount, kHc, kDim, kIters, kMix, kHc * kDim, copies);
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  const HcShape p{kHc, kDim, kIters, 1e-6f, 1e-6f};
  const size_t n = size_t(kHc) * kDim, fn_n = size_t(kMix) * n;
  Buffers b;
  uint64_t seed = 1;
  std::vector<DeviceWeight> fn, scale, base, norm;
  for (int c = 0; c < copies; ++c) {
    float* f = b.floats(fn_n);
    fill_random_f32(f, fn_n, seed++, 0.02f, s);
    fn.push_back(f32_weight(f, kMix, int64_t(n)));
    float* sc = b.floats(3);
    fill_random_f32(sc, 3, seed++, 1.0f, s);
    scale.push_back(f32_weight(sc, 3, 1));
    float* bs = b.floats(kMix);
    fill_random_f32(bs, kMix, seed++, 1.0f, s);
    base.push_back(f32_weight(bs, kMix, 1));
    float* nw = b.floats(kDim);
    fill_random_f32(nw, kDim, seed++, 1.0f, s);
    norm.push_back(f32_weight(nw, kDim, 1));
  }
  float* X = b.floats(kTmax * n);
  float* R = b.floats(kTmax * n);
  float* y = b.floats(size_t(kTmax) * kDim);
  float* x = b.floats(size_t(kTmax) * kDim);
  float* pre_a = b.floats(kTmax * kHc);
  float* pre_b = b.floats(kTmax * kHc);
  float* post = b.floats(kTmax * kHc);
  float* comb = b.floats(kTmax * kHc * kHc);
  float* partial = b.floats(hc_mixes_scratch_floats(p, kTmax));
  fill_random_f32(X, kTmax * n, seed++, 1.0f, s);
  fill_random_f32(R, kTmax * n, seed++, 1.0f, s);
  fill_random_f32(y, size_t(kTmax) * kDim, seed++, 1.0f, s);
  fill_random_f32(pre_a, kTmax * kHc, seed++, 1.0f, s);
  fill_random_f32(post, kTmax * kHc, seed++, 1.0f, s);
  fill_random_f32(comb, kTmax * kHc * kHc, seed++, 0.5f, s);
  hc_mixes_partial(p, fn[0], X, kTmax, partial, s);
  // The MoE slots [kTmax, top-k + 1, dim] and ids: row t's k-th expert (t + 3 k) % E; ids7 gives
  // the shared slot the id E (last in the combine's ascending order) for moe_combine_rows.
  float* slots = b.floats(size_t(kTmax) * (kTopK + 1) * kDim);
  fill_random_f32(slots, size_t(kTmax) * (kTopK + 1) * kDim, seed++, 1.0f, s);
  std::vector<int32_t> ids_h(size_t(kTmax) * kTopK), ids7_h(size_t(kTmax) * (kTopK + 1));
  for (int t = 0; t < kTmax; ++t) {
    for (int k = 0; k < kTopK; ++k)
      ids_h[size_t(t) * kTopK + k] = ids7_h[size_t(t) * (kTopK + 1) + k] = (t + 3 * k) % kExperts;
    ids7_h[size_t(t) * (kTopK + 1) + kTopK] = kExperts;
  }
  int32_t* ids = reinterpret_cast<int32_t*>(b.floats(ids_h.size()));
  int32_t* ids7 = reinterpret_cast<int32_t*>(b.floats(ids7_h.size()));
  UF_CUDA_CHECK(cudaMemcpy(ids, ids_h.data(), ids_h.size() * 4, cudaMemcpyHostToDevice));
  UF_CUDA_CHECK(cudaMemcpy(ids7, ids7_h.data(), ids7_h.size() * 4, cudaMemcpyHostToDevice));
  const MoeSlots moe{slots, ids, kTopK, kExperts};
  UF_CUDA_CHECK(cudaStreamSynchronize(s));

  const size_t S = hc_mixes_scratch_floats(p, 1) / size_t(kMix + 1);
  std::printf("splits %zu, partials %zu floats per row\n", S, S * (kMix + 1));
  for (int T : rows) {
    const double part_bytes = double(T) * double(S) * (kMix + 1) * 4;
    // fn once; R read, out written, x read; partials written.
    const double pm_bytes = double(fn_n) * 4 + double(T) * (2.0 * n + kDim) * 4 + part_bytes;
    // partials read; X read, y written, norm weight; pre / post / comb written.
    const double mp_bytes =
        part_bytes + double(T) * (double(n) + 2.0 * kDim + (2 * kHc + kHc * kHc)) * 4 + kDim * 4.0;
    struct Times {
      float pm, mp, pair, fin, pn;
    };
    auto measure = [&](bool legacy, int groups) {
      set_mhc_legacy_kernels(legacy);
      set_mhc_post_groups(groups);
      const float t_pm = uf::bench::time_graph_us(s, reps, [&] {
        for (int c = 0; c < copies; ++c)
          hc_post_mixes(p, y, X, post, comb, T, R, fn[size_t(c)], partial, s);
      });
      const float t_mp = uf::bench::time_graph_us(s, reps, [&] {
        for (int c = 0; c < copies; ++c)
          hc_mix_pre_norm(p, scale[size_t(c)], base[size_t(c)], partial, R, c % 2 ? pre_b : pre_a,
                          norm[size_t(c)], 1e-6f, T, x, c % 2 ? pre_a : pre_b, post, comb, s);
      });
      const float t_pair = uf::bench::time_graph_us(s, reps, [&] {
        for (int c = 0; c < copies; ++c) {
          hc_post_mixes(p, y, X, post, comb, T, R, fn[size_t(c)], partial, s);
          hc_mix_pre_norm(p, scale[size_t(c)], base[size_t(c)], partial, R, c % 2 ? pre_b : pre_a,
                          norm[size_t(c)], 1e-6f, T, x, c % 2 ? pre_a : pre_b, post, comb, s);
        }
      });
      // The two halves of hc_mix_pre_norm as separate kernels (a step may fork the finish).
      const float t_fin = uf::bench::time_graph_us(s, reps, [&] {
        for (int c = 0; c < copies; ++c)
          hc_mixes_finish(p, scale[size_t(c)], base[size_t(c)], partial, T, c % 2 ? pre_a : pre_b,
                          post, comb, s);
      });
      const float t_pn = uf::bench::time_graph_us(s, reps, [&] {
        for (int c = 0; c < copies; ++c)
          hc_pre_norm(p, R, c % 2 ? pre_b : pre_a, norm[size_t(c)], 1e-6f, T, x, s);
      });
      set_mhc_legacy_kernels(false);
      set_mhc_post_groups(2);  // the default
      const float c = float(copies);
      return Times{t_pm / c, t_mp / c, t_pair / c, t_fin / c, t_pn / c};
    };
    const Times o = measure(true, 4), w = measure(false, 4), w2 = measure(false, 2);
    const double fin_bytes = part_bytes + double(T) * (2 * kHc + kHc * kHc) * 4;
    const double pn_bytes = double(T) * (double(n) + 2.0 * kDim) * 4 + kDim * 4.0;
    line("hc_post_mixes", T, o.pm, w.pm, w2.pm, pm_bytes);
    line("hc_mix_pre_norm", T, o.mp, w.mp, w2.mp, mp_bytes);
    line("pair", T, o.pair, w.pair, w2.pair, pm_bytes + mp_bytes);
    line("hc_mixes_finish", T, o.fin, w.fin, w2.fin, fin_bytes);
    line("hc_pre_norm", T, o.pn, w.pn, w2.pn, pn_bytes);
    // moe fold: combine + post against the fused post (x comes from the slots: the same R / post
    // / comb / fn reads and out / partial writes).
    const float t_cp = uf::bench::time_graph_us(s, reps, [&] {
      for (int c = 0; c < copies; ++c) {
        moe_combine_rows(slots, ids7, T, kTopK + 1, kExperts + 1, kDim, y, s);
        hc_post_mixes(p, y, X, post, comb, T, R, fn[size_t(c)], partial, s);
      }
    });
    const float t_fold = uf::bench::time_graph_us(s, reps, [&] {
      for (int c = 0; c < copies; ++c)
        hc_post_mixes_moe(p, moe, X, post, comb, T, R, fn[size_t(c)], partial, s);
    });
    const float cc = float(copies);
    std::printf("moe fold         T=%d  combine+post %7.2f  fused %7.2f us/call  saves %5.2f us\n",
                T, t_cp / cc, t_fold / cc, (t_cp - t_fold) / cc);
  }
  bench_prefill(p, prefill_rows, std::min(reps, 50), s);
  UF_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

#endif
