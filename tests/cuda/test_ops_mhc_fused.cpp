// The fused mHC ops (hc_mixes_partial, hc_post_mixes, hc_mix_pre_norm, hc_pre_norm; ops/mhc.cu)
// and the register-resident rms_norm (ops/norm_rope.cu) against the unfused device ops and the
// CPU reference, on fresh random inputs at small odd shapes and at the real ones (hc 4, dim 5120),
// for every row count 1..8 plus 20 (several hc_post_mixes row groups).
//
// Claims and tolerances:
//  - bitwise vs the unfused device ops: hc_mixes_partial's partials == hc_mixes' scratch (hc_mixes
//    runs the same channel-split kernel); hc_mix_pre_norm's pre / post / comb == hc_mixes' ==
//    hc_mixes_finish's (the same finish: split-order sum, r and Sinkhorn); its y == hc_pre +
//    rms_norm (the same partition of the row); hc_post_mixes' out == hc_post, its partials ==
//    hc_mixes' scratch over that out; a chain of two sublayers (layer()'s data flow) == the
//    unfused chain.
//  - vs the CPU: hc_post bitwise; the mixes |err| <= 1e-4 and rms_norm outputs 1 bf16 ulp on at
//    most 0.5% of the elements (the reasons are in test_ops_elementwise.cpp's header). With mixes
//    that are exact in any order (one nonzero stream value per row: fn . v is one product, |v|^2
//    is 1) only CUDA's expf (<= 2 ulp) differs from the CPU, through sigmoid, softmax and the
//    Sinkhorn's divisions (which do not amplify relative errors): |err| <= 5e-6 on pre / post /
//    comb (values <= 2; ~40 fp32 ulps of 1), a check of the register Sinkhorn's operation order
//    20x tighter than the general bound.
//  - spec == plain: row t of a T-row call is bitwise the 1-row call on row t, for every t of T = 5,
//    7 and 8.
//  - bitwise vs the session-6 kernels (set_mhc_legacy_kernels): hc_post_mixes, hc_mixes_partial
//    and hc_mix_pre_norm give the same bits as the kernels they replace, for every shape and row
//    count above (the restructuring keeps every operation and order).
// Outputs and scratch are poisoned with NaN first; a NaN anywhere fails. Failures print the count
// of bad elements, NaNs, max abs / rel error and the first bad index with both values.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "cpu/mhc.h"
#include "cpu/norm.h"
#include "cuda/device_memory.h"
#include "cuda/device_weights.h"
#include "cuda/ops/elementwise.h"
#include "cuda_test_util.h"
#include "model/weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

// ---- comparison ----

enum class Mode { kBitwise, kBf16Ulp, kAbs };
struct Tol {
  Mode mode = Mode::kBitwise;
  double frac = 0;  // kBf16Ulp: share of elements allowed 1 bf16 ulp off
  double atol = 0;  // kAbs
};

int bf16_key(float f) {
  const uint32_t b = core::float_to_bits(f) >> 16;
  return (b & 0x8000u) ? -int(b & 0x7fffu) : int(b);
}

::testing::AssertionResult compare(const std::string& what, const std::vector<float>& got,
                                   const std::vector<float>& want, const Tol& tol = {}) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << what << ": size " << got.size() << " != " << want.size();
  size_t nan = 0, inexact = 0, bad = 0, first = SIZE_MAX;
  double max_abs = 0, max_rel = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = got[i], w = want[i];
    if (std::isnan(g) || std::isnan(w)) ++nan;
    if (bits_equal(g, w) && !std::isnan(g)) continue;
    ++inexact;
    bool ok = false;
    if (!std::isnan(g) && !std::isnan(w)) {
      const double d = std::fabs(double(g) - double(w));
      max_abs = std::max(max_abs, d);
      max_rel = std::max(max_rel, d / std::max(std::fabs(double(w)), 1e-30));
      if (tol.mode == Mode::kBf16Ulp)
        ok = (core::float_to_bits(g) & 0xffffu) == 0 && std::abs(bf16_key(g) - bf16_key(w)) <= 1;
      else if (tol.mode == Mode::kAbs)
        ok = d <= tol.atol;
    }
    if (!ok && bad++ == 0) first = i;
  }
  const bool too_many =
      tol.mode == Mode::kBf16Ulp && double(inexact) > tol.frac * double(got.size());
  char line[512];
  std::snprintf(line, sizeof(line),
                "%s: n=%zu inexact=%zu bad=%zu NaN=%zu max_abs=%.3g max_rel=%.3g", what.c_str(),
                got.size(), inexact, bad, nan, max_abs, max_rel);
  if (bad == 0 && !too_many) return ::testing::AssertionSuccess();
  auto r = ::testing::AssertionFailure() << line;
  if (too_many) r << " (more than " << tol.frac * 100 << "% inexact)";
  if (first != SIZE_MAX) {
    char b[200];
    std::snprintf(b, sizeof(b), "; first bad index %zu: got %.9g (%a) want %.9g (%a)", first,
                  double(got[first]), double(got[first]), double(want[first]), double(want[first]));
    r << b;
  }
  return r;
}

