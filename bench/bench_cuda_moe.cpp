// bench_cuda_moe: the MoE of one decode layer of a TP8 rank (dim 5120, expert intermediate
// slice 288, 384 MXFP4 experts, top-6, FP8 shared expert) for T = 1, 2, 4, 7, 8 rows.
//  1. The whole layer through DeviceMoe::apply (router gate GEMV + route/quant + routed experts +
//     shared expert + combine), MoeFp4's e4m3 mma path vs its f16 HMMA path (MoeFp4::set_f16,
//     through set_default_f16: two sets of DeviceMoe copies), over `layers` DeviceMoe copies each
//     fed its own input (different experts, so L2 holds none of the weights), bitwise check of
//     f16 vs e4m3, floor = (distinct experts x one expert's bytes + gate + shared expert bytes) /
//     4.1 TB/s.
//  2. The routing kernel (moe_route) and the routed experts alone (MoeFp4::run: w13 + w2 +
//     combine, default kernel choice, e4m3 vs f16) with random routing, and route + act_quant +
//     MoE on the routing it produced, each beside its floor; then each kernel set (unit kernels
//     forced at every M, persistent) with each mma path, bitwise checked against the first.
// Each timing is the median CUDA-graph replay over several layers' weights, divided by the layer
// count (replay_us_per_copy, the bench's one timing loop). For reference, the whole layer before
// session 7's kernel changes (H200): 41.4 / 72.9 / 115.3 us at T = 1 / 4 / 7. Then prefill:
// T = 64, 512 rows by chunks of 8 through MoeFp4 against MoeFp4Prefill
// (tests/cuda/test_moe_prefill.cpp), us, GB/s, bitwise check. Last: MoeFp4Prefill's e4m3 mma
// kernels vs its f16 HMMA kernels (set_f16) on 64- and 16-column items (set_cols) at T = 512 /
// 2048, us and TFLOP/s, bitwise check.
//
//   bench_cuda_moe [--reps N] [--copies N] [--layers N]

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#ifndef UF_HAVE_CUDA
int main() {
  std::printf("bench_cuda_moe: built without the CUDA backend\n");
  return 0;
}
#else

#include <cuda_runtime.h>

#include "core/dtypes.h"
#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#include "cuda/device_memory.h"
#include "cuda/gemv.h"
#include "cuda/moe.h"
#include "cuda/ops/moe.h"
#include "cuda_bench_util.h"
#include "model/weights.h"

using namespace uf::cuda;

namespace {

constexpr int kDim = 5120, kInter = 288, kExperts = 384, kTopk = 6;
constexpr float kSwigluLimit = 10.0f;

size_t expert_bytes() {
  return 2 * (size_t(kInter) * kDim / 2 + size_t(kInter) * kDim / 32) + size_t(kDim) * kInter / 2 +
         size_t(kDim) * kInter / 32;
}

struct Buffers {
  std::vector<void*> ptrs;
  uint8_t* bytes(size_t n) {
    void* p = nullptr;
    UF_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 16)));
    ptrs.push_back(p);
    return static_cast<uint8_t*>(p);
  }
  ~Buffers() {
    for (void* p : ptrs) cudaFree(p);
  }
};

Fp4ExpertsView make_experts(Buffers& b, uint64_t& seed) {
  const size_t w13 = size_t(kExperts) * kInter * kDim / 2,
               s13 = size_t(kExperts) * kInter * kDim / 32;
  const size_t w2 = size_t(kExperts) * kDim * kInter / 2,
               s2 = size_t(kExperts) * kDim * kInter / 32;
  const size_t sz[6] = {w13, s13, w13, s13, w2, s2};
  uint8_t* p[6];
  for (int i = 0; i < 6; ++i) {
    p[i] = b.bytes(sz[i]);
    if (i % 2 == 0)
      fill_random_bytes(p[i], sz[i], seed++, 0, 255, nullptr);
    else
      fill_random_bytes(p[i], sz[i], seed++, 118, 124, nullptr);
  }
  return {p[0], p[1], p[2], p[3], p[4], p[5], kExperts, kDim, kInter};
}

