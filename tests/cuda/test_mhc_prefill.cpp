// hc_post_mixes_mma and hc_fn_terms (ops/mhc_prefill.h): the prefill mHC expand with the next
// sublayer's mixes on the bf16 tensor cores, against
//   - hc_post_mixes (ops/mhc.cu, the decode kernels): out bitwise (the same expression);
//   - an fp64 reference of each mix (sum over j of fn[m, j] * v[t, j], v = out) and of |v|^2, the
//     partials of a row summed in fp64: a split's mix is exact products summed by 2 * hc k16 mma
//     steps (at most 4 fp32 ulps of the running sum each, test_bf16_gemm.cpp's bound) and its
//     terms' additions, so |err| <= (2 hc + terms) * 2^-22 * sum|products|; hc_post_mixes'
//     serial chains (32 products and adds a stream, then the streams) within (64 + hc) * 2^-24;
//   - the finish (hc_mixes_finish) on both partials: pre / post / comb within 1e-4 (the bound the
//     mixes tests hold the device to against the CPU);
//   - itself: a row's out and partials do not depend on T (the first 77 rows of a 130- or
//     512-row call equal a 77-row call's, bitwise); every partial written (NaN-poisoned first);
//   - hc_fn_terms: hi + mid + lo == fn exactly (F32), one term == fn (BF16), zero padding rows,
//     a value three bf16 terms cannot hold (2^-140) poisons its mix with NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "cuda/device_memory.h"
#include "cuda/device_weights.h"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/mhc_prefill.h"
#include "cuda_test_util.h"
#include "model/weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

struct HostFn {
  std::vector<uint8_t> data;
  model::Weight w;
  float at(int64_t i) const {
    if (w.format == WFormat::kF32) {
      float f;
      std::memcpy(&f, &data[4 * size_t(i)], 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, &data[2 * size_t(i)], 2);
    return core::bf16_to_float(h);
  }
};

// fn [mix, hc * dim]: N(0, 1 / sqrt(n)) times a power of two per element in [2^-6, 2^2] (values
// across binades, as trained weights).
HostFn make_fn(const HcShape& p, WFormat fmt, std::mt19937& rng) {
  HostFn h;
  const int64_t rows = (2 + p.hc) * p.hc, cols = int64_t(p.hc) * p.dim;
  h.w.format = fmt;
  h.w.rows = rows;
  h.w.cols = cols;
  h.w.name = "fn";
  std::normal_distribution<float> nd(0.f, 1.0f / std::sqrt(float(cols)));
  std::uniform_int_distribution<int> e(-6, 2);
  const size_t n = size_t(rows) * size_t(cols);
  h.data.resize(n * (fmt == WFormat::kF32 ? 4 : 2));
  for (size_t i = 0; i < n; ++i) {
    const float v = std::ldexp(nd(rng), e(rng));
    if (fmt == WFormat::kF32) {
      std::memcpy(&h.data[4 * i], &v, 4);
    } else {
      const uint16_t b = core::float_to_bf16(v);
      std::memcpy(&h.data[2 * i], &b, 2);
    }
  }
  h.w.data = h.data.data();
  return h;
}

std::vector<float> random_vec(size_t n, std::mt19937& rng, float lo, float hi, bool bf16) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = bf16 ? core::round_bf16(u(rng)) : u(rng);
  return v;
}

struct Inputs {
  std::vector<float> x, R, post, comb;
};
Inputs make_inputs(const HcShape& p, int T, std::mt19937& rng) {
  const size_t n = size_t(p.hc) * size_t(p.dim);
  return Inputs{random_vec(size_t(T) * p.dim, rng, -2.f, 2.f, false),
                random_vec(size_t(T) * n, rng, -4.f, 4.f, true),
                random_vec(size_t(T) * p.hc, rng, 0.f, 2.f, false),
                random_vec(size_t(T) * p.hc * p.hc, rng, 0.f, 1.f, false)};
}

struct Out {
  std::vector<float> out, partial;
};

