// DenseMma (cuda/kernels/dense_mma.h: the tensor-core dense GEMV) and the DeviceLinear kinds that
// use it (kBf16OutBf16X, kF32Bf16X) against cpu::linear_f32 / linear_bf16_out(_rows), on fresh
// random weights and bf16-exact inputs: head-, router-, wo_a- and Markov-head-like shapes (scaled
// down in rows where the real ones would cost CPU time, keeping the configuration: S = 1 for the
// many-row weights, split K for the router / wo_a ones), odd row counts and offsets, strided x / y.
// Every output poisoned with NaN first; rows bitwise equal across T = 1..8 and 13 (spec == plain).
// Both decode paths (DenseMmaPath::kAuto: the resident cluster kernel where it fits, at every
// cluster size it can take; kLegacy: the session-6 kernels) run on the same inputs and must agree
// bitwise (they implement the same sum order, dense_mma.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/linear.h"
#include "cuda/gemv.h"
#include "cuda/kernels/dense_mma.h"
#include "cuda/ops/linear.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

// Tolerance, relative to sum_k |x w| (the terms are exact products on both sides, so only the fp32
// summation differs): the classic bound gamma_n = n u for n sequential fp32 adds of terms whose
// magnitudes sum to mag, added for the two orders: the CPU's dot8 (8 chains of K/8 adds, then 3
// tree levels) and the device's K/16 mma accumulations (each may truncate instead of rounding:
// <= 1 ulp of the running magnitude) plus S part adds; never below the 2^-16 the other
// tensor-core tests use. bf16 outputs: plus one bf16 ulp (a rounding flip).
double tol_factor(int64_t K, int S) {
  return std::max(0x1p-16, double(K / 8 + 3 + K / 16 + S + 8) * 0x1p-24);
}

struct MmaCase {
  const char* name;
  WFormat format;
  int64_t rows, cols;
  int64_t r0, n;  // the call's row range (n = 0: every row)
  int x_pad, y_pad;
  bool round;  // bf16 outputs (linear_bf16_out_rows), else fp32 (linear_f32)
  bool row_scale;
  bool resident = false;  // the automatic plan must take the resident kernel (>= 100 SMs)
};

// The CPU's y[T, n] (row stride n) for rows [r0, r0 + n) of w on x [T, xs].
std::vector<float> cpu_rows(const model::Weight& w, int64_t r0, int64_t n,
                            const std::vector<float>& x, int xs, int T, bool round) {
  const int64_t K = w.cols;
  std::vector<float> want(size_t(T) * size_t(n));
  if (round) {
    cpu::linear_bf16_out_rows(w, r0, n, x.data(), xs, T, want.data(), int(n));
    return want;
  }
  std::vector<float> xc(size_t(T) * size_t(K)), full(size_t(T) * size_t(w.rows));
  for (int t = 0; t < T; ++t)
    std::copy_n(x.begin() + int64_t(t) * xs, K, xc.begin() + int64_t(t) * K);
  cpu::linear_f32(w, xc.data(), T, full.data());
  for (int t = 0; t < T; ++t)
    std::copy_n(full.begin() + int64_t(t) * w.rows + r0, n, want.begin() + int64_t(t) * n);
  return want;
}

// sum_k |x[t, k] w[r0 + j, k]| in double, [T, n].
std::vector<double> magnitudes(const model::Weight& w, int64_t r0, int64_t n,
                               const std::vector<float>& x, int xs, int T) {
  const int64_t K = w.cols;
  std::vector<double> mag(size_t(T) * size_t(n), 0.0);
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t j = 0; j < n; ++j) {
    w.row(r0 + j, row.data());
    for (int t = 0; t < T; ++t) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += std::fabs(double(x[size_t(t * xs + k)]) * row[size_t(k)]);
      mag[size_t(t * n + j)] = s;
    }
  }
  return mag;
}

