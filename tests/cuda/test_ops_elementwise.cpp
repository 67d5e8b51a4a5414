// The elementwise / row-wise device ops (cuda/ops/elementwise.h) against their CPU reference
// functions on fresh random inputs, with row counts 1, 3, 8 and 300, plus spec == plain (a row's
// output is bitwise the same whether it is computed alone or among many rows).
//
// Tolerances (each op's kernel comment says where its arithmetic differs from the CPU):
//  - bitwise: quantisers, round_bf16, embed_rows, hc_pre, hc_post, tap_mean (same operations in
//    the same order, never contracted to FMA).
//  - rms_norm: the sum of squares is reduced in another order, so 1/rms may differ by a few fp32
//    ulps; that flips a bf16 rounding only when the product lies within a few 2^-24 (relative) of a
//    bf16 midpoint (~1e-4 of elements). Allowed: 1 bf16 ulp on at most 0.5% of the elements.
//  - rope: cos/sin in double as the CPU, rounded to fp32; differs only if CUDA's double sincos
//    (<= 2 double ulps) rounds to another fp32 than glibc's: allowed 1 bf16 ulp on <= 0.01%.
//  - hc_mixes: 20480-term fp32 dot products in another order (ops/mhc.cu: serial over 32
//    channels, the hc streams in order, the dim / 32 splits by lane then a butterfly, instead of
//    the CPU's serial sum; short sums in a tree round no worse: ~1e-5 absolute on O(1) mixes) and
//    CUDA's expf (<= 2 ulp) through sigmoid / softmax / Sinkhorn, which do not amplify errors of
//    that size: |err| <= 1e-4 on pre (~[0,1]), post ([0,2]) and comb ([0,1]).
//  - compress_pool: expf differs by <= 2 ulps, so each softmax weight is off by <= (r + 4) fp32
//    ulps relative and the weighted sum by that much of max |kv|: |err| <= (2r + 8) 2^-23 max|kv|.
// Outputs are poisoned with NaN first; any NaN fails (inputs are finite, except in round_bf16's
// test where NaN inputs must give the CPU's NaN bits).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "core/quant.h"
#include "cpu/compressor.h"
#include "cpu/mhc.h"
#include "cpu/norm.h"
#include "cuda/device_memory.h"
#include "cuda/device_weights.h"
#include "cuda/ops/elementwise.h"
#include "cuda_test_util.h"
#include "model/rope.h"
#include "model/weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

constexpr int kRowCounts[] = {1, 3, 8, 300};

// ---- comparison ----

enum class Mode { kBitwise, kBf16Ulp, kAbs };
struct Tol {
  Mode mode = Mode::kBitwise;
  double max_inexact_frac = 0;                 // kBf16Ulp: share of elements allowed 1 bf16 ulp off
  double atol = 0;                             // kAbs (unless bound is given)
  const std::vector<double>* bound = nullptr;  // kAbs: per-element bound
};

int bf16_key(float f) {
  const uint32_t b = core::float_to_bits(f) >> 16;
  return (b & 0x8000u) ? -int(b & 0x7fffu) : int(b);
}
bool is_bf16(float f) { return (core::float_to_bits(f) & 0xffffu) == 0; }

