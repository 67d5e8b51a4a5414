// hc_post_mixes_moe (ops/mhc.cu): the FFN's mHC expand computing the MoE combine itself from
// DeviceMoe::apply_partial_experts' slots, against the combine entry points followed by the
// existing hc_post_mixes. Every comparison is BITWISE (the fused kernel runs the combine's fp32
// operations in its order, then hc_post_mixes' own), on out [T, hc, dim] and on the next mixes'
// partials; outputs and partials are poisoned with NaN before each run, and a NaN anywhere fails.
//  (a) vs DeviceMoe::combine_experts + hc_post_mixes (where the test builds a DeviceMoe: dim %
//      256 == 0), and vs a host emulation of combine_experts (the same fp32 adds and bf16
//      roundings) + hc_post_mixes at every shape; the emulation is itself checked bitwise against
//      combine_experts.
//  (b) vs moe_combine_rows (MoeFp4's combine kernel, moe_combine_kernel) on bf16-valued slots with
//      the shared expert as a last pseudo-expert (id n_experts, so it is added after the routed
//      sum, as run_add's add), rounded to bf16: the decode path's combine.
//  (c) end to end: DeviceMoe::apply + hc_post_mixes vs apply_partial_experts + hc_post_mixes_moe
//      (the wiring CudaModel uses), rows 1..8;
//  (d) moe_combine_rows on prefill rows (its vector kernel) vs the same rows in calls of 8.
// Random slots span magnitudes, hold signed zeros, and the slots of invalid ids (-1, n_experts)
// are NaN (never written by the MoE: the fold must not read them into a sum). Ids repeat across
// rows (8 experts, top-6), one row per call has a duplicated valid id (the combine's insertion
// sort keeps k order for equal ids; so must the fold). Rows 1..8 and 13 (two row blocks), each
// mHC kernel variant (rows kernel with 2 / 4 groups, the legacy kernel), fn F32 / BF16 / none,
// and spec == plain (a row alone gives the same bits). Failures print the first mismatch in hex.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "cuda/device_memory.h"
#include "cuda/device_weights.h"
#include "cuda/moe.h"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/moe.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

// Bitwise comparison; on failure the count, NaNs and the first mismatch with both values in hex.
::testing::AssertionResult same_bits(const std::string& what, const std::vector<float>& got,
                                     const std::vector<float>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << what << ": size " << got.size() << " != " << want.size();
  size_t bad = 0, nan = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) ++nan;
    if (!bits_equal(got[i], want[i]) || std::isnan(got[i])) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  char b[320];
  std::snprintf(b, sizeof(b),
                "%s: %zu of %zu differ (NaN %zu); first at %zu: got %.9g (0x%08x) want %.9g "
                "(0x%08x)",
                what.c_str(), bad, got.size(), nan, first, double(got[first]),
                unsigned(f32_bits(got[first])), double(want[first]),
                unsigned(f32_bits(want[first])));
  return ::testing::AssertionFailure() << b;
}

// Random MoE slots [T, K + 1, D]: per-(row, slot) magnitudes 2^-6..2^6, ~1% signed zeros; the
// slots of invalid ids NaN. ids [T, K]: distinct draws from [0, E) per row; row 1 (T >= 2) gets
// the invalid ids -1 and E, row 2 (T >= 3) repeats its first id in its last slot.
struct MoeData {
  std::vector<float> slots;
  std::vector<int32_t> ids;
};