std::vector<float> slice(const std::vector<float>& v, size_t off, size_t n) {
  return std::vector<float>(v.begin() + int64_t(off), v.begin() + int64_t(off + n));
}

// ---- random data ----

// T rows of n values: N(0, 1) times a per-row power of two in [2^-4, 2^4]; odd rows rounded to
// bf16 (the stream is bf16-valued), even rows arbitrary fp32.
std::vector<float> random_rows(int T, int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> e(-4, 4);
  std::vector<float> x(size_t(T) * size_t(n));
  for (int t = 0; t < T; ++t) {
    const float s = std::ldexp(1.0f, e(rng));
    for (int64_t i = 0; i < n; ++i) {
      float v = nd(rng) * s;
      if (t & 1) v = core::round_bf16(v);
      x[size_t(t) * size_t(n) + size_t(i)] = v;
    }
  }
  return x;
}

std::vector<float> uniform(size_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// A model::Weight (F32 or BF16) with host storage; vectors bind as [n, 1].
struct HostWeight {
  std::vector<uint8_t> data;
  model::Weight w;
};

HostWeight make_weight(WFormat fmt, int64_t rows, int64_t cols, std::mt19937& rng, float mean,
                       float sd) {
  HostWeight h;
  h.w.format = fmt;
  h.w.rows = rows;
  h.w.cols = cols;
  h.w.name = "test";
  const size_t n = size_t(rows) * size_t(cols);
  std::normal_distribution<float> nd(mean, sd);
  if (fmt == WFormat::kBF16) {
    h.data.resize(2 * n);
    for (size_t i = 0; i < n; ++i) {
      const uint16_t v = core::float_to_bf16(nd(rng));
      std::memcpy(&h.data[2 * i], &v, 2);
    }
  } else {
    h.data.resize(4 * n);
    for (size_t i = 0; i < n; ++i) {
      const float v = nd(rng);
      std::memcpy(&h.data[4 * i], &v, 4);
    }
  }
  h.w.data = h.data.data();
  return h;
}

cpu::HcParams to_cpu(const HcShape& p) {
  return cpu::HcParams{p.hc, p.dim, p.sinkhorn_iters, p.norm_eps, p.hc_eps};
}

// One sublayer's mHC weights (host + device).
struct MixWeights {
  HostWeight fn, scale, base, norm;
  DeviceWeight dfn, dscale, dbase, dnorm;
  MixWeights(const HcShape& p, WFormat fmt, std::mt19937& rng, DeviceArena& arena)
      : fn(make_weight(fmt, (2 + p.hc) * p.hc, int64_t(p.hc) * p.dim, rng, 0.f,
                       1.0f / std::sqrt(float(p.hc * p.dim)))),
        scale(make_weight(WFormat::kF32, 3, 1, rng, 1.0f, 0.3f)),
        base(make_weight(WFormat::kF32, (2 + p.hc) * p.hc, 1, rng, 0.f, 1.0f)),
        norm(make_weight(fmt, p.dim, 1, rng, 1.0f, 0.3f)) {
    dfn = upload_weight(fn.w, arena);
    dscale = upload_weight(scale.w, arena);
    dbase = upload_weight(base.w, arena);
    dnorm = upload_weight(norm.w, arena);
  }
};

struct Shape {
  int hc, dim;
  WFormat fmt;
};
// Small odd shapes (chunks straddling streams, a partial last chunk, dim % 4 != 0, hc 8 with 81
// partial values per chunk; F32 dim 200: a partial last 32-channel block whose whole
// 16-byte pieces hc_post_mixes stages by cp.async and the rest by scalar loads) and the real ones.
const Shape kShapes[] = {{4, 256, WFormat::kF32},  {3, 200, WFormat::kBF16},
                         {2, 202, WFormat::kF32},  {8, 64, WFormat::kBF16},
                         {4, 5120, WFormat::kF32}, {4, 5120, WFormat::kBF16},
                         {4, 200, WFormat::kF32}};
const int kRows[] = {1, 2, 3, 4, 5, 6, 7, 8, 20};

HcShape shape_of(const Shape& s) { return HcShape{s.hc, s.dim, 20, 1e-6f, 1e-6f}; }
std::string name_of(const Shape& s, int T) {
  return "hc=" + std::to_string(s.hc) + " dim=" + std::to_string(s.dim) +
         (s.fmt == WFormat::kBF16 ? " BF16" : " F32") + " T=" + std::to_string(T);
}

// Outputs of the fused mixes + collapse + norm on T rows.
struct MixOut {
  std::vector<float> partial, pre, post, comb, y;
};

MixOut run_fused_mixes(const HcShape& p, const MixWeights& mw, const float* dX, const float* dpin,
                       int T, float eps) {
  const int hc = p.hc;
  DeviceBuffer<float> part(hc_mixes_scratch_floats(p, T)), pre(size_t(T) * hc),
      post(size_t(T) * hc), comb(size_t(T) * hc * hc), y(size_t(T) * p.dim);
  part.poison();
  pre.poison();
  post.poison();
  comb.poison();
  y.poison();
  hc_mixes_partial(p, mw.dfn, dX, T, part.get(), nullptr);
  sync_and_check();
  MixOut o;
  o.partial = part.download();
  hc_mix_pre_norm(p, mw.dscale, mw.dbase, part.get(), dX, dpin, mw.dnorm, eps, T, y.get(),
                  pre.get(), post.get(), comb.get(), nullptr);
  sync_and_check();
  o.pre = pre.download();
  o.post = post.download();
  o.comb = comb.download();
  o.y = y.download();
  return o;
}

// ---- rms_norm (the new partition) ----

TEST(CudaMhcFused, RmsNormMatchesCpuAndIsLayoutIndependent) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(301);
  const float eps = 1e-6f;
  // 20000: more vectors than 4 per thread of the 1024-thread cap (the reload loop).
  for (WFormat fmt : {WFormat::kBF16, WFormat::kF32})
    for (int n : {100, 128, 202, 512, 1280, 5120, 20000})
      for (int T : {1, 3, 8}) {
        const std::string what = std::string("rms_norm ") +
                                 (fmt == WFormat::kBF16 ? "BF16" : "F32") +
                                 " n=" + std::to_string(n) + " T=" + std::to_string(T);
        HostWeight hw = make_weight(fmt, n, 1, rng, 1.0f, 0.3f);
        const auto x = random_rows(T, n, rng);
        std::vector<float> want(x.size());
        cpu::rms_norm(hw.w, eps, x.data(), T, n, want.data());
        DeviceArena arena;
        const DeviceWeight dw = upload_weight(hw.w, arena);
        DeviceBuffer<float> dx(x), dy(x.size());
        dy.poison();
        rms_norm(dw, eps, dx.get(), T, n, dy.get(), nullptr);
        sync_and_check();
        const auto got = dy.download();
        EXPECT_TRUE(compare(what + " vs CPU", got, want, Tol{Mode::kBf16Ulp, 0.005}));
        for (int k = 0; k < T; ++k) {  // spec == plain
          DeviceBuffer<float> one(static_cast<size_t>(n));
          one.poison();
          rms_norm(dw, eps, dx.get() + int64_t(k) * n, 1, n, one.get(), nullptr);
          sync_and_check();
          EXPECT_TRUE(compare(what + " row " + std::to_string(k) + " alone", one.download(),
                              slice(got, size_t(k) * n, size_t(n))));
        }
        // Misaligned rows (scalar loads) give the same bits as aligned ones (vector loads).
        DeviceBuffer<float> mx(x.size() + 1), my(x.size() + 1);
        UF_CUDA_CHECK(
            cudaMemcpy(mx.get() + 1, dx.get(), x.size() * sizeof(float), cudaMemcpyDeviceToDevice));
        my.poison();
        rms_norm(dw, eps, mx.get() + 1, T, n, my.get() + 1, nullptr);
        sync_and_check();
        EXPECT_TRUE(compare(what + " misaligned", slice(my.download(), 1, x.size()), got));
        // In place.
        rms_norm(dw, eps, dx.get(), T, n, dx.get(), nullptr);
        sync_and_check();
        EXPECT_TRUE(compare(what + " in place", dx.download(), got));
      }
}

