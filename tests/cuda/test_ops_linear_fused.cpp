// DeviceLinear's one-launch paths (cuda/ops/linear.h): kQuant FP8 through Fp8Gemv::run_fused, the
// other kQuant weights through quant_rows_x, dense_rows on one grid for any row count, and
// apply_group. Checked bitwise against the two-kernel path they replace (act_quant_fp8_f32 +
// Fp8Gemv::run + bf16 rounding) at the model's rank-slice shapes, row-count independence, and the
// number of kernel launches (graph nodes of a captured apply).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "cuda/gemv.h"
#include "cuda/ops/linear.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

// "" or: how many of [T, n] differ bitwise (NaN counts), the first (token, feature), both values.
std::string diff(const std::vector<float>& got, const std::vector<float>& want, int64_t n) {
  size_t bad = 0, nan = 0;
  long first = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    nan += !std::isfinite(got[i]);
    if (f32_bits(got[i]) != f32_bits(want[i]) && bad++ == 0) first = long(i);
  }
  if (bad == 0 && nan == 0) return "";
  char buf[300];
  std::snprintf(buf, sizeof buf,
                "%zu of %zu differ, %zu non-finite; first at token %ld feature %ld: got %.9g "
                "(0x%08x) want %.9g (0x%08x)",
                bad, want.size(), nan, first < 0 ? -1 : first / long(n),
                first < 0 ? -1 : first % long(n), first < 0 ? 0.0 : double(got[size_t(first)]),
                first < 0 ? 0u : f32_bits(got[size_t(first)]),
                first < 0 ? 0.0 : double(want[size_t(first)]),
                first < 0 ? 0u : f32_bits(want[size_t(first)]));
  return buf;
}

std::vector<float> run_apply(const DeviceLinear& lin, const DeviceBuffer<float>& x, int T,
                             bool partial) {
  DeviceBuffer<float> y(size_t(T) * size_t(lin.rows()));
  y.poison();
  if (partial)
    lin.apply_partial(x.get(), T, y.get(), nullptr);
  else
    lin.apply(x.get(), T, y.get(), nullptr);
  sync_and_check();
  return y.download();
}

// The path apply() took before the fusion: act_quant_fp8_f32, Fp8Gemv::run (fp32 out), then the
// bf16 rounding (host core::round_bf16 == the device's RNE rounding), per chunk of 8 rows.
std::vector<float> two_kernel_apply(const DeviceLinear& lin, const Fp8Gemv& g,
                                    const std::vector<float>& x, int T, bool round) {
  const int64_t N = lin.rows(), K = lin.cols();
  std::vector<float> y(size_t(T) * size_t(N));
  DeviceBuffer<uint8_t> codes(size_t(kMaxDecodeRows) * size_t(K));
  DeviceBuffer<float> scales(size_t(kMaxDecodeRows) * size_t(K / 32));
  for (int t0 = 0; t0 < T; t0 += kMaxDecodeRows) {
    const int m = std::min(kMaxDecodeRows, T - t0);
    const DeviceBuffer<float> xc(std::vector<float>(x.begin() + size_t(t0) * size_t(K),
                                                    x.begin() + size_t(t0 + m) * size_t(K)));
    DeviceBuffer<float> yc(size_t(m) * size_t(N));
    yc.poison();
    act_quant_fp8_f32(xc.get(), m, int(K), codes.get(), scales.get(), nullptr);
    g.run(Fp8WeightView{lin.weight().data, lin.weight().scale, int(N), int(K)},
          QuantActView{codes.get(), scales.get(), m, int(K)}, yc.get(), nullptr, nullptr);
    sync_and_check();
    const std::vector<float> o = yc.download();
    for (size_t i = 0; i < o.size(); ++i)
      y[size_t(t0) * size_t(N) + i] = round ? core::round_bf16(o[i]) : o[i];
  }
  return y;
}

// Rank-slice shapes of the model: wq_a, wq_b, wkv-like, wo_b, shared expert w1+w3.
const int64_t kReal[][2] = {{1280, 5120}, {4096, 1280}, {512, 5120}, {5120, 1024}, {576, 5120}};