::testing::AssertionResult check_close(const std::string& what, const std::vector<float>& got,
                                       const std::vector<float>& want, const Tol& tol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << what << ": size " << got.size() << " != " << want.size();
  size_t nan = 0, inexact = 0, bad = 0, first_bad = SIZE_MAX;
  double max_abs = 0, max_rel = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = got[i], w = want[i];
    if (bits_equal(g, w)) continue;
    ++inexact;
    bool ok = false;
    if (std::isnan(g)) {
      ++nan;
    } else {
      const double d = std::fabs(double(g) - double(w));
      max_abs = std::max(max_abs, d);
      max_rel = std::max(max_rel, d / std::max(std::fabs(double(w)), 1e-30));
      if (tol.mode == Mode::kBf16Ulp)
        ok = is_bf16(g) && std::abs(bf16_key(g) - bf16_key(w)) <= 1;
      else if (tol.mode == Mode::kAbs)
        ok = d <= (tol.bound ? (*tol.bound)[i] : tol.atol);
    }
    if (!ok) {
      ++bad;
      if (first_bad == SIZE_MAX) first_bad = i;
    }
  }
  const bool too_many =
      tol.mode == Mode::kBf16Ulp && double(inexact) > tol.max_inexact_frac * double(got.size());
  char line[512];
  std::snprintf(line, sizeof(line),
                "%s: n=%zu inexact=%zu bad=%zu NaN=%zu max_abs=%.3g max_rel=%.3g", what.c_str(),
                got.size(), inexact, bad, nan, max_abs, max_rel);
  if (tol.mode != Mode::kBitwise) std::printf("  %s\n", line);
  if (bad == 0 && !too_many) return ::testing::AssertionSuccess();
  auto r = ::testing::AssertionFailure() << line;
  if (too_many) r << " (more than " << tol.max_inexact_frac * 100 << "% inexact)";
  if (first_bad != SIZE_MAX) {
    char b[160];
    std::snprintf(b, sizeof(b), "; first bad index %zu: got %.9g (%a) want %.9g (%a)", first_bad,
                  double(got[first_bad]), double(got[first_bad]), double(want[first_bad]),
                  double(want[first_bad]));
    r << b;
  }
  return r;
}

std::vector<float> slice(const std::vector<float>& v, size_t off, size_t n) {
  return std::vector<float>(v.begin() + int64_t(off), v.begin() + int64_t(off + n));
}

// Rows checked for spec == plain in a T-row call.
std::vector<int> probe_rows(int T) {
  if (T == 1) return {};
  return {0, T / 2, T - 1};
}

// ---- random data ----

// T rows of n values: N(0, 1) times a per-row power of two in [2^-6, 2^6]; odd rows rounded to
// bf16 (most activations are), even rows arbitrary fp32.
std::vector<float> random_rows(int T, int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> e(-6, 6);
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

// A model::Weight with host storage. Vectors bind as [n, 1] (as model::bind_weights does).
struct HostWeight {
  std::vector<uint8_t> data, scale;
  model::Weight w;
};

HostWeight make_weight(WFormat fmt, int64_t rows, int64_t cols, std::mt19937& rng, float mean,
                       float sd, bool row_scale = false) {
  HostWeight h;
  h.w.format = fmt;
  h.w.rows = rows;
  h.w.cols = cols;
  h.w.row_scale = row_scale;
  h.w.name = "test";
  const size_t n = size_t(rows) * size_t(cols);
  std::normal_distribution<float> nd(mean, sd);
  switch (fmt) {
    case WFormat::kF32: {
      h.data.resize(4 * n);
      for (size_t i = 0; i < n; ++i) {
        const float v = nd(rng);
        std::memcpy(&h.data[4 * i], &v, 4);
      }
      break;
    }
    case WFormat::kBF16: {
      h.data.resize(2 * n);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t v = core::float_to_bf16(nd(rng));
        std::memcpy(&h.data[2 * i], &v, 2);
      }
      break;
    }
    case WFormat::kFP8: {
      h.data = random_e4m3(n, rng);
      const int64_t sr = row_scale ? rows : (rows + 31) / 32;
      // Codes 0 (2^-127, an fp32 subnormal) and 1 exercise subnormal products.
      h.scale = random_bytes(size_t(sr) * size_t((cols + 31) / 32), rng, 0, 140);
      break;
    }
    case WFormat::kFP4: {
      h.data = random_bytes(n / 2, rng);
      h.scale = random_bytes(size_t(rows) * size_t(cols / 32), rng, 100, 140);
      break;
    }
  }
  h.w.data = h.data.data();
  h.w.scale = h.scale.empty() ? nullptr : h.scale.data();
  return h;
}

const char* fmt_name(WFormat f) {
  switch (f) {
    case WFormat::kF32:
      return "F32";
    case WFormat::kBF16:
      return "BF16";
    case WFormat::kFP8:
      return "FP8";
    case WFormat::kFP4:
      return "FP4";
  }
  return "?";
}

// ---- rms_norm ----