MoeData random_moe(int T, int K, int E, int D, std::mt19937& rng) {
  MoeData m;
  m.ids.resize(size_t(T) * K);
  std::vector<int> perm(static_cast<size_t>(E));
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) perm[size_t(e)] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int k = 0; k < K; ++k) m.ids[size_t(t) * K + k] = perm[size_t(k)];
  }
  if (T >= 2) {
    m.ids[size_t(1) * K + 0] = -1;
    if (K >= 3) m.ids[size_t(1) * K + 2] = E;
  }
  if (T >= 3 && K >= 2) m.ids[size_t(2) * K + K - 1] = m.ids[size_t(2) * K + 0];
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> mag(-6, 6), zero(0, 99);
  m.slots.resize(size_t(T) * (K + 1) * D);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k <= K; ++k) {
      float* s = &m.slots[(size_t(t) * (K + 1) + k) * D];
      const int e = k < K ? m.ids[size_t(t) * K + k] : 0;
      const float sc = std::ldexp(1.0f, mag(rng));
      for (int d = 0; d < D; ++d) {
        if (e < 0 || e >= E) {
          s[d] = std::nanf("");
          continue;
        }
        const int z = zero(rng);
        s[d] = z == 0 ? -0.0f : z == 1 ? 0.0f : nd(rng) * sc;
      }
    }
  return m;
}

// combine_experts' arithmetic on the host: stable sort of the valid ids, fp32 sum from 0 of
// bf16(slot), then bf16(sum + bf16(shared)) (host float adds round to nearest like __fadd_rn).
std::vector<float> host_combine(const MoeData& m, int T, int K, int E, int D) {
  std::vector<float> y(size_t(T) * D);
  for (int t = 0; t < T; ++t) {
    std::vector<int> ks;
    for (int k = 0; k < K; ++k) {
      const int e = m.ids[size_t(t) * K + k];
      if (e >= 0 && e < E) ks.push_back(k);
    }
    std::stable_sort(ks.begin(), ks.end(), [&](int a, int b) {
      return m.ids[size_t(t) * K + a] < m.ids[size_t(t) * K + b];
    });
    const float* row = &m.slots[size_t(t) * (K + 1) * D];
    for (int d = 0; d < D; ++d) {
      float sum = 0.f;
      for (int k : ks) sum = sum + core::round_bf16(row[size_t(k) * D + d]);
      y[size_t(t) * D + d] = core::round_bf16(sum + core::round_bf16(row[size_t(K) * D + d]));
    }
  }
  return y;
}

// The mHC side of one call: R [T, hc, D], post [T, hc], comb [T, hc, hc] on the device.
struct MhcIn {
  DeviceBuffer<float> R, post, comb;
  MhcIn(const HcShape& p, int T, std::mt19937& rng)
      : R(random_acts(T, int64_t(p.hc) * p.dim, rng)),
        post(uniform(size_t(T) * p.hc, 0.f, 2.f, rng)),
        comb(uniform(size_t(T) * p.hc * p.hc, 0.f, 1.f, rng)) {}
  static std::vector<float> uniform(size_t n, float lo, float hi, std::mt19937& rng) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = u(rng);
    return v;
  }
};

struct PostOut {
  std::vector<float> out, partial;
};

// hc_post_mixes on x (device [T, D]) or hc_post_mixes_moe on moe: out and (fn set) the partials.
PostOut run_post(const HcShape& p, const MhcIn& in, const float* x, const MoeSlots* moe, int T,
                 const DeviceWeight& fn) {
  DeviceBuffer<float> out(size_t(T) * p.hc * p.dim), part(hc_mixes_scratch_floats(p, T));
  out.poison();
  part.poison();
  if (moe)
    hc_post_mixes_moe(p, *moe, in.R.get(), in.post.get(), in.comb.get(), T, out.get(), fn,
                      part.get(), nullptr);
  else
    hc_post_mixes(p, x, in.R.get(), in.post.get(), in.comb.get(), T, out.get(), fn, part.get(),
                  nullptr);
  sync_and_check();
  PostOut o{out.download(), {}};
  if (!fn.empty()) o.partial = part.download();
  return o;
}

void expect_same(const std::string& what, const PostOut& got, const PostOut& want) {
  EXPECT_TRUE(same_bits(what + " out", got.out, want.out));
  EXPECT_TRUE(same_bits(what + " partials", got.partial, want.partial));
}

// The mHC kernel variants: rows kernel with 2 (default) / 4 groups, the session-6 kernel.
struct Variant {
  const char* name;
  bool legacy;
  int groups;
};
const Variant kVariants[] = {{"g2", false, 2}, {"g4", false, 4}, {"legacy", true, 2}};