// got [T, ys] (columns >= n must still hold the poison) against want [T, n].
void check_against_cpu(const char* name, int T, const std::vector<float>& got, int ys,
                       const std::vector<float>& want, const std::vector<double>& mag, int64_t n,
                       double factor, bool round) {
  std::vector<float> g(want.size());
  size_t written_outside = 0;
  for (int t = 0; t < T; ++t)
    for (int64_t j = 0; j < ys; ++j) {
      const float v = got[size_t(t * ys + j)];
      if (j < n)
        g[size_t(t * n + j)] = v;
      else if (!std::isnan(v))
        ++written_outside;
    }
  const Compare cmp(g, want, [&](size_t i) {
    const float ulp = round ? bf16_ulp(std::max(std::fabs(g[i]), std::fabs(want[i]))) : 0.f;
    return std::fabs(double(g[i]) - double(want[i])) <= double(ulp) + factor * mag[i];
  });
  std::printf("[dense_mma] %s T=%d: %s\n", name, T, cmp.report(g, want).c_str());
  EXPECT_EQ(cmp.nan, 0u) << name << " T=" << T << " " << cmp.report(g, want);
  EXPECT_EQ(cmp.bad, 0u) << name << " T=" << T << " " << cmp.report(g, want);
  EXPECT_EQ(written_outside, 0u) << name << " T=" << T << ": outputs written outside [0, n)";
  // bf16 outputs: a flip needs the fp32 value within the fp32 error of a rounding midpoint.
  if (round) {
    EXPECT_GE(double(cmp.exact), 0.99 * double(cmp.n))
        << name << " T=" << T << ": " << cmp.exact << " of " << cmp.n << " bitwise equal";
  }
}

// Row t of a [T, ys] result vs row t of another, bitwise, over columns [0, n).
void expect_rows_equal(const char* name, const std::vector<float>& a, int ta, const float* b,
                       int tb_row, int64_t n, const char* what) {
  for (int64_t j = 0; j < n; ++j)
    ASSERT_TRUE(bits_equal(a[size_t(ta) + size_t(j)], b[size_t(j)]))
        << name << " " << what << ": token row " << tb_row << " feature " << j << ": "
        << a[size_t(ta) + size_t(j)] << " vs " << b[size_t(j)];
}

class DenseMmaShapes : public ::testing::TestWithParam<MmaCase> {};

