// The decode chunk's router variants (ops/moe_ops.cu, moe_router_run): moe_router2_kernel (the
// default), moe_router_kernel (the previous one-launch router) and the legacy path (dense_rows gate
// GEMV + route_quant_kernel) must give BITWISE the same outputs: gate scores (dense_rows' fp32
// order), score-function values (probs, the two one-launch kernels), expert choice and weights,
// FP8 codes and scales of x. Rows 1..8; the real shape (384 experts, dim 5120) and small ones,
// including an expert count that leaves the last CTA short of gate rows, and softmax (which the new
// kernel hands to the previous one). Outputs are poisoned before each run; NaN never passes.
// Also: spec == plain (a row alone gives the bits it has in an 8-row call), and the self-resetting
// counter (a second call gives the same bits).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/dtypes.h"
#include "cuda/device_weights.h"
#include "cuda/ops/moe.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda::test {
namespace {

struct RouterCase {
  const char* name;
  int E, K, D;
  const char* func;
  float temp, route_scale;
};

struct Outs {
  std::vector<float> scores, probs, gw, xs;
  std::vector<int32_t> gi;
  std::vector<uint8_t> codes;
};

// First differing index of two equally long arrays (SIZE_MAX: none), bitwise for floats.
template <typename T>
size_t first_diff(const std::vector<T>& a, const std::vector<T>& b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      if (!bits_equal(a[i], b[i])) return i;
    } else {
      if (a[i] != b[i]) return i;
    }
  }
  return SIZE_MAX;
}

class Router {
 public:
  Router(const RouterCase& c, std::mt19937& rng)
      : c_(c),
        gate_(size_t(c.E) * c.D),
        bias_(size_t(c.E)),
        x_(size_t(8) * c.D),
        scores_(size_t(8) * c.E),
        probs_(size_t(8) * c.E),
        counter_(1),
        gi_(size_t(8) * c.K),
        gw_(size_t(8) * c.K),
        codes_(size_t(8) * c.D),
        xs_(size_t(8) * c.D / 32) {
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<uint16_t> g(size_t(c.E) * c.D);
    const float gs = 1.f / std::sqrt(float(c.D));
    for (auto& v : g) v = core::float_to_bf16(nd(rng) * gs);
    UF_CUDA_CHECK(cudaMemcpy(gate_.get(), g.data(), g.size() * 2, cudaMemcpyHostToDevice));
    std::vector<float> b(size_t(c.E));
    for (auto& v : b) v = 0.05f * nd(rng);
    bias_.upload(b);
    x_.upload(random_acts(8, c.D, rng, 1.f, false));  // fp32 x: every mantissa bit matters
    UF_CUDA_CHECK(cudaMemset(counter_.get(), 0, sizeof(int)));
    w_.format = model::WFormat::kBF16;
    w_.rows = c.E;
    w_.cols = c.D;
    w_.data = reinterpret_cast<const uint8_t*>(gate_.get());
    shape_.dim = c.D;
    shape_.inter = 32;
    shape_.n_experts = c.E;
    shape_.top_k = c.K;
    shape_.score_func = c.func;
    shape_.gate_temp = c.temp;
    shape_.route_scale = c.route_scale;
  }
  // One call on rows [r0, r0 + rows) of x.
  Outs run(int variant, int r0, int rows) {
    scores_.poison();
    probs_.poison();
    gw_.poison();
    xs_.poison();
    UF_CUDA_CHECK(cudaMemset(gi_.get(), 0xFF, gi_.size() * sizeof(int32_t)));
    UF_CUDA_CHECK(cudaMemset(codes_.get(), 0x7F, codes_.size()));
    moe_router_run(variant, shape_, w_, bias_.get(), x_.get() + int64_t(r0) * c_.D, rows,
                   scores_.get(), probs_.get(), counter_.get(), gi_.get(), gw_.get(), codes_.get(),
                   xs_.get(), nullptr);
    sync_and_check();
    Outs o{scores_.download(), probs_.download(), gw_.download(),
           xs_.download(),     gi_.download(),    codes_.download()};
    int cnt = -1;
    UF_CUDA_CHECK(cudaMemcpy(&cnt, counter_.get(), sizeof(int), cudaMemcpyDeviceToHost));
    EXPECT_EQ(cnt, 0) << c_.name << " variant " << variant << ": counter left at " << cnt;
    return o;
  }

 private:
  RouterCase c_;
  DeviceBuffer<uint16_t> gate_;
  DeviceBuffer<float> bias_, x_, scores_, probs_;
  DeviceBuffer<int> counter_;
  DeviceBuffer<int32_t> gi_;
  DeviceBuffer<float> gw_;
  DeviceBuffer<uint8_t> codes_;
  DeviceBuffer<float> xs_;
  DeviceWeight w_;
  MoeShape shape_;
};