TEST(CudaOpsElementwise, RmsNormMatchesCpu) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(101);
  const float eps = 1e-6f;
  const Tol tol{Mode::kBf16Ulp, 0.005};
  for (WFormat fmt : {WFormat::kBF16, WFormat::kF32})
    for (int n : {256, 512, 5120})
      for (int T : kRowCounts) {
        const std::string what = std::string("rms_norm ") + fmt_name(fmt) +
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
        EXPECT_TRUE(check_close(what, got, want, tol));
        for (int k : probe_rows(T)) {  // spec == plain
          DeviceBuffer<float> one(static_cast<size_t>(n));
          one.poison();
          rms_norm(dw, eps, dx.get() + int64_t(k) * n, 1, n, one.get(), nullptr);
          sync_and_check();
          EXPECT_TRUE(check_close(what + " row " + std::to_string(k) + " alone", one.download(),
                                  slice(got, size_t(k) * n, size_t(n)), Tol{}));
        }
        // In place (y aliases x) gives the same bits.
        rms_norm(dw, eps, dx.get(), T, n, dx.get(), nullptr);
        sync_and_check();
        EXPECT_TRUE(check_close(what + " in place", dx.download(), got, Tol{}));
      }
}

// ---- rope ----

TEST(CudaOpsElementwise, RopeMatchesCpu) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(102);
  const Tol tol{Mode::kBf16Ulp, 1e-4};
  struct Shape {
    int rope_dim, count, n;
  };
  const Shape shapes[] = {{64, 4, 128}, {64, 64, 512}, {64, 1, 64}, {32, 3, 96}};
  const model::Rope ropes[] = {model::Rope(64, 10000.0, 0, 1.0, 32.0, 1.0),
                               model::Rope(64, 160000.0, 65536, 16.0, 32.0, 1.0)};
  const model::Rope rope32(32, 10000.0, 0, 1.0, 32.0, 1.0);
  const int64_t starts[][2] = {{0, 1}, {123457, 1}, {1000003, 4}};
  for (const Shape& s : shapes)
    for (int ri = 0; ri < 2; ++ri)
      for (const auto& ps : starts)
        for (bool inverse : {false, true})
          for (int T : kRowCounts) {
            const model::Rope& rp = s.rope_dim == 32 ? rope32 : ropes[ri];
            const int64_t row = int64_t(s.count) * s.n;
            const std::string what = "rope dim=" + std::to_string(s.rope_dim) +
                                     " count=" + std::to_string(s.count) +
                                     " n=" + std::to_string(s.n) + " yarn=" + std::to_string(ri) +
                                     " p0=" + std::to_string(ps[0]) +
                                     " inv=" + std::to_string(inverse) + " T=" + std::to_string(T);
            const auto x = random_rows(T, row, rng);
            std::vector<float> want = x;
            for (int t = 0; t < T; ++t)
              rp.apply_many(want.data() + t * row, s.count, s.n, ps[0] + t * ps[1], inverse);
            DeviceBuffer<float> freqs(rp.freqs()), dv(x);
            rope(freqs.get(), rp.dim(), dv.get(), T, s.count, s.n, ps[0], ps[1], inverse, nullptr);
            sync_and_check();
            const auto got = dv.download();
            EXPECT_TRUE(check_close(what, got, want, tol));
            for (int k : probe_rows(T)) {  // spec == plain: row k alone at its own position
              DeviceBuffer<float> one(slice(x, size_t(k * row), size_t(row)));
              rope(freqs.get(), rp.dim(), one.get(), 1, s.count, s.n, ps[0] + k * ps[1], ps[1],
                   inverse, nullptr);
              sync_and_check();
              EXPECT_TRUE(check_close(what + " row " + std::to_string(k) + " alone", one.download(),
                                      slice(got, size_t(k * row), size_t(row)), Tol{}));
            }
          }
}

// ---- quantisers ----

// Blocks of mixed character: zeros, sub-floor magnitudes, ordinary, huge (saturating) values,
// bf16 values (which hit e4m3 / e2m1 rounding ties often) and arbitrary fp32 values.
std::vector<float> random_quant_input(int64_t rows, int n, int block, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> kind(0, 15), e(-30, 30);
  std::vector<float> x(size_t(rows) * size_t(n));
  for (size_t b = 0; b < x.size(); b += size_t(block)) {
    const int k = kind(rng);
    const float s = k == 0   ? 0.f
                    : k == 1 ? 1e-38f
                    : k == 2 ? 1e-6f
                    : k == 3 ? 1e30f
                             : std::ldexp(1.0f, e(rng));
    const bool bf16 = kind(rng) < 8;
    for (int i = 0; i < block; ++i) {
      float v = nd(rng) * s;
      if (kind(rng) == 0) v = -v * 1000.f;  // an outlier inside the block
      x[b + size_t(i)] = bf16 ? core::round_bf16(v) : v;
    }
  }
  return x;
}