// ---- hc_mixes_partial + hc_mix_pre_norm vs hc_mixes + hc_pre + rms_norm ----

TEST(CudaMhcFused, MixPreNormMatchesUnfused) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(302);
  const float eps = 1e-6f;
  for (const Shape& sh : kShapes)
    for (int T : kRows) {
      const HcShape p = shape_of(sh);
      const int hc = p.hc, D = p.dim, n = hc * D;
      const std::string what = "mix_pre_norm " + name_of(sh, T);
      DeviceArena arena;
      const MixWeights mw(p, sh.fmt, rng, arena);
      const auto X = random_rows(T, n, rng);
      const auto pin = uniform(size_t(T) * hc, 0.f, 1.f, rng);
      DeviceBuffer<float> dX(X), dpin(pin);
      // Unfused device path.
      DeviceBuffer<float> scr(hc_mixes_scratch_floats(p, T)), upre(size_t(T) * hc),
          upost(size_t(T) * hc), ucomb(size_t(T) * hc * hc), ux(size_t(T) * D);
      scr.poison();
      upre.poison();
      upost.poison();
      ucomb.poison();
      ux.poison();
      hc_mixes(p, mw.dfn, mw.dscale, mw.dbase, dX.get(), T, upre.get(), upost.get(), ucomb.get(),
               scr.get(), nullptr);
      hc_pre(p, dX.get(), dpin.get(), T, ux.get(), nullptr);
      rms_norm(mw.dnorm, eps, ux.get(), T, D, ux.get(), nullptr);
      sync_and_check();
      const MixOut f = run_fused_mixes(p, mw, dX.get(), dpin.get(), T, eps);
      EXPECT_TRUE(compare(what + " partials vs hc_mixes scratch", f.partial, scr.download()));
      EXPECT_TRUE(compare(what + " pre vs hc_mixes", f.pre, upre.download()));
      EXPECT_TRUE(compare(what + " post vs hc_mixes", f.post, upost.download()));
      EXPECT_TRUE(compare(what + " comb vs hc_mixes", f.comb, ucomb.download()));
      EXPECT_TRUE(compare(what + " y vs hc_pre + rms_norm", f.y, ux.download()));
      {  // the finish alone (a forked branch of the step) gives the same bits
        DeviceBuffer<float> fpre(size_t(T) * hc), fpost(size_t(T) * hc), fcomb(size_t(T) * hc * hc),
            part(f.partial);
        fpre.poison();
        fpost.poison();
        fcomb.poison();
        hc_mixes_finish(p, mw.dscale, mw.dbase, part.get(), T, fpre.get(), fpost.get(), fcomb.get(),
                        nullptr);
        sync_and_check();
        EXPECT_TRUE(compare(what + " hc_mixes_finish pre", fpre.download(), f.pre));
        EXPECT_TRUE(compare(what + " hc_mixes_finish post", fpost.download(), f.post));
        EXPECT_TRUE(compare(what + " hc_mixes_finish comb", fcomb.download(), f.comb));
      }
      // CPU reference.
      std::vector<float> wpre(size_t(T) * hc), wpost(size_t(T) * hc), wcomb(size_t(T) * hc * hc),
          wc(size_t(T) * D), wy(size_t(T) * D);
      cpu::hc_mixes(to_cpu(p), mw.fn.w, mw.scale.w, mw.base.w, X.data(), T, wpre.data(),
                    wpost.data(), wcomb.data());
      cpu::hc_pre(to_cpu(p), X.data(), pin.data(), T, wc.data());
      cpu::rms_norm(mw.norm.w, eps, wc.data(), T, D, wy.data());
      const Tol mt{Mode::kAbs, 0, 1e-4};
      EXPECT_TRUE(compare(what + " pre vs CPU", f.pre, wpre, mt));
      EXPECT_TRUE(compare(what + " post vs CPU", f.post, wpost, mt));
      EXPECT_TRUE(compare(what + " comb vs CPU", f.comb, wcomb, mt));
      EXPECT_TRUE(compare(what + " y vs CPU", f.y, wy, Tol{Mode::kBf16Ulp, 0.005}));
      // hc_pre_norm (no mixes): the same y.
      DeviceBuffer<float> y2(size_t(T) * D);
      y2.poison();
      hc_pre_norm(p, dX.get(), dpin.get(), mw.dnorm, eps, T, y2.get(), nullptr);
      sync_and_check();
      EXPECT_TRUE(compare(what + " hc_pre_norm y", y2.download(), f.y));
      if (T != 5 && T != 7 && T != 8) continue;  // spec == plain at 5, 7 and 8 rows
      // spec == plain: every row alone.
      const size_t S1 = f.partial.size() / size_t(T);
      for (int k = 0; k < T; ++k) {
        const std::string rk = what + " row " + std::to_string(k) + " alone";
        const MixOut o =
            run_fused_mixes(p, mw, dX.get() + int64_t(k) * n, dpin.get() + k * hc, 1, eps);
        EXPECT_TRUE(compare(rk + " partials", o.partial, slice(f.partial, k * S1, S1)));
        EXPECT_TRUE(compare(rk + " pre", o.pre, slice(f.pre, size_t(k) * hc, hc)));
        EXPECT_TRUE(compare(rk + " post", o.post, slice(f.post, size_t(k) * hc, hc)));
        EXPECT_TRUE(compare(rk + " comb", o.comb, slice(f.comb, size_t(k) * hc * hc, hc * hc)));
        EXPECT_TRUE(compare(rk + " y", o.y, slice(f.y, size_t(k) * D, D)));
      }
    }
}