TEST_P(DenseMmaShapes, MatchesCpuAndRowsIndependentOfT) {
  UF_REQUIRE_GPU();
  const MmaCase c = GetParam();
  std::mt19937 rng(4321);
  auto hw = make_weight(c.format, c.rows, c.cols, rng, 116, 122, c.row_scale, c.name);
  DeviceArena arena;
  const DeviceWeight dw = upload_weight(hw->w, arena);
  ASSERT_TRUE(DenseMma::supports(dw)) << c.name;
  const DenseMma mma(dw, device_sm_count());
  const int64_t K = c.cols, n = c.n > 0 ? c.n : c.rows - c.r0;
  const int S = mma.splits(n);
  const int xs = int(K) + c.x_pad, ys = int(n) + c.y_pad;
  const double factor = tol_factor(K, S);
  std::printf("[dense_mma] %s: [%lld, %lld] rows [%lld, %lld) S=%d tol=%.3g*sum|wx|\n", c.name,
              static_cast<long long>(c.rows), static_cast<long long>(K),
              static_cast<long long>(c.r0), static_cast<long long>(c.r0 + n), S, factor);

  constexpr int kTmax = 13;
  const std::vector<float> x = random_acts(kTmax, xs, rng);  // bf16 values
  const DeviceBuffer<float> dx(x);
  auto run = [&](const float* xp, int T) {
    DeviceBuffer<float> dy(size_t(T) * size_t(ys));
    dy.poison();
    mma.run(dw, c.r0, n, xp, xs, T, dy.get(), ys, c.round, nullptr);
    sync_and_check();
    return dy.download();
  };
  // T = 13 (two chunks of 8 rows: the full-K configuration) against the CPU.
  const std::vector<float> y13 = run(dx.get(), kTmax);
  check_against_cpu(c.name, kTmax, y13, ys, cpu_rows(hw->w, c.r0, n, x, xs, kTmax, c.round),
                    magnitudes(hw->w, c.r0, n, x, xs, kTmax), n, factor, c.round);
  // T = 1..8 (split K where S > 1): each row bitwise the 13-row call's (and so within the CPU
  // tolerance); the unwritten columns still poisoned.
  for (int T = 1; T <= kMaxDecodeRows; ++T) {
    const std::vector<float> y = run(dx.get(), T);
    for (int t = 0; t < T; ++t) {
      expect_rows_equal(c.name, y, t * ys, y13.data() + size_t(t) * ys, t, n, "T-row vs 13-row");
      for (int64_t j = n; j < ys; ++j)
        ASSERT_TRUE(std::isnan(y[size_t(t * ys + j)]))
            << c.name << " T=" << T << " wrote col " << j;
    }
  }
  // Each of the 13 rows alone (T = 1).
  for (int t = 0; t < kTmax; ++t) {
    const std::vector<float> y = run(dx.get() + int64_t(t) * xs, 1);
    expect_rows_equal(c.name, y, 0, y13.data() + size_t(t) * ys, t, n, "alone vs 13-row");
  }

  // The legacy kernels and the resident kernel at each cluster size it can take: bitwise the same
  // outputs (every written element, and the poison left in the columns >= n).
  const int sms = device_sm_count();
  const int auto_cluster = mma.resident_cluster(n);
  std::printf("[dense_mma] %s: resident cluster %d (0 = legacy kernel) on %d SMs\n", c.name,
              auto_cluster, sms);
  if (c.resident && sms >= 100) {
    EXPECT_GT(auto_cluster, 0) << c.name << ": the automatic plan should take the resident kernel";
  }
  const DenseMma legacy(dw, sms, DenseMmaPath::kLegacy);
  EXPECT_EQ(legacy.resident_cluster(n), 0) << c.name;
  auto run_plan = [&](const DenseMma& plan, int T) {
    DeviceBuffer<float> dy(size_t(T) * size_t(ys));
    dy.poison();
    plan.run(dw, c.r0, n, dx.get(), xs, T, dy.get(), ys, c.round, nullptr);
    sync_and_check();
    return dy.download();
  };
  std::vector<std::vector<float>> legacy_out(kMaxDecodeRows + 1);
  for (int T = 1; T <= kMaxDecodeRows; ++T) legacy_out[size_t(T)] = run_plan(legacy, T);
  for (int cl : {0, 1, 2, 4, 8}) {
    const DenseMma plan(dw, sms, DenseMmaPath::kAuto, cl);
    const int used = plan.resident_cluster(n);
    if (cl != 0 && used == 0) continue;  // this cluster size cannot serve the shape
    for (int T = 1; T <= kMaxDecodeRows; ++T) {
      const std::vector<float>& want = legacy_out[size_t(T)];
      const std::vector<float> got = run_plan(plan, T);
      size_t diff = 0, first = got.size();
      for (size_t i = 0; i < got.size(); ++i)
        if (!bits_equal(got[i], want[i])) {
          ++diff;
          first = std::min(first, i);
        }
      EXPECT_EQ(diff, 0u) << c.name << " cluster " << used << " (asked " << cl << ") T=" << T
                          << ": " << diff << " elements differ from the legacy kernel, first "
                          << first << " (row " << (first < got.size() ? first / size_t(ys) : 0)
                          << ", col " << (first < got.size() ? first % size_t(ys) : 0)
                          << "): " << (first < got.size() ? got[first] : 0.f) << " vs "
                          << (first < got.size() ? want[first] : 0.f);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DenseMmaShapes,
    ::testing::Values(
        // Head: 129280 rows -> S = 1, several tiles per warp; 8200 rows keep S = 1 (>= 3 x SMs
        // tiles) at a CPU cost a test can afford. Not a multiple of 16 (8200 = 512.5 tiles).
        MmaCase{"head_like", WFormat::kBF16, 8200, 5120, 0, 0, 0, 0, false, false},
        // The TP8 rank's eighth of the head has 16160 rows (S = 1 or 2 by SM count): 1010 tiles.
        MmaCase{"head8_like", WFormat::kBF16, 1010 * 16, 1024, 0, 0, 0, 0, false, false},
        // More tiles than the grid's warps (2500 tiles; 8 KB x + the warps' weight rings: 2 CTAs
        // an SM, 264 CTAs on 132 SMs): warps run 2 tiles, the ring crossing tile boundaries.
        MmaCase{"multi_tile_bf16", WFormat::kBF16, 40000, 512, 0, 0, 0, 2, true, false},
        // Router gate [384, 5120] BF16, fp32 scores: split K (S = 16 on 132 SMs).
        MmaCase{"router", WFormat::kBF16, 384, 5120, 0, 0, 0, 0, false, false, true},
        // wo_a of a TP8 rank: FP8 [1024, 4096] with 32x32 block scales, bf16 out, split K.
        MmaCase{"wo_a_rank", WFormat::kFP8, 1024, 4096, 0, 0, 0, 0, true, false, true},
        // wo_a group 1 of 2 on one GPU: rows [1024, 2048), x and y strided as output_proj's.
        // 63 tiles (the last one half full): the resident plan's last cluster has an idle warp.
        MmaCase{"wo_a_ragged", WFormat::kFP8, 1000, 4096, 0, 0, 0, 0, true, false, true},
        MmaCase{"wo_a_group", WFormat::kFP8, 2048, 4096, 1024, 1024, 4096, 1024, true, false, true},
        // Markov head [129280, 256]: K = 256 (4 chunks a tile), S = 1.
        MmaCase{"markov_like", WFormat::kBF16, 8200, 256, 0, 0, 0, 0, false, false},
        // Odd shapes: rows not a multiple of 16, K = 320 (5 chunks: S = 1), x stride % 4 != 0
        // (scalar staging loads), padded y.
        MmaCase{"odd_bf16", WFormat::kBF16, 200, 320, 0, 0, 3, 5, true, false},
        // FP8 row range starting inside a 32-row scale block (tiles straddle scale rows).
        MmaCase{"fp8_offset_rows", WFormat::kFP8, 200, 512, 40, 137, 0, 2, true, false},
        MmaCase{"fp8_row_scale", WFormat::kFP8, 100, 256, 0, 0, 0, 0, false, true}),
    [](const ::testing::TestParamInfo<MmaCase>& i) { return std::string(i.param.name); });

// The bf16-exactness contract: a token row with one x value that is not a bf16 value gets NaN
// outputs (never a silently rounded product); the other rows are untouched, bitwise. A NaN in x
// propagates the same way.
TEST(DenseMma, NonBf16InputPoisonsItsRow) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(77);
  for (const auto& [f, rows] :
       {std::pair{WFormat::kBF16, int64_t(384)}, std::pair{WFormat::kBF16, int64_t(8200)},
        std::pair{WFormat::kFP8, int64_t(1024)}}) {
    const int64_t K = 1024;
    auto hw = make_weight(f, rows, K, rng);
    DeviceArena arena;
    const DeviceWeight dw = upload_weight(hw->w, arena);
    for (const DenseMmaPath path : {DenseMmaPath::kAuto, DenseMmaPath::kLegacy})
      for (int T : {5, 13}) {
        const DenseMma mma(dw, device_sm_count(), path);
        std::vector<float> x = random_acts(T, K, rng);
        auto run = [&](const std::vector<float>& xv) {
          const DeviceBuffer<float> dx(xv);
          DeviceBuffer<float> dy(size_t(T) * size_t(rows));
          dy.poison();
          mma.run(dw, 0, rows, dx.get(), K, T, dy.get(), rows, false, nullptr);
          sync_and_check();
          return dy.download();
        };
        const std::vector<float> clean = run(x);
        std::vector<float> bad = x;
        bad[size_t(2 * K + 700)] = 1.0f + 0x1p-12f;  // needs 13 significand bits
        bad[size_t(4 * K + 3)] = NAN;
        const std::vector<float> y = run(bad);
        for (int t = 0; t < T; ++t)
          for (int64_t j = 0; j < rows; ++j) {
            const float v = y[size_t(t * rows + j)], w = clean[size_t(t * rows + j)];
            if (t == 2 || t == 4)
              ASSERT_TRUE(std::isnan(v))
                  << "rows " << rows << " path " << int(path) << " T=" << T << " t=" << t
                  << " j=" << j << ": " << v << " from a non-bf16 / NaN input";
            else
              ASSERT_TRUE(bits_equal(v, w) && std::isfinite(v))
                  << "rows " << rows << " path " << int(path) << " T=" << T << " t=" << t
                  << " j=" << j << ": " << v << " vs " << w;
          }
      }
  }
}

// One kernel launch per call (split K included: the last warp of a tile finishes it), and a
// replayed graph gives the stream's bits (the split counters reset themselves).
TEST(DenseMma, OneLaunchAndGraphReplay) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(78);
  for (const auto& [f, rows, K] : {std::tuple{WFormat::kBF16, int64_t(384), int64_t(5120)},
                                   std::tuple{WFormat::kFP8, int64_t(1024), int64_t(4096)},
                                   std::tuple{WFormat::kBF16, int64_t(8200), int64_t(256)}}) {
    auto hw = make_weight(f, rows, K, rng);
    DeviceArena arena;
    const DeviceWeight dw = upload_weight(hw->w, arena);
    const DenseMma mma(dw, device_sm_count());
    for (int T : {1, 7, 13}) {
      const DeviceBuffer<float> dx(random_acts(T, K, rng));
      DeviceBuffer<float> dy(size_t(T) * size_t(rows));
      dy.poison();
      mma.run(dw, 0, rows, dx.get(), K, T, dy.get(), rows, true, nullptr);
      sync_and_check();
      const std::vector<float> want = dy.download();
      cudaStream_t s;
      UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      cudaGraph_t graph;
      UF_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      mma.run(dw, 0, rows, dx.get(), K, T, dy.get(), rows, true, s);
      UF_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
      size_t nodes = 0;
      UF_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
      EXPECT_EQ(nodes, 1u) << "rows " << rows << " T=" << T << ": kernel launches";
      cudaGraphExec_t exec;
      UF_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int rep = 0; rep < 3; ++rep) {
        UF_CUDA_CHECK(cudaMemset(dy.get(), 0xFF, dy.size() * sizeof(float)));
        UF_CUDA_CHECK(cudaGraphLaunch(exec, s));
        UF_CUDA_CHECK(cudaStreamSynchronize(s));
        const std::vector<float> got = dy.download();
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_TRUE(bits_equal(got[i], want[i]))
              << "rows " << rows << " T=" << T << " replay " << rep << " element " << i << ": "
              << got[i] << " vs " << want[i];
      }
      UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
      UF_CUDA_CHECK(cudaGraphDestroy(graph));
      UF_CUDA_CHECK(cudaStreamDestroy(s));
    }
  }
}

