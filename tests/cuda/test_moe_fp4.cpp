// MXFP4 routed-expert MoE (W4A8, grouped, SwiGLU with clamps, routing weight before w2) against a
// CPU restatement of the reference, and spec == plain for the grouping.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtypes.h"
#include "core/quant.h"
#include "cuda/gemv.h"
#include "cuda/moe.h"
#include "cuda_test_util.h"

namespace uf::cuda::test {
namespace {

constexpr float kLimit = 10.0f;  // swiglu_limit of the model
constexpr int kSplitKb = 16;     // the w13 kernel's K split (moe_fp4.cu kKbPerSplit)

struct Experts {
  int E, dim, inter;
  std::vector<uint8_t> w1, w1s, w3, w3s, w2, w2s;
};

Experts random_experts(int E, int dim, int inter, std::mt19937& rng) {
  Experts x{E, dim, inter, {}, {}, {}, {}, {}, {}};
  x.w1 = random_bytes(size_t(E) * inter * dim / 2, rng);
  x.w3 = random_bytes(size_t(E) * inter * dim / 2, rng);
  x.w2 = random_bytes(size_t(E) * dim * inter / 2, rng);
  // Scales chosen so that gate/up land around the clamp limit and both clamps are exercised.
  x.w1s = random_bytes(size_t(E) * inter * dim / 32, rng, 119, 123);
  x.w3s = random_bytes(size_t(E) * inter * dim / 32, rng, 119, 123);
  x.w2s = random_bytes(size_t(E) * dim * inter / 32, rng, 118, 124);
  return x;
}

float e2m1_at(const std::vector<uint8_t>& packed, size_t elem) {
  const uint8_t b = packed[elem / 2];
  return core::e2m1_to_float((elem & 1) ? core::e2m1_odd(b) : core::e2m1_even(b));
}

// acc = sum over K blocks in order of (partial * a_scale) * w_scale in fp32, K split into
// chunks of `split_kb` blocks summed in chunk order (the kernels' order; partials are exact).
float cpu_row_dot(const std::vector<uint8_t>& w, const std::vector<uint8_t>& ws, size_t row, int k,
                  const uint8_t* a, const float* as, int split_kb) {
  const int nkb = k / 32;
  float total = 0.f;
  for (int s0 = 0; s0 < nkb; s0 += split_kb) {
    float acc = 0.f;
    for (int kb = s0; kb < std::min(nkb, s0 + split_kb); ++kb) {
      double part = 0;
      for (int i = 0; i < 32; ++i)
        part += double(e2m1_at(w, row * k + kb * 32 + i)) * core::e4m3_to_float(a[kb * 32 + i]);
      const float sw = core::e8m0_to_float(ws[row * nkb + kb]);
      acc = std::fma(float(part) * as[kb], sw, acc);
    }
    total = s0 == 0 ? acc : total + acc;
  }
  return total;
}

// out [m, dim]: the reference MoE (routed part) with the kernels' summation order.
std::vector<float> cpu_moe(const Experts& x, const std::vector<uint8_t>& codes,
                           const std::vector<float>& scales, const std::vector<int>& idx,
                           const std::vector<float>& wts, int m, int topk) {
  const int dim = x.dim, inter = x.inter;
  std::vector<float> out(size_t(m) * dim, 0.f);
  for (int t = 0; t < m; ++t) {
    std::vector<int> order(topk);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return idx[t * topk + a] < idx[t * topk + b]; });
    const uint8_t* a = &codes[size_t(t) * dim];
    const float* as = &scales[size_t(t) * dim / 32];
    for (int kk : order) {
      const int e = idx[t * topk + kk];
      const float wt = wts[t * topk + kk];
      std::vector<float> h(inter);
      for (int i = 0; i < inter; ++i) {
        const size_t row = size_t(e) * inter + i;
        float g = core::round_bf16(cpu_row_dot(x.w1, x.w1s, row, dim, a, as, kSplitKb));
        float u = core::round_bf16(cpu_row_dot(x.w3, x.w3s, row, dim, a, as, kSplitKb));
        u = std::clamp(u, -kLimit, kLimit);
        g = std::min(g, kLimit);
        h[i] = core::round_bf16(wt * ((g / (1.0f + std::exp(-g))) * u));
      }
      std::vector<uint8_t> hc(inter);
      std::vector<float> hs(inter / 32);
      for (int b = 0; b < inter / 32; ++b)
        hs[b] = core::quantize_fp8_block(&h[b * 32], 32, &hc[b * 32]);
      for (int n = 0; n < dim; ++n) {
        const float y = core::round_bf16(
            cpu_row_dot(x.w2, x.w2s, size_t(e) * dim + n, inter, hc.data(), hs.data(), 1 << 30));
        out[size_t(t) * dim + n] += y;
      }
    }
  }
  return out;
}

