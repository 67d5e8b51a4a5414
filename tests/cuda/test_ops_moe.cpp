// DeviceMoe and DeviceEngram (cuda/ops/moe.h) against cpu::moe_forward and cpu::engram_forward:
// routing (score functions, bias, top-k, normalisation, route_scale), MXFP4 routed experts with
// the clamps firing, the FP8 shared expert; rows 1, 3, 8, 20 (chunks of 8), outputs poisoned with
// NaN, spec == plain bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "cpu/engram.h"
#include "cpu/linear.h"
#include "cpu/moe.h"
#include "cuda/ops/engram.h"
#include "cuda/ops/moe.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

struct MoeCase {
  const char* name;
  int E, K, dim, inter;
  const char* score_func;
  float gate_temp, route_scale, limit;
  int routed_scale_lo, routed_scale_hi;  // E8M0 codes of the FP4 expert scales
};

std::unique_ptr<HostMoe> make_moe(const MoeCase& c, std::mt19937& rng) {
  return make_host_moe(c.E, c.dim, c.inter, c.routed_scale_lo, c.routed_scale_hi, rng);
}

// The CPU router's biased scores of row t (to recognise near-ties).
std::vector<float> biased_scores(const model::MoeWeights& w, const MoeCase& c, const float* x) {
  std::vector<float> s(static_cast<size_t>(c.E));
  cpu::linear_f32(w.gate, x, 1, s.data());
  const std::vector<float> bias = w.gate_bias.to_vector();
  const std::string f = c.score_func;
  float mx = -INFINITY, sum = 0;
  for (float& v : s) v /= c.gate_temp, mx = std::max(mx, v);
  if (f == "softmax") {
    for (float& v : s) sum += (v = std::exp(v - mx));
    for (float& v : s) v /= sum;
  }
  for (size_t e = 0; e < s.size(); ++e) {
    float v = s[e];
    if (f == "sigmoid") v = 1.f / (1.f + std::exp(-v));
    if (f == "sqrtsoftplus") v = std::sqrt(v > 20.f ? v : std::log1p(std::exp(v)));
    s[e] = v + bias[e];
  }
  return s;
}

bool near_tie(std::vector<float> b, int K) {
  std::sort(b.begin(), b.end(), std::greater<float>());
  for (int k = 0; k < K && k + 1 < int(b.size()); ++k)
    if (std::fabs(b[size_t(k)] - b[size_t(k + 1)]) <=
        1e-5f * std::max(1.f, std::fabs(b[size_t(k)])))
      return true;
  return false;
}

class OpsMoe : public ::testing::TestWithParam<MoeCase> {};