TEST(OpsLinearFused, EqualsTwoKernelPathAtRealShapes) {
  UF_REQUIRE_GPU();
  const ScopedPrefillGemm bitwise(PrefillGemm::kFp8Bitwise);  // T = 11: bitwise
  const int sms = device_sm_count();
  std::mt19937 rng(31);
  for (const auto& s : kReal) {
    const int64_t N = s[0], K = s[1];
    auto hw = make_weight(WFormat::kFP8, N, K, rng, 116, 122);
    DeviceArena arena;
    const DeviceLinear lin(hw->w, LinearKind::kQuant, arena);
    const Fp8Gemv g(int(N), int(K), sms);  // the same plan as lin's: (N, K, SMs) only
    for (int T : {1, 2, 3, 4, 5, 6, 7, 8, 11}) {
      const std::vector<float> x = random_acts(T, K, rng, 1.f, T % 2 == 0);
      const DeviceBuffer<float> dx(x);
      for (bool partial : {false, true}) {
        const std::vector<float> got = run_apply(lin, dx, T, partial);
        const std::vector<float> want = two_kernel_apply(lin, g, x, T, !partial);
        const std::string e = diff(got, want, N);
        EXPECT_TRUE(e.empty()) << "N=" << N << " K=" << K << " T=" << T
                               << (partial ? " apply_partial: " : " apply: ") << e;
      }
      // A misaligned x (4 bytes off) takes the three-kernel fallback: the same bits.
      if (T == 3) {
        std::vector<float> xo(x.size() + 4, 0.f);
        std::copy(x.begin(), x.end(), xo.begin() + 1);
        const DeviceBuffer<float> dxo(xo);
        DeviceBuffer<float> y(size_t(T) * size_t(N));
        y.poison();
        lin.apply(dxo.get() + 1, T, y.get(), nullptr);
        sync_and_check();
        const std::string e = diff(y.download(), run_apply(lin, dx, T, false), N);
        EXPECT_TRUE(e.empty()) << "N=" << N << " K=" << K << " misaligned x: " << e;
      }
    }
  }
}

// spec == plain at real shapes: each row of an 8-row apply == that row alone.
TEST(OpsLinearFused, RowIndependenceAtRealShapes) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(32);
  for (const auto& s : kReal) {
    const int64_t N = s[0], K = s[1];
    auto hw = make_weight(WFormat::kFP8, N, K, rng, 116, 122);
    DeviceArena arena;
    const DeviceLinear lin(hw->w, LinearKind::kQuant, arena);
    const std::vector<float> x = random_acts(kMaxDecodeRows, K, rng);
    const DeviceBuffer<float> dx(x);
    const std::vector<float> full = run_apply(lin, dx, kMaxDecodeRows, false);
    for (int t = 0; t < kMaxDecodeRows; ++t) {
      const DeviceBuffer<float> one(std::vector<float>(x.begin() + size_t(t) * size_t(K),
                                                       x.begin() + size_t(t + 1) * size_t(K)));
      const std::vector<float> got = run_apply(lin, one, 1, false);
      const std::vector<float> want(full.begin() + size_t(t) * size_t(N),
                                    full.begin() + size_t(t + 1) * size_t(N));
      const std::string e = diff(got, want, N);
      ASSERT_TRUE(e.empty()) << "N=" << N << " K=" << K << " row " << t << " alone vs in 8: " << e;
    }
  }
}

// dense_rows takes 4 weight rows a block for prefill calls (4+ chunks of 8 token rows) and one
// for decode calls: a row's fp32 order must not change with it. The router's gate shape (BF16
// [384, 5120]) and an F32 weight, 100 rows in one call against the same rows 8 at a time.
TEST(OpsLinearFused, DenseRowsPrefillEqualsDecodeChunks) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(35);
  for (const auto f : {WFormat::kBF16, WFormat::kF32}) {
    const int64_t N = f == WFormat::kBF16 ? 384 : 200, K = f == WFormat::kBF16 ? 5120 : 512;
    auto hw = make_weight(f, N, K, rng);
    DeviceArena arena;
    const DeviceLinear lin(hw->w, LinearKind::kF32, arena);
    const int T = 100;
    const std::vector<float> x = random_acts(T, K, rng);
    const std::vector<float> full = run_apply(lin, DeviceBuffer<float>(x), T, false);
    for (int t0 = 0; t0 < T; t0 += kMaxDecodeRows) {
      const int m = std::min(kMaxDecodeRows, T - t0);
      const DeviceBuffer<float> part(std::vector<float>(x.begin() + size_t(t0) * size_t(K),
                                                        x.begin() + size_t(t0 + m) * size_t(K)));
      const std::vector<float> got = run_apply(lin, part, m, false);
      const std::vector<float> want(full.begin() + size_t(t0) * size_t(N),
                                    full.begin() + size_t(t0 + m) * size_t(N));
      const std::string e = diff(got, want, N);
      ASSERT_TRUE(e.empty()) << "N=" << N << " K=" << K << " rows " << t0 << "..+" << m
                             << " as a decode call vs inside a " << T << "-row call: " << e;
    }
  }
}