// Mixes exact in any summation order (row t: X = 0 except X[t, c_t] = +-1), so pre / post / comb
// differ from the CPU's only through expf: the Sinkhorn's operations and order, for several
// iteration counts (1: only the first column normalisation) and hc (8: two comb elements a lane).
TEST(CudaMhcFused, FinishWithExactMixesIsCloseToCpu) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(306);
  const float eps = 1e-6f;
  for (const Shape& sh : {kShapes[4], kShapes[3], kShapes[1]})
    for (int iters : {1, 2, 20}) {
      HcShape p = shape_of(sh);
      p.sinkhorn_iters = iters;
      const int hc = p.hc, n = hc * p.dim, T = 5;
      const std::string what = "exact mixes " + name_of(sh, T) + " iters=" + std::to_string(iters);
      DeviceArena arena;
      MixWeights mw(p, sh.fmt, rng, arena);
      // r = 1 / sqrt(1 / n + norm_eps) ~ sqrt(n): fn ~ N(0, 4 / n) gives mixes ~ N(0, 4), the
      // sigmoids' and the softmax's curved parts (larger ones saturate them).
      const HostWeight fn =
          make_weight(sh.fmt, (2 + hc) * hc, n, rng, 0.f, 2.0f / std::sqrt(float(n)));
      mw.dfn = upload_weight(fn.w, arena);
      std::vector<float> X(size_t(T) * n, 0.f);
      std::uniform_int_distribution<int> pick(0, n - 1);
      for (int t = 0; t < T; ++t) X[size_t(t) * n + size_t(pick(rng))] = (t & 1) ? -1.f : 1.f;
      const auto pin = uniform(size_t(T) * hc, 0.f, 1.f, rng);
      DeviceBuffer<float> dX(X), dpin(pin);
      const MixOut f = run_fused_mixes(p, mw, dX.get(), dpin.get(), T, eps);
      std::vector<float> wpre(size_t(T) * hc), wpost(size_t(T) * hc), wcomb(size_t(T) * hc * hc);
      cpu::hc_mixes(to_cpu(p), fn.w, mw.scale.w, mw.base.w, X.data(), T, wpre.data(), wpost.data(),
                    wcomb.data());
      const Tol tight{Mode::kAbs, 0, 5e-6};
      EXPECT_TRUE(compare(what + " pre vs CPU", f.pre, wpre, tight));
      EXPECT_TRUE(compare(what + " post vs CPU", f.post, wpost, tight));
      EXPECT_TRUE(compare(what + " comb vs CPU", f.comb, wcomb, tight));
    }
}