using CpuQdq = void (*)(float*, size_t, int);
using DevQdq = void (*)(float*, int64_t, int, int, cudaStream_t);

void check_qdq(const char* name, CpuQdq cpu_fn, DevQdq dev_fn, int block, uint32_t seed) {
  std::mt19937 rng(seed);
  for (int n : {512, 5120})
    for (int T : kRowCounts) {
      const auto x = random_quant_input(T, n, block, rng);
      std::vector<float> want = x;
      cpu_fn(want.data(), want.size(), block);
      DeviceBuffer<float> dx(x);
      dev_fn(dx.get(), T, n, block, nullptr);
      sync_and_check();
      EXPECT_TRUE(check_close(std::string(name) + " block=" + std::to_string(block) +
                                  " n=" + std::to_string(n) + " T=" + std::to_string(T),
                              dx.download(), want, Tol{}));
    }
}

// Bitwise: the same scale bits and the same roundings as core/quant.h. Since every element is
// exact, spec == plain holds trivially.
TEST(CudaOpsElementwise, QdqFp8Bitwise) {
  UF_REQUIRE_GPU();
  for (int block : {32, 128}) check_qdq("qdq_fp8", core::fake_quant_fp8, qdq_fp8, block, 103);
}
TEST(CudaOpsElementwise, QdqFp4E4m3ScaleBitwise) {
  UF_REQUIRE_GPU();
  for (int block : {16, 32})
    check_qdq("qdq_fp4_e4m3_scale", core::fake_quant_fp4_e4m3_scale, qdq_fp4_e4m3_scale, block,
              104);
}
TEST(CudaOpsElementwise, QdqFp4E8m0ScaleBitwise) {
  UF_REQUIRE_GPU();
  for (int block : {16, 32})
    check_qdq("qdq_fp4_e8m0_scale", core::fake_quant_fp4_e8m0_scale, qdq_fp4_e8m0_scale, block,
              105);
}

// Every kind of fp32: random bit patterns (NaN, inf, subnormals included), exact ties (low half
// 0x8000) and ordinary values; NaN inputs must give core::round_bf16's quiet NaN bits.
TEST(CudaOpsElementwise, RoundBf16Bitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(106);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> nd(0.f, 100.f);
  const size_t n = 1000003;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    switch (i % 3) {
      case 0:
        x[i] = core::bits_to_float(bits(rng));
        break;
      case 1:
        x[i] = core::bits_to_float((bits(rng) & 0xffff0000u) | 0x8000u);
        break;
      default:
        x[i] = nd(rng);
    }
  }
  x[0] = core::bits_to_float(0x7f800001u);  // signalling NaN
  x[1] = core::bits_to_float(0x7f7fffffu);  // rounds to inf
  std::vector<float> want(n);
  for (size_t i = 0; i < n; ++i) want[i] = core::round_bf16(x[i]);
  DeviceBuffer<float> dx(x);
  round_bf16(dx.get(), int64_t(n), nullptr);
  sync_and_check();
  const auto got = dx.download();
  size_t bad = 0, first = SIZE_MAX;
  for (size_t i = 0; i < n; ++i)
    if (!bits_equal(got[i], want[i]) && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << "first bad index " << first << ": input bits " << std::hex
                     << core::float_to_bits(x[first]) << " got " << core::float_to_bits(got[first])
                     << " want " << core::float_to_bits(want[first]);
}

// ---- mHC ----

cpu::HcParams to_cpu(const HcShape& p) {
  return cpu::HcParams{p.hc, p.dim, p.sinkhorn_iters, p.norm_eps, p.hc_eps};
}