struct DeviceExperts {
  DeviceBuffer<uint8_t> w1, w1s, w3, w3s, w2, w2s;
  explicit DeviceExperts(const Experts& x)
      : w1(x.w1), w1s(x.w1s), w3(x.w3), w3s(x.w3s), w2(x.w2), w2s(x.w2s) {}
  Fp4ExpertsView view(const Experts& x) const {
    return {w1.get(), w1s.get(), w3.get(), w3s.get(), w2.get(), w2s.get(), x.E, x.dim, x.inter};
  }
};

std::vector<float> gpu_moe(const MoeFp4& moe, const DeviceExperts& dx, const Experts& x,
                           const std::vector<uint8_t>& codes, const std::vector<float>& scales,
                           const std::vector<int>& idx, const std::vector<float>& wts, int m) {
  DeviceBuffer<uint8_t> a(codes);
  DeviceBuffer<float> as(scales);
  DeviceBuffer<int> di(idx);
  DeviceBuffer<float> dw(wts);
  DeviceBuffer<float> out(size_t(m) * x.dim);
  out.poison();
  moe.run(dx.view(x), QuantActView{a.get(), as.get(), m, x.dim}, di.get(), dw.get(), kLimit,
          out.get(), nullptr);
  sync_and_check();
  return out.download();
}

void random_inputs(int m, int dim, int E, int topk, std::mt19937& rng, std::vector<uint8_t>& codes,
                   std::vector<float>& scales, std::vector<int>& idx, std::vector<float>& wts) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> xv(size_t(m) * dim);
  for (auto& v : xv) v = core::round_bf16(nd(rng));
  codes.assign(xv.size(), 0);
  scales.assign(xv.size() / 32, 0.f);
  for (size_t b = 0; b < xv.size() / 32; ++b)
    scales[b] = core::quantize_fp8_block(&xv[b * 32], 32, &codes[b * 32]);
  idx.clear();
  wts.clear();
  std::uniform_real_distribution<float> ud(0.05f, 0.6f);
  for (int t = 0; t < m; ++t) {
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int k = 0; k < topk; ++k) {
      idx.push_back(perm[k]);
      wts.push_back(ud(rng));
    }
  }
}

TEST(CudaMoeFp4, MatchesCpuReference) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(21);
  const int topk = 6;
  // (experts, dim, inter): a small shape (2 K splits) and the model's TP8 slice (10 K splits).
  const int shapes[][3] = {{16, 1024, 96}, {24, 5120, 288}};
  for (const auto& s : shapes) {
    const Experts x = random_experts(s[0], s[1], s[2], rng);
    const DeviceExperts dx(x);
    MoeFp4 moe(x.dim, x.inter, topk, device_sm_count());
    for (int m : {1, 4, 8}) {
      std::vector<uint8_t> codes;
      std::vector<float> scales, wts;
      std::vector<int> idx;
      random_inputs(m, x.dim, x.E, topk, rng, codes, scales, idx, wts);
      const auto got = gpu_moe(moe, dx, x, codes, scales, idx, wts, m);
      const auto want = cpu_moe(x, codes, scales, idx, wts, m, topk);
      double err2 = 0, ref2 = 0;
      int exact = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got[i])) << "unwritten or NaN output " << i;
        const double e = double(got[i]) - want[i];
        err2 += e * e;
        ref2 += double(want[i]) * want[i];
        exact += bits_equal(got[i], want[i]);
      }
      const double rel = std::sqrt(err2 / ref2);
      std::printf("moe_fp4 E=%d dim=%d inter=%d m=%d: |err|/|ref| = %.3g, bitwise equal %d/%zu\n",
                  x.E, x.dim, x.inter, m, rel, exact, got.size());
      // Same fp32 operations in the same order; differences come only from expf (1 ulp) or a
      // tensor-core partial that is not exact, flipping a bf16 or fp8 rounding now and then.
      EXPECT_LE(rel, 1e-4);
      EXPECT_GE(exact, int(0.99 * got.size()));
    }
  }
}