void set_variant(const Variant& v) {
  set_mhc_legacy_kernels(v.legacy);
  set_mhc_post_groups(v.groups);
}
void reset_variant() {
  set_mhc_legacy_kernels(false);
  set_mhc_post_groups(2);
}
// Restores the default kernels however the test leaves (a failed ASSERT, an exception).
struct VariantGuard {
  ~VariantGuard() { reset_variant(); }
};

struct FoldShape {
  int hc, dim;
  WFormat fmt;  // fn's format; kF32 with no_fn: the expand alone
  bool no_fn;
};
// The real shape (fn F32 and BF16, and without the partials), and small ones: dim 200 (a partial
// last 32-channel block, whole 16-byte pieces by cp.async and the rest scalar), dim 202 (D % 4 !=
// 0: every slot piece by plain loads), hc 1..3.
const FoldShape kFoldShapes[] = {{4, 5120, WFormat::kF32, false}, {4, 5120, WFormat::kBF16, false},
                                 {4, 5120, WFormat::kF32, true},  {4, 256, WFormat::kF32, false},
                                 {4, 200, WFormat::kF32, false},  {3, 202, WFormat::kBF16, false},
                                 {2, 128, WFormat::kF32, false},  {1, 64, WFormat::kF32, false}};

TEST(CudaMhcCombineFold, MatchesCombineThenPostBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(4242);
  constexpr int kE = 8, kK = 6;
  const VariantGuard guard;
  for (const FoldShape& fs : kFoldShapes) {
    const HcShape p{fs.hc, fs.dim, 20, 1e-6f, 1e-6f};
    DeviceArena arena;
    const auto fn_host = make_weight(fs.fmt, (2 + fs.hc) * fs.hc, int64_t(fs.hc) * fs.dim, rng);
    const DeviceWeight fn = fs.no_fn ? DeviceWeight{} : upload_weight(fn_host->w, arena);
    // A DeviceMoe of this dim for its combine_experts (the weights are never run here).
    std::unique_ptr<HostMoe> hm;
    std::unique_ptr<DeviceMoe> dmoe;
    if (fs.dim % 256 == 0) {
      hm = make_host_moe(kE, fs.dim, 64, 118, 122, rng);
      MoeShape ms{fs.dim, 64, kE, kK, "sqrtsoftplus", 1.f, 1.f, 0.f};
      ms.max_prefill_rows = 8;
      dmoe = std::make_unique<DeviceMoe>(hm->w, ms, arena);
    }
    for (int T : {1, 2, 3, 4, 5, 6, 7, 8, 13}) {
      const std::string base = "hc=" + std::to_string(fs.hc) + " dim=" + std::to_string(fs.dim) +
                               (fs.no_fn                   ? " no-fn"
                                : fs.fmt == WFormat::kBF16 ? " BF16"
                                                           : " F32") +
                               " T=" + std::to_string(T);
      const MoeData md = random_moe(T, kK, kE, fs.dim, rng);
      const MhcIn in(p, T, rng);
      DeviceBuffer<float> dslots(md.slots);
      DeviceBuffer<int32_t> dids(md.ids);
      const MoeSlots moe{dslots.get(), dids.get(), kK, kE};
      // The references' x: the host emulation, and combine_experts where a DeviceMoe exists.
      const std::vector<float> x_host = host_combine(md, T, kK, kE, fs.dim);
      DeviceBuffer<float> dx_host(x_host), dx_dev(size_t(T) * fs.dim);
      if (dmoe) {
        dx_dev.poison();
        dmoe->combine_experts(dslots.get(), dids.get(), T, dx_dev.get(), nullptr);
        sync_and_check();
        ASSERT_TRUE(
            same_bits(base + " host emulation vs combine_experts", x_host, dx_dev.download()));
      }
      for (const Variant& v : kVariants) {
        set_variant(v);
        const std::string what = base + " " + v.name;
        const PostOut got = run_post(p, in, nullptr, &moe, T, fn);
        expect_same(what + " vs host combine + hc_post_mixes", got,
                    run_post(p, in, dx_host.get(), nullptr, T, fn));
        if (dmoe)
          expect_same(what + " vs combine_experts + hc_post_mixes", got,
                      run_post(p, in, dx_dev.get(), nullptr, T, fn));
        // spec == plain: each row alone.
        if (T == 7 && std::string(v.name) == "g2") {
          for (int t = 0; t < T; ++t) {
            const MoeSlots one{dslots.get() + size_t(t) * (kK + 1) * fs.dim,
                               dids.get() + size_t(t) * kK, kK, kE};
            MhcIn in1(p, 1, rng);
            const size_t n = size_t(p.hc) * p.dim;
            UF_CUDA_CHECK(cudaMemcpy(in1.R.get(), in.R.get() + t * n, n * 4, cudaMemcpyDefault));
            UF_CUDA_CHECK(
                cudaMemcpy(in1.post.get(), in.post.get() + t * p.hc, p.hc * 4, cudaMemcpyDefault));
            UF_CUDA_CHECK(cudaMemcpy(in1.comb.get(), in.comb.get() + t * p.hc * p.hc,
                                     p.hc * p.hc * 4, cudaMemcpyDefault));
            const PostOut alone = run_post(p, in1, nullptr, &one, 1, fn);
            const std::vector<float> row(got.out.begin() + int64_t(t * n),
                                         got.out.begin() + int64_t((t + 1) * n));
            EXPECT_TRUE(same_bits(what + " row " + std::to_string(t) + " alone", alone.out, row));
          }
        }
      }
      reset_variant();
    }
  }
}