// Host weights of one MoE layer in checkpoint formats (random bytes; kPool distinct expert
// byte sets shared round-robin by the 384 experts: each DeviceMoe uploads its own device copy).
struct HostLayer {
  static constexpr int kPool = 4;
  std::vector<uint8_t> gate, w13[kPool][2], s13[kPool][2], w2[kPool], s2[kPool];
  std::vector<uint8_t> sh[3], shs[3];
  uf::model::MoeWeights w;
  uint64_t st = 0x9E3779B97F4A7C15ull;
  uint8_t next() {
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    return uint8_t(st >> 24);
  }
  std::vector<uint8_t> bytes(size_t n, int lo = 0, int hi = 255, int mask = 0xFF) {
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = uint8_t(lo + (next() & mask) % (hi - lo + 1));
    return v;
  }
  static uf::model::Weight view(uf::model::WFormat f, int64_t rows, int64_t cols,
                                const std::vector<uint8_t>& d, const std::vector<uint8_t>* sc,
                                const char* name) {
    uf::model::Weight x;
    x.format = f;
    x.rows = rows;
    x.cols = cols;
    x.data = d.data();
    x.scale = sc ? sc->data() : nullptr;
    x.name = name;
    return x;
  }
  HostLayer() {
    using uf::model::WFormat;
    gate.resize(size_t(kExperts) * kDim * 2);
    for (size_t i = 0; i < gate.size(); i += 2) {
      const float v = (float(next()) - 127.5f) / 1275.f;  // |v| < 0.1
      const uint16_t b = uf::core::float_to_bf16(v);
      std::memcpy(&gate[i], &b, 2);
    }
    w.gate = view(WFormat::kBF16, kExperts, kDim, gate, nullptr, "gate");
    for (int p = 0; p < kPool; ++p) {
      for (int j = 0; j < 2; ++j) {
        w13[p][j] = bytes(size_t(kInter) * kDim / 2);
        s13[p][j] = bytes(size_t(kInter) * kDim / 32, 119, 123);
      }
      w2[p] = bytes(size_t(kDim) * kInter / 2);
      s2[p] = bytes(size_t(kDim) * kInter / 32, 118, 122);
    }
    for (int e = 0; e < kExperts; ++e) {
      const int p = e % kPool;
      uf::model::ExpertWeights x;
      x.w1 = view(WFormat::kFP4, kInter, kDim, w13[p][0], &s13[p][0], "w1");
      x.w3 = view(WFormat::kFP4, kInter, kDim, w13[p][1], &s13[p][1], "w3");
      x.w2 = view(WFormat::kFP4, kDim, kInter, w2[p], &s2[p], "w2");
      w.experts.push_back(x);
    }
    // FP8 (e4m3 codes without NaN: bit 3 clear), 32x32 block scales.
    const int64_t rows[3] = {kInter, kInter, kDim}, cols[3] = {kDim, kDim, kInter};
    for (int j = 0; j < 3; ++j) {
      sh[j] = bytes(size_t(rows[j]) * cols[j], 0, 255, 0xF7);
      shs[j] = bytes(size_t((rows[j] + 31) / 32) * ((cols[j] + 31) / 32), 116, 120);
    }
    w.shared.w1 = view(WFormat::kFP8, kInter, kDim, sh[0], &shs[0], "s1");
    w.shared.w3 = view(WFormat::kFP8, kInter, kDim, sh[1], &shs[1], "s3");
    w.shared.w2 = view(WFormat::kFP8, kDim, kInter, sh[2], &shs[2], "s2");
  }
};

