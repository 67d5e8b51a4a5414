// The prefill routed-expert path (MoeFp4Prefill) against the decode path run in chunks of 8 rows:
// BITWISE equal for the same routing (same products, same K-block order, the same w13 split sums
// in split order, the same epilogue and combine order), at the real TP8 slice (dim 5120, inter
// 288, 384 experts, top-6) and small shapes; routings random, skewed (every row on the same
// experts: > 64 columns per expert) and with invalid ids. DeviceMoe for T > 8 (whose gate runs on
// the tensor cores) against the decode chunks within stated bounds, bitwise between prefill
// plans, and against the CPU (test_ops_moe.cpp's bounds); outputs poisoned.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/linear.h"
#include "cpu/moe.h"
#include "cuda/gemv.h"
#include "cuda/moe.h"
#include "cuda/ops/moe.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda::test {
namespace {

// Fast bytes for the real shape's 850 MB of experts (mt19937 per byte would take seconds).
void fill_random(std::vector<uint8_t>& v, uint64_t seed, int lo = 0, int hi = 255) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  const uint32_t range = uint32_t(hi - lo + 1);
  for (size_t i = 0; i < v.size(); i += 8) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    uint64_t r = s;
    for (size_t j = i; j < std::min(v.size(), i + 8); ++j, r >>= 8)
      v[j] = uint8_t(range == 256 ? (r & 0xff) : lo + int((r & 0xff) % range));
  }
}

struct DevExperts {
  DeviceBuffer<uint8_t> w1, w1s, w3, w3s, w2, w2s;
  Fp4ExpertsView view;
  DevExperts(int E, int dim, int inter, uint64_t seed)
      : w1(size_t(E) * inter * dim / 2),
        w1s(size_t(E) * inter * dim / 32),
        w3(size_t(E) * inter * dim / 2),
        w3s(size_t(E) * inter * dim / 32),
        w2(size_t(E) * dim * inter / 2),
        w2s(size_t(E) * dim * inter / 32) {
    std::vector<uint8_t> h;
    auto put = [&](DeviceBuffer<uint8_t>& b, uint64_t sd, int lo, int hi) {
      h.assign(b.size(), 0);
      fill_random(h, sd, lo, hi);
      b.upload(h);
    };
    put(w1, seed + 1, 0, 255);
    put(w3, seed + 2, 0, 255);
    put(w2, seed + 3, 0, 255);
    // Scales as test_moe_fp4.cpp: gate / up around the clamp limit (both clamps fire).
    put(w1s, seed + 4, 119, 123);
    put(w3s, seed + 5, 119, 123);
    put(w2s, seed + 6, 118, 124);
    view = {w1.get(), w1s.get(), w3.get(), w3s.get(), w2.get(), w2s.get(), E, dim, inter};
  }
};

enum class Routing { kRandom, kSkewed, kInvalid };
const char* routing_name(Routing r) {
  return r == Routing::kRandom ? "random" : r == Routing::kSkewed ? "skewed" : "invalid";
}

// [T, K] distinct expert ids per row and weights. kSkewed: every row picks from the same K + 2
// experts (so each has ~T columns: several 64-column items). kInvalid: ~1/8 of the ids are -1 or
// >= E (select nothing).
void make_routing(int T, int E, int K, Routing mode, std::mt19937& rng, std::vector<int32_t>& idx,
                  std::vector<float>& w) {
  idx.assign(size_t(T) * K, 0);
  w.assign(size_t(T) * K, 0.f);
  std::uniform_real_distribution<float> wd(0.05f, 0.6f);
  std::vector<int> perm(static_cast<size_t>(E));
  const int pool = mode == Routing::kSkewed ? std::min(E, K + 2) : E;
  for (int t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.begin() + pool, 0);
    for (int k = 0; k < K; ++k) {
      std::uniform_int_distribution<int> d(k, pool - 1);
      std::swap(perm[size_t(k)], perm[size_t(d(rng))]);
      int e = perm[size_t(k)];
      if (mode == Routing::kInvalid && rng() % 8 == 0) e = (rng() % 2) ? -1 : E + int(rng() % 5);
      idx[size_t(t) * K + k] = e;
      w[size_t(t) * K + k] = wd(rng);
    }
  }
}