// (b) the decode path's own combine: moe_combine_kernel (through moe_combine_rows) sums bf16
// slots in ascending id and run_add adds the shared expert after them; here the shared slot is
// pseudo-expert kE (the largest id, so added last; the slots layout [T, K + 1, D] is exactly
// moe_combine_rows' y with top-(K + 1)), and the final bf16 rounding is done on the host. On
// bf16-valued slots the fold's per-slot roundings are identities, so the results must agree.
TEST(CudaMhcCombineFold, MatchesMoeCombineKernelOnBf16Slots) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(77);
  constexpr int kE = 8, kK = 6, kD = 5120;
  const HcShape p{4, kD, 20, 1e-6f, 1e-6f};
  DeviceArena arena;
  const auto fn_host = make_weight(WFormat::kF32, 24, 4 * kD, rng);
  const DeviceWeight fn = upload_weight(fn_host->w, arena);
  for (int T = 1; T <= 8; ++T) {
    MoeData md = random_moe(T, kK, kE, kD, rng);
    for (float& v : md.slots) v = core::round_bf16(v);
    // Id kE is the shared pseudo-expert here: the out-of-range routed id moves past it.
    for (int32_t& e : md.ids)
      if (e >= kE) e = kE + 5;
    std::vector<int32_t> ids7(size_t(T) * (kK + 1));
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < kK; ++k) ids7[size_t(t) * (kK + 1) + k] = md.ids[size_t(t) * kK + k];
      ids7[size_t(t) * (kK + 1) + kK] = kE;
    }
    if (T >= 3) {  // moe_combine_kernel's order for a repeated id is its k order too
      ASSERT_EQ(md.ids[size_t(2) * kK + kK - 1], md.ids[size_t(2) * kK + 0]);
    }
    DeviceBuffer<float> dslots(md.slots), dsum(size_t(T) * kD);
    DeviceBuffer<int32_t> dids(md.ids), dids7(ids7);
    dsum.poison();
    moe_combine_rows(dslots.get(), dids7.get(), T, kK + 1, kE + 1, kD, dsum.get(), nullptr);
    sync_and_check();
    std::vector<float> x = dsum.download();
    for (float& v : x) v = core::round_bf16(v);
    DeviceBuffer<float> dx(x);
    const MhcIn in(p, T, rng);
    const MoeSlots moe{dslots.get(), dids.get(), kK, kE};
    expect_same("T=" + std::to_string(T) + " fold vs moe_combine_rows + hc_post_mixes",
                run_post(p, in, nullptr, &moe, T, fn), run_post(p, in, dx.get(), nullptr, T, fn));
  }
}