TEST_P(OpsMoe, MatchesCpuAndSpecEqualsPlain) {
  UF_REQUIRE_GPU();
  const MoeCase c = GetParam();
  std::mt19937 rng(4321);
  auto hm = make_moe(c, rng);
  const MoeShape shape{c.dim, c.inter, c.E, c.K, c.score_func, c.gate_temp, c.route_scale, c.limit};
  const cpu::MoeParams p{c.E, c.K, c.score_func, c.gate_temp, c.route_scale, c.limit, true};
  DeviceArena arena;
  DeviceMoe moe(hm->w, shape, arena);
  size_t total_within = 0, total_compared = 0;
  for (int T : {1, 3, 8, 20}) {
    const std::vector<float> x = random_acts(T, c.dim, rng);
    std::vector<float> want(size_t(T) * c.dim), want_w(size_t(T) * c.K);
    std::vector<int32_t> want_i(size_t(T) * c.K);
    cpu::moe_forward(hm->w, p, x.data(), T, c.dim, c.inter, want.data(), want_i.data(),
                     want_w.data());
    if (c.limit > 0 && T == 20) {  // the clamps must fire (shared expert's gate as a witness)
      std::vector<float> g(size_t(T) * c.inter);
      cpu::linear(hm->w.shared.w1, x.data(), T, g.data());
      const auto fired = std::count_if(g.begin(), g.end(), [&](float v) { return v > c.limit; });
      EXPECT_GT(fired, 0) << c.name << ": no gate value above the clamp limit";
    }
    DeviceBuffer<float> dx(x), dy(size_t(T) * c.dim), dw(size_t(T) * c.K);
    DeviceBuffer<int32_t> di(size_t(T) * c.K);
    dy.poison();
    dw.poison();
    UF_CUDA_CHECK(cudaMemset(di.get(), 0xFF, di.size() * sizeof(int32_t)));
    moe.apply(dx.get(), T, dy.get(), di.get(), dw.get(), nullptr);
    sync_and_check();
    const std::vector<float> got = dy.download(), got_w = dw.download();
    const std::vector<int32_t> got_i = di.download();
    {  // A second call gives bitwise the same output: the w13 group counters are reset by each
       // call and the fixed split order does not depend on which warp finishes last.
      DeviceBuffer<float> ly(size_t(T) * c.dim);
      ly.poison();
      moe.apply(dx.get(), T, ly.get(), di.get(), dw.get(), nullptr);
      sync_and_check();
      const std::vector<float> lv = ly.download();
      size_t diff = 0, first = lv.size();
      for (size_t i = 0; i < lv.size(); ++i)
        if (!bits_equal(lv[i], got[i])) first = std::min(first, i), ++diff;
      EXPECT_EQ(diff, 0u) << c.name << " T=" << T << ": second call differs, first at " << first
                          << " (row " << first / size_t(c.dim) << ")"
                          << (first < lv.size() ? " second " + std::to_string(lv[first]) +
                                                      " first " + std::to_string(got[first])
                                                : std::string());
      // The earlier path (persistent MoeFp4 kernels, shared expert on the caller's stream,
      // separate combine) gives bitwise the same output, for each of the three outputs.
      moe.set_legacy(true);
      DeviceBuffer<float> oy(size_t(T) * c.dim), np(size_t(T) * c.dim), op(size_t(T) * c.dim);
      const int64_t sf = moe.slot_floats_per_row();
      DeviceBuffer<float> ns(size_t(T) * sf), os(size_t(T) * sf);
      for (DeviceBuffer<float>* b : {&oy, &np, &op, &ns, &os}) b->poison();
      moe.apply(dx.get(), T, oy.get(), di.get(), dw.get(), nullptr);
      sync_and_check();
      {  // the routing too (the default path's one-launch router vs gate GEMV + route_quant)
        const std::vector<int32_t> oi = di.download();
        const std::vector<float> ow = dw.download();
        size_t bad = 0;
        for (size_t i = 0; i < oi.size(); ++i)
          bad += oi[i] != got_i[i] || !bits_equal(ow[i], got_w[i]);
        EXPECT_EQ(bad, 0u) << c.name << " T=" << T << ": legacy vs new routing differs in " << bad
                           << " of " << oi.size() << " (expert, weight) pairs";
      }
      moe.apply_partial(dx.get(), T, op.get(), di.get(), dw.get(), nullptr);
      moe.apply_partial_experts(dx.get(), T, os.get(), di.get(), dw.get(), nullptr);
      moe.set_legacy(false);
      moe.apply_partial(dx.get(), T, np.get(), di.get(), dw.get(), nullptr);
      moe.apply_partial_experts(dx.get(), T, ns.get(), di.get(), dw.get(), nullptr);
      sync_and_check();
      const std::vector<int32_t> ids = di.download();
      auto same = [&](const std::vector<float>& a, const std::vector<float>& b, const char* what,
                      int64_t row_len) {
        size_t d = 0, f = a.size(), nan = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          nan += std::isnan(a[i]) || std::isnan(b[i]);
          if (!bits_equal(a[i], b[i])) f = std::min(f, i), ++d;
        }
        EXPECT_TRUE(d == 0 && nan == 0)
            << c.name << " T=" << T << " " << what << ": legacy vs new: " << d << " differ, " << nan
            << " NaN, first at " << f << " (row " << f / size_t(row_len) << ")";
      };
      same(oy.download(), got, "apply", c.dim);
      same(op.download(), np.download(), "apply_partial", c.dim);
      // Slots of invalid experts are never written (stay NaN in both): compare the valid ones.
      std::vector<float> a = os.download(), b = ns.download();
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < c.K; ++k) {
          const int32_t e = ids[size_t(t) * c.K + k];
          if (e < 0 || e >= c.E)
            for (int d = 0; d < c.dim; ++d)
              a[t * sf + k * c.dim + d] = b[t * sf + k * c.dim + d] = 0;
        }
      same(a, b, "apply_partial_experts", sf);
    }

    // Routing: identical choice unless the CPU's biased scores are near-tied (expf / log1pf
    // on the device may differ from glibc by an ulp or two; the gate GEMV itself is bitwise).
    // Weights: a few ulps of fp32 (same operations, those functions' ulps).
    std::vector<bool> same_route(static_cast<size_t>(T), true);
    int ties = 0;
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < c.K; ++k)
        if (got_i[size_t(t * c.K + k)] != want_i[size_t(t * c.K + k)])
          same_route[size_t(t)] = false;
      if (!same_route[size_t(t)]) {
        ++ties;
        EXPECT_TRUE(near_tie(biased_scores(hm->w, c, &x[size_t(t) * c.dim]), c.K))
            << c.name << " T=" << T << " row " << t << ": expert choice differs from the CPU "
            << "(first: got " << got_i[size_t(t * c.K)] << " want " << want_i[size_t(t * c.K)]
            << ") without a near-tie";
        continue;
      }
      for (int k = 0; k < c.K; ++k) {
        const float g = got_w[size_t(t * c.K + k)], wv = want_w[size_t(t * c.K + k)];
        ASSERT_TRUE(std::isfinite(g)) << c.name << " gate_w NaN at row " << t << " k " << k;
        EXPECT_LE(std::fabs(g - wv), 1e-5f * std::fabs(wv))
            << c.name << " T=" << T << " gate_w row " << t << " k " << k;
      }
    }
    EXPECT_LE(ties, 1) << c.name << " T=" << T;

    // Output: where the routing agrees, the same operations except the order of a block's 32
    // products in the tensor cores (MoeFp4, Fp8Gemv), the K-split grouping and expf's ulp. Each
    // can flip a bf16 rounding of g / u / h (rare: the fp32 value must sit within ~2^-16 of a
    // midpoint); a flipped h may change its FP8 code (one e4m3 step of one of `inter` terms of a
    // w2 output: ~1% of the row's rms on average, up to ~10% where that h is the row's largest)
    // or, rarely, its block scale; such a flip moves a whole row by a few ulps. So: all elements
    // within 2 ulps + 15% of the row's rms, and >= 90% of all the case's elements (over every T)
    // within one bf16 ulp. Wrong semantics (weight after w2, missing clamp, unrounded g/u) change
    // many h codes in every row and move most elements by several ulps.
    std::vector<double> rms(static_cast<size_t>(T), 0.0);
    for (int t = 0; t < T; ++t) {
      for (int d = 0; d < c.dim; ++d)
        rms[size_t(t)] += double(want[size_t(t * c.dim + d)]) * want[size_t(t * c.dim + d)];
      rms[size_t(t)] = std::sqrt(rms[size_t(t)] / c.dim);
    }
    size_t within_ulp = 0, compared = 0;
    const Compare cmp(got, want, [&](size_t i) {
      const size_t t = i / size_t(c.dim);
      if (!same_route[t]) return true;
      ++compared;
      const float d = std::fabs(got[i] - want[i]);
      const float u = bf16_ulp(std::max(std::fabs(got[i]), std::fabs(want[i])));
      if (d <= u) ++within_ulp;
      return d <= 2 * u + float(0.15 * rms[t]);
    });
    EXPECT_EQ(cmp.nan, 0u) << c.name << " T=" << T << " " << cmp.report(got, want);
    EXPECT_EQ(cmp.bad, 0u) << c.name << " T=" << T << " " << cmp.report(got, want);
    total_within += within_ulp;
    total_compared += compared;
    std::printf("[ops_moe] %s T=%d: %s within_1ulp=%zu/%zu route_mismatch_rows=%d\n", c.name, T,
                cmp.report(got, want).c_str(), within_ulp, compared, ties);

    // spec == plain: each row of a decode call (T <= 8) alone gives the same bits. A prefill
    // call (T > 8) computes the gate on the tensor cores (LinearKind::kF32Bf16XPrefill): the
    // same exact products in another fp32 order, checked against the CPU above.
    if (T == 8) {
      DeviceBuffer<float> oy(static_cast<size_t>(c.dim)), ow(static_cast<size_t>(c.K));
      DeviceBuffer<int32_t> oi(static_cast<size_t>(c.K));
      for (int r = 0; r < T; ++r) {
        oy.poison();
        moe.apply(dx.get() + int64_t(r) * c.dim, 1, oy.get(), oi.get(), ow.get(), nullptr);
        sync_and_check();
        const std::vector<float> y1 = oy.download(), w1 = ow.download();
        const std::vector<int32_t> i1 = oi.download();
        for (int k = 0; k < c.K; ++k) {
          ASSERT_EQ(i1[size_t(k)], got_i[size_t(r * c.K + k)]) << c.name << " row " << r;
          ASSERT_TRUE(bits_equal(w1[size_t(k)], got_w[size_t(r * c.K + k)]))
              << c.name << " row " << r;
        }
        for (int d = 0; d < c.dim; ++d)
          ASSERT_TRUE(bits_equal(y1[size_t(d)], got[size_t(r * c.dim + d)]))
              << c.name << " row " << r << " d " << d << ": alone " << y1[size_t(d)]
              << ", in an 8-row call " << got[size_t(r * c.dim + d)];
      }
    }
  }
  EXPECT_GE(double(total_within), 0.9 * double(total_compared))
      << c.name << ": " << total_within << " of " << total_compared
      << " outputs within one bf16 ulp";
}