// The collapse + norm reads misaligned streams with scalar loads: same bits.
TEST(CudaMhcFused, PreNormMisalignedSameBits) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(303);
  const float eps = 1e-6f;
  for (const Shape& sh : kShapes) {
    const HcShape p = shape_of(sh);
    const int T = 5, n = p.hc * p.dim;
    DeviceArena arena;
    const MixWeights mw(p, sh.fmt, rng, arena);
    const auto X = random_rows(T, n, rng);
    const auto pin = uniform(size_t(T) * p.hc, 0.f, 1.f, rng);
    DeviceBuffer<float> dX(X), dpin(pin), y(size_t(T) * p.dim), mX(X.size() + 1),
        my(size_t(T) * p.dim + 1);
    UF_CUDA_CHECK(
        cudaMemcpy(mX.get() + 1, dX.get(), X.size() * sizeof(float), cudaMemcpyDeviceToDevice));
    y.poison();
    my.poison();
    hc_pre_norm(p, dX.get(), dpin.get(), mw.dnorm, eps, T, y.get(), nullptr);
    hc_pre_norm(p, mX.get() + 1, dpin.get(), mw.dnorm, eps, T, my.get() + 1, nullptr);
    sync_and_check();
    EXPECT_TRUE(compare("hc_pre_norm misaligned " + name_of(sh, T),
                        slice(my.download(), 1, size_t(T) * p.dim), y.download()));
  }
}

// ---- hc_post_mixes vs hc_post + hc_mixes' partials ----

struct PostOut {
  std::vector<float> out, partial;
};

PostOut run_post_mixes(const HcShape& p, const DeviceWeight& fn, const float* dx, const float* dR,
                       const float* dpost, const float* dcomb, int T) {
  DeviceBuffer<float> out(size_t(T) * p.hc * p.dim), part(hc_mixes_scratch_floats(p, T));
  out.poison();
  part.poison();
  hc_post_mixes(p, dx, dR, dpost, dcomb, T, out.get(), fn, part.get(), nullptr);
  sync_and_check();
  return PostOut{out.download(), fn.empty() ? std::vector<float>{} : part.download()};
}

TEST(CudaMhcFused, PostMixesMatchesUnfused) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(304);
  for (const Shape& sh : kShapes)
    for (int T : kRows) {
      const HcShape p = shape_of(sh);
      const int hc = p.hc, D = p.dim, n = hc * D;
      const std::string what = "post_mixes " + name_of(sh, T);
      DeviceArena arena;
      const MixWeights mw(p, sh.fmt, rng, arena);
      const auto x = random_rows(T, D, rng);
      const auto R = random_rows(T, n, rng);
      const auto post = uniform(size_t(T) * hc, 0.f, 2.f, rng);
      const auto comb = uniform(size_t(T) * hc * hc, 0.f, 1.f, rng);
      DeviceBuffer<float> dx(x), dR(R), dpost(post), dcomb(comb);
      const PostOut f = run_post_mixes(p, mw.dfn, dx.get(), dR.get(), dpost.get(), dcomb.get(), T);
      // Unfused: hc_post, then hc_mixes over its output (its scratch holds the partials).
      DeviceBuffer<float> uout(R.size()), scr(hc_mixes_scratch_floats(p, T)), a(size_t(T) * hc),
          b(size_t(T) * hc), c(size_t(T) * hc * hc);
      uout.poison();
      scr.poison();
      hc_post(p, dx.get(), dR.get(), dpost.get(), dcomb.get(), T, uout.get(), nullptr);
      hc_mixes(p, mw.dfn, mw.dscale, mw.dbase, uout.get(), T, a.get(), b.get(), c.get(), scr.get(),
               nullptr);
      sync_and_check();
      EXPECT_TRUE(compare(what + " out vs hc_post", f.out, uout.download()));
      EXPECT_TRUE(compare(what + " partials vs hc_mixes scratch", f.partial, scr.download()));
      std::vector<float> want(R.size());
      cpu::hc_post(to_cpu(p), x.data(), R.data(), post.data(), comb.data(), T, want.data());
      EXPECT_TRUE(compare(what + " out vs CPU", f.out, want));
      // Without fn: the expand alone.
      const PostOut e =
          run_post_mixes(p, DeviceWeight{}, dx.get(), dR.get(), dpost.get(), dcomb.get(), T);
      EXPECT_TRUE(compare(what + " out without fn", e.out, f.out));
      if (T != 5 && T != 7 && T != 8) continue;  // spec == plain at 5, 7 and 8 rows
      const size_t S1 = f.partial.size() / size_t(T);
      for (int k = 0; k < T; ++k) {
        const std::string rk = what + " row " + std::to_string(k) + " alone";
        const PostOut o =
            run_post_mixes(p, mw.dfn, dx.get() + int64_t(k) * D, dR.get() + int64_t(k) * n,
                           dpost.get() + k * hc, dcomb.get() + k * hc * hc, 1);
        EXPECT_TRUE(compare(rk + " out", o.out, slice(f.out, size_t(k) * n, size_t(n))));
        EXPECT_TRUE(compare(rk + " partials", o.partial, slice(f.partial, k * S1, S1)));
      }
    }
}