// Bitwise comparison with a precise diagnostic. `check(i)`: whether element i must be compared
// (and must be finite in `got`).
template <typename Check>
void expect_bitwise(const std::vector<float>& got, const std::vector<float>& want, int row_len,
                    const std::string& what, Check check) {
  size_t diff = 0, nan = 0, compared = 0, nonzero = 0;
  long first = -1;
  float max_abs = 0.f;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!check(i)) continue;
    ++compared;
    if (!std::isfinite(got[i])) ++nan;
    if (got[i] != 0.f) ++nonzero;
    if (!bits_equal(got[i], want[i])) {
      if (first < 0) first = long(i);
      ++diff;
      max_abs = std::max(max_abs, std::fabs(got[i] - want[i]));
    }
  }
  EXPECT_EQ(nan, 0u) << what << ": " << nan << " non-finite of " << compared;
  EXPECT_GT(nonzero, compared / 2)
      << what << ": mostly zeros (" << nonzero << " of " << compared << ")";
  EXPECT_EQ(diff, 0u) << what << ": " << diff << " of " << compared
                      << " differ from the chunked decode path, max_abs " << max_abs
                      << ", first at " << first << " (row " << (first >= 0 ? first / row_len : -1)
                      << ", col " << (first >= 0 ? first % row_len : -1) << ": prefill "
                      << (first >= 0 ? got[size_t(first)] : 0.f) << ", decode "
                      << (first >= 0 ? want[size_t(first)] : 0.f) << ")";
}

struct Shape {
  const char* name;
  int dim, inter, E, K;
  float limit;
};

class MoePrefillKernels : public ::testing::TestWithParam<Shape> {};