INSTANTIATE_TEST_SUITE_P(
    Configs, OpsMoe,
    ::testing::Values(
        // the tiny fixture's backbone MoE, scales raised so that both clamps fire
        MoeCase{"e8_top2_clamp", 8, 2, 256, 128, "sqrtsoftplus", 1.f, 1.5f, 10.f, 121, 125},
        // the released model's 384 experts / top-6, small dims
        MoeCase{"e384_top6", 384, 6, 256, 64, "sqrtsoftplus", 1.f, 2.5f, 10.f, 119, 123},
        MoeCase{"e8_softmax_temp", 8, 2, 256, 128, "softmax", 0.7f, 1.f, 0.f, 118, 122},
        // DSpark stage MoE: 4 experts
        MoeCase{"e4_sigmoid", 4, 2, 128, 64, "sigmoid", 1.f, 1.5f, 10.f, 120, 124}),
    [](const ::testing::TestParamInfo<MoeCase>& i) { return std::string(i.param.name); });

// DeviceMoe inside a CUDA graph: the shared expert's forked stream (event fork / join) and the
// router's self-resetting counter are captured; replays on a non-default stream equal the eager
// call bitwise, for apply, apply_partial and apply_partial_experts, at T = 1 and 8.
TEST(OpsMoeGraph, CaptureReplayEqualsEager) {
  UF_REQUIRE_GPU();
  const MoeCase c{"e384_top6", 384, 6, 256, 64, "sqrtsoftplus", 1.f, 2.5f, 10.f, 119, 123};
  std::mt19937 rng(99);
  auto hm = make_moe(c, rng);
  const MoeShape shape{c.dim, c.inter, c.E, c.K, c.score_func, c.gate_temp, c.route_scale, c.limit};
  DeviceArena arena;
  DeviceMoe moe(hm->w, shape, arena);
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int64_t sf = moe.slot_floats_per_row();
  // The shared expert in line (the default) and on the object's forked stream: the forked run's
  // results must be bitwise the in-line run's, eager and replayed.
  std::vector<float> inline_out[2][3];
  for (int T : {1, 8}) {
    const std::vector<float> x = random_acts(T, c.dim, rng);
    for (bool fork : {false, true}) {
      moe.set_fork_shared(fork);
      DeviceBuffer<float> dx(x);
      DeviceBuffer<int32_t> di(size_t(T) * c.K);
      DeviceBuffer<float> dw(size_t(T) * c.K);
      for (int mode = 0; mode < 3; ++mode) {
        const size_t n = mode == 2 ? size_t(T) * sf : size_t(T) * c.dim;
        DeviceBuffer<float> eager(n), graph(n);
        eager.poison();
        graph.poison();
        auto call = [&](float* y) {
          if (mode == 0) moe.apply(dx.get(), T, y, di.get(), dw.get(), s);
          if (mode == 1) moe.apply_partial(dx.get(), T, y, di.get(), dw.get(), s);
          if (mode == 2) moe.apply_partial_experts(dx.get(), T, y, di.get(), dw.get(), s);
        };
        call(eager.get());
        UF_CUDA_CHECK(cudaStreamSynchronize(s));
        cudaGraph_t g;
        UF_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        call(graph.get());
        UF_CUDA_CHECK(cudaStreamEndCapture(s, &g));
        cudaGraphExec_t exec;
        UF_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
        for (int r = 0; r < 3; ++r) UF_CUDA_CHECK(cudaGraphLaunch(exec, s));
        UF_CUDA_CHECK(cudaStreamSynchronize(s));
        UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
        UF_CUDA_CHECK(cudaGraphDestroy(g));
        sync_and_check();
        const std::vector<float> a = eager.download(), b = graph.download();
        size_t diff = 0, nan = 0, first = a.size();
        for (size_t i = 0; i < a.size(); ++i) {
          nan += std::isnan(a[i]) || std::isnan(b[i]);
          if (!bits_equal(a[i], b[i])) first = std::min(first, i), ++diff;
        }
        EXPECT_TRUE(diff == 0 && nan == 0) << "T=" << T << " mode " << mode << " fork " << fork
                                           << ": graph replay vs eager: " << diff << " differ ("
                                           << nan << " NaN), first at " << first;
        std::vector<float>& ref = inline_out[T == 8][mode];
        if (!fork) {
          ref = a;
        } else {
          size_t fd = 0;
          for (size_t i = 0; i < a.size(); ++i) fd += !bits_equal(a[i], ref[i]);
          EXPECT_EQ(fd, 0u) << "T=" << T << " mode " << mode << ": forked vs in-line shared expert";
        }
      }
    }
  }
  moe.set_fork_shared(false);
  UF_CUDA_CHECK(cudaStreamDestroy(s));
}