TEST(CudaOpsElementwise, HcMixesMatchesCpu) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(107);
  const Tol tol{Mode::kAbs, 0, 1e-4};
  for (WFormat fmt : {WFormat::kF32, WFormat::kBF16})
    for (int dim : {256, 5120})
      for (int T : kRowCounts) {
        const HcShape p{4, dim, 20, 1e-6f, 1e-6f};
        const int hc = p.hc, n = hc * dim, mix = (2 + hc) * hc;
        const std::string what = std::string("hc_mixes ") + fmt_name(fmt) +
                                 " dim=" + std::to_string(dim) + " T=" + std::to_string(T);
        HostWeight fn = make_weight(fmt, mix, n, rng, 0.f, 1.0f / std::sqrt(float(n)));
        HostWeight scale = make_weight(WFormat::kF32, 3, 1, rng, 1.0f, 0.3f);
        HostWeight base = make_weight(WFormat::kF32, mix, 1, rng, 0.f, 1.0f);
        const auto X = random_rows(T, n, rng);
        std::vector<float> wpre(size_t(T) * hc), wpost(size_t(T) * hc), wcomb(size_t(T) * hc * hc);
        cpu::hc_mixes(to_cpu(p), fn.w, scale.w, base.w, X.data(), T, wpre.data(), wpost.data(),
                      wcomb.data());
        DeviceArena arena;
        const DeviceWeight dfn = upload_weight(fn.w, arena), dsc = upload_weight(scale.w, arena),
                           dbs = upload_weight(base.w, arena);
        DeviceBuffer<float> dX(X), pre(wpre.size()), post(wpost.size()), comb(wcomb.size());
        DeviceBuffer<float> scratch(hc_mixes_scratch_floats(p, T));
        scratch.poison();
        pre.poison();
        post.poison();
        comb.poison();
        hc_mixes(p, dfn, dsc, dbs, dX.get(), T, pre.get(), post.get(), comb.get(), scratch.get(),
                 nullptr);
        sync_and_check();
        const auto gpre = pre.download(), gpost = post.download(), gcomb = comb.download();
        EXPECT_TRUE(check_close(what + " pre", gpre, wpre, tol));
        EXPECT_TRUE(check_close(what + " post", gpost, wpost, tol));
        EXPECT_TRUE(check_close(what + " comb", gcomb, wcomb, tol));
        for (int k : probe_rows(T)) {  // spec == plain
          DeviceBuffer<float> p1(static_cast<size_t>(hc)), q1(static_cast<size_t>(hc)),
              c1(static_cast<size_t>(hc * hc));
          p1.poison();
          q1.poison();
          c1.poison();
          hc_mixes(p, dfn, dsc, dbs, dX.get() + int64_t(k) * n, 1, p1.get(), q1.get(), c1.get(),
                   scratch.get(), nullptr);
          sync_and_check();
          const std::string rk = what + " row " + std::to_string(k) + " alone";
          EXPECT_TRUE(
              check_close(rk + " pre", p1.download(), slice(gpre, size_t(k * hc), hc), Tol{}));
          EXPECT_TRUE(
              check_close(rk + " post", q1.download(), slice(gpost, size_t(k * hc), hc), Tol{}));
          EXPECT_TRUE(check_close(rk + " comb", c1.download(),
                                  slice(gcomb, size_t(k * hc * hc), size_t(hc * hc)), Tol{}));
        }
      }
}