// quant_rows_x (FP4, row-scaled FP8, FP8 with rows % 16 != 0): apply_partial rounded to bf16 is
// apply, bitwise (apply == cpu::linear_quant bitwise is test_ops_linear.cpp's check).
TEST(OpsLinearFused, QuantRowsPartialRoundsToApply) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(33);
  struct C {
    WFormat f;
    int64_t n, k;
    bool row_scale;
  };
  for (const C c : {C{WFormat::kFP4, 128, 256, false}, C{WFormat::kFP8, 100, 64, true},
                    C{WFormat::kFP8, 200, 512, false}}) {
    auto hw = make_weight(c.f, c.n, c.k, rng, 118, 122, c.row_scale);
    DeviceArena arena;
    const DeviceLinear lin(hw->w, LinearKind::kQuant, arena);
    for (int T : {1, 8, 20}) {
      const DeviceBuffer<float> dx(random_acts(T, c.k, rng));
      const std::vector<float> full = run_apply(lin, dx, T, false);
      std::vector<float> part = run_apply(lin, dx, T, true);
      for (float& v : part) v = core::round_bf16(v);
      const std::string e = diff(part, full, c.n);
      EXPECT_TRUE(e.empty()) << "format " << int(c.f) << " [" << c.n << ", " << c.k << "] T=" << T
                             << ": " << e;
    }
  }
}

// apply_group == each linear's own apply / apply_partial, bitwise; mixed paths in one list.
TEST(OpsLinearFused, ApplyGroupEqualsApply) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(34);
  const int64_t K = 5120;
  struct C {
    WFormat f;
    int64_t n;
    LinearKind kind;
    bool partial;
  };
  const C cs[] = {{WFormat::kFP8, 1280, LinearKind::kQuant, false},
                  {WFormat::kFP8, 576, LinearKind::kQuant, true},
                  {WFormat::kBF16, 64, LinearKind::kBf16Out, false},
                  {WFormat::kFP8, 200, LinearKind::kQuant, false},  // quant_rows_x path
                  {WFormat::kFP8, 512, LinearKind::kQuant, false},
                  {WFormat::kFP8, 128, LinearKind::kQuant, false}};
  DeviceArena arena;
  std::vector<std::unique_ptr<HostWeight>> hws;
  std::vector<DeviceLinear> lins;
  for (const C& c : cs) {
    hws.push_back(make_weight(c.f, c.n, K, rng, 116, 122));
    lins.emplace_back(hws.back()->w, c.kind, arena);
  }
  for (int T : {1, 3, 8, 11}) {
    const DeviceBuffer<float> dx(random_acts(T, K, rng));
    std::vector<std::unique_ptr<DeviceBuffer<float>>> ys;
    std::vector<LinearCall> calls;
    for (size_t i = 0; i < lins.size(); ++i) {
      ys.push_back(std::make_unique<DeviceBuffer<float>>(size_t(T) * size_t(cs[i].n)));
      ys.back()->poison();
      calls.push_back(LinearCall{&lins[i], ys.back()->get(), cs[i].partial});
    }
    DeviceLinear::apply_group(calls, dx.get(), T, nullptr);
    sync_and_check();
    for (size_t i = 0; i < lins.size(); ++i) {
      const std::string e =
          diff(ys[i]->download(), run_apply(lins[i], dx, T, cs[i].partial), cs[i].n);
      EXPECT_TRUE(e.empty()) << "call " << i << " [" << cs[i].n << ", " << K << "] T=" << T << ": "
                             << e;
    }
  }
}