// Engram: FP8 table with per-row scales, FP8 wkv (Fp8Gemv), BF16 q/k weights.
TEST(OpsEngram, MatchesCpuAliasingAndSpecEqualsPlain) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(777);
  const int hc = 4, D = 64, n_cols = 4, head_dim = 64, rows = 500;
  const auto host = make_host_engram(hc, D, n_cols, head_dim, rows, rng);
  const model::EngramWeights& w = host->w;
  const EngramShape shape{hc, D, n_cols, head_dim, 1e-6f};
  const cpu::EngramParams p{hc, D, n_cols, head_dim, 1e-6f};
  DeviceArena arena;
  DeviceEngram eng(w, shape, arena);
  std::uniform_int_distribution<int64_t> id(0, rows - 1);
  size_t total_exact = 0, total_n = 0;
  for (int T : {1, 3, 8, 20}) {
    std::vector<int64_t> ids(size_t(T) * n_cols);
    for (auto& v : ids) v = id(rng);
    const std::vector<float> X = random_acts(T * hc, D, rng);
    std::vector<float> want(X.size());
    cpu::engram_forward(w, p, ids.data(), X.data(), T, want.data());
    DeviceBuffer<int64_t> dids(ids);
    DeviceBuffer<float> dX(X), dout(X.size());
    dout.poison();
    eng.apply(dids.get(), dX.get(), T, dout.get(), nullptr);
    sync_and_check();
    const std::vector<float> got = dout.download();
    // compare_engram's bound, and >= 97% bitwise over all the test's outputs (~0.5% expected to
    // flip).
    const Compare cmp = compare_engram(got, want, D);
    EXPECT_EQ(cmp.nan, 0u) << "T=" << T << " " << cmp.report(got, want);
    EXPECT_EQ(cmp.bad, 0u) << "T=" << T << " " << cmp.report(got, want);
    total_exact += cmp.exact;
    total_n += cmp.n;
    std::printf("[ops_engram] T=%d: %s\n", T, cmp.report(got, want).c_str());

    // out aliasing X gives the same bits.
    DeviceBuffer<float> dA(X);
    eng.apply(dids.get(), dA.get(), T, dA.get(), nullptr);
    sync_and_check();
    const std::vector<float> aliased = dA.download();
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_TRUE(bits_equal(aliased[i], got[i])) << "aliased output differs at " << i;

    if (T == 20) {  // spec == plain
      DeviceBuffer<float> one(size_t(hc) * D);
      for (int r = 0; r < T; ++r) {
        one.poison();
        eng.apply(dids.get() + int64_t(r) * n_cols, dX.get() + int64_t(r) * hc * D, 1, one.get(),
                  nullptr);
        sync_and_check();
        const std::vector<float> o = one.download();
        for (int i = 0; i < hc * D; ++i)
          ASSERT_TRUE(bits_equal(o[size_t(i)], got[size_t(r * hc * D + i)]))
              << "row " << r << " element " << i;
      }
    }
  }
  EXPECT_GE(double(total_exact), 0.97 * double(total_n))
      << total_exact << " of " << total_n << " outputs bitwise equal";
}