// ---- two sublayers in layer()'s data flow, fused vs unfused ----
// Unfused (the old layer()): R <- X; hc_mixes(attn) -> apre, apost, acomb; hc_pre(X, pre_mix);
// rms_norm; y1 (a fixed random sublayer output); hc_post(y1, R) -> X; R <- X;
// hc_mixes(ffn) -> pre_mix, fpost, fcomb; hc_pre(X, apre); rms_norm; y2; hc_post(y2, R) -> X;
// then the next layer's attention mixes over X.
// Fused (the new layer()): hc_mixes_partial(attn); hc_mix_pre_norm(attn, X, pre_mix);
// hc_post_mixes(y1, X -> R2, ffn fn); hc_mix_pre_norm(ffn, R2, apre);
// hc_post_mixes(y2, R2 -> X, next attn fn); hc_mix_pre_norm(next attn, X, pre_mix).
TEST(CudaMhcFused, LayerChainMatchesUnfused) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(305);
  const float eps = 1e-6f;
  for (const Shape& sh : {kShapes[0], kShapes[1], kShapes[4], kShapes[5]})
    for (int T : {1, 3, 8}) {
      const HcShape p = shape_of(sh);
      const int hc = p.hc, D = p.dim, n = hc * D;
      const size_t TH = size_t(T) * hc, TC = size_t(T) * hc * hc, TD = size_t(T) * D;
      const std::string what = "layer chain " + name_of(sh, T);
      DeviceArena arena;
      const MixWeights att(p, sh.fmt, rng, arena), ffn(p, sh.fmt, rng, arena),
          nxt(p, sh.fmt, rng, arena);
      const auto X0 = random_rows(T, n, rng);
      const auto y1 = random_rows(T, D, rng), y2 = random_rows(T, D, rng);
      const auto pm0 = uniform(TH, 0.f, 1.f, rng);
      DeviceBuffer<float> dy1(y1), dy2(y2);
      struct Run {
        std::vector<float> X, pre_mix, x_att, x_ffn, x_next, apre, apost, acomb, fpost, fcomb, npre,
            npost, ncomb;
      };
      auto unfused = [&] {
        DeviceBuffer<float> X(X0), R(X0.size()), pm(pm0), apre(TH), apost(TH), acomb(TC), fpost(TH),
            fcomb(TC), npre(TH), npost(TH), ncomb(TC), xa(TD), xf(TD), xn(TD),
            scr(hc_mixes_scratch_floats(p, T));
        for (auto* b : {&R, &apre, &apost, &acomb, &fpost, &fcomb, &npre, &npost, &ncomb, &xa, &xf,
                        &xn, &scr})
          b->poison();
        const size_t bytes = X0.size() * sizeof(float);
        UF_CUDA_CHECK(cudaMemcpy(R.get(), X.get(), bytes, cudaMemcpyDeviceToDevice));
        hc_mixes(p, att.dfn, att.dscale, att.dbase, X.get(), T, apre.get(), apost.get(),
                 acomb.get(), scr.get(), nullptr);
        hc_pre(p, X.get(), pm.get(), T, xa.get(), nullptr);
        rms_norm(att.dnorm, eps, xa.get(), T, D, xa.get(), nullptr);
        hc_post(p, dy1.get(), R.get(), apost.get(), acomb.get(), T, X.get(), nullptr);
        UF_CUDA_CHECK(cudaMemcpy(R.get(), X.get(), bytes, cudaMemcpyDeviceToDevice));
        hc_mixes(p, ffn.dfn, ffn.dscale, ffn.dbase, X.get(), T, pm.get(), fpost.get(), fcomb.get(),
                 scr.get(), nullptr);
        hc_pre(p, X.get(), apre.get(), T, xf.get(), nullptr);
        rms_norm(ffn.dnorm, eps, xf.get(), T, D, xf.get(), nullptr);
        hc_post(p, dy2.get(), R.get(), fpost.get(), fcomb.get(), T, X.get(), nullptr);
        hc_mixes(p, nxt.dfn, nxt.dscale, nxt.dbase, X.get(), T, npre.get(), npost.get(),
                 ncomb.get(), scr.get(), nullptr);
        hc_pre(p, X.get(), pm.get(), T, xn.get(), nullptr);
        rms_norm(nxt.dnorm, eps, xn.get(), T, D, xn.get(), nullptr);
        sync_and_check();
        return Run{X.download(),     pm.download(),    xa.download(),    xf.download(),
                   xn.download(),    apre.download(),  apost.download(), acomb.download(),
                   fpost.download(), fcomb.download(), npre.download(),  npost.download(),
                   ncomb.download()};
      };
      auto fused = [&] {
        DeviceBuffer<float> X(X0), R(X0.size()), pm(pm0), apre(TH), apost(TH), acomb(TC), fpost(TH),
            fcomb(TC), npre(TH), npost(TH), ncomb(TC), xa(TD), xf(TD), xn(TD),
            scr(hc_mixes_scratch_floats(p, T));
        for (auto* b : {&R, &apre, &apost, &acomb, &fpost, &fcomb, &npre, &npost, &ncomb, &xa, &xf,
                        &xn, &scr})
          b->poison();
        hc_mixes_partial(p, att.dfn, X.get(), T, scr.get(), nullptr);
        hc_mix_pre_norm(p, att.dscale, att.dbase, scr.get(), X.get(), pm.get(), att.dnorm, eps, T,
                        xa.get(), apre.get(), apost.get(), acomb.get(), nullptr);
        hc_post_mixes(p, dy1.get(), X.get(), apost.get(), acomb.get(), T, R.get(), ffn.dfn,
                      scr.get(), nullptr);
        hc_mix_pre_norm(p, ffn.dscale, ffn.dbase, scr.get(), R.get(), apre.get(), ffn.dnorm, eps, T,
                        xf.get(), pm.get(), fpost.get(), fcomb.get(), nullptr);
        hc_post_mixes(p, dy2.get(), R.get(), fpost.get(), fcomb.get(), T, X.get(), nxt.dfn,
                      scr.get(), nullptr);
        hc_mix_pre_norm(p, nxt.dscale, nxt.dbase, scr.get(), X.get(), pm.get(), nxt.dnorm, eps, T,
                        xn.get(), npre.get(), npost.get(), ncomb.get(), nullptr);
        sync_and_check();
        return Run{X.download(),     pm.download(),    xa.download(),    xf.download(),
                   xn.download(),    apre.download(),  apost.download(), acomb.download(),
                   fpost.download(), fcomb.download(), npre.download(),  npost.download(),
                   ncomb.download()};
      };
      const Run u = unfused(), f = fused();
      EXPECT_TRUE(compare(what + " X", f.X, u.X));
      EXPECT_TRUE(compare(what + " pre_mix", f.pre_mix, u.pre_mix));
      EXPECT_TRUE(compare(what + " attn x", f.x_att, u.x_att));
      EXPECT_TRUE(compare(what + " ffn x", f.x_ffn, u.x_ffn));
      EXPECT_TRUE(compare(what + " next attn x", f.x_next, u.x_next));
      EXPECT_TRUE(compare(what + " apre", f.apre, u.apre));
      EXPECT_TRUE(compare(what + " apost", f.apost, u.apost));
      EXPECT_TRUE(compare(what + " acomb", f.acomb, u.acomb));
      EXPECT_TRUE(compare(what + " fpost", f.fpost, u.fpost));
      EXPECT_TRUE(compare(what + " fcomb", f.fcomb, u.fcomb));
      EXPECT_TRUE(compare(what + " next pre", f.npre, u.npre));
      EXPECT_TRUE(compare(what + " next post", f.npost, u.npost));
      EXPECT_TRUE(compare(what + " next comb", f.ncomb, u.ncomb));
    }
}