// The one timing loop of this bench: one(c) enqueues copy c (a layer / an expert stack) of the
// timed work. Copy 0 runs once eagerly (launch errors surface here, outside a capture), then the
// median CUDA-graph replay of all copies in order, in us per copy. Every copy's outputs are
// written when it returns.
template <typename F>
float replay_us_per_copy(cudaStream_t s, int reps, int copies, F&& one) {
  one(0);
  UF_CUDA_CHECK(cudaStreamSynchronize(s));
  const float us = uf::bench::time_graph_us(s, reps, [&] {
    for (int c = 0; c < copies; ++c) one(c);
  });
  return us / copies;
}

// Part 1: the whole MoE layer through DeviceMoe, MoeFp4's e4m3 vs f16 mma path.
void bench_layer(int layers, int reps, cudaStream_t s) {
  std::printf(
      "\nwhole MoE layer (DeviceMoe::apply: gate + route + experts + shared + combine), "
      "%d layers\n",
      layers);
  HostLayer host;
  MoeShape shape;
  shape.dim = kDim;
  shape.inter = kInter;
  shape.n_experts = kExperts;
  shape.top_k = kTopk;
  shape.score_func = "sqrtsoftplus";
  shape.route_scale = 2.5f;
  shape.swiglu_limit = kSwigluLimit;
  shape.max_prefill_rows = 0;
  DeviceArena arena;
  // [0]: e4m3 mma path, [1]: f16 HMMA path (MoeFp4 reads the default at construction).
  std::vector<std::unique_ptr<DeviceMoe> > moes[2];
  for (int k = 0; k < 2; ++k) {
    MoeFp4::set_default_f16(k == 1);
    for (int l = 0; l < layers; ++l)
      moes[k].push_back(std::make_unique<DeviceMoe>(host.w, shape, arena));
  }
  MoeFp4::set_default_f16(true);
  // Inputs: bf16-valued fp32 [8, dim] per layer (its own routing); outputs and routing per layer.
  float* x = arena.alloc<float>(size_t(layers) * 8 * kDim);
  float* y_new = arena.alloc<float>(size_t(layers) * 8 * kDim);
  float* y_old = arena.alloc<float>(size_t(layers) * 8 * kDim);
  int32_t* gi = arena.alloc<int32_t>(size_t(layers) * 8 * kTopk);
  float* gw = arena.alloc<float>(size_t(layers) * 8 * kTopk);
  {
    std::vector<float> hx(size_t(layers) * 8 * kDim);
    std::mt19937 rng(77);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : hx) v = uf::core::bf16_to_float(uf::core::float_to_bf16(nd(rng)));
    UF_CUDA_CHECK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
  }
  const double shared_bytes =
      3.0 * kInter * kDim + 3.0 * ((kInter + 31) / 32) * (kDim / 32);  // FP8 + scales
  const double gate_bytes = double(kExperts) * kDim * 2;
  std::printf("%3s %8s %10s %10s %8s %10s %8s %s\n", "T", "experts", "e4m3 us", "f16 us", "speedup",
              "floor us", "f16 GB/s", "f16 == e4m3");
  for (int T : {1, 2, 4, 7, 8}) {
    float us[2];
    for (int k = 0; k < 2; ++k) {
      float* y = k == 0 ? y_old : y_new;
      UF_CUDA_CHECK(cudaMemsetAsync(y, 0xFF, size_t(layers) * 8 * kDim * 4, s));
      us[k] = replay_us_per_copy(s, reps, layers, [&](int l) {
        moes[k][size_t(l)]->apply(x + size_t(l) * 8 * kDim, T, y + size_t(l) * 8 * kDim,
                                  gi + size_t(l) * 8 * kTopk, gw + size_t(l) * 8 * kTopk, s);
      });
    }
    // Bytes a perfect kernel reads per layer: the distinct experts of that layer's rows.
    std::vector<int32_t> hi(size_t(layers) * 8 * kTopk);
    UF_CUDA_CHECK(cudaMemcpy(hi.data(), gi, hi.size() * 4, cudaMemcpyDeviceToHost));
    double experts = 0;
    for (int l = 0; l < layers; ++l) {
      std::vector<int32_t> u(hi.begin() + size_t(l) * 8 * kTopk,
                             hi.begin() + size_t(l) * 8 * kTopk + size_t(T) * kTopk);
      std::sort(u.begin(), u.end());
      experts += double(std::unique(u.begin(), u.end()) - u.begin());
    }
    experts /= layers;
    const double bytes = experts * double(expert_bytes()) + gate_bytes + shared_bytes;
    std::vector<float> a(size_t(layers) * 8 * kDim), c(a.size());
    UF_CUDA_CHECK(cudaMemcpy(a.data(), y_old, a.size() * 4, cudaMemcpyDeviceToHost));
    UF_CUDA_CHECK(cudaMemcpy(c.data(), y_new, c.size() * 4, cudaMemcpyDeviceToHost));
    size_t diff = 0, nan = 0;
    for (int l = 0; l < layers; ++l)
      for (size_t i = 0; i < size_t(T) * kDim; ++i) {
        const size_t j = size_t(l) * 8 * kDim + i;
        nan += std::isnan(a[j]) || std::isnan(c[j]);
        diff += std::memcmp(&a[j], &c[j], 4) != 0;
      }
    std::printf("%3d %8.1f %10.2f %10.2f %7.2fx %10.2f %8.0f %s\n", T, experts, us[0], us[1],
                us[0] / us[1], bytes / 4.1e12 * 1e6, bytes / (us[1] * 1e-6) / 1e9,
                diff == 0 && nan == 0 ? "bitwise" : "DIFFERENT / NaN!");
    if (diff || nan) std::printf("    %zu outputs differ, %zu NaN\n", diff, nan);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 200, copies = 6, layers = 8;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--copies") && i + 1 < argc) copies = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--layers") && i + 1 < argc) layers = std::atoi(argv[++i]);
  }
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs; MoE dim %d inter %d experts %d top-%d, %d expert stacks\n",
              prop.name, sms, kDim, kInter, kExperts, kTopk, copies);
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  bench_layer(layers, reps, s);

  Buffers b;
  uint64_t seed = 1;
  std::vector<Fp4ExpertsView> ex;
  for (int c = 0; c < copies; ++c) ex.push_back(make_experts(b, seed));
  uint16_t* xb = reinterpret_cast<uint16_t*>(b.bytes(size_t(8) * kDim * 2));
  uint8_t* codes = b.bytes(size_t(8) * kDim);
  float* scales = reinterpret_cast<float*>(b.bytes(size_t(8) * kDim / 32 * 4));
  fill_random_bf16(xb, size_t(8) * kDim, seed++, 2.0f, nullptr);
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  act_quant_fp8_bf16(xb, 8, kDim, codes, scales, s);
  float* out_old = reinterpret_cast<float*>(b.bytes(size_t(8) * kDim * 4));
  float* out_new = reinterpret_cast<float*>(b.bytes(size_t(8) * kDim * 4));
  int* idx = reinterpret_cast<int*>(b.bytes(8 * kTopk * 4));
  float* wts = reinterpret_cast<float*>(b.bytes(8 * kTopk * 4));
  std::mt19937 rng(5);
  std::vector<int> hidx;
  std::uniform_real_distribution<float> ud(0.05f, 0.4f);
  std::vector<float> hw;
  for (int t = 0; t < 8; ++t) {
    std::vector<int> perm(kExperts);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    hidx.insert(hidx.end(), perm.begin(), perm.begin() + kTopk);
    for (int k = 0; k < kTopk; ++k) hw.push_back(ud(rng));
  }
  UF_CUDA_CHECK(cudaMemcpy(idx, hidx.data(), hidx.size() * 4, cudaMemcpyHostToDevice));
  UF_CUDA_CHECK(cudaMemcpy(wts, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));

  MoeFp4 moe(kDim, kInter, kTopk, sms);
  std::printf("w13 K splits %d\n", moe.w13_splits());

  // Routing inputs: random gate scores [8, E], zero bias (route -> act_quant -> MoE is one
  // layer's routed part; the router GEMV and the shared expert are other kernels).
  MoeShape shape;
  shape.dim = kDim;
  shape.inter = kInter;
  shape.n_experts = kExperts;
  shape.top_k = kTopk;
  shape.score_func = "sqrtsoftplus";
  shape.route_scale = 2.5f;
  shape.swiglu_limit = kSwigluLimit;
  float* rscores = reinterpret_cast<float*>(b.bytes(size_t(8) * kExperts * 4));
  float* rbias = reinterpret_cast<float*>(b.bytes(size_t(kExperts) * 4));
  float* xf = reinterpret_cast<float*>(b.bytes(size_t(8) * kDim * 4));
  {
    std::vector<float> hs(size_t(8) * kExperts), hx(size_t(8) * kDim);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : hs) v = nd(rng);
    for (auto& v : hx) v = nd(rng);
    UF_CUDA_CHECK(cudaMemcpy(rscores, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    UF_CUDA_CHECK(cudaMemcpy(xf, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    UF_CUDA_CHECK(cudaMemset(rbias, 0, size_t(kExperts) * 4));
  }
  int* ridx = reinterpret_cast<int*>(b.bytes(8 * kTopk * 4));
  float* rwts = reinterpret_cast<float*>(b.bytes(8 * kTopk * 4));

  // Per layer (graph of `copies` layers over distinct expert stacks, so L2 holds no weights):
  //   route: moe_route alone; moe: MoeFp4::run (w13 + w2 + combine) on fixed random routing;
  //   layer: route + act_quant + MoeFp4::run on the routing it produced.
  // floor = distinct experts x one expert's bytes / 4.1 TB/s (the bytes a perfect kernel reads).
  std::printf(
      "\nrouted experts (MoeFp4, default kernel choice; e4m3 = the e4m3 mma path, moe = the f16 "
      "HMMA path)\n");
  std::printf("%3s %7s %9s %9s %9s %8s %9s %9s %8s %9s\n", "M", "experts", "route us", "e4m3 moe",
              "moe us", "moe GB/s", "floor us", "layer us", "experts", "floor us");
  for (int m : {1, 2, 4, 7, 8}) {
    std::vector<int> uniq(hidx.begin(), hidx.begin() + m * kTopk);
    std::sort(uniq.begin(), uniq.end());
    uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
    const double bytes = double(uniq.size() * expert_bytes());
    const QuantActView act{codes, scales, m, kDim};
    auto timed = [&](auto&& body) {
      return replay_us_per_copy(s, reps, copies, [&](int c) { body(ex[size_t(c)]); });
    };
    UF_CUDA_CHECK(cudaMemsetAsync(out_new, 0xFF, size_t(8) * kDim * 4, s));
    const float route_us =
        timed([&](const Fp4ExpertsView&) { moe_route(shape, rscores, rbias, m, ridx, rwts, s); });
    moe.set_f16(false);
    const float old_us = timed(
        [&](const Fp4ExpertsView& e) { moe.run(e, act, idx, wts, kSwigluLimit, out_old, s); });
    moe.set_f16(true);
    const float moe_us = timed(
        [&](const Fp4ExpertsView& e) { moe.run(e, act, idx, wts, kSwigluLimit, out_new, s); });
    std::vector<float> o_old(size_t(m) * kDim);
    UF_CUDA_CHECK(cudaMemcpy(o_old.data(), out_old, o_old.size() * 4, cudaMemcpyDeviceToHost));
    const float layer_us = timed([&](const Fp4ExpertsView& e) {
      moe_route(shape, rscores, rbias, m, ridx, rwts, s);
      act_quant_fp8_f32(xf, m, kDim, codes, scales, s);
      moe.run(e, act, ridx, rwts, kSwigluLimit, out_old, s);
    });
    std::vector<int> gi(size_t(m) * kTopk);
    UF_CUDA_CHECK(cudaMemcpy(gi.data(), ridx, gi.size() * 4, cudaMemcpyDeviceToHost));
    std::sort(gi.begin(), gi.end());
    gi.erase(std::unique(gi.begin(), gi.end()), gi.end());
    const double lbytes = double(gi.size() * expert_bytes());
    std::vector<float> o(size_t(m) * kDim);
    UF_CUDA_CHECK(cudaMemcpy(o.data(), out_new, o.size() * 4, cudaMemcpyDeviceToHost));
    size_t nan = 0;
    for (float v : o) nan += std::isnan(v) ? 1 : 0;
    const bool same = std::memcmp(o.data(), o_old.data(), o.size() * 4) == 0;
    std::printf("%3d %7zu %9.2f %9.2f %9.2f %8.0f %9.2f %9.2f %8zu %9.2f%s%s\n", m, uniq.size(),
                route_us, old_us, moe_us, bytes / (moe_us * 1e-6) / 1e9, bytes / 4.1e12 * 1e6,
                layer_us, gi.size(), lbytes / 4.1e12 * 1e6, nan ? "  NaN in the output!" : "",
                same ? "" : "  f16 != e4m3!");
  }
  // Each kernel set with each mma path (the unit kernels forced at every M), checked bitwise
  // against the first.
  std::printf(
      "\nrouted experts by kernel set and mma path, us (unit kernels forced at every M)\n%3s %10s "
      "%10s %10s %10s %s\n",
      "M", "unit e4m3", "unit f16", "pers e4m3", "pers f16", "bitwise");
  for (int m : {1, 2, 4, 7, 8}) {
    const QuantActView act{codes, scales, m, kDim};
    float us[4];
    std::vector<float> ref(size_t(m) * kDim), o(ref.size());
    bool same = true;
    size_t nan = 0;
    for (int v = 0; v < 4; ++v) {
      moe.set_legacy(v >= 2);
      moe.set_unit_max_rows(8);
      moe.set_f16(v % 2 == 1);
      UF_CUDA_CHECK(cudaMemsetAsync(out_new, 0xFF, size_t(8) * kDim * 4, s));
      us[v] = replay_us_per_copy(s, reps, copies, [&](int c) {
        moe.run(ex[size_t(c)], act, idx, wts, kSwigluLimit, out_new, s);
      });
      UF_CUDA_CHECK(
          cudaMemcpy((v ? o : ref).data(), out_new, o.size() * 4, cudaMemcpyDeviceToHost));
      for (float x : (v ? o : ref)) nan += std::isnan(x) ? 1 : 0;
      if (v) same = same && std::memcmp(o.data(), ref.data(), o.size() * 4) == 0;
    }
    std::printf("%3d %10.2f %10.2f %10.2f %10.2f %s%s\n", m, us[0], us[1], us[2], us[3],
                same ? "yes" : "NO!", nan ? "  NaN in the output!" : "");
  }
  moe.set_legacy(false);
  moe.set_unit_max_rows(2);
  moe.set_f16(true);
  // Restore the quantised bf16 input for the prefill comparison below.
  act_quant_fp8_bf16(xb, 8, kDim, codes, scales, s);

  // Prefill: T rows through MoeFp4 in chunks of 8 (the old path) vs MoeFp4Prefill (pairs grouped
  // by expert over all T rows, each expert's weights read once). GB/s = distinct experts x one
  // expert's bytes / time (the bytes a perfect kernel must read once). The inputs and the routing
  // are made once for kMaxT rows; both prefill sections below use their first T rows.
  constexpr int kMaxT = 2048;
  MoeFp4Prefill pf(kDim, kInter, kTopk, kExperts, kMaxT);
  uint16_t* pxb = reinterpret_cast<uint16_t*>(b.bytes(size_t(kMaxT) * kDim * 2));
  uint8_t* pcodes = b.bytes(size_t(kMaxT) * kDim);
  float* pscales = reinterpret_cast<float*>(b.bytes(size_t(kMaxT) * kDim / 32 * 4));
  fill_random_bf16(pxb, size_t(kMaxT) * kDim, seed++, 2.0f, nullptr);
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  for (int t0 = 0; t0 < kMaxT; t0 += 8)
    act_quant_fp8_bf16(pxb + size_t(t0) * kDim, 8, kDim, pcodes + size_t(t0) * kDim,
                       pscales + size_t(t0) * kDim / 32, s);
  float* pout_old = reinterpret_cast<float*>(b.bytes(size_t(kMaxT) * kDim * 4));
  float* pout_new = reinterpret_cast<float*>(b.bytes(size_t(kMaxT) * kDim * 4));
  int* pidx = reinterpret_cast<int*>(b.bytes(size_t(kMaxT) * kTopk * 4));
  float* pwts = reinterpret_cast<float*>(b.bytes(size_t(kMaxT) * kTopk * 4));
  std::vector<int> phidx;
  std::vector<float> phw;
  for (int t = 0; t < kMaxT; ++t) {
    std::vector<int> perm(kExperts);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    phidx.insert(phidx.end(), perm.begin(), perm.begin() + kTopk);
    for (int k = 0; k < kTopk; ++k) phw.push_back(ud(rng));
  }
  UF_CUDA_CHECK(cudaMemcpy(pidx, phidx.data(), phidx.size() * 4, cudaMemcpyHostToDevice));
  UF_CUDA_CHECK(cudaMemcpy(pwts, phw.data(), phw.size() * 4, cudaMemcpyHostToDevice));
  std::printf("\nprefill (routed experts only, random routing)\n%5s %8s %12s %8s %12s %8s %8s %s\n",
              "T", "experts", "chunked us", "GB/s", "prefill us", "GB/s", "speedup", "bitwise");
  for (int T : {64, 512}) {
    std::vector<int> uniq(phidx.begin(), phidx.begin() + T * kTopk);
    std::sort(uniq.begin(), uniq.end());
    uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
    const double bytes = double(uniq.size() * expert_bytes());
    float us[2];
    for (int k = 0; k < 2; ++k) {
      float* out = k == 0 ? pout_old : pout_new;
      auto body = [&](const Fp4ExpertsView& e) {
        if (k == 1) {
          pf.run(e, QuantActView{pcodes, pscales, T, kDim}, pidx, pwts, kSwigluLimit, out, s);
          return;
        }
        for (int t0 = 0; t0 < T; t0 += 8)
          moe.run(e,
                  QuantActView{pcodes + size_t(t0) * kDim, pscales + size_t(t0) * kDim / 32,
                               std::min(8, T - t0), kDim},
                  pidx + t0 * kTopk, pwts + t0 * kTopk, kSwigluLimit, out + size_t(t0) * kDim, s);
      };
      UF_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, size_t(kMaxT) * kDim * 4, s));
      us[k] = replay_us_per_copy(s, std::max(3, std::min(20, reps / 3)), copies,
                                 [&](int c) { body(ex[size_t(c)]); });
    }
    std::vector<float> a(size_t(T) * kDim), c(size_t(T) * kDim);
    UF_CUDA_CHECK(cudaMemcpy(a.data(), pout_old, a.size() * 4, cudaMemcpyDeviceToHost));
    UF_CUDA_CHECK(cudaMemcpy(c.data(), pout_new, c.size() * 4, cudaMemcpyDeviceToHost));
    const bool same = std::memcmp(a.data(), c.data(), a.size() * 4) == 0;
    std::printf("%5d %8zu %12.1f %8.0f %12.1f %8.0f %7.2fx %s  (%.0f tok/s new)\n", T, uniq.size(),
                us[0], bytes / (us[0] * 1e-6) / 1e9, us[1], bytes / (us[1] * 1e-6) / 1e9,
                us[0] / us[1], same ? "equal" : "DIFFERENT", T / (us[1] * 1e-6));
  }

  // Prefill kernels: MoeFp4Prefill::run (plan + w13 + w2 + combine) with the e4m3 mma kernels
  // (set_f16(false)) vs the f16 HMMA kernels (set_f16(true), default) on 64-column and on
  // 16-column items (set_cols; the default takes 16 at 512 rows, 64 at 2048), T = 512 / 2048
  // rows, random routing (~8 / ~32 pairs an expert). TFLOP/s = 2 * pairs * (2 * I + I) * dim /
  // time (w1 and w3: I x dim each, w2: dim x I, per valid (row, expert) pair).
  std::printf(
      "\nprefill kernels, MoeFp4Prefill::run (plan + w13 + w2 + combine), e4m3 mma vs f16 HMMA "
      "(set_f16) on 64- / 16-column items (set_cols)\n  TFLOP/s = 2 * pairs * 3 * inter * dim / "
      "time\n%5s %6s %10s %10s %10s %9s %9s %9s %s\n",
      "T", "pairs", "e4m3 us", "f16/64 us", "f16/16 us", "e4m3 TF/s", "f16/64", "f16/16",
      "bitwise");
  float* pout_16 = reinterpret_cast<float*>(b.bytes(size_t(kMaxT) * kDim * 4));
  for (int T : {512, 2048}) {
    float us[3];
    float* outs[3] = {pout_old, pout_new, pout_16};
    for (int k = 0; k < 3; ++k) {
      pf.set_f16(k != 0);
      pf.set_cols(k == 1 ? 64 : k == 2 ? 16 : 0);
      UF_CUDA_CHECK(cudaMemsetAsync(outs[k], 0xFF, size_t(kMaxT) * kDim * 4, s));
      us[k] = replay_us_per_copy(s, 20, copies, [&](int c) {
        pf.run(ex[size_t(c)], QuantActView{pcodes, pscales, T, kDim}, pidx, pwts, kSwigluLimit,
               outs[k], s);
      });
    }
    pf.set_f16(true);
    pf.set_cols(0);
    std::vector<float> a(size_t(T) * kDim), c(size_t(T) * kDim), d(size_t(T) * kDim);
    UF_CUDA_CHECK(cudaMemcpy(a.data(), pout_old, a.size() * 4, cudaMemcpyDeviceToHost));
    UF_CUDA_CHECK(cudaMemcpy(c.data(), pout_new, c.size() * 4, cudaMemcpyDeviceToHost));
    UF_CUDA_CHECK(cudaMemcpy(d.data(), pout_16, d.size() * 4, cudaMemcpyDeviceToHost));
    size_t diff = 0, nan = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      nan += std::isnan(a[i]) || std::isnan(c[i]) || std::isnan(d[i]);
      diff += std::memcmp(&a[i], &c[i], 4) != 0 || std::memcmp(&a[i], &d[i], 4) != 0;
    }
    const double flops = 2.0 * T * kTopk * 3.0 * kInter * kDim;  // every pair valid here
    std::printf("%5d %6d %10.1f %10.1f %10.1f %9.1f %9.1f %9.1f %s\n", T, T * kTopk, us[0], us[1],
                us[2], flops / (us[0] * 1e-6) / 1e12, flops / (us[1] * 1e-6) / 1e12,
                flops / (us[2] * 1e-6) / 1e12,
                diff == 0 && nan == 0 ? "equal" : "DIFFERENT / NaN!");
    if (diff || nan) std::printf("    %zu outputs differ, %zu NaN\n", diff, nan);
  }
  return 0;
}

#endif