// Tensor parallelism: the table split by rows over 3 "ranks" (uneven: 167, 167, 166 rows), each
// gathering its rows and +0 elsewhere, the gathers summed (what the TP all-reduce does) before
// wkv. The result must be the whole table's bit for bit: one rank alone contributes each value.
// The ranks run one after the other here: a first pass records each rank's gather, a second
// pass feeds every rank the sum.
TEST(OpsEngram, RowSplitTableEqualsTheWholeTable) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(4242);
  const int hc = 4, D = 64, n_cols = 4, head_dim = 64, rows = 500, ranks = 3;
  const auto host = make_host_engram(hc, D, n_cols, head_dim, rows, rng);
  const model::EngramWeights& w = host->w;
  DeviceArena arena;
  const EngramShape whole_shape{hc, D, n_cols, head_dim, 1e-6f};
  DeviceEngram whole(w, whole_shape, arena);
  EXPECT_FALSE(whole.split());
  const int64_t chunk = (rows + ranks - 1) / ranks;
  std::vector<std::unique_ptr<DeviceEngram>> part;
  for (int r = 0; r < ranks; ++r) {
    const int64_t r0 = r * chunk, n = std::min<int64_t>(chunk, rows - r0);
    model::EngramWeights pw = w;
    pw.table.data = w.table.data + r0 * head_dim;           // FP8: a byte per element
    pw.table.scale = w.table.scale + r0 * (head_dim / 32);  // per-row E8M0, one per 32
    pw.table.rows = n;
    EngramShape s = whole_shape;
    s.row_begin = r0;
    s.rows_total = rows;
    part.push_back(std::make_unique<DeviceEngram>(pw, s, arena));
    EXPECT_TRUE(part.back()->split());
  }
  // A split table without a reduce (or a whole one with) is refused, not silently wrong.
  DeviceBuffer<int64_t> one_id(std::vector<int64_t>(size_t(n_cols), 0));
  DeviceBuffer<float> one_x(random_acts(hc, D, rng)), one_out(size_t(hc) * D);
  EXPECT_THROW(part[0]->apply(one_id.get(), one_x.get(), 1, one_out.get(), nullptr),
               std::exception);
  EXPECT_THROW(
      whole.apply(one_id.get(), one_x.get(), 1, one_out.get(), nullptr, [](float*, size_t) {}),
      std::exception);

  std::uniform_int_distribution<int64_t> id(0, rows - 1);
  for (int T : {1, 5, 8, 13}) {
    std::vector<int64_t> ids(size_t(T) * n_cols);
    for (auto& v : ids) v = id(rng);
    ids[0] = 0, ids[ids.size() - 1] = rows - 1;  // the first and the last row of the table
    const std::vector<float> X = random_acts(T * hc, D, rng);
    DeviceBuffer<int64_t> dids(ids);
    DeviceBuffer<float> dX(X), want(X.size()), got(X.size());
    want.poison();
    whole.apply(dids.get(), dX.get(), T, want.get(), nullptr);
    sync_and_check();
    const std::vector<float> ref = want.download();
    // Pass 1: each rank's gathers, chunk by chunk (apply splits T into chunks of 8 rows).
    std::vector<std::vector<std::vector<float>>> gathered(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r)
      part[size_t(r)]->apply(dids.get(), dX.get(), T, got.get(), nullptr, [&](float* v, size_t n) {
        sync_and_check();
        std::vector<float> h(n);
        UF_CUDA_CHECK(cudaMemcpy(h.data(), v, n * sizeof(float), cudaMemcpyDeviceToHost));
        gathered[size_t(r)].push_back(std::move(h));
      });
    // Every gathered value comes from exactly one rank (the others hold +0 there).
    for (size_t c = 0; c < gathered[0].size(); ++c)
      for (size_t i = 0; i < gathered[0][c].size(); ++i) {
        int owners = 0;
        for (int r = 0; r < ranks; ++r) owners += gathered[size_t(r)][c][i] != 0.f;
        ASSERT_LE(owners, 1) << "chunk " << c << " value " << i;
      }
    // Pass 2: every rank continues from the sum, and must give the whole table's outputs.
    for (int r = 0; r < ranks; ++r) {
      got.poison();
      size_t chunk_no = 0;
      part[size_t(r)]->apply(dids.get(), dX.get(), T, got.get(), nullptr, [&](float* v, size_t n) {
        std::vector<float> sum(n, 0.f);
        for (int q = 0; q < ranks; ++q)
          for (size_t i = 0; i < n; ++i) sum[i] += gathered[size_t(q)][chunk_no][i];
        ++chunk_no;
        UF_CUDA_CHECK(cudaMemcpy(v, sum.data(), n * sizeof(float), cudaMemcpyHostToDevice));
      });
      sync_and_check();
      const std::vector<float> out = got.download();
      for (size_t i = 0; i < out.size(); ++i)
        ASSERT_TRUE(bits_equal(out[i], ref[i])) << "T=" << T << " rank " << r << " output " << i
                                                << ": " << out[i] << " vs whole " << ref[i];
    }
  }
}