// Kernel launches per call: capture into a graph and count its nodes; the replayed graph must
// give the stream's bits.
size_t captured_nodes(const std::function<void(cudaStream_t)>& f, float* y, size_t n,
                      const std::vector<float>& want, const char* what) {
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  UF_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  f(s);
  UF_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  size_t nodes = 0;
  UF_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
  cudaGraphExec_t exec;
  UF_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  UF_CUDA_CHECK(cudaMemset(y, 0xFF, n * sizeof(float)));
  UF_CUDA_CHECK(cudaGraphLaunch(exec, s));
  UF_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<float> got(n);
  UF_CUDA_CHECK(cudaMemcpy(got.data(), y, n * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(diff(got, want, 1), "") << what << ": graph replay differs from the stream run";
  UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
  UF_CUDA_CHECK(cudaGraphDestroy(graph));
  UF_CUDA_CHECK(cudaStreamDestroy(s));
  return nodes;
}

TEST(OpsLinearFused, OneLaunchPerApply) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(35);
  struct C {
    const char* name;
    WFormat f;
    int64_t n, k;
    LinearKind kind;
    bool row_scale;
    bool gemv;  // Fp8Gemv path: one launch per 8 rows
  };
  const C cs[] = {{"fp8_gemv", WFormat::kFP8, 512, 1024, LinearKind::kQuant, false, true},
                  {"fp8_quant_rows", WFormat::kFP8, 200, 256, LinearKind::kQuant, false, false},
                  {"fp8_row_scale", WFormat::kFP8, 100, 64, LinearKind::kQuant, true, false},
                  {"fp4_quant", WFormat::kFP4, 128, 256, LinearKind::kQuant, false, false},
                  {"bf16_out", WFormat::kBF16, 96, 256, LinearKind::kBf16Out, false, false},
                  {"f32", WFormat::kF32, 40, 96, LinearKind::kF32, false, false}};
  for (const C& c : cs) {
    auto hw = make_weight(c.f, c.n, c.k, rng, 118, 122, c.row_scale);
    DeviceArena arena;
    const DeviceLinear lin(hw->w, c.kind, arena);
    for (int T : {1, 8, 20}) {
      const DeviceBuffer<float> dx(random_acts(T, c.k, rng));
      DeviceBuffer<float> dy(size_t(T) * size_t(c.n));
      for (bool partial : {false, true}) {
        const std::vector<float> want = run_apply(lin, dx, T, partial);
        const size_t nodes = captured_nodes(
            [&](cudaStream_t s) {
              if (partial)
                lin.apply_partial(dx.get(), T, dy.get(), s);
              else
                lin.apply(dx.get(), T, dy.get(), s);
            },
            dy.get(), dy.size(), want, c.name);
        // FP8 GEMV weights: one launch per 8 rows up to 8 rows; more rows take the prefill GEMM
        // (a quantisation pre-pass + the GEMM per chunk of up to 512 rows, any tail of <= 8 rows
        // on the GEMV).
        const size_t expect = !c.gemv ? 1 : T <= 8 ? 1 : size_t(2 * ((T + 511) / 512));
        EXPECT_EQ(nodes, expect) << c.name << " T=" << T << (partial ? " apply_partial" : " apply")
                                 << ": kernel launches";
      }
    }
  }
  // apply_rows: one launch for any T.
  auto hw = make_weight(WFormat::kBF16, 128, 64, rng);
  DeviceArena arena;
  const DeviceLinear lin(hw->w, LinearKind::kAuto, arena);
  const int T = 20;
  const DeviceBuffer<float> dx(random_acts(T, 64, rng));
  DeviceBuffer<float> dy(size_t(T) * 48);
  dy.poison();
  lin.apply_rows(32, 48, dx.get(), 64, T, dy.get(), 48, nullptr);
  sync_and_check();
  const size_t nodes = captured_nodes(
      [&](cudaStream_t s) { lin.apply_rows(32, 48, dx.get(), 64, T, dy.get(), 48, s); }, dy.get(),
      dy.size(), dy.download(), "apply_rows");
  EXPECT_EQ(nodes, 1u) << "apply_rows T=20: kernel launches";
}

}  // namespace
}  // namespace uf::cuda::test