TEST_P(MoePrefillKernels, BitwiseTheChunkedDecodePath) {
  UF_REQUIRE_GPU();
  const Shape s = GetParam();
  const int D = s.dim, I = s.inter, E = s.E, K = s.K;
  DevExperts ex(E, D, I, 77);
  constexpr int kMaxT = 512;
  MoeFp4 decode(D, I, K, 0);
  MoeFp4Prefill prefill(D, I, K, E, kMaxT);
  std::mt19937 rng(99);
  for (int T : {9, 64, 200, 512}) {
    for (Routing mode : {Routing::kRandom, Routing::kSkewed, Routing::kInvalid}) {
      const std::string tag =
          std::string(s.name) + " T=" + std::to_string(T) + " " + routing_name(mode);
      std::vector<int32_t> idx;
      std::vector<float> wts;
      make_routing(T, E, K, mode, rng, idx, wts);
      const std::vector<float> x = random_acts(T, D, rng);
      DeviceBuffer<float> dx(x), dw(wts);
      DeviceBuffer<int32_t> di(idx);
      // Activation quantisation: the any-m kernel vs act_quant_fp8_f32 by chunks of 8.
      DeviceBuffer<uint8_t> codes(size_t(T) * D), codes8(size_t(T) * D);
      DeviceBuffer<float> scales(size_t(T) * D / 32), scales8(size_t(T) * D / 32);
      codes.poison();
      scales.poison();
      moe_act_quant_rows(dx.get(), T, D, codes.get(), scales.get(), nullptr);
      for (int t0 = 0; t0 < T; t0 += kMaxDecodeRows)
        act_quant_fp8_f32(dx.get() + int64_t(t0) * D, std::min(kMaxDecodeRows, T - t0), D,
                          codes8.get() + int64_t(t0) * D, scales8.get() + int64_t(t0) * D / 32,
                          nullptr);
      sync_and_check();
      ASSERT_EQ(codes.download(), codes8.download()) << tag << ": act quant codes differ";
      {
        const auto a = scales.download(), b = scales8.download();
        for (size_t i = 0; i < a.size(); ++i)
          ASSERT_TRUE(bits_equal(a[i], b[i])) << tag << ": act quant scale " << i;
      }
      const QuantActView act{codes.get(), scales.get(), T, D};
      auto chunk = [&](int t0) {
        return QuantActView{codes.get() + int64_t(t0) * D, scales.get() + int64_t(t0) * D / 32,
                            std::min(kMaxDecodeRows, T - t0), D};
      };
      // run / run_partial: [T, D].
      for (int partial = 0; partial < 2; ++partial) {
        DeviceBuffer<float> got(size_t(T) * D), want(size_t(T) * D);
        got.poison();
        want.poison();
        if (partial)
          prefill.run_partial(ex.view, act, di.get(), dw.get(), s.limit, got.get(), nullptr);
        else
          prefill.run(ex.view, act, di.get(), dw.get(), s.limit, got.get(), nullptr);
        for (int t0 = 0; t0 < T; t0 += kMaxDecodeRows) {
          if (partial)
            decode.run_partial(ex.view, chunk(t0), di.get() + t0 * K, dw.get() + t0 * K, s.limit,
                               want.get() + int64_t(t0) * D, nullptr);
          else
            decode.run(ex.view, chunk(t0), di.get() + t0 * K, dw.get() + t0 * K, s.limit,
                       want.get() + int64_t(t0) * D, nullptr);
        }
        sync_and_check();
        // Rows whose every id is invalid are legitimately all zeros; fine for the nonzero check
        // at ~1/8 invalid ids.
        expect_bitwise(got.download(), want.download(), D,
                       tag + (partial ? " run_partial" : " run"), [](size_t) { return true; });
      }
      {  // run_experts: each valid pair's slot; invalid pairs stay untouched (poison) in both.
        const int64_t stride = int64_t(K + 1) * D;
        DeviceBuffer<float> got(size_t(T) * stride), want(size_t(T) * stride);
        got.poison();
        want.poison();
        prefill.run_experts(ex.view, act, di.get(), dw.get(), s.limit, got.get(), stride, nullptr);
        for (int t0 = 0; t0 < T; t0 += kMaxDecodeRows)
          decode.run_experts(ex.view, chunk(t0), di.get() + t0 * K, dw.get() + t0 * K, s.limit,
                             want.get() + t0 * stride, stride, nullptr);
        sync_and_check();
        const auto g = got.download(), w = want.download();
        expect_bitwise(g, w, int(stride), tag + " run_experts", [&](size_t i) {
          const size_t t = i / size_t(stride), k = (i % size_t(stride)) / size_t(D);
          if (k >= size_t(K)) return false;
          const int e = idx[t * K + k];
          return e >= 0 && e < E;
        });
        size_t touched = 0;  // invalid pairs and the extra slot must not be written
        for (size_t i = 0; i < g.size(); ++i) {
          const size_t t = i / size_t(stride), k = (i % size_t(stride)) / size_t(D);
          const bool valid = k < size_t(K) && idx[t * K + k] >= 0 && idx[t * K + k] < E;
          if (!valid && std::isfinite(g[i])) ++touched;
        }
        EXPECT_EQ(touched, 0u) << tag << " run_experts wrote outside the valid pairs' slots";
      }
      std::printf("[moe_prefill] %s: checked\n", tag.c_str());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MoePrefillKernels,
    ::testing::Values(
        // the TP8 rank slice of the released model: 10 w13 splits of 16 K blocks, w2 over 9
        Shape{"tp8_slice", 5120, 288, 384, 6, 10.f},
        // one w13 split (8 K blocks), no clamps
        Shape{"small_k256", 256, 64, 16, 4, 0.f},
        // two w13 splits, the second partial (16 + 4 K blocks), top-8 (the decode limit)
        Shape{"k640_top8", 640, 96, 40, 8, 10.f}),
    [](const ::testing::TestParamInfo<Shape>& i) { return std::string(i.param.name); });

// ---- DeviceMoe: prefill path vs chunks of 8 (bitwise) and vs the CPU ----

struct MoeCase {
  const char* name;
  int E, K, dim, inter;
  const char* score_func;
  float gate_temp, route_scale, limit;
  int routed_scale_lo, routed_scale_hi;
};

class DeviceMoePrefill : public ::testing::TestWithParam<MoeCase> {};

TEST_P(DeviceMoePrefill, AgreesWithDecodeChunksAndCpu) {
  UF_REQUIRE_GPU();
  const MoeCase c = GetParam();
  std::mt19937 rng(2468);
  auto hm = make_host_moe(c.E, c.dim, c.inter, c.routed_scale_lo, c.routed_scale_hi, rng);
  MoeShape shape{c.dim, c.inter, c.E, c.K, c.score_func, c.gate_temp, c.route_scale, c.limit};
  const cpu::MoeParams p{c.E, c.K, c.score_func, c.gate_temp, c.route_scale, c.limit, true};
  DeviceArena arena;
  DeviceMoe moe(hm->w, shape, arena);  // max_prefill_rows 512
  shape.max_prefill_rows = 64;         // T = 200: chunks 64, 64, 64 and a decode tail of 8
  DeviceMoe moe64(hm->w, shape, arena);
  ASSERT_TRUE(moe.prefill_enabled());
  const int D = c.dim, K = c.K;
  for (int T : {9, 64, 200, 600}) {
    const std::string tag = std::string(c.name) + " T=" + std::to_string(T);
    const std::vector<float> x = random_acts(T, D, rng);
    DeviceBuffer<float> dx(x);
    struct Out {
      std::vector<float> y, yp, slots, gw;
      std::vector<int32_t> gi;
    };
    auto run_all = [&](DeviceMoe& m, bool prefill) {
      m.set_prefill_enabled(prefill);
      Out o;
      DeviceBuffer<float> y(size_t(T) * D), yp(size_t(T) * D), gw(size_t(T) * K),
          slots(size_t(T) * m.slot_floats_per_row());
      DeviceBuffer<int32_t> gi(size_t(T) * K);
      y.poison();
      yp.poison();
      gw.poison();
      slots.poison();
      UF_CUDA_CHECK(cudaMemset(gi.get(), 0xFF, gi.size() * sizeof(int32_t)));
      m.apply(dx.get(), T, y.get(), gi.get(), gw.get(), nullptr);
      m.apply_partial(dx.get(), T, yp.get(), nullptr, nullptr, nullptr);  // internal gate ws
      m.apply_partial_experts(dx.get(), T, slots.get(), gi.get(), gw.get(), nullptr);
      sync_and_check();
      m.set_prefill_enabled(true);
      o.y = y.download();
      o.yp = yp.download();
      o.slots = slots.download();
      o.gw = gw.download();
      o.gi = gi.download();
      return o;
    };
    const Out chunked = run_all(moe, false);
    // The prefill path computes the gate on the tensor cores (LinearKind::kF32Bf16XPrefill; the
    // decode router keeps dense_rows' fp32 order): the same exact products summed in another
    // order, so a row routes like the decode chunks except at an fp32 near-tie of its gate
    // scores, and its gate weights differ in their last bits (outputs then within ~1 bf16 ulp).
    // Rows routed alike: weights within 1e-5, outputs within 2 ulps + 1e-3 of the row's rms.
    // Between the two prefill plans (chunks of 512 and of 64 rows) the prefill rows are bitwise
    // (the tensor-core gate of a row does not depend on the chunk); moe64's tail of 8 rows runs
    // the decode path, so it is compared like the chunks.
    const Out pf512 = run_all(moe, true);
    const Out pf64 = run_all(moe64, true);
    const int tail0 = T > 8 ? std::max(0, (T - 8) / 64 * 64) : 0;  // moe64's decode tail start
    auto close = [&](const Out& a, const Out& b, const std::string& what, int t_begin) {
      int mismatched = 0;
      for (int t = t_begin; t < T; ++t) {
        bool same = true;
        for (int k = 0; k < K; ++k) same &= a.gi[size_t(t * K + k)] == b.gi[size_t(t * K + k)];
        if (!same) {
          ++mismatched;
          continue;
        }
        for (int k = 0; k < K; ++k) {
          const float x1 = a.gw[size_t(t * K + k)], x2 = b.gw[size_t(t * K + k)];
          ASSERT_TRUE(std::isfinite(x1)) << what << " gate_w NaN, row " << t;
          ASSERT_LE(std::fabs(x1 - x2), 1e-5f * std::fabs(x2)) << what << " gate_w row " << t;
        }
        // apply (bf16 outputs) and apply_partial (its unrounded fp32 sums): the same bound.
        for (const auto& [ya, yb, name] :
             {std::tuple{&a.y, &b.y, "apply"}, std::tuple{&a.yp, &b.yp, "apply_partial"}}) {
          double rms = 0;
          for (int d = 0; d < D; ++d)
            rms += double((*yb)[size_t(t * D + d)]) * (*yb)[size_t(t * D + d)];
          rms = std::sqrt(rms / D);
          for (int d = 0; d < D; ++d) {
            const float y1 = (*ya)[size_t(t * D + d)], y2 = (*yb)[size_t(t * D + d)];
            const float u = bf16_ulp(std::max(std::fabs(y1), std::fabs(y2)));
            ASSERT_TRUE(std::isfinite(y1)) << what << " " << name << " NaN, row " << t;
            ASSERT_LE(std::fabs(y1 - y2), 2 * u + float(1e-3 * rms))
                << what << " " << name << " row " << t << " d " << d << ": " << y1 << " vs " << y2;
          }
        }
      }
      EXPECT_LE(mismatched, std::max(1, (T - t_begin) / 50)) << what << ": rows routed unlike";
    };
    close(pf512, chunked, tag + " prefill (512) vs decode chunks", 0);
    close(pf64, chunked, tag + " prefill (64) vs decode chunks", 0);
    if (tail0 > 0) {  // the prefill rows of both plans: bitwise
      auto head = [&](const std::vector<float>& v, int row_len) {
        return std::vector<float>(v.begin(), v.begin() + int64_t(tail0) * row_len);
      };
      ASSERT_TRUE(
          std::equal(pf64.gi.begin(), pf64.gi.begin() + int64_t(tail0) * K, pf512.gi.begin()))
          << tag << ": the two prefill plans route differently";
      expect_bitwise(head(pf64.gw, K), head(pf512.gw, K), K, tag + " plans gate_w",
                     [](size_t) { return true; });
      expect_bitwise(head(pf64.y, D), head(pf512.y, D), D, tag + " plans apply",
                     [](size_t) { return true; });
      expect_bitwise(head(pf64.yp, D), head(pf512.yp, D), D, tag + " plans apply_partial",
                     [](size_t) { return true; });
      const int sf = int(moe.slot_floats_per_row());
      expect_bitwise(head(pf64.slots, sf), head(pf512.slots, sf), sf,
                     tag + " plans apply_partial_experts", [](size_t) { return true; });
    }
    if (T > 200) continue;  // the CPU reference: T <= 200 keeps the test fast

    // Against the CPU, test_ops_moe.cpp's bounds and reasoning: rows routed like the CPU (the
    // rest only at near-ties) within 2 ulps + 15% of the row's rms, >= 90% within one bf16 ulp.
    std::vector<float> want(size_t(T) * D), want_w(size_t(T) * K);
    std::vector<int32_t> want_i(size_t(T) * K);
    cpu::moe_forward(hm->w, p, x.data(), T, D, c.inter, want.data(), want_i.data(), want_w.data());
    const Out& got = pf512;
    std::vector<bool> same(size_t(T), true);
    int mismatched = 0;
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k)
        if (got.gi[size_t(t * K + k)] != want_i[size_t(t * K + k)]) same[size_t(t)] = false;
      mismatched += same[size_t(t)] ? 0 : 1;
    }
    EXPECT_LE(mismatched, std::max(1, T / 50)) << tag << ": rows routed unlike the CPU";
    std::vector<double> rms(size_t(T), 0.0);
    for (int t = 0; t < T; ++t) {
      for (int d = 0; d < D; ++d)
        rms[size_t(t)] += double(want[size_t(t * D + d)]) * want[size_t(t * D + d)];
      rms[size_t(t)] = std::sqrt(rms[size_t(t)] / D);
    }
    size_t within = 0, compared = 0;
    const Compare cmp(got.y, want, [&](size_t i) {
      const size_t t = i / size_t(D);
      if (!same[t]) return true;
      ++compared;
      const float d = std::fabs(got.y[i] - want[i]);
      const float u = bf16_ulp(std::max(std::fabs(got.y[i]), std::fabs(want[i])));
      if (d <= u) ++within;
      return d <= 2 * u + float(0.15 * rms[t]);
    });
    EXPECT_EQ(cmp.nan, 0u) << tag << " " << cmp.report(got.y, want);
    EXPECT_EQ(cmp.bad, 0u) << tag << " " << cmp.report(got.y, want);
    EXPECT_GE(double(within), 0.9 * double(compared))
        << tag << ": " << within << " of " << compared << " within one bf16 ulp";
    std::printf("[moe_prefill] %s vs CPU: %s within_1ulp=%zu/%zu route_mismatch_rows=%d\n",
                tag.c_str(), cmp.report(got.y, want).c_str(), within, compared, mismatched);
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, DeviceMoePrefill,
                         ::testing::Values(MoeCase{"e384_top6", 384, 6, 256, 64, "sqrtsoftplus",
                                                   1.f, 2.5f, 10.f, 119, 123},
                                           MoeCase{"e8_top2_clamp", 8, 2, 256, 128, "sqrtsoftplus",
                                                   1.f, 1.5f, 10.f, 121, 125}),
                         [](const ::testing::TestParamInfo<MoeCase>& i) {
                           return std::string(i.param.name);
                         });

}  // namespace
}  // namespace uf::cuda::test