// hc_post_mixes_mma (mma) or hc_post_mixes on the first T rows of in.
Out run(const HcShape& p, const Inputs& in, int T, bool mma, const DeviceWeight& fn,
        const HcFnTerms& terms) {
  const size_t n = size_t(p.hc) * size_t(p.dim);
  DeviceBuffer<float> x(std::vector<float>(in.x.begin(), in.x.begin() + int64_t(T) * p.dim)),
      R(std::vector<float>(in.R.begin(), in.R.begin() + int64_t(T * n))),
      post(std::vector<float>(in.post.begin(), in.post.begin() + int64_t(T) * p.hc)),
      comb(std::vector<float>(in.comb.begin(), in.comb.begin() + int64_t(T) * p.hc * p.hc)),
      out(size_t(T) * n), part(hc_mixes_scratch_floats(p, T));
  out.poison();
  part.poison();
  if (mma) {
    hc_post_mixes_mma(p, x.get(), R.get(), post.get(), comb.get(), T, out.get(), terms, part.get(),
                      nullptr);
    sync_and_check();
  } else {
    hc_post_mixes(p, x.get(), R.get(), post.get(), comb.get(), T, out.get(), fn, part.get(),
                  nullptr);
    sync_and_check();
  }
  return Out{out.download(), part.download()};
}

size_t count_nan(const std::vector<float>& v) {
  return size_t(std::count_if(v.begin(), v.end(), [](float f) { return std::isnan(f); }));
}

struct Case {
  int hc, dim;
  WFormat fmt;
};

TEST(MhcPrefill, FnTermsAreExact) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(1601);
  for (const Case c :
       {Case{4, 5120, WFormat::kF32}, Case{4, 256, WFormat::kBF16}, Case{3, 64, WFormat::kF32}}) {
    const HcShape p{c.hc, c.dim, 20, 1e-6f, 1e-6f};
    SCOPED_TRACE("hc=" + std::to_string(c.hc) + " dim=" + std::to_string(c.dim));
    HostFn fn = make_fn(p, c.fmt, rng);
    const int mix = (2 + p.hc) * p.hc;
    const int64_t cols = fn.w.cols;
    if (c.fmt == WFormat::kF32) {  // one value three bf16 terms cannot hold (mix 1, column 3)
      const float tiny = std::ldexp(1.0f, -140);
      std::memcpy(&fn.data[4 * size_t(cols + 3)], &tiny, 4);
    }
    DeviceArena arena;
    const DeviceWeight dfn = upload_weight(fn.w, arena);
    ASSERT_TRUE(hc_post_mixes_mma_supported(p, dfn));
    const HcFnTerms t = hc_fn_terms(p, dfn, arena);  // no UploadScope: written at once
    ASSERT_FALSE(t.empty());
    const int terms = c.fmt == WFormat::kF32 ? 3 : 1;
    ASSERT_EQ(t.terms, terms);
    ASSERT_EQ(t.stride % 8, 0);
    ASSERT_GE(t.stride, mix);
    ASSERT_EQ(t.rows % 16, 0);
    ASSERT_GE(t.rows, terms * t.stride);
    std::vector<uint16_t> h(size_t(t.rows) * size_t(cols));
    UF_CUDA_CHECK(cudaMemcpy(h.data(), t.w, h.size() * 2, cudaMemcpyDeviceToHost));
    size_t inexact = 0, nan_elsewhere = 0;
    for (int m = 0; m < mix; ++m)
      for (int64_t j = 0; j < cols; ++j) {
        const bool poisoned = c.fmt == WFormat::kF32 && m == 1 && j == 3;
        const double f = fn.at(int64_t(m) * cols + j);
        double sum = 0;
        for (int k = 0; k < terms; ++k)
          sum += core::bf16_to_float(h[size_t(k * t.stride + m) * size_t(cols) + size_t(j)]);
        if (poisoned) {
          EXPECT_TRUE(std::isnan(sum)) << "the 2^-140 element is not poisoned";
          continue;
        }
        if (std::isnan(sum)) ++nan_elsewhere;
        if (sum != f) ++inexact;
      }
    EXPECT_EQ(inexact, 0u);
    EXPECT_EQ(nan_elsewhere, 0u);
    for (int r = 0; r < t.rows; ++r) {
      if (r / t.stride < terms && r % t.stride < mix) continue;
      for (int64_t j = 0; j < cols; ++j)
        ASSERT_EQ(h[size_t(r) * size_t(cols) + size_t(j)], 0) << "padding row " << r;
    }
  }
}