// ---- the current kernels vs the session-6 ones (set_mhc_legacy_kernels) ----
// hc_post_mixes_rows_kernel (rows spread over warp groups, fn staged in shared memory) and the
// early-weight hc_mix_pre_norm keep every operation and order of the kernels they replace, so
// every output is bitwise the legacy kernels' for every shape and row count (hc 8 runs the legacy
// kernel on both sides: the new one takes hc <= 4), with 4 and 2 row groups a block
// (set_mhc_post_groups), at decode and prefill row counts. Also F32 fn at a misaligned address (the
// new kernel's scalar staging path instead of cp.async).

struct LegacyGuard {
  LegacyGuard(bool on, int groups) {
    set_mhc_legacy_kernels(on);
    set_mhc_post_groups(groups);
  }
  ~LegacyGuard() {
    set_mhc_legacy_kernels(false);
    set_mhc_post_groups(2);  // the default
  }
};

struct AllOut {
  std::vector<float> out, partial, out_nofn, mp_partial, pre, post, comb, y;
};

AllOut run_all(const HcShape& p, const MixWeights& mw, const DeviceWeight& fn, const float* dx,
               const float* dR, const float* dpost, const float* dcomb, const float* dpin, int T,
               float eps, bool legacy, int groups) {
  LegacyGuard guard(legacy, groups);
  AllOut a;
  const PostOut f = run_post_mixes(p, fn, dx, dR, dpost, dcomb, T);
  a.out = f.out;
  a.partial = f.partial;
  a.out_nofn = run_post_mixes(p, DeviceWeight{}, dx, dR, dpost, dcomb, T).out;
  const int hc = p.hc;
  DeviceBuffer<float> part(hc_mixes_scratch_floats(p, T)), pre(size_t(T) * hc),
      post(size_t(T) * hc), comb(size_t(T) * hc * hc), y(size_t(T) * p.dim);
  part.poison();
  pre.poison();
  post.poison();
  comb.poison();
  y.poison();
  hc_mixes_partial(p, fn, dR, T, part.get(), nullptr);
  hc_mix_pre_norm(p, mw.dscale, mw.dbase, part.get(), dR, dpin, mw.dnorm, eps, T, y.get(),
                  pre.get(), post.get(), comb.get(), nullptr);
  sync_and_check();
  a.mp_partial = part.download();
  a.pre = pre.download();
  a.post = post.download();
  a.comb = comb.download();
  a.y = y.download();
  return a;
}