TEST(CudaMoeFp4, RowResultIndependentOfOtherRows) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(22);
  const int topk = 6;
  const Experts x = random_experts(12, 1024, 64, rng);  // 12 experts: rows share experts
  const DeviceExperts dx(x);
  MoeFp4 moe(x.dim, x.inter, topk, device_sm_count());
  std::vector<uint8_t> codes;
  std::vector<float> scales, wts;
  std::vector<int> idx;
  random_inputs(8, x.dim, x.E, topk, rng, codes, scales, idx, wts);
  const auto full = gpu_moe(moe, dx, x, codes, scales, idx, wts, 8);
  for (int t = 0; t < 8; ++t) {
    std::vector<uint8_t> c1(codes.begin() + size_t(t) * x.dim,
                            codes.begin() + size_t(t + 1) * x.dim);
    std::vector<float> s1(scales.begin() + size_t(t) * x.dim / 32,
                          scales.begin() + size_t(t + 1) * x.dim / 32);
    std::vector<int> i1(idx.begin() + t * topk, idx.begin() + (t + 1) * topk);
    std::vector<float> w1(wts.begin() + t * topk, wts.begin() + (t + 1) * topk);
    std::reverse(i1.begin(), i1.end());  // the order of a row's top-k list must not matter
    std::reverse(w1.begin(), w1.end());
    const auto one = gpu_moe(moe, dx, x, c1, s1, i1, w1, 1);
    for (int n = 0; n < x.dim; ++n)
      ASSERT_TRUE(bits_equal(one[n], full[size_t(t) * x.dim + n])) << "row " << t << " n " << n;
  }
}

// The persistent w13 kernel copies the input codes into shared memory with 16-byte cp.async
// pieces: a misaligned input is refused with a clear error instead of a fault or wrong reads.
TEST(CudaMoeFp4, RefusesMisalignedInputCodes) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(23);
  const int topk = 6;
  const Experts x = random_experts(8, 1024, 64, rng);
  const DeviceExperts dx(x);
  MoeFp4 moe(x.dim, x.inter, topk, device_sm_count());
  std::vector<uint8_t> codes;
  std::vector<float> scales, wts;
  std::vector<int> idx;
  random_inputs(4, x.dim, x.E, topk, rng, codes, scales, idx, wts);
  codes.resize(codes.size() + 16);
  DeviceBuffer<uint8_t> a(codes);
  DeviceBuffer<float> as(scales);
  DeviceBuffer<int> di(idx);
  DeviceBuffer<float> dw(wts);
  DeviceBuffer<float> out(size_t(4) * x.dim);
  const Fp4ExpertsView w = dx.view(x);
  EXPECT_THROW(moe.run(w, QuantActView{a.get() + 8, as.get(), 4, x.dim}, di.get(), dw.get(), kLimit,
                       out.get(), nullptr),
               std::exception);
  // The aligned input still runs.
  moe.run(w, QuantActView{a.get(), as.get(), 4, x.dim}, di.get(), dw.get(), kLimit, out.get(),
          nullptr);
  sync_and_check();
}

TEST(CudaSwigluQuant, MatchesCpu) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0.f, 8.f);
  const int m = 5, inter = 288;
  std::vector<float> gu(size_t(m) * 2 * inter);
  for (auto& v : gu) v = nd(rng);
  DeviceBuffer<float> dgu(gu);
  DeviceBuffer<uint8_t> codes(size_t(m) * inter);
  DeviceBuffer<float> scales(size_t(m) * inter / 32);
  codes.poison();
  scales.poison();
  swiglu_quant_fp8(dgu.get(), m, inter, kLimit, codes.get(), scales.get(), nullptr);
  sync_and_check();
  const auto gc = codes.download();
  const auto gs = scales.download();
  int same = 0;
  for (int t = 0; t < m; ++t) {
    std::vector<float> h(inter);
    for (int i = 0; i < inter; ++i) {
      float g = core::round_bf16(gu[size_t(t) * 2 * inter + i]);
      float u = core::round_bf16(gu[size_t(t) * 2 * inter + inter + i]);
      u = std::clamp(u, -kLimit, kLimit);
      g = std::min(g, kLimit);
      h[i] = core::round_bf16((g / (1.0f + std::exp(-g))) * u);
    }
    for (int b = 0; b < inter / 32; ++b) {
      uint8_t c[32];
      const float s = core::quantize_fp8_block(&h[b * 32], 32, c);
      EXPECT_TRUE(bits_equal(s, gs[size_t(t) * inter / 32 + b]));
      for (int i = 0; i < 32; ++i) {
        const uint8_t got = gc[size_t(t) * inter + b * 32 + i];
        same += got == c[i];
        // expf may differ by an ulp between host and device: at most one e4m3 step apart.
        EXPECT_LE(std::fabs(core::e4m3_to_float(got) - core::e4m3_to_float(c[i])),
                  std::fabs(core::e4m3_to_float(c[i])) * 0.125f + 1e-30f);
      }
    }
  }
  EXPECT_GE(same, int(0.99 * m * inter));
}

}  // namespace
}  // namespace uf::cuda::test