// DeviceLinear with the *Bf16X kinds: apply / apply_partial / apply_rows take DenseMma where the
// weight allows (and match the CPU within the tolerance above), dense_rows otherwise (F32 weights,
// K % 64 != 0).
TEST(DenseMma, DeviceLinearKinds) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(79);
  struct C {
    const char* name;
    WFormat f;
    int64_t rows, cols;
    LinearKind kind;
  };
  const C cs[] = {{"router_f32", WFormat::kBF16, 384, 5120, LinearKind::kF32Bf16X},
                  {"router_prefill", WFormat::kBF16, 384, 5120, LinearKind::kF32Bf16XPrefill},
                  {"bf16_out_prefill", WFormat::kBF16, 128, 1024, LinearKind::kBf16OutBf16XPrefill},
                  {"fp8_bf16_out", WFormat::kFP8, 1024, 4096, LinearKind::kBf16OutBf16X},
                  {"f32_fallback", WFormat::kF32, 40, 256, LinearKind::kF32Bf16X},
                  {"bf16_k96_fallback", WFormat::kBF16, 48, 96, LinearKind::kBf16OutBf16X}};
  for (const C& c : cs) {
    auto hw = make_weight(c.f, c.rows, c.cols, rng);
    DeviceArena arena;
    const DeviceLinear lin(hw->w, c.kind, arena);
    const bool round =
        c.kind == LinearKind::kBf16OutBf16X || c.kind == LinearKind::kBf16OutBf16XPrefill;
    const int64_t N = c.rows, K = c.cols;
    const double factor = tol_factor(K, 32);  // any split count the plan may pick (<= 32)
    for (int T : {1, 7, 13}) {
      const std::vector<float> x = random_acts(T, K, rng);
      const DeviceBuffer<float> dx(x);
      DeviceBuffer<float> dy(size_t(T) * size_t(N)), dp(size_t(T) * size_t(N));
      dy.poison();
      dp.poison();
      lin.apply(dx.get(), T, dy.get(), nullptr);
      lin.apply_partial(dx.get(), T, dp.get(), nullptr);
      sync_and_check();
      const std::vector<float> y = dy.download(), yp = dp.download();
      check_against_cpu(c.name, T, y, int(N), cpu_rows(hw->w, 0, N, x, int(K), T, round),
                        magnitudes(hw->w, 0, N, x, int(K), T), N, factor, round);
      // apply_partial: the unrounded fp32 sums (kF32: apply itself).
      check_against_cpu(c.name, T, yp, int(N), cpu_rows(hw->w, 0, N, x, int(K), T, false),
                        magnitudes(hw->w, 0, N, x, int(K), T), N, factor, false);
      for (size_t i = 0; i < y.size(); ++i) {
        const float want = round ? core::round_bf16(yp[i]) : yp[i];
        ASSERT_TRUE(bits_equal(y[i], want))
            << c.name << " T=" << T << " element " << i << ": apply " << y[i]
            << " vs rounded apply_partial " << want;
      }
    }
    // apply_rows: the second half of the rows, strided x and y (bf16 outputs, as wo_a).
    const int64_t r0 = N / 2, n = N - N / 2;
    const int xs = int(K) + 32, ys = int(n) + 3;
    for (int T : {1, 8, 13}) {
      const std::vector<float> x = random_acts(T, xs, rng);
      const DeviceBuffer<float> dx(x);
      DeviceBuffer<float> dy(size_t(T) * size_t(ys));
      dy.poison();
      lin.apply_rows(r0, n, dx.get(), xs, T, dy.get(), ys, nullptr);
      sync_and_check();
      check_against_cpu(c.name, T, dy.download(), ys, cpu_rows(hw->w, r0, n, x, xs, T, true),
                        magnitudes(hw->w, r0, n, x, xs, T), n, factor, true);
    }
  }
}