// got vs want over the first `rows` rows of each output (want's rows start at row `wr0`).
void expect_same(const RouterCase& c, const std::string& what, const Outs& got, const Outs& want,
                 int rows, int wr0, bool probs) {
  auto check = [&](const char* name, auto& g, auto& w, size_t per_row) {
    std::remove_cvref_t<decltype(w)> ws(w.begin() + size_t(wr0) * per_row, w.end());
    const size_t n = size_t(rows) * per_row;
    size_t nan = 0;
    if constexpr (std::is_same_v<typename std::remove_cvref_t<decltype(g)>::value_type, float>)
      for (size_t i = 0; i < n; ++i) nan += std::isnan(g[i]);
    const size_t f = first_diff(g, ws, n);
    EXPECT_TRUE(f == SIZE_MAX && nan == 0)
        << c.name << " " << what << " " << name << ": " << nan << " NaN of " << n
        << (f == SIZE_MAX
                ? std::string()
                : ", first difference at " + std::to_string(f) + " (row " +
                      std::to_string(f / per_row) + "): got " + std::to_string(double(g[f])) +
                      " want " + std::to_string(double(ws[f])));
  };
  check("scores", got.scores, want.scores, size_t(c.E));
  if (probs) check("probs", got.probs, want.probs, size_t(c.E));
  check("gate_i", got.gi, want.gi, size_t(c.K));
  check("gate_w", got.gw, want.gw, size_t(c.K));
  check("codes", got.codes, want.codes, size_t(c.D));
  check("xscales", got.xs, want.xs, size_t(c.D / 32));
}

TEST(OpsMoeRouter, VariantsBitwiseAndSpecEqualsPlain) {
  UF_REQUIRE_GPU();
  const RouterCase cases[] = {
      {"real_e384_top6", 384, 6, 5120, "sqrtsoftplus", 1.f, 2.5f},
      {"e10_top3_short_cta", 10, 3, 256, "sigmoid", 0.8f, 1.5f},  // 10 % 4 != 0
      {"e8_softmax", 8, 2, 256, "softmax", 0.7f, 1.f},
      {"e384_d1024", 384, 8, 1024, "sqrtsoftplus", 1.f, 1.f},
  };
  std::mt19937 rng(777);
  for (const RouterCase& c : cases) {
    Router r(c, rng);
    const bool probs = std::string(c.func) != "softmax";
    Outs full8;
    for (int rows = 1; rows <= 8; ++rows) {
      const std::string tag = "rows=" + std::to_string(rows);
      const Outs legacy = r.run(2, 0, rows);
      const Outs prev = r.run(1, 0, rows);
      const Outs cur = r.run(0, 0, rows);
      const Outs again = r.run(0, 0, rows);  // the counter reset by the first call
      // Legacy writes no probs: compare everything else with it.
      expect_same(c, tag + " previous kernel vs legacy", prev, legacy, rows, 0, false);
      expect_same(c, tag + " new kernel vs legacy", cur, legacy, rows, 0, false);
      expect_same(c, tag + " new kernel vs previous kernel", cur, prev, rows, 0, probs);
      expect_same(c, tag + " new kernel second call", again, cur, rows, 0, probs);
      if (rows == 8) full8 = cur;
    }
    for (int t = 0; t < 8; ++t) {  // spec == plain: row t alone
      const Outs one = r.run(0, t, 1);
      expect_same(c, "row " + std::to_string(t) + " alone vs in 8 rows", one, full8, 1, t, probs);
    }
    std::printf("[ops_moe_router] %s: variants compared at rows 1..8\n", c.name);
  }
}

// DeviceMoe with the previous router kernel selected gives the same bits as with the new one
// (the default); the full-model comparison of the default path lives in OpsMoe.
TEST(OpsMoeRouter, DeviceMoeVariantSwitch) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(99);
  const int E = 384, K = 6, D = 256, I = 64;
  auto hm = make_host_moe(E, D, I, 119, 123, rng);
  const MoeShape shape{D, I, E, K, "sqrtsoftplus", 1.f, 2.5f, 10.f};
  DeviceArena arena;
  DeviceMoe moe(hm->w, shape, arena);
  for (int T : {1, 7, 8}) {
    DeviceBuffer<float> dx(random_acts(T, D, rng)), y0(size_t(T) * D), y1(size_t(T) * D);
    DeviceBuffer<float> w0(size_t(T) * K), w1(size_t(T) * K);
    DeviceBuffer<int32_t> i0(size_t(T) * K), i1(size_t(T) * K);
    for (auto* b : {&y0, &y1, &w0, &w1}) b->poison();
    set_moe_router_variant(1);
    moe.apply(dx.get(), T, y1.get(), i1.get(), w1.get(), nullptr);
    set_moe_router_variant(0);
    moe.apply(dx.get(), T, y0.get(), i0.get(), w0.get(), nullptr);
    sync_and_check();
    const auto a = y0.download(), b = y1.download();
    const size_t f = first_diff(a, b, a.size());
    size_t nan = 0;
    for (float v : a) nan += std::isnan(v);
    EXPECT_TRUE(f == SIZE_MAX && nan == 0)
        << "T=" << T << ": new vs previous router kernel: " << nan << " NaN, first difference at "
        << (f == SIZE_MAX ? -1 : int64_t(f));
    EXPECT_EQ(i0.download(), i1.download()) << "T=" << T;
    const auto wa = w0.download(), wb = w1.download();
    EXPECT_EQ(first_diff(wa, wb, wa.size()), SIZE_MAX) << "T=" << T;
  }
}

}  // namespace
}  // namespace uf::cuda::test