// A shape hc_post_mixes_mma refuses gets no terms (the model keeps hc_post_mixes).
TEST(MhcPrefill, UnsupportedShapesGetNoTerms) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(1602);
  DeviceArena arena;
  for (const Case c : {Case{8, 64, WFormat::kF32}, Case{3, 204, WFormat::kF32}}) {
    const HcShape p{c.hc, c.dim, 20, 1e-6f, 1e-6f};
    const HostFn fn = make_fn(p, c.fmt, rng);
    const DeviceWeight dfn = upload_weight(fn.w, arena);
    EXPECT_FALSE(hc_post_mixes_mma_supported(p, dfn));
    EXPECT_TRUE(hc_fn_terms(p, dfn, arena).empty());
  }
}

TEST(MhcPrefill, MatchesHcPostMixesAndFp64) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(1603);
  // The real shapes; a partial last block (dim 208: 3.25 blocks, the last split half past dim
  // ... dim 200: its last split partly past dim); hc 1..3 (mix strides 8, 8, 16).
  const Case cases[] = {{4, 5120, WFormat::kF32}, {4, 5120, WFormat::kBF16},
                        {4, 256, WFormat::kF32},  {2, 208, WFormat::kF32},
                        {3, 64, WFormat::kBF16},  {1, 96, WFormat::kF32},
                        {4, 200, WFormat::kF32}};
  for (const Case& c : cases) {
    const HcShape p{c.hc, c.dim, 20, 1e-6f, 1e-6f};
    const int hc = p.hc, D = p.dim, mix = (2 + hc) * hc, M1 = mix + 1;
    const int S = (D + 31) / 32;
    const int64_t n = int64_t(hc) * D;
    DeviceArena arena;
    const HostFn fn = make_fn(p, c.fmt, rng);
    const DeviceWeight dfn = upload_weight(fn.w, arena);
    const HcFnTerms terms = hc_fn_terms(p, dfn, arena);
    ASSERT_FALSE(terms.empty());
    const int Tmax = c.dim == 5120 ? 512 : 130;
    const Inputs in = make_inputs(p, Tmax, rng);
    // Scale / base for the finish (random, as the mixes tests).
    std::vector<float> scale = random_vec(3, rng, 0.5f, 1.5f, false);
    std::vector<float> base = random_vec(size_t(mix), rng, -1.f, 1.f, false);
    model::Weight ws{}, wb{};
    ws.format = wb.format = WFormat::kF32;
    ws.rows = 3, ws.cols = 1, ws.data = reinterpret_cast<const uint8_t*>(scale.data());
    wb.rows = mix, wb.cols = 1, wb.data = reinterpret_cast<const uint8_t*>(base.data());
    ws.name = wb.name = "mix";
    const DeviceWeight dscale = upload_weight(ws, arena), dbase = upload_weight(wb, arena);
    for (int T : {9, 77, Tmax}) {
      const std::string what = "hc=" + std::to_string(hc) + " dim=" + std::to_string(D) +
                               (c.fmt == WFormat::kF32 ? " F32" : " BF16") +
                               " T=" + std::to_string(T);
      SCOPED_TRACE(what);
      const Out g = run(p, in, T, true, dfn, terms), d = run(p, in, T, false, dfn, terms);
      ASSERT_EQ(count_nan(g.out), 0u);
      ASSERT_EQ(count_nan(g.partial), 0u) << "a partial left unwritten";
      size_t out_diff = 0;
      for (size_t i = 0; i < g.out.size(); ++i) out_diff += !bits_equal(g.out[i], d.out[i]);
      EXPECT_EQ(out_diff, 0u) << "out differs from hc_post_mixes'";
      // Each mix and |v|^2 against fp64: the partials' split sum (fp64) vs the exact sum.
      const double rel_g = (2.0 * hc + terms.terms) * std::ldexp(1.0, -22);
      const double rel_d = (64.0 + hc) * std::ldexp(1.0, -24);
      double worst_g = 0, worst_d = 0;
      std::vector<double> fv(size_t(mix) * size_t(n));
      for (size_t i = 0; i < fv.size(); ++i) fv[i] = fn.at(int64_t(i));
      for (int t = 0; t < T; ++t) {
        const float* v = g.out.data() + size_t(t) * size_t(n);
        for (int m = 0; m < M1; ++m) {
          double exact = 0, mag = 0;
          for (int64_t j = 0; j < n; ++j) {
            const double prod =
                (m < mix ? fv[size_t(m) * size_t(n) + size_t(j)] : double(v[j])) * v[j];
            exact += prod;
            mag += std::fabs(prod);
          }
          double sg = 0, sd = 0;
          for (int s = 0; s < S; ++s) {
            sg += g.partial[(size_t(t) * M1 + m) * S + s];
            sd += d.partial[(size_t(t) * M1 + m) * S + s];
          }
          worst_g = std::max(worst_g, std::fabs(sg - exact) / (rel_g * mag + 1e-30));
          worst_d = std::max(worst_d, std::fabs(sd - exact) / (rel_d * mag + 1e-30));
        }
      }
      std::printf("%s: |err| / bound: mma %.3g (bound %.3g x sum|products|), hc_post_mixes %.3g\n",
                  what.c_str(), worst_g, rel_g, worst_d);
      EXPECT_LE(worst_g, 1.0);
      EXPECT_LE(worst_d, 1.0);
      // The finish on both partials.
      auto finish = [&](const std::vector<float>& part) {
        DeviceBuffer<float> dp(part), pre(size_t(T) * hc), post(size_t(T) * hc),
            comb(size_t(T) * hc * hc);
        pre.poison();
        post.poison();
        comb.poison();
        hc_mixes_finish(p, dscale, dbase, dp.get(), T, pre.get(), post.get(), comb.get(), nullptr);
        sync_and_check();
        std::vector<float> r = pre.download();
        for (auto* b : {&post, &comb}) {
          const auto v = b->download();
          r.insert(r.end(), v.begin(), v.end());
        }
        return r;
      };
      const auto fg = finish(g.partial), fd = finish(d.partial);
      double fmax = 0;
      for (size_t i = 0; i < fg.size(); ++i) {
        ASSERT_FALSE(std::isnan(fg[i])) << "finish output " << i;
        fmax = std::max(fmax, std::fabs(double(fg[i]) - fd[i]));
      }
      EXPECT_LE(fmax, 1e-4) << "pre / post / comb from the two partials";
      // Row independence: the first 77 rows alone give the same bits.
      if (T == Tmax) {
        const Out a = run(p, in, 77, true, dfn, terms);
        for (size_t i = 0; i < a.out.size(); ++i)
          ASSERT_TRUE(bits_equal(a.out[i], g.out[i])) << "out element " << i;
        // The partials' layout is [t][m][s]: the 77-row call's are a prefix.
        for (size_t i = 0; i < a.partial.size(); ++i)
          ASSERT_TRUE(bits_equal(a.partial[i], g.partial[i])) << "partial " << i;
      }
    }
  }
}

// A poisoned fn term reaches the mixes: that mix is NaN for every row, the others are not.
TEST(MhcPrefill, PoisonedTermMakesItsMixNaN) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(1604);
  const HcShape p{4, 256, 20, 1e-6f, 1e-6f};
  HostFn fn = make_fn(p, WFormat::kF32, rng);
  const int mix = (2 + p.hc) * p.hc, M1 = mix + 1, S = p.dim / 32, T = 20;
  const float tiny = std::ldexp(1.0f, -140);
  std::memcpy(&fn.data[4 * size_t(5 * fn.w.cols + 7)], &tiny, 4);  // mix 5
  DeviceArena arena;
  const DeviceWeight dfn = upload_weight(fn.w, arena);
  const HcFnTerms terms = hc_fn_terms(p, dfn, arena);
  const Inputs in = make_inputs(p, T, rng);
  const Out g = run(p, in, T, true, dfn, terms);
  for (int t = 0; t < T; ++t)
    for (int m = 0; m < M1; ++m) {
      const float v = g.partial[(size_t(t) * M1 + m) * S];
      EXPECT_EQ(std::isnan(v), m == 5) << "row " << t << " mix " << m;
    }
}

}  // namespace
}  // namespace uf::cuda::test