// moe_route's selection on constructed ties (its keys: order-preserving float bits + ~expert id):
// equal scores pick the lowest ids in ascending order, increasing scores the highest ids in
// descending order, the bias decides among equal scores (ties again to the lower id), -0 and +0
// scores count as equal; weights of equal scores are equal and sum to route_scale (K > 1:
// normalised). Row 5 takes all six from one lane of the one-warp router (experts 5 + 32 i, in a
// scrambled score order): its sorted per-lane list must advance six times.
// Exact expectations: they depend only on the comparator, not on expf / log1pf.
TEST(OpsMoeRoute, SelectionOrderAndTies) {
  UF_REQUIRE_GPU();
  constexpr int E = 384, K = 6, rows = 6;
  MoeShape shape;
  shape.n_experts = E;
  shape.top_k = K;
  shape.score_func = "sqrtsoftplus";
  shape.route_scale = 2.5f;
  std::vector<float> scores(size_t(rows) * E, 0.5f), bias(size_t(E), 0.f);
  for (int e = 0; e < E; ++e) scores[size_t(1) * E + e] = 0.01f * float(e);  // row 1: increasing
  // Rows 0, 2 (equal scores): the bias picks 300 (+4), then 7 and 200 (+3 each: the lower id
  // first), then the lowest unbiased ids 0, 1, 2.
  bias[300] = 4.f;
  bias[7] = 3.f;
  bias[200] = 3.f;
  for (int e = 0; e < E; ++e) scores[size_t(3) * E + e] = (e % 2) ? -0.0f : 0.0f;  // row 3
  // Row 4: one large score at 383, the rest equal: 383 first, then the bias order.
  scores[size_t(4) * E + 383] = 8.f;
  // Row 5: 30 + 2 ((5 i) mod 12) at expert 5 + 32 i (sqrt-softplus ~ sqrt: 5.5 .. 7.2, above
  // every biased 0.5): the order i = 7, 2, 9, 4, 11, 6.
  for (int i = 0; i < 12; ++i)
    scores[size_t(5) * E + 5 + 32 * i] = 30.f + 2.f * float((5 * i) % 12);
  DeviceBuffer<float> ds(scores), db(bias);
  DeviceBuffer<int32_t> gi(size_t(rows) * K);
  DeviceBuffer<float> gw(size_t(rows) * K);
  gw.poison();
  UF_CUDA_CHECK(cudaMemset(gi.get(), 0xFF, gi.size() * sizeof(int32_t)));
  moe_route(shape, ds.get(), db.get(), rows, gi.get(), gw.get(), nullptr);
  sync_and_check();
  const std::vector<int32_t> i = gi.download();
  const std::vector<float> w = gw.download();
  // Row 1: sc(3.0) + 4 > sc(2.0) + 3 > sc(0.07) + 3 > sc(3.83) > sc(3.82) > ...
  const std::vector<std::vector<int32_t>> want = {
      {300, 7, 200, 0, 1, 2}, {300, 200, 7, 383, 382, 381}, {300, 7, 200, 0, 1, 2},
      {300, 7, 200, 0, 1, 2}, {300, 7, 200, 383, 0, 1},     {229, 69, 293, 133, 357, 197}};
  for (int t = 0; t < rows; ++t) {
    const std::vector<int32_t> got(i.begin() + t * K, i.begin() + (t + 1) * K);
    EXPECT_EQ(got, want[size_t(t)]) << "row " << t;
    float sum = 0.f;
    for (int k = 0; k < K; ++k) {
      ASSERT_TRUE(std::isfinite(w[size_t(t * K + k)])) << "row " << t << " k " << k;
      sum += w[size_t(t * K + k)];
    }
    EXPECT_NEAR(sum, shape.route_scale, 1e-5f) << "row " << t;
  }
  for (int t : {0, 2, 3})  // equal scores: equal weights
    for (int k = 1; k < K; ++k)
      EXPECT_EQ(w[size_t(t * K + k)], w[size_t(t * K)]) << "row " << t << " k " << k;
}

}  // namespace
}  // namespace uf::cuda::test