std::vector<float> uniform(size_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

TEST(CudaOpsElementwise, HcPreBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(108);
  for (int dim : {256, 5120})
    for (int T : kRowCounts) {
      const HcShape p{4, dim, 20, 1e-6f, 1e-6f};
      const auto X = random_rows(T, int64_t(p.hc) * dim, rng);
      const auto w = uniform(size_t(T) * p.hc, -0.2f, 1.2f, rng);
      std::vector<float> want(size_t(T) * dim);
      cpu::hc_pre(to_cpu(p), X.data(), w.data(), T, want.data());
      DeviceBuffer<float> dX(X), dw(w), y(want.size());
      y.poison();
      hc_pre(p, dX.get(), dw.get(), T, y.get(), nullptr);
      sync_and_check();
      EXPECT_TRUE(check_close("hc_pre dim=" + std::to_string(dim) + " T=" + std::to_string(T),
                              y.download(), want, Tol{}));
    }
}

TEST(CudaOpsElementwise, HcPostBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(109);
  for (int dim : {256, 5120})
    for (int T : kRowCounts) {
      const HcShape p{4, dim, 20, 1e-6f, 1e-6f};
      const int hc = p.hc;
      const std::string what = "hc_post dim=" + std::to_string(dim) + " T=" + std::to_string(T);
      const auto x = random_rows(T, dim, rng);
      const auto R = random_rows(T, int64_t(hc) * dim, rng);
      const auto post = uniform(size_t(T) * hc, 0.f, 2.f, rng);
      const auto comb = uniform(size_t(T) * hc * hc, 0.f, 1.f, rng);
      std::vector<float> want(R.size());
      cpu::hc_post(to_cpu(p), x.data(), R.data(), post.data(), comb.data(), T, want.data());
      DeviceBuffer<float> dx(x), dR(R), dpost(post), dcomb(comb), out(R.size());
      out.poison();
      hc_post(p, dx.get(), dR.get(), dpost.get(), dcomb.get(), T, out.get(), nullptr);
      sync_and_check();
      EXPECT_TRUE(check_close(what, out.download(), want, Tol{}));
      // out aliasing R (documented as allowed by this implementation).
      hc_post(p, dx.get(), dR.get(), dpost.get(), dcomb.get(), T, dR.get(), nullptr);
      sync_and_check();
      EXPECT_TRUE(check_close(what + " in place", dR.download(), want, Tol{}));
    }
}

// ---- embedding, tap, compressor pooling ----

TEST(CudaOpsElementwise, EmbedRowsBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(110);
  struct Case {
    WFormat fmt;
    bool row_scale;
    int64_t cols;
  };
  const Case cases[] = {{WFormat::kF32, false, 256},   {WFormat::kBF16, false, 256},
                        {WFormat::kBF16, false, 5120}, {WFormat::kFP8, false, 256},
                        {WFormat::kFP8, true, 256},    {WFormat::kFP8, false, 5120},
                        {WFormat::kFP4, false, 256}};
  const int64_t V = 100;  // not a multiple of 32: a partial FP8 scale block
  const int hc = 4;
  for (const Case& c : cases)
    for (int T : kRowCounts) {
      const std::string what = std::string("embed_rows ") + fmt_name(c.fmt) +
                               (c.row_scale ? " row_scale" : "") +
                               " cols=" + std::to_string(c.cols) + " T=" + std::to_string(T);
      HostWeight tab = make_weight(c.fmt, V, c.cols, rng, 0.f, 1.f, c.row_scale);
      std::uniform_int_distribution<int32_t> id(0, int32_t(V) - 1);
      std::vector<int32_t> ids(static_cast<size_t>(T));
      for (auto& i : ids) i = id(rng);
      ids[0] = int32_t(V) - 1;
      const size_t D = size_t(c.cols);
      std::vector<float> want(size_t(T) * hc * D), want_pre(size_t(T) * hc), row(D);
      for (int t = 0; t < T; ++t) {
        tab.w.row(ids[size_t(t)], row.data());
        for (int k = 0; k < hc; ++k) {
          std::copy(row.begin(), row.end(), want.begin() + int64_t((size_t(t) * hc + k) * D));
          want_pre[size_t(t) * hc + k] = k == 0 ? 1.f : 0.f;
        }
      }
      DeviceArena arena;
      const DeviceWeight dt = upload_weight(tab.w, arena);
      DeviceBuffer<int32_t> dids(ids);
      DeviceBuffer<float> X(want.size()), pre(want_pre.size());
      X.poison();
      pre.poison();
      embed_rows(dt, dids.get(), T, hc, X.get(), pre.get(), nullptr);
      sync_and_check();
      EXPECT_TRUE(check_close(what, X.download(), want, Tol{}));
      EXPECT_TRUE(check_close(what + " pre_mix", pre.download(), want_pre, Tol{}));
    }
}

TEST(CudaOpsElementwise, TapMeanBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(111);
  const int hc = 4, taps = 3, tap = 1;
  for (int dim : {256, 5120})
    for (int T : kRowCounts) {
      const auto X = random_rows(T, int64_t(hc) * dim, rng);
      const int64_t stride = int64_t(taps) * dim;
      // CpuModel::run_layers' DSpark tap; the other taps' slots stay NaN (never written).
      std::vector<float> want(size_t(T) * size_t(stride), std::nanf(""));
      for (int t = 0; t < T; ++t)
        for (int d = 0; d < dim; ++d) {
          float sum = 0;
          for (int c = 0; c < hc; ++c) sum += X[(size_t(t) * hc + c) * dim + d];
          want[size_t(t * stride + tap * dim + d)] = core::round_bf16(sum / float(hc));
        }
      DeviceBuffer<float> dX(X), out(want.size());
      out.poison();
      tap_mean(dX.get(), T, hc, dim, out.get() + tap * dim, stride, nullptr);
      sync_and_check();
      auto got = out.download();
      size_t written_elsewhere = 0;
      for (int t = 0; t < T; ++t)
        for (int64_t i = 0; i < stride; ++i)
          if (i / dim != tap && !std::isnan(got[size_t(t * stride + i)])) ++written_elsewhere;
      EXPECT_EQ(written_elsewhere, 0u) << "tap_mean wrote outside its slot";
      std::vector<float> g, w;
      for (int t = 0; t < T; ++t) {
        const size_t o = size_t(t * stride + tap * dim);
        g.insert(g.end(), got.begin() + int64_t(o), got.begin() + int64_t(o + dim));
        w.insert(w.end(), want.begin() + int64_t(o), want.begin() + int64_t(o + dim));
      }
      EXPECT_TRUE(check_close("tap_mean dim=" + std::to_string(dim) + " T=" + std::to_string(T), g,
                              w, Tol{}));
    }
}

TEST(CudaOpsElementwise, CompressPoolMatchesCpu) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(112);
  for (int hd : {128, 512})
    for (int r : {1, 4, 64})
      for (int G : kRowCounts) {
        const std::string what = "compress_pool hd=" + std::to_string(hd) +
                                 " r=" + std::to_string(r) + " groups=" + std::to_string(G);
        const size_t rows = size_t(G) * r;
        const auto kv = random_rows(int(rows), hd, rng);
        std::vector<float> gate = random_rows(int(rows), hd, rng);
        for (auto& v : gate) v = std::clamp(v, -40.f, 40.f);
        // Rows referenced through shuffled pointer arrays, as the caller's ring buffer does.
        std::vector<size_t> perm(rows);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        DeviceBuffer<float> dkv(kv), dgate(gate);
        std::vector<const float*> hk(rows), hg(rows), dk(rows), dg(rows);
        for (size_t i = 0; i < rows; ++i) {
          hk[i] = kv.data() + perm[i] * hd;
          hg[i] = gate.data() + perm[i] * hd;
          dk[i] = dkv.get() + perm[i] * hd;
          dg[i] = dgate.get() + perm[i] * hd;
        }
        std::vector<float> want(size_t(G) * hd);
        std::vector<double> bound(want.size());
        for (int g = 0; g < G; ++g) {
          cpu::compress_pool(hk.data() + size_t(g) * r, hg.data() + size_t(g) * r, r, hd,
                             want.data() + size_t(g) * hd);
          for (int c = 0; c < hd; ++c) {
            double m = 0;
            for (int t = 0; t < r; ++t)
              m = std::max(m, std::fabs(double(hk[size_t(g * r + t)][c])));
            bound[size_t(g) * hd + c] = (2.0 * r + 8.0) * std::ldexp(1.0, -23) * m;
          }
        }
        DeviceBuffer<const float*> pk(dk), pg(dg);
        DeviceBuffer<float> out(want.size());
        out.poison();
        compress_pool(pk.get(), pg.get(), G, r, hd, out.get(), nullptr);
        sync_and_check();
        const auto got = out.download();
        EXPECT_TRUE(check_close(what, got, want, Tol{Mode::kAbs, 0, 0, &bound}));
        for (int k : probe_rows(G)) {  // spec == plain
          DeviceBuffer<float> one(static_cast<size_t>(hd));
          one.poison();
          compress_pool(pk.get() + size_t(k) * r, pg.get() + size_t(k) * r, 1, r, hd, one.get(),
                        nullptr);
          sync_and_check();
          EXPECT_TRUE(check_close(what + " group " + std::to_string(k) + " alone", one.download(),
                                  slice(got, size_t(k) * hd, size_t(hd)), Tol{}));
        }
      }
}

}  // namespace
}  // namespace uf::cuda::test
