// The prefill GEMM's f16 kernel (kernels/fp8_gemm.cu: each fragment converted once per K block,
// only the HMMAs of ptxas' e4m3 emulation per pair) against
//   - the legacy kernel (fp8_gemm_set_legacy(true): the emulated e4m3 mma.sync), and
//   - the decode GEMV (Fp8Gemv::run by chunks of 8 rows, the kb_per_split of its plan),
// at the real TP8 rank-slice shapes, odd N (N % 128 != 0), K tails (K blocks not a multiple of the
// 4-block stage) and M in {1, 9, 64, 100, 512, 2048} (tile edges, both block shapes). Every
// output must be BITWISE equal (tolerance 0: the kernels compute the same f16 HMMA chain, the
// same fmaf per K block and the same split sums); rounded outputs (round = true) bitwise the
// legacy kernel's rounded ones and round_bf16 of the GEMV's. Outputs are poisoned with 0xFF bytes
// (NaN) and a guard row after M x N must stay poisoned. The first mismatch is printed with its bits
// in hex.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "cuda/gemv.h"
#include "cuda_test_util.h"

namespace uf::cuda::test {
namespace {

// Restores the default kernel choice however a test exits.
struct KernelChoice {
  explicit KernelChoice(bool legacy) { fp8_gemm_set_legacy(legacy); }
  ~KernelChoice() { fp8_gemm_set_legacy(false); }
};

// Bitwise comparison of the M x N outputs; prints the first mismatch (token, feature, hex bits).
// Returns the number of differing outputs.
size_t compare(const std::vector<float>& got, const std::vector<float>& want, int m, int n,
               const char* what) {
  size_t bad = 0;
  for (size_t i = 0; i < size_t(m) * size_t(n); ++i) {
    if (bits_equal(got[i], want[i])) continue;
    if (bad == 0)
      std::printf(
          "[fp8_gemm_f16] %s: first mismatch at token %zu feature %zu: got 0x%08x (%.9g) "
          "want 0x%08x (%.9g)\n",
          what, i / size_t(n), i % size_t(n), f32_bits(got[i]), double(got[i]), f32_bits(want[i]),
          double(want[i]));
    ++bad;
  }
  return bad;
}

// Outputs still holding the poison (0xFFFFFFFF: never written) within M x N, and whether the
// guard row after them is untouched.
size_t unwritten(const std::vector<float>& v, size_t n) {
  size_t c = 0;
  for (size_t i = 0; i < n; ++i) c += f32_bits(v[i]) == 0xFFFFFFFFu;
  return c;
}
bool guard_intact(const std::vector<float>& v, size_t from) {
  for (size_t i = from; i < v.size(); ++i)
    if (f32_bits(v[i]) != 0xFFFFFFFFu) return false;
  return true;
}
size_t count_nonfinite(const std::vector<float>& v, size_t n) {
  size_t c = 0;
  for (size_t i = 0; i < n; ++i) c += !std::isfinite(v[i]);
  return c;
}

struct Case {
  const char* name;
  int n, k;
  std::vector<int> ms;
  int wscale_lo, wscale_hi;  // E8M0 weight-scale codes
  int row_exp;               // activation rows scaled by 2^e, e uniform in [-row_exp, row_exp]
  bool finite;               // outputs must be finite (false: extreme scales may overflow)
};

// One prefill GEMM call into a poisoned (m + 1) x n buffer.
std::vector<float> run_gemm(const Fp8WeightView& wv, const QuantActView& av, int kbps, bool round,
                            bool legacy) {
  const KernelChoice choice(legacy);
  DeviceBuffer<float> out(size_t(av.m + 1) * size_t(wv.n));
  out.poison();
  fp8_gemm_prefill(wv, av, kbps, out.get(), round, nullptr);
  sync_and_check();
  return out.download();
}

void run_case(const Case& c) {
  std::mt19937 rng(uint32_t(c.n * 131 + c.k));
  const int n = c.n, k = c.k, nkb = k / 32;
  const int mmax = *std::max_element(c.ms.begin(), c.ms.end());
  const DeviceBuffer<uint8_t> w(random_e4m3(size_t(n) * k, rng));
  const DeviceBuffer<uint8_t> ws(
      random_bytes(size_t((n + 31) / 32) * nkb, rng, c.wscale_lo, c.wscale_hi));
  std::vector<float> x(size_t(mmax) * k);
  std::uniform_real_distribution<float> ux(-1.f, 1.f);
  std::uniform_int_distribution<int> ue(-c.row_exp, c.row_exp);
  for (int r = 0; r < mmax; ++r) {
    const float s = std::ldexp(1.f, ue(rng));
    for (int i = 0; i < k; ++i) x[size_t(r) * k + i] = ux(rng) * s;
  }
  const DeviceBuffer<float> dx(x);
  DeviceBuffer<uint8_t> codes(size_t(mmax) * k);
  DeviceBuffer<float> scales(size_t(mmax) * nkb);
  act_quant_fp8_rows(dx.get(), k, mmax, k, codes.get(), scales.get(), nullptr);
  sync_and_check();
  const Fp8WeightView wv{w.get(), ws.get(), n, k};
  const int sms = device_sm_count();
  for (const Fp8GemvPath path : {Fp8GemvPath::kAuto, Fp8GemvPath::kPipelined}) {
    const Fp8Gemv plan(n, k, sms, path);
    for (const int m : c.ms) {
      if (path == Fp8GemvPath::kPipelined && m != 100 && m != c.ms.front()) continue;
      char what[192];
      std::snprintf(what, sizeof what, "%s N=%d K=%d M=%d (%s plan, %d splits x %d K blocks)",
                    c.name, n, k, m, plan.resident() ? "resident" : "pipelined", plan.splits(),
                    plan.kb_per_split());
      const QuantActView av{codes.get(), scales.get(), m, k};
      // The decode GEMV by chunks of 8 rows (unrounded fp32 outputs).
      DeviceBuffer<float> dec(size_t(m + 1) * size_t(n));
      dec.poison();
      for (int t0 = 0; t0 < m; t0 += kMaxDecodeRows) {
        const QuantActView ac{codes.get() + size_t(t0) * k, scales.get() + size_t(t0) * nkb,
                              std::min(kMaxDecodeRows, m - t0), k};
        plan.run(wv, ac, dec.get() + size_t(t0) * n, nullptr, nullptr);
      }
      sync_and_check();
      const std::vector<float> gemv = dec.download();
      const size_t mn = size_t(m) * size_t(n);
      ASSERT_EQ(unwritten(gemv, mn), 0u) << what << ": GEMV left outputs unwritten";
      for (const bool round : {false, true}) {
        const int kbps = plan.kb_per_split();
        const std::vector<float> old = run_gemm(wv, av, kbps, round, true);
        std::vector<float> want(mn);
        for (size_t i = 0; i < mn; ++i) want[i] = round ? core::round_bf16(gemv[i]) : gemv[i];
        char w2[256];
        std::snprintf(w2, sizeof w2, "%s round=%d legacy vs GEMV", what, int(round));
        EXPECT_EQ(compare(old, want, m, n, w2), 0u) << w2;
        {
          const std::vector<float> got = run_gemm(wv, av, kbps, round, false);
          std::snprintf(w2, sizeof w2, "%s round=%d f16", what, int(round));
          EXPECT_EQ(unwritten(got, mn), 0u) << w2 << ": outputs left unwritten";
          EXPECT_TRUE(guard_intact(got, mn)) << w2 << ": wrote past M x N";
          if (c.finite) {
            EXPECT_EQ(count_nonfinite(got, mn), 0u) << w2 << ": non-finite outputs";
          }
          const size_t d_old = compare(got, old, m, n, (std::string(w2) + " vs legacy").c_str());
          const size_t d_dec = compare(got, want, m, n, (std::string(w2) + " vs GEMV").c_str());
          EXPECT_EQ(d_old, 0u) << w2 << ": outputs differ from the legacy kernel";
          EXPECT_EQ(d_dec, 0u) << w2 << ": outputs differ from the decode GEMV";
          if (d_old + d_dec == 0)
            std::printf("[fp8_gemm_f16] %s: %zu outputs bitwise equal\n", w2, mn);
        }
      }
    }
  }
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name << " [" << c.n << ", " << c.k << "]";
}

class Fp8GemmF16 : public ::testing::TestWithParam<Case> {};

TEST_P(Fp8GemmF16, BitwiseLegacyAndDecode) {
  UF_REQUIRE_GPU();
  run_case(GetParam());
}

const std::vector<int> kMs = {1, 9, 64, 100, 512, 2048};

// Real TP8 rank slices (wq_a|wkv, wq_b, wo_b, shared w2, Engram's wkv and full projection), odd
// N and K tails, and one case with extreme scales (E8M0 2^-126..2^53, rows 2^-40..2^40: subnormal
// and zero products through the fmaf; outputs may then overflow, so only bitwise equality and
// full coverage are checked there).
INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8GemmF16,
    ::testing::Values(Case{"wq_a_wkv", 1792, 5120, kMs, 114, 124, 3, true},
                      Case{"wq_b", 4096, 1280, kMs, 114, 124, 3, true},
                      Case{"wo_b", 5120, 1024, kMs, 114, 124, 3, true},
                      Case{"shared_w2", 5120, 288, kMs, 114, 124, 3, true},
                      Case{"engram_wkv", 3200, 6144, {9, 100, 512, 2048}, 114, 124, 3, true},
                      Case{"engram_full", 25600, 6144, {64, 512}, 114, 124, 3, true},
                      Case{"odd_n_k_tail", 1040, 4128, {1, 9, 100, 517}, 114, 124, 3, true},
                      Case{"small_k_tail", 208, 288, {1, 9, 71, 130, 2048}, 114, 124, 3, true},
                      Case{"tiny", 16, 32, {1, 9, 65, 517}, 114, 124, 3, true},
                      Case{"n144_k160", 144, 160, {10, 64, 513}, 114, 124, 3, true},
                      Case{"extreme_scales", 1296, 1056, {9, 100, 700}, 1, 180, 40, false}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace uf::cuda::test