// kF32Bf16XPrefill (the MoE router gate, the compressor's fp32 projections): decode calls (T <= 8)
// bitwise kF32's dense_rows (the order the fused decode routers repeat), prefill calls bitwise
// kF32Bf16X's tensor-core path; kBf16OutBf16XPrefill (the compressor's and indexer's bf16
// projections) likewise between kBf16Out and kBf16OutBf16X.
TEST(DenseMma, PrefillKindSwitchesAtDecodeRows) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(83);
  auto hw = make_weight(WFormat::kBF16, 384, 5120, rng);
  DeviceArena arena;
  for (const auto& [pk, dk, mk] :
       {std::tuple{LinearKind::kF32Bf16XPrefill, LinearKind::kF32, LinearKind::kF32Bf16X},
        std::tuple{LinearKind::kBf16OutBf16XPrefill, LinearKind::kBf16Out,
                   LinearKind::kBf16OutBf16X}}) {
    const DeviceLinear pre(hw->w, pk, arena);
    const DeviceLinear f32(hw->w, dk, arena);
    const DeviceLinear mma(hw->w, mk, arena);
    for (int T : {1, 8, 9, 64}) {
      const std::vector<float> x = random_acts(T, 5120, rng);
      const DeviceBuffer<float> dx(x);
      DeviceBuffer<float> a(size_t(T) * 384), b(size_t(T) * 384);
      a.poison();
      b.poison();
      pre.apply(dx.get(), T, a.get(), nullptr);
      (T <= 8 ? f32 : mma).apply(dx.get(), T, b.get(), nullptr);
      sync_and_check();
      const auto ya = a.download(), yb = b.download();
      for (size_t i = 0; i < ya.size(); ++i)
        ASSERT_TRUE(bits_equal(ya[i], yb[i]) && !std::isnan(ya[i]))
            << "kind " << int(pk) << " T=" << T << " element " << i << ": " << ya[i] << " vs "
            << yb[i];
    }
  }
}

}  // namespace
}  // namespace uf::cuda::test