TEST(CudaMhcFused, NewKernelsMatchLegacyBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(307);
  const float eps = 1e-6f;
  // kRows, and prefill row counts (77 and 130 end mid-block).
  const int rows[] = {1, 2, 3, 4, 5, 6, 7, 8, 20, 64, 77, 130};
  for (const Shape& sh : kShapes)
    for (int T : rows)
      for (bool misaligned : {false, true}) {
        if (misaligned && sh.fmt != WFormat::kF32) continue;
        const HcShape p = shape_of(sh);
        const int hc = p.hc, D = p.dim, n = hc * D;
        const std::string what =
            "new vs legacy " + name_of(sh, T) + (misaligned ? " fn misaligned" : "");
        DeviceArena arena;
        const MixWeights mw(p, sh.fmt, rng, arena);
        DeviceWeight fn = mw.dfn;
        DeviceBuffer<float> shifted(misaligned ? size_t((2 + hc) * hc) * size_t(n) + 1 : 1);
        if (misaligned) {
          UF_CUDA_CHECK(cudaMemcpy(shifted.get() + 1, mw.dfn.data,
                                   size_t((2 + hc) * hc) * size_t(n) * sizeof(float),
                                   cudaMemcpyDeviceToDevice));
          fn.data = reinterpret_cast<const uint8_t*>(shifted.get() + 1);
        }
        const auto x = random_rows(T, D, rng);
        const auto R = random_rows(T, n, rng);
        const auto post = uniform(size_t(T) * hc, 0.f, 2.f, rng);
        const auto comb = uniform(size_t(T) * hc * hc, 0.f, 1.f, rng);
        const auto pin = uniform(size_t(T) * hc, 0.f, 1.f, rng);
        DeviceBuffer<float> dx(x), dR(R), dpost(post), dcomb(comb), dpin(pin);
        const AllOut o = run_all(p, mw, fn, dx.get(), dR.get(), dpost.get(), dcomb.get(),
                                 dpin.get(), T, eps, true, 4);
        for (int groups : {4, 2}) {
          const AllOut c = run_all(p, mw, fn, dx.get(), dR.get(), dpost.get(), dcomb.get(),
                                   dpin.get(), T, eps, false, groups);
          const std::string wg = what + " groups=" + std::to_string(groups);
          EXPECT_TRUE(compare(wg + " hc_post_mixes out", c.out, o.out));
          EXPECT_TRUE(compare(wg + " hc_post_mixes partials", c.partial, o.partial));
          EXPECT_TRUE(compare(wg + " hc_post_mixes out without fn", c.out_nofn, o.out_nofn));
          EXPECT_TRUE(compare(wg + " hc_mixes_partial", c.mp_partial, o.mp_partial));
          EXPECT_TRUE(compare(wg + " hc_mix_pre_norm pre", c.pre, o.pre));
          EXPECT_TRUE(compare(wg + " hc_mix_pre_norm post", c.post, o.post));
          EXPECT_TRUE(compare(wg + " hc_mix_pre_norm comb", c.comb, o.comb));
          EXPECT_TRUE(compare(wg + " hc_mix_pre_norm y", c.y, o.y));
        }
      }
}

// hc_post_mixes refuses out aliasing R (a block reads every stream of its channels).
TEST(CudaMhcFused, PostMixesRejectsInPlace) {
  UF_REQUIRE_GPU();
  const HcShape p{4, 256, 20, 1e-6f, 1e-6f};
  DeviceBuffer<float> x(256), R(1024), post(4), comb(16);
  EXPECT_ANY_THROW(hc_post_mixes(p, x.get(), R.get(), post.get(), comb.get(), 1, R.get(),
                                 DeviceWeight{}, nullptr, nullptr));
}

}  // namespace
}  // namespace uf::cuda::test