// (d) moe_combine_rows on prefill rows (moe_combine_vec_kernel: 4 columns a thread) is the decode
// kernel's sum bit for bit: 40 rows at once against the same rows in calls of 8, with invalid and
// repeated ids (random_moe's NaN slots of invalid ids must stay out of the sums) and signed zeros.
TEST(CudaMhcCombineFold, PrefillCombineEqualsDecodeCombine) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(78);
  constexpr int kE = 8, kK = 6, kD = 5120, T = 40;
  MoeData md = random_moe(T, kK, kE, kD, rng);
  for (int32_t& e : md.ids)  // id kE is the shared pseudo-expert here (as in (b))
    if (e >= kE) e = kE + 5;
  std::vector<int32_t> ids7(size_t(T) * (kK + 1));
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < kK; ++k) ids7[size_t(t) * (kK + 1) + k] = md.ids[size_t(t) * kK + k];
    ids7[size_t(t) * (kK + 1) + kK] = kE;
  }
  DeviceBuffer<float> dslots(md.slots), whole(size_t(T) * kD), chunked(size_t(T) * kD);
  DeviceBuffer<int32_t> dids7(ids7);
  whole.poison();
  chunked.poison();
  moe_combine_rows(dslots.get(), dids7.get(), T, kK + 1, kE + 1, kD, whole.get(), nullptr);
  for (int t0 = 0; t0 < T; t0 += 8)
    moe_combine_rows(dslots.get() + size_t(t0) * (kK + 1) * kD, dids7.get() + t0 * (kK + 1), 8,
                     kK + 1, kE + 1, kD, chunked.get() + size_t(t0) * kD, nullptr);
  sync_and_check();
  const auto a = whole.download(), b = chunked.download();
  size_t bad = 0, nan = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    bad += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
    nan += std::isnan(a[i]);
  }
  EXPECT_EQ(bad, 0u) << "prefill combine differs from the decode combine";
  EXPECT_EQ(nan, 0u) << "a NaN slot of an invalid id reached a sum";
}

// (c) the wiring: apply_partial_experts + hc_post_mixes_moe == apply + hc_post_mixes at one GPU.
TEST(CudaMhcCombineFold, EndToEndMatchesApplyThenPost) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(2027);
  constexpr int kE = 16, kK = 6, kD = 5120, kI = 64;
  const HcShape p{4, kD, 20, 1e-6f, 1e-6f};
  DeviceArena arena;
  auto hm = make_host_moe(kE, kD, kI, 118, 122, rng);
  MoeShape ms{kD, kI, kE, kK, "sqrtsoftplus", 1.f, 2.5f, 10.f};
  ms.max_prefill_rows = 8;
  DeviceMoe dmoe(hm->w, ms, arena);
  const auto fn_host = make_weight(WFormat::kBF16, 24, 4 * kD, rng);
  const DeviceWeight fn = upload_weight(fn_host->w, arena);
  for (int T = 1; T <= 8; ++T) {
    const std::vector<float> x = random_acts(T, kD, rng);
    DeviceBuffer<float> dx(x), dy(size_t(T) * kD), dslots(size_t(T) * dmoe.slot_floats_per_row());
    DeviceBuffer<float> gw(size_t(T) * kK), gw2(size_t(T) * kK);
    DeviceBuffer<int32_t> gi(size_t(T) * kK), gi2(size_t(T) * kK);
    dy.poison();
    dslots.poison();
    dmoe.apply(dx.get(), T, dy.get(), gi.get(), gw.get(), nullptr);
    dmoe.apply_partial_experts(dx.get(), T, dslots.get(), gi2.get(), gw2.get(), nullptr);
    sync_and_check();
    const MhcIn in(p, T, rng);
    const MoeSlots moe{dslots.get(), gi2.get(), kK, kE};
    expect_same("T=" + std::to_string(T) + " apply_partial_experts + fold vs apply + post",
                run_post(p, in, nullptr, &moe, T, fn), run_post(p, in, dy.get(), nullptr, T, fn));
  }
}

}  // namespace
}  // namespace uf::cuda::test
