// Device sparse attention and indexer ops (cuda/ops/attention.h) against their CPU reference
// (cpu/attention.h, cpu/indexer.h) on seeded random inputs: empty slots, rows of different
// widths, widths > 100k, exact ties. Outputs are poisoned with NaN (0xFF bytes) first; any NaN
// fails; entries a call must leave untouched must still hold the poison. Every op is also
// checked for spec == plain: a row's result is bitwise the same in a 1-row call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "cpu/attention.h"
#include "cpu/indexer.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/elementwise.h"
#include "cuda_test_util.h"
#include "score_rows_test_util.h"

namespace uf::cuda::test {
namespace {

constexpr uint32_t kPoisonF32 = 0xffffffffu;

// Distance in bf16 steps between two bf16-valued floats (signed-magnitude order, -0 == +0).
int64_t bf16_ulps(float a, float b) {
  auto ord = [](float f) {
    const uint32_t c = f32_bits(f) >> 16;
    return (c & 0x8000u) ? -int64_t(c & 0x7fffu) : int64_t(c & 0x7fffu);
  };
  return std::llabs(ord(a) - ord(b));
}

// The spacing of bf16 values at |v| (8 significant bits).
double bf16_spacing(float v) { return v == 0.f ? 0x1p-133 : std::ldexp(1.0, std::ilogb(v) - 7); }

// ------------------------------------------------------------------------------------------
// sparse_attn

struct AttnCase {
  const char* name;
  int T, H, hd, W, k, entries;
};

// The fast path repeated into a poisoned buffer: bitwise the first call's output (no atomics, no
// order that depends on timing).
template <typename Run>
void check_repeat_is_bitwise(const std::vector<float>& got, int T, int H, int hd, int n_slots,
                             Run run) {
  DeviceBuffer<float> o2(got.size());
  o2.poison();
  run(o2.get());
  sync_and_check();
  const auto again = o2.download();
  size_t diff = 0, first = got.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (!bits_equal(got[i], again[i])) {
      if (first == got.size()) first = i;
      ++diff;
    }
  EXPECT_EQ(diff, 0u) << "sparse_attn T=" << T << " H=" << H << " hd=" << hd << " slots=" << n_slots
                      << ": a repeated call differs; first at " << first << " (row "
                      << first / (size_t(H) * hd) << " head " << (first / hd) % H << " dim "
                      << first % hd << "): " << got[std::min(first, got.size() - 1)] << " vs "
                      << again[std::min(first, got.size() - 1)];
}

// Which sparse_attn path a check runs: the reference kernel (one CTA per (row, head)), the
// split path (a scratch buffer given: every decode caller) with its default chunk records (the
// tensor-core kernel where it applies) or with the CPU-order ones (set_sparse_attn_chunk_mma
// (false)), or sparse_attn_mma (prefill spans).
enum class Path { kReference, kSplit, kSplitCpuOrder, kMma };

// Whether the split path's records come from the tensor-core kernel (attention_chunk_mma.cu's
// rule: hd % 16 == 0, hd <= 512, chunks of 16). ChunkMmaDispatch checks this rule against the
// kernels' outputs.
bool chunk_mma_records(Path path, int hd, bool chunks32 = false) {
  return path == Path::kSplit && hd % 16 == 0 && hd <= 512 && !chunks32;
}

// Sets the split path's chunk records for one check, restoring the default after.
class ChunkRecords {
 public:
  explicit ChunkRecords(Path path) { set_sparse_attn_chunk_mma(path != Path::kSplitCpuOrder); }
  ~ChunkRecords() { set_sparse_attn_chunk_mma(true); }
  ChunkRecords(const ChunkRecords&) = delete;
  ChunkRecords& operator=(const ChunkRecords&) = delete;
};

// Bounds against the CPU, by the records a check runs:
//
// split, CPU order: the fast chunked path's CPU-order records (scores kernel, P.V per chunk of 16
// slots for 8 heads, merge in chunk order; ops/attention.cu). It computes every s_j bit for bit
// as the CPU (dot8 lanes, no FMA), takes each chunk's base from the CPU's running max after its
// 64-slot block and the same exp, so every bf16(p_j) equals the CPU's; only the fp32 sums are
// re-associated (P.V with FMAs per chunk, slot groups, chunk weights w_c = exp(M_b - M) instead
// of the CPU's running products of exp(m - m_new)). Each side's sum has an error below
// ~80 * 2^-24 of sum_j p_j |v_j[d]| (its longest addition chain is under 80 steps), so the two
// differ by at most 2^-16 of the weighted mean |v|, on top of which the final bf16 rounding may
// flip: bound per output 1 bf16 ulp + 2^-16 * sum_j p_j |v_j[d]| / sum_j p_j (exact softmax in
// double). Such flips are rare (the sums differ by ~1e-6 relative): more than 1% of outputs not
// bitwise equal to the CPU fails. spec == plain is checked bitwise.
//
// mma (sparse_attn_mma, tensor cores; and the split path's tensor-core records): s_j is
// re-associated (and, for an fp32 q, carries the hi / lo split's 2^-17), ~1e-6 relative, which
// flips bf16(p_j) by one bf16 ulp (2^-8 relative) for a rare slot; the split path's records also
// round p_j against their chunk's own max, not the CPU's running max: each bf16(p_j) is within
// 2^-9 of the exact p_j, like the CPU's, so the two are at most 2^-8 apart. Bound per output
// 1 bf16 ulp + 2^-8 * the p-weighted mean |v| (a flip of the heaviest slot's p at most; a wrong
// slot, head or block would be off by O(1) of it). Repeats and 1-row calls are checked bitwise
// (the kernels' results never depend on other rows).
// fp32_q: q with full fp32 mantissas (the split's lo half is exercised); else bf16 values.
void check_sparse_attn(const AttnCase& c, uint32_t seed, Path path = Path::kReference,
                       bool fp32_q = false, bool chunks32 = false) {
  const bool split = path == Path::kSplit || path == Path::kSplitCpuOrder;
  // Tensor-core products (the prefill kernel or the split path's records) or the CPU's order.
  const bool mma = path == Path::kMma || chunk_mma_records(path, c.hd, chunks32);
  const bool cpu_order = split && !mma;
  const ChunkRecords records(path);
  SCOPED_TRACE(std::string(c.name) + (split ? " split" : "") + (mma ? " mma" : "") +
               (fp32_q ? " fp32 q" : ""));
  std::mt19937 rng(seed);
  const int T = c.T, H = c.H, hd = c.hd, W = c.W, k = c.k;
  const int n_win_vecs = std::max(1, T * W);
  // q is scaled up so that some rows have peaked softmaxes (scores of several units).
  auto q = normal_bf16(size_t(T) * H * hd, rng, 2.5f);
  if (fp32_q) {
    std::uniform_real_distribution<float> jitter(-1.f, 1.f);
    for (float& v : q) v += v * jitter(rng) * 0x1p-9f;  // below bf16's spacing: a full mantissa
  }
  const auto wbank = normal_bf16(size_t(n_win_vecs) * hd, rng, 1.f);
  const auto ckv = normal_bf16(size_t(std::max(1, c.entries)) * hd, rng, 1.f);
  const auto sink = normal_bf16(size_t(H), rng, 1.f);
  const float scale = float(std::pow(double(hd), -0.5));

  // Slot patterns per row (t % 5): 0 leading empty window slots (decode near the start),
  // 1 all present, 2 everything empty (output must be 0), 3 random holes, 4 trailing holes.
  std::uniform_int_distribution<int> coin(0, 3), ent(0, std::max(0, c.entries - 1));
  std::vector<int> win(size_t(T) * W, -1);
  std::vector<int32_t> topk(size_t(T) * std::max(k, 1), -1);
  for (int t = 0; t < T; ++t) {
    const int pat = t % 5;
    for (int j = 0; j < W; ++j) {
      bool present = true;
      if (pat == 0) present = j >= W / 2 + 1;
      if (pat == 2) present = false;
      if (pat == 3) present = coin(rng) != 0;
      if (present) win[size_t(t) * W + j] = t * W + j;
    }
    for (int j = 0; j < k; ++j) {
      bool present = true;
      if (pat == 2) present = false;
      if (pat == 3) present = coin(rng) != 0;
      if (pat == 4) present = j < k / 3;
      if (present && c.entries > 0) topk[size_t(t) * k + j] = ent(rng);
    }
  }

  DeviceBuffer<float> dq(q), dwbank(wbank), dsink(sink);
  DeviceBuffer<uint16_t> dckv(bf16_bits(ckv));  // the session's compressed KV is bf16
  std::vector<const float*> wptr(std::max<size_t>(1, win.size()), nullptr);
  for (size_t i = 0; i < win.size(); ++i)
    wptr[i] = win[i] >= 0 ? dwbank.get() + int64_t(win[i]) * hd : nullptr;
  DeviceBuffer<const float*> dwin(wptr);
  DeviceBuffer<int32_t> dtopk(topk);
  DeviceBuffer<float> dout(size_t(T) * H * hd);
  DeviceBuffer<float> scratch(std::max<size_t>(1, sparse_attn_scratch_floats(T, H, hd, W + k)));
  scratch.poison();
  float* sp = split ? scratch.get() : nullptr;
  // The path under test on rows [t0, t0 + n) into o.
  auto run = [&](int t0, int n, float* o) {
    const float* qt = dq.get() + int64_t(t0) * H * hd;
    const float* const* wt = W > 0 ? dwin.get() + int64_t(t0) * W : nullptr;
    const int32_t* kt = k > 0 ? dtopk.get() + int64_t(t0) * k : nullptr;
    if (path == Path::kMma)
      ASSERT_TRUE(
          sparse_attn_mma(qt, n, H, hd, wt, W, kt, k, dckv.get(), dsink.get(), scale, o, nullptr))
          << "sparse_attn_mma refused the shape";
    else
      sparse_attn(qt, n, H, hd, wt, W, kt, k, dckv.get(), dsink.get(), scale, o, nullptr, nullptr,
                  sp);
  };
  dout.poison();
  run(0, T, dout.get());
  sync_and_check();
  const auto got = dout.download();
  if (split || mma) check_repeat_is_bitwise(got, T, H, hd, W + k, [&](float* o) { run(0, T, o); });

  std::vector<float> ref(size_t(T) * H * hd);
  for (int t = 0; t < T; ++t) {
    std::vector<const float*> slots;
    for (int j = 0; j < W; ++j) {
      const int w = win[size_t(t) * W + j];
      slots.push_back(w >= 0 ? wbank.data() + int64_t(w) * hd : nullptr);
    }
    for (int j = 0; j < k; ++j) {
      const int32_t e = topk[size_t(t) * k + j];
      slots.push_back(e >= 0 ? ckv.data() + int64_t(e) * hd : nullptr);
    }
    cpu::sparse_attn_row(q.data() + int64_t(t) * H * hd, H, hd, slots.data(), int(slots.size()),
                         sink.data(), scale, ref.data() + int64_t(t) * H * hd);
  }

  // Tolerance 1 bf16 ulp: the kernel repeats the CPU's arithmetic order step by step (dot8
  // lanes, slot-order sums, no FMA), except exp: glibc expf (< 0.502 ulp) vs a correctly
  // rounded exp here. A 1-fp32-ulp change of p or of the denominator moves the output by far
  // less than a bf16 ulp, so at most one bf16 rounding flips.
  // Split mode: the weighted mean of |v| per output (the scale of the re-associated fp32 sums).
  std::vector<double> wmean;
  if (split || mma) {
    wmean.assign(got.size(), 0.0);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        std::vector<const float*> sl;
        for (int j = 0; j < W; ++j) {
          const int w = win[size_t(t) * W + j];
          sl.push_back(w >= 0 ? wbank.data() + int64_t(w) * hd : nullptr);
        }
        for (int j = 0; j < k; ++j) {
          const int32_t e = topk[size_t(t) * k + j];
          sl.push_back(e >= 0 ? ckv.data() + int64_t(e) * hd : nullptr);
        }
        const float* qh = q.data() + (int64_t(t) * H + h) * hd;
        std::vector<double> sc(sl.size(), -INFINITY);
        double mx = sink[size_t(h)];
        for (size_t j = 0; j < sl.size(); ++j) {
          if (!sl[j]) continue;
          double d = 0;
          for (int i = 0; i < hd; ++i) d += double(qh[i]) * sl[j][i];
          sc[j] = d * scale;
          mx = std::max(mx, sc[j]);
        }
        double den = std::exp(double(sink[size_t(h)]) - mx);
        for (double v : sc) den += std::exp(v - mx);
        for (int i = 0; i < hd; ++i) {
          double a = 0;
          for (size_t j = 0; j < sl.size(); ++j)
            if (sl[j]) a += std::exp(sc[j] - mx) * std::fabs(sl[j][i]);
          wmean[(size_t(t) * H + h) * hd + i] = a / den;
        }
      }
  }
  int64_t max_ulp = 0, n_nan = 0, n_diff = 0, first_bad = -1, n_bad = 0;
  double worst = 0;  // split: the largest |gpu - cpu| / bound
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) {
      ++n_nan;
      if (first_bad < 0) first_bad = int64_t(i);
      continue;
    }
    const int64_t u = bf16_ulps(got[i], ref[i]);
    if (!bits_equal(got[i], ref[i])) ++n_diff;
    max_ulp = std::max(max_ulp, u);
    bool ok = u <= 1;
    if (split || mma) {
      const double bound = bf16_spacing(std::max(std::fabs(got[i]), std::fabs(ref[i]))) +
                           (mma ? 0x1p-8 : 0x1p-16) * wmean[i];
      const double err = std::fabs(double(got[i]) - ref[i]);
      ok = err <= bound;
      worst = std::max(worst, err / bound);
    }
    n_bad += !ok;
    if (!ok && first_bad < 0) first_bad = int64_t(i);
  }
  int64_t n_nonzero_empty = 0;  // all-empty rows: exactly 0 (running max -1e30, denominator inf)
  for (int t = 0; t < T; ++t)
    if (t % 5 == 2)
      for (int i = 0; i < H * hd; ++i)
        n_nonzero_empty += got[size_t(t) * H * hd + size_t(i)] != 0.f;
  EXPECT_EQ(n_nonzero_empty, 0) << "all-empty rows must give 0";
  std::printf(
      "[sparse_attn %s%s T=%d] %zu outputs: max %lld bf16 ulp, %lld not bitwise, %lld NaN, %lld "
      "out of bound, worst err/bound %.3f\n",
      c.name, split ? (mma ? " split mma" : " split") : (mma ? " mma" : ""), T, got.size(),
      (long long)max_ulp, (long long)n_diff, (long long)n_nan, (long long)n_bad, worst);
  EXPECT_EQ(n_nan, 0);
  EXPECT_EQ(n_bad, 0) << (split || mma ? "outputs beyond the bound" : "outputs beyond 1 bf16 ulp");
  if (cpu_order) {  // the CPU-order records' p are the CPU's: only rare re-association flips
    EXPECT_LE(double(n_diff), 0.01 * double(got.size()))
        << n_diff << " of " << got.size() << " outputs differ from the CPU (more than 1%)";
  }
  if (first_bad >= 0) {
    const int64_t i = first_bad, t = i / (H * hd), h = (i / hd) % H, d = i % hd;
    ADD_FAILURE() << "first bad output: row " << t << " head " << h << " dim " << d << ": gpu "
                  << got[size_t(i)] << " cpu " << ref[size_t(i)]
                  << (split || mma ? " (weighted mean |v| " + std::to_string(wmean[size_t(i)]) + ")"
                                   : std::string());
  }

  // spec == plain: every row alone.
  DeviceBuffer<float> d1(size_t(H) * hd);
  for (int t = 0; t < T; ++t) {
    d1.poison();
    scratch.poison();  // the chunk records must be rewritten, not left over from the T-row call
    run(t, 1, d1.get());
    sync_and_check();
    const auto one = d1.download();
    for (int i = 0; i < H * hd; ++i)
      if (!bits_equal(one[size_t(i)], got[size_t(t) * H * hd + size_t(i)])) {
        ADD_FAILURE() << "spec != plain: row " << t << " index " << i << ": 1-row "
                      << one[size_t(i)] << " vs " << T << "-row " << got[size_t(t) * H * hd + i];
        break;
      }
  }
}

TEST(CudaOpsAttention, SparseAttnTiny) {
  UF_REQUIRE_GPU();
  check_sparse_attn({"tiny", 10, 4, 128, 8, 8, 40}, 101);
}

TEST(CudaOpsAttention, SparseAttnRealPerRank) {
  UF_REQUIRE_GPU();
  // 128 window + 512 top-k = 640 slots = 10 blocks of 64.
  check_sparse_attn({"real-tp8", 5, 8, 512, 128, 512, 3000}, 102);
}

TEST(CudaOpsAttention, SparseAttnSplitMode) {
  UF_REQUIRE_GPU();
  uint32_t seed = 111;
  for (Path path : {Path::kSplit, Path::kSplitCpuOrder}) {
    check_sparse_attn({"tiny", 10, 4, 128, 8, 8, 40}, seed++, path);
    check_sparse_attn({"real-tp8", 8, 8, 512, 128, 512, 3000}, seed++, path);
    check_sparse_attn({"draft", 5, 8, 512, 133, 0, 1}, seed++, path);
  }
  // The tensor-core records with q of full fp32 mantissas (its lo half is exercised).
  check_sparse_attn({"real-tp8", 7, 8, 512, 128, 512, 3000}, seed++, Path::kSplit, true);
}

// The decode shapes of a TP8 rank at every row count 1..8 (128 window + 512 top-k slots, and
// the window-only layers' 128 slots), on both kinds of chunk records, plus the chunked path's
// odd corners: a partial last chunk, head groups of fewer than 8 heads and more than one group,
// head_dim 100 (odd float4 stride, 4 P.V slot groups; CPU-order records on either setting) and
// 1024 (one P.V slot group, the largest shared memory; likewise); then the same with chunks of
// 32 slots forced (the benchmark's variant, CPU-order records).
TEST(CudaOpsAttention, SparseAttnSplitDecodeShapes) {
  UF_REQUIRE_GPU();
  for (Path path : {Path::kSplit, Path::kSplitCpuOrder}) {
    const uint32_t s0 = path == Path::kSplit ? 0 : 1000;
    for (int T = 1; T <= 8; ++T) {
      check_sparse_attn({"real-tp8", T, 8, 512, 128, 512, 2000}, s0 + 120 + uint32_t(T), path);
      check_sparse_attn({"window-only", T, 8, 512, 128, 0, 0}, s0 + 140 + uint32_t(T), path);
    }
    check_sparse_attn({"odd", 6, 3, 100, 37, 50, 90}, s0 + 161, path);
    check_sparse_attn({"12-heads", 3, 12, 256, 20, 300, 400}, s0 + 162, path);
    check_sparse_attn({"real-64h", 2, 64, 512, 128, 512, 700}, s0 + 163, path);
    check_sparse_attn({"hd1024", 2, 8, 1024, 40, 300, 500}, s0 + 164, path);
  }
  sparse_attn_chunk_override(32);
  check_sparse_attn({"real-tp8 c32", 7, 8, 512, 128, 512, 2000}, 171, Path::kSplit, false, true);
  check_sparse_attn({"draft c32", 5, 8, 512, 133, 0, 1}, 172, Path::kSplit, false, true);
  check_sparse_attn({"odd c32", 6, 3, 100, 37, 50, 90}, 173, Path::kSplit, false, true);
  check_sparse_attn({"hd1024 c32", 2, 8, 1024, 40, 300, 500}, 174, Path::kSplit, false, true);
  sparse_attn_chunk_override(0);
}

// The chunked path's corners, on both kinds of chunk records: 1024 and 1088 slots (16 / 17
// blocks of 64), one slot, a last 1-slot chunk (65 slots), 8 rows of hd 128 / 256 / 100 (4 P.V
// slot groups, odd float4 stride), a second head group of 4 heads, head_dim 48 (3 k-steps over
// the tensor-core kernel's 4 warps).
TEST(CudaOpsAttention, SparseAttnSplitCorners) {
  UF_REQUIRE_GPU();
  for (Path path : {Path::kSplit, Path::kSplitCpuOrder}) {
    const uint32_t s0 = path == Path::kSplit ? 0 : 1000;
    check_sparse_attn({"1024 slots", 3, 8, 512, 128, 896, 2000}, s0 + 181, path);
    check_sparse_attn({"1088 slots", 2, 8, 512, 128, 960, 2000}, s0 + 182, path);
    check_sparse_attn({"one slot", 4, 8, 512, 1, 0, 0}, s0 + 183, path);
    check_sparse_attn({"65 slots", 5, 8, 256, 60, 5, 30}, s0 + 184, path);
    check_sparse_attn({"tiny T8", 8, 4, 128, 8, 8, 40}, s0 + 185, path);
    check_sparse_attn({"12-heads T8", 8, 12, 256, 20, 300, 400}, s0 + 186, path);
    check_sparse_attn({"odd T8", 8, 3, 100, 37, 50, 90}, s0 + 187, path);
    check_sparse_attn({"hd48", 5, 8, 48, 30, 40, 100}, s0 + 188, path);
  }
}

// The device inputs of one split-path call: T rows of H heads, W window slots (rows of their own)
// and k top-k slots into `entries` bf16 compressed-KV rows (empty_slots: some top-k ids are -1),
// bf16-valued q / KV / sinks from `seed`. run(out) is one sparse_attn call with the split scratch.
struct SplitInputs {
  struct Host {
    std::vector<float> q, wbank, ckv, sink;
    std::vector<int32_t> topk;
  };
  static Host host_inputs(int T, int H, int hd, int W, int k, int entries, uint32_t seed,
                          bool empty_slots) {
    std::mt19937 rng(seed);
    Host h;
    h.q = normal_bf16(size_t(T) * H * hd, rng, 2.5f);
    h.wbank = normal_bf16(size_t(T) * W * hd, rng, 1.f);
    h.ckv = normal_bf16(size_t(entries) * hd, rng, 1.f);
    h.sink = normal_bf16(size_t(H), rng, 1.f);
    std::uniform_int_distribution<int> ent(empty_slots ? -1 : 0, entries - 1);
    h.topk.resize(size_t(T) * k);
    for (auto& e : h.topk) e = ent(rng);
    return h;
  }
  static std::vector<const float*> window_rows(const float* bank, int n, int hd) {
    std::vector<const float*> w(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) w[size_t(i)] = bank + int64_t(i) * hd;
    return w;
  }

  SplitInputs(int T_, int H_, int hd_, int W_, int k_, int entries, uint32_t seed, bool empty_slots)
      : SplitInputs(T_, H_, hd_, W_, k_,
                    host_inputs(T_, H_, hd_, W_, k_, entries, seed, empty_slots)) {}
  SplitInputs(int T_, int H_, int hd_, int W_, int k_, const Host& h)
      : T(T_),
        H(H_),
        hd(hd_),
        W(W_),
        k(k_),
        q(h.q),
        wbank(h.wbank),
        sink(h.sink),
        scratch(sparse_attn_scratch_floats(T_, H_, hd_, W_ + k_)),
        ckv(bf16_bits(h.ckv)),
        win(window_rows(wbank.get(), T_ * W_, hd_)),
        topk(h.topk),
        scale(float(std::pow(double(hd_), -0.5))) {}
  void run(float* out) {
    sparse_attn(q.get(), T, H, hd, win.get(), W, topk.get(), k, ckv.get(), sink.get(), scale, out,
                nullptr, nullptr, scratch.get());
  }

  int T, H, hd, W, k;
  DeviceBuffer<float> q, wbank, sink, scratch;
  DeviceBuffer<uint16_t> ckv;  // the session's compressed KV is bf16
  DeviceBuffer<const float*> win;
  DeviceBuffer<int32_t> topk;
  float scale;
};

// Which records the split path runs: the tensor-core kernel's differ from the CPU-order ones
// (their p_j are rounded against other bases) wherever it applies, and where it does not (hd not
// a multiple of 16, past 512, chunks of 32) the default call IS the CPU-order one, bit for bit.
// So chunk_mma_records (the bounds the checks above pick) follows the kernels' real rule.
TEST(CudaOpsAttention, ChunkMmaDispatch) {
  UF_REQUIRE_GPU();
  struct Shape {
    int hd;
    bool chunks32;
  };
  for (const Shape sh : {Shape{512, false}, Shape{128, false}, Shape{48, false}, Shape{100, false},
                         Shape{1024, false}, Shape{520, false}, Shape{512, true}}) {
    const int T = 3, H = 8, hd = sh.hd, W = 40, k = 60, entries = 200;
    SCOPED_TRACE("hd " + std::to_string(hd) + (sh.chunks32 ? " chunks of 32" : ""));
    SplitInputs in(T, H, hd, W, k, entries, 400 + uint32_t(hd), false);
    DeviceBuffer<float> def(size_t(T) * H * hd), cpu(size_t(T) * H * hd);
    auto run = [&](Path path, float* o) {
      const ChunkRecords records(path);
      in.run(o);
    };
    if (sh.chunks32) sparse_attn_chunk_override(32);
    def.poison();
    cpu.poison();
    run(Path::kSplit, def.get());
    run(Path::kSplitCpuOrder, cpu.get());
    sparse_attn_chunk_override(0);
    sync_and_check();
    const auto a = def.download(), b = cpu.download();
    size_t diff = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_FALSE(std::isnan(a[i]) || std::isnan(b[i])) << "NaN at " << i;
      diff += !bits_equal(a[i], b[i]);
    }
    if (chunk_mma_records(Path::kSplit, hd, sh.chunks32))
      EXPECT_GT(diff, 0u) << "the tensor-core records should differ from the CPU-order ones";
    else
      EXPECT_EQ(diff, 0u) << "the CPU-order records should have run";
  }
}

// The tensor-core chunk records at 1, 2, 4 and 8 heads a CTA (chunk_mma_heads splits a small
// grid's heads over more CTAs): every split gives bitwise the 8-head CTAs' outputs (each head's
// records depend on its own q column only), for head counts that leave a partial group (6, 12),
// row counts on both sides of the rule, and the rule's own pick (override 0). The 8-head outputs
// are the ones the CPU comparisons above check.
TEST(CudaOpsAttention, ChunkMmaHeadsPerCtaBitwise) {
  UF_REQUIRE_GPU();
  struct Shape {
    int T, H, hd;
  };
  for (const Shape sh :
       {Shape{1, 8, 512}, Shape{2, 8, 512}, Shape{3, 6, 128}, Shape{7, 12, 64}, Shape{2, 1, 512}}) {
    const int T = sh.T, H = sh.H, hd = sh.hd, W = 40, k = 60, entries = 200;
    SCOPED_TRACE("T " + std::to_string(T) + " H " + std::to_string(H) + " hd " +
                 std::to_string(hd));
    SplitInputs in(T, H, hd, W, k, entries, 500 + uint32_t(T * 100 + H), true);
    DeviceBuffer<float> out(size_t(T) * H * hd);
    auto run = [&](int heads) {
      sparse_attn_chunk_heads_override(heads);
      out.poison();
      in.run(out.get());
      sparse_attn_chunk_heads_override(0);
      sync_and_check();
      return out.download();
    };
    const auto ref = run(8);
    for (float v : ref) ASSERT_FALSE(std::isnan(v)) << "NaN in the 8-head outputs";
    for (int heads : {1, 2, 4, 0}) {
      const auto got = run(heads);
      size_t diff = 0;
      for (size_t i = 0; i < got.size(); ++i) diff += !bits_equal(got[i], ref[i]);
      EXPECT_EQ(diff, 0u) << heads << " heads a CTA (0: the rule)";
    }
  }
}

// The attention's rotary embedding (AttnRope): q rotated as it is staged, the output rotated back
// in the split path's merge (the reference path: q's shared copy, then rope()); either way bitwise
// rope(q) + sparse_attn without it + rope(out, inverse), and q in memory untouched. Shapes: the
// TP8 rank's (hd 512, rope 64), an odd head_dim whose rotated channels start on a float4
// (100 / 36: the merge rotates), one that does not (100 / 30: the reference path), hd 128 with
// two head groups (the tensor-core records' rope at another width), device positions and p0 + t
// positions; the split path with both kinds of chunk records.
void check_attn_rope(int T, int H, int hd, int rope_dim, Path path, bool device_pos,
                     uint32_t seed) {
  const bool split = path == Path::kSplit || path == Path::kSplitCpuOrder;
  const bool mma = path == Path::kMma;
  const ChunkRecords records(path);
  SCOPED_TRACE("T=" + std::to_string(T) + " hd=" + std::to_string(hd) +
               " rope=" + std::to_string(rope_dim) +
               (split ? (path == Path::kSplit ? " split" : " split cpu-order")
                      : (mma ? " mma" : " reference")) +
               (device_pos ? " positions" : " p0"));
  std::mt19937 rng(seed);
  const int W = 40, k = 60, entries = 300;
  const auto q = normal_bf16(size_t(T) * H * hd, rng, 2.5f);
  const auto wbank = normal_bf16(size_t(T) * W * hd, rng, 1.f);
  const auto ckv = normal_bf16(size_t(entries) * hd, rng, 1.f);
  const auto sink = normal_bf16(size_t(H), rng, 1.f);
  std::vector<float> freqs(size_t(rope_dim / 2));
  for (size_t i = 0; i < freqs.size(); ++i)
    freqs[i] = float(std::pow(10000.0, -2.0 * double(i) / double(rope_dim)));
  std::uniform_int_distribution<int> ent(0, entries - 1);
  std::uniform_int_distribution<int64_t> pos_d(0, 1 << 20);
  std::vector<int32_t> topk(size_t(T) * k);
  for (auto& e : topk) e = ent(rng);
  std::vector<int64_t> pos(static_cast<size_t>(T));
  for (auto& p : pos) p = pos_d(rng);
  const int64_t p0 = pos_d(rng);
  DeviceBuffer<float> dq(q), dwbank(wbank), dsink(sink), dfreqs(freqs);
  DeviceBuffer<uint16_t> dckv(bf16_bits(ckv));
  std::vector<const float*> wptr(size_t(T) * W);
  for (size_t i = 0; i < wptr.size(); ++i) wptr[i] = dwbank.get() + int64_t(i) * hd;
  DeviceBuffer<const float*> dwin(wptr);
  DeviceBuffer<int32_t> dtopk(topk);
  DeviceBuffer<int64_t> dpos(pos);
  DeviceBuffer<float> scratch(sparse_attn_scratch_floats(T, H, hd, W + k));
  DeviceBuffer<float> fused(size_t(T) * H * hd), want(size_t(T) * H * hd);
  const float scale = float(std::pow(double(hd), -0.5));
  float* sp = split ? scratch.get() : nullptr;
  const int64_t* positions = device_pos ? dpos.get() : nullptr;
  DeviceBuffer<float> dq_rot(q);
  auto attn = [&](const float* qq, float* o, const AttnRope& r) {
    if (mma)
      ASSERT_TRUE(sparse_attn_mma(qq, T, H, hd, dwin.get(), W, dtopk.get(), k, dckv.get(),
                                  dsink.get(), scale, o, nullptr, nullptr, r));
    else
      sparse_attn(qq, T, H, hd, dwin.get(), W, dtopk.get(), k, dckv.get(), dsink.get(), scale, o,
                  nullptr, nullptr, sp, r);
  };
  fused.poison();
  want.poison();
  attn(dq.get(), fused.get(), AttnRope{dfreqs.get(), rope_dim, p0, positions});
  rope(dfreqs.get(), rope_dim, dq_rot.get(), T, H, hd, p0, 1, /*inverse=*/false, nullptr,
       positions);
  attn(dq_rot.get(), want.get(), AttnRope{});
  rope(dfreqs.get(), rope_dim, want.get(), T, H, hd, p0, 1, /*inverse=*/true, nullptr, positions);
  sync_and_check();
  if (split || mma)
    check_repeat_is_bitwise(fused.download(), T, H, hd, W + k, [&](float* o) {
      attn(dq.get(), o, AttnRope{dfreqs.get(), rope_dim, p0, positions});
    });
  const auto q_after = dq.download();
  for (size_t i = 0; i < q.size(); ++i)
    ASSERT_TRUE(bits_equal(q_after[i], q[i])) << "q was modified at " << i;
  const auto a = fused.download(), b = want.download();
  size_t diff = 0, nan = 0, first = a.size();
  for (size_t i = 0; i < a.size(); ++i) {
    nan += std::isnan(a[i]) || std::isnan(b[i]);
    if (!bits_equal(a[i], b[i])) first = std::min(first, i), ++diff;
  }
  EXPECT_EQ(nan, 0u);
  EXPECT_EQ(diff, 0u) << "first at " << first << ": " << a[std::min(first, a.size() - 1)] << " vs "
                      << b[std::min(first, b.size() - 1)];
}

TEST(CudaOpsAttention, RopeEqualsSeparateRopes) {
  UF_REQUIRE_GPU();
  uint32_t seed = 900;
  for (Path path : {Path::kSplit, Path::kSplitCpuOrder, Path::kReference})
    for (bool device_pos : {true, false}) {
      check_attn_rope(7, 8, 512, 64, path, device_pos, seed++);
      check_attn_rope(3, 4, 100, 36, path, device_pos, seed++);
      check_attn_rope(3, 4, 100, 30, path, device_pos, seed++);
      check_attn_rope(5, 12, 128, 64, path, device_pos, seed++);
    }
  for (bool device_pos : {true, false}) {  // sparse_attn_mma: head_dim a multiple of 32
    check_attn_rope(70, 8, 512, 64, Path::kMma, device_pos, seed++);
    check_attn_rope(20, 12, 128, 64, Path::kMma, device_pos, seed++);
  }
}

// sparse_attn_mma (prefill spans) against the CPU: a TP8 rank's prefill rows (hd 512, 128 window
// + 512 top-k), q with full fp32 mantissas, fewer heads than a CTA's 8 (tiny-a's 4), two head
// groups (12), 64 heads, 17 whole blocks, a last block of one slot, head_dim 64 (half the warps
// without output tiles) and 128; then the shapes it refuses (nothing launched, out untouched).
TEST(CudaOpsAttention, SparseAttnMmaPrefill) {
  UF_REQUIRE_GPU();
  check_sparse_attn({"real-tp8", 40, 8, 512, 128, 512, 3000}, 191, Path::kMma);
  check_sparse_attn({"real-tp8", 12, 8, 512, 128, 512, 3000}, 192, Path::kMma, /*fp32_q=*/true);
  check_sparse_attn({"tiny", 10, 4, 128, 8, 8, 40}, 193, Path::kMma);
  check_sparse_attn({"12-heads", 9, 12, 256, 20, 300, 400}, 194, Path::kMma);
  check_sparse_attn({"real-64h", 3, 64, 512, 128, 512, 700}, 195, Path::kMma);
  check_sparse_attn({"1088 slots", 3, 8, 512, 128, 960, 2000}, 196, Path::kMma);
  check_sparse_attn({"65 slots", 5, 8, 256, 60, 5, 30}, 197, Path::kMma);
  check_sparse_attn({"hd64", 6, 8, 64, 30, 40, 100}, 198, Path::kMma);
  check_sparse_attn({"window-only", 10, 8, 512, 128, 0, 0}, 199, Path::kMma);

  DeviceBuffer<float> q(size_t(2) * 8 * 1024), out(size_t(2) * 8 * 1024), sink(8);
  std::vector<const float*> none(size_t(2) * 4, nullptr);
  DeviceBuffer<const float*> win(none);
  out.poison();
  for (int hd : {100, 1024, 48})  // not a multiple of 32, or past 512
    EXPECT_FALSE(sparse_attn_mma(q.get(), 2, 8, hd, win.get(), 4, nullptr, 0, nullptr, sink.get(),
                                 1.f, out.get(), nullptr))
        << "hd " << hd;
  EXPECT_FALSE(sparse_attn_mma(q.get() + 1, 2, 8, 128, win.get(), 4, nullptr, 0, nullptr,
                               sink.get(), 1.f, out.get(), nullptr))
      << "unaligned q";
  sync_and_check();
  for (float v : out.download()) ASSERT_TRUE(std::isnan(v)) << "a refused call wrote its output";
}

TEST(CudaOpsAttention, SparseAttnRealAllHeads) {
  UF_REQUIRE_GPU();
  check_sparse_attn({"real-64h", 3, 64, 512, 128, 512, 700}, 103);
}

TEST(CudaOpsAttention, SparseAttnOddShapes) {
  UF_REQUIRE_GPU();
  check_sparse_attn({"window-only", 5, 8, 512, 128, 0, 0}, 104);
  // head_dim not a multiple of 8 (dot8 tail), slot count not a multiple of 64.
  check_sparse_attn({"odd", 6, 3, 100, 37, 50, 90}, 105);
}

// ------------------------------------------------------------------------------------------
// index_scores

struct IndexCase {
  const char* name;
  int n_heads, hd;
  std::vector<int> vis, width;
  int bank_run = 1;  // rows per run of one key bank (the banks alternate run by run)
};

void check_index_scores(const IndexCase& c, uint32_t seed) {
  SCOPED_TRACE(c.name);
  std::mt19937 rng(seed);
  const int T = int(c.vis.size()), Hi = c.n_heads, hd = c.hd;
  const int max_width = *std::max_element(c.width.begin(), c.width.end()) + 3;
  const int max_vis = std::max(1, *std::max_element(c.vis.begin(), c.vis.end()));
  // The model's operands: FP4 QDQ q and keys (per 32; head dims that are not a multiple of 32
  // keep plain bf16 values), on which both head_dim-128 kernels are bitwise the CPU.
  auto operand = [&](std::vector<float> v) { return hd % 32 == 0 ? fp4_qdq(std::move(v)) : v; };
  const auto q = operand(normal_bf16(size_t(T) * Hi * hd, rng, 1.f));
  const auto w = normal_bf16(size_t(T) * Hi, rng, 0.1f);  // negative weights included
  // Two key banks; run r of bank_run rows reads bank r % 2 (rows of a call may read different
  // layers' keys; a prefill chunk's rows read one bank).
  const auto bank0 = operand(normal_bf16(size_t(max_vis) * hd, rng, 1.f));
  const auto bank1 = operand(normal_bf16(size_t(max_vis) * hd, rng, 1.f));
  DeviceBuffer<float> dq(q), dw(w);
  DeviceBuffer<uint16_t> db0(bf16_bits(bank0)), db1(bf16_bits(bank1));
  std::vector<const uint16_t*> kp(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) kp[size_t(t)] = (t / c.bank_run) % 2 ? db1.get() : db0.get();
  DeviceBuffer<const uint16_t*> dkeys(kp);
  DeviceBuffer<int32_t> dvis(std::vector<int32_t>(c.vis.begin(), c.vis.end()));
  DeviceBuffer<int32_t> dwidth(std::vector<int32_t>(c.width.begin(), c.width.end()));
  DeviceBuffer<float> dscore(size_t(T) * max_width);
  dscore.poison();
  index_scores(dq.get(), dw.get(), T, Hi, hd, dkeys.get(), dvis.get(), dwidth.get(), max_width,
               dscore.get(), nullptr);
  sync_and_check();
  const auto got = dscore.download();

  // Tolerance 0: the kernel reproduces the CPU's summation order exactly (dot8 lanes and their
  // fixed pairing, bf16 roundings, heads in order, no FMA), so the scores are bitwise equal.
  int64_t n_bad = 0, n_nan = 0, max_ulp = 0;
  for (int t = 0; t < T; ++t) {
    const int wd = c.width[size_t(t)];
    std::vector<float> ref(size_t(std::max(wd, 1)));
    if (wd > 0)
      cpu::index_scores_row(q.data() + int64_t(t) * Hi * hd, w.data() + int64_t(t) * Hi, Hi, hd,
                            (t / c.bank_run) % 2 ? bank1.data() : bank0.data(), c.vis[size_t(t)],
                            wd, ref.data());
    const float* g = got.data() + int64_t(t) * max_width;
    for (int i = 0; i < max_width; ++i) {
      if (i >= wd) {
        if (f32_bits(g[i]) != kPoisonF32 && n_bad++ == 0)
          ADD_FAILURE() << "row " << t << " entry " << i << " past width " << wd
                        << " was written: " << g[i];
        continue;
      }
      if (std::isnan(g[i])) {
        if (n_nan++ == 0) ADD_FAILURE() << "NaN at row " << t << " entry " << i;
        continue;
      }
      if (std::isinf(ref[size_t(i)]) || std::isinf(g[i])) {
        if (!bits_equal(g[i], ref[size_t(i)]) && n_bad++ == 0)
          ADD_FAILURE() << "-inf pattern differs at row " << t << " entry " << i << ": gpu " << g[i]
                        << " cpu " << ref[size_t(i)];
        continue;
      }
      const int64_t u = bf16_ulps(g[i], ref[size_t(i)]);
      max_ulp = std::max(max_ulp, u);
      if (!bits_equal(g[i], ref[size_t(i)]) && n_bad++ == 0)
        ADD_FAILURE() << "first bad score: row " << t << " entry " << i << ": gpu " << g[i]
                      << " cpu " << ref[size_t(i)] << " (" << u << " bf16 ulp)";
    }
  }
  std::printf("[index_scores %s] %d rows, max width %d: %lld bad, max %lld bf16 ulp, %lld NaN\n",
              c.name, T, max_width, (long long)n_bad, (long long)max_ulp, (long long)n_nan);
  EXPECT_EQ(n_bad, 0);
  EXPECT_EQ(n_nan, 0);

  DeviceBuffer<float> d1(static_cast<size_t>(max_width));
  for (int t = 0; t < T; ++t) {
    d1.poison();
    index_scores(dq.get() + int64_t(t) * Hi * hd, dw.get() + int64_t(t) * Hi, 1, Hi, hd,
                 dkeys.get() + t, dvis.get() + t, dwidth.get() + t, max_width, d1.get(), nullptr);
    sync_and_check();
    const auto one = d1.download();
    for (int i = 0; i < max_width; ++i)
      if (!bits_equal(one[size_t(i)], got[size_t(t) * max_width + size_t(i)])) {
        ADD_FAILURE() << "spec != plain: row " << t << " entry " << i;
        break;
      }
  }
}

TEST(CudaOpsAttention, IndexScoresTiny) {
  UF_REQUIRE_GPU();
  // (vis, width): decode rows (vis == width), prefill rows (vis < width), nothing visible.
  check_index_scores({"tiny", 8, 128, {0, 1, 5, 37, 64, 65, 100}, {7, 1, 5, 64, 64, 130, 100}},
                     201);
}

TEST(CudaOpsAttention, IndexScoresReal) {
  UF_REQUIRE_GPU();
  check_index_scores({"real", 32, 128, {3000, 129, 2500, 0, 17}, {3000, 2600, 2600, 2600, 17}},
                     202);
}

// Prefill-shaped calls: many rows over one bank (a CTA's keys serve every group of its span),
// and runs of 37 rows per bank (runs crossing the groups and spans), 8 heads (a TP8 rank's) and
// 32; rows see 2900 .. 3099 entries of widths up to 3100, some nothing.
IndexCase prefill_case(const char* name, int n_heads, int T, int bank_run) {
  IndexCase c{name, n_heads, 128, {}, {}, bank_run};
  for (int t = 0; t < T; ++t) {
    c.width.push_back(t % 11 == 5 ? 2950 : 3100);
    c.vis.push_back(t % 13 == 7 ? 0 : std::min(c.width.back(), 2900 + 2 * t % 200));
  }
  return c;
}

TEST(CudaOpsAttention, IndexScoresPrefill) {
  UF_REQUIRE_GPU();
  check_index_scores(prefill_case("prefill one bank", 8, 150, 1 << 20), 203);
  check_index_scores(prefill_case("prefill runs of 37", 8, 150, 37), 204);
  check_index_scores(prefill_case("prefill 32 heads", 32, 70, 1 << 20), 205);
}

// Kernel attributes (the shared-memory limit above 48 KB) belong to a device's context: the
// attention and index-score kernels must be configured on EVERY device a process launches them on
// (a tensor-parallel rank on GPU 1 after GPU 0), not once per process. Needs two GPUs.
TEST(CudaOpsAttention, RealShapesOnEveryDevice) {
  UF_REQUIRE_GPU();
  const int n = gpu_count();
  if (n < 2) GTEST_SKIP() << "one GPU: the per-device configuration needs two to be tested";
  for (int d = 0; d < n; ++d) {
    SCOPED_TRACE("device " + std::to_string(d));
    ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
    check_sparse_attn({"real-tp8", 7, 8, 512, 128, 512, 2000}, 180 + uint32_t(d), Path::kSplit);
    check_index_scores({"real", 32, 128, {3000, 129}, {3000, 2600}}, 190 + uint32_t(d));
  }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// ------------------------------------------------------------------------------------------
// topk_select and candidate_mask: score rows of several kinds.

struct SelRow {
  int width, vis;
  RowKind kind;
};

struct SelData {
  int T = 0, max_width = 0;
  std::vector<float> score;  // [T, max_width], NaN padding past width
  std::vector<int32_t> width, vis;
};

SelData make_rows(const std::vector<SelRow>& rows, std::mt19937& rng) {
  SelData d;
  d.T = int(rows.size());
  for (const auto& r : rows) d.max_width = std::max(d.max_width, r.width);
  d.max_width += 5;
  d.score.assign(size_t(d.T) * d.max_width, NAN);  // past width: must never be read
  for (int t = 0; t < d.T; ++t) {
    const auto s =
        make_score_row(rows[size_t(t)].kind, rows[size_t(t)].width, rows[size_t(t)].vis, rng);
    std::copy(s.begin(), s.end(), d.score.begin() + int64_t(t) * d.max_width);
    d.width.push_back(rows[size_t(t)].width);
    d.vis.push_back(rows[size_t(t)].vis);
  }
  return d;
}

const std::vector<SelRow> kSelRows = {
    {0, 0, RowKind::kNormal},           {1, 1, RowKind::kNormal},
    {7, 0, RowKind::kNormal},  // prefill row that sees nothing yet
    {8, 3, RowKind::kFewValues},        {9, 9, RowKind::kAllEqual},
    {600, 600, RowKind::kFewValues},    {600, 550, RowKind::kSignedZeros},
    {5000, 4000, RowKind::kNormal},     {5000, 5000, RowKind::kAllNegInf},
    {16384, 16384, RowKind::kAllEqual}, {150001, 149990, RowKind::kFewValues},
    {262144, 262144, RowKind::kNormal}, {262144, 200003, RowKind::kFewValues},
};

void check_topk(const std::vector<SelRow>& rows, int k, uint32_t seed) {
  std::mt19937 rng(seed);
  const SelData d = make_rows(rows, rng);
  DeviceBuffer<float> dscore(d.score);
  DeviceBuffer<int32_t> dwidth(d.width), dvis(d.vis);
  DeviceBuffer<int32_t> dout(size_t(d.T) * k);
  dout.poison();
  topk_select(dscore.get(), d.T, d.max_width, dwidth.get(), k, dvis.get(), dout.get(), nullptr);
  sync_and_check();
  const auto got = dout.download();
  // Exact: the selection is a strict total order (score desc, position asc).
  int n_bad_rows = 0;
  for (int t = 0; t < d.T; ++t) {
    const int wd = d.width[size_t(t)], kk = std::min(k, wd);
    std::vector<int32_t> ref(size_t(k), -1);
    if (kk > 0)
      cpu::topk_select(d.score.data() + int64_t(t) * d.max_width, wd, kk, d.vis[size_t(t)],
                       ref.data());
    for (int j = 0; j < k; ++j) {
      const int32_t g = got[size_t(t) * k + size_t(j)];
      if (g != ref[size_t(j)]) {
        ++n_bad_rows;
        const float* s = d.score.data() + int64_t(t) * d.max_width;
        auto sc = [&](int32_t p) { return p >= 0 && p < wd ? s[p] : NAN; };
        ADD_FAILURE() << "topk k=" << k << " row " << t << " (width " << wd << ", vis "
                      << d.vis[size_t(t)] << ") slot " << j << ": gpu " << g << " (score " << sc(g)
                      << ") cpu " << ref[size_t(j)] << " (score " << sc(ref[size_t(j)]) << ")";
        break;
      }
    }
  }
  std::printf("[topk_select k=%d] %d rows, max width %d: %d bad rows\n", k, d.T, d.max_width,
              n_bad_rows);

  DeviceBuffer<int32_t> d1(static_cast<size_t>(k));
  for (int t = 0; t < d.T; ++t) {
    d1.poison();
    topk_select(dscore.get() + int64_t(t) * d.max_width, 1, d.max_width, dwidth.get() + t, k,
                dvis.get() + t, d1.get(), nullptr);
    sync_and_check();
    const auto one = d1.download();
    EXPECT_TRUE(std::equal(one.begin(), one.end(), got.begin() + int64_t(t) * k))
        << "spec != plain: topk row " << t;
  }
}

TEST(CudaOpsAttention, TopkSelectReal) {
  UF_REQUIRE_GPU();
  check_topk(kSelRows, 512, 301);
}

TEST(CudaOpsAttention, TopkSelectTiny) {
  UF_REQUIRE_GPU();
  check_topk(kSelRows, 8, 302);
  check_topk({{1, 1, RowKind::kNormal}, {3, 2, RowKind::kAllEqual}}, 1, 303);
}

void check_candidate(const std::vector<SelRow>& rows, int topk_blocks, int block_size,
                     uint32_t seed) {
  std::mt19937 rng(seed);
  const SelData d = make_rows(rows, rng);
  DeviceBuffer<float> dscore(d.score);
  DeviceBuffer<int32_t> dwidth(d.width), dvis(d.vis);
  DeviceBuffer<uint8_t> dkeep(size_t(d.T) * d.max_width);
  dkeep.poison();
  candidate_mask(dscore.get(), d.T, d.max_width, dwidth.get(), dvis.get(), topk_blocks, block_size,
                 dkeep.get(), nullptr);
  sync_and_check();
  const auto got = dkeep.download();
  int n_bad_rows = 0;
  for (int t = 0; t < d.T; ++t) {
    const int wd = d.width[size_t(t)];
    std::vector<uint8_t> ref(static_cast<size_t>(wd));
    if (wd > 0)
      cpu::candidate_mask(d.score.data() + int64_t(t) * d.max_width, wd, d.vis[size_t(t)],
                          topk_blocks, block_size, ref.data());
    int kept = 0;
    for (int i = 0; i < d.max_width; ++i) {
      const uint8_t g = got[size_t(t) * d.max_width + size_t(i)];
      const uint8_t r = i < wd ? ref[size_t(i)] : uint8_t(0xff);  // past width: untouched
      kept += i < wd && g == 1;
      if (g != r) {
        ++n_bad_rows;
        ADD_FAILURE() << "candidate_mask (" << topk_blocks << " x " << block_size << ") row " << t
                      << " (width " << wd << ", vis " << d.vis[size_t(t)] << ") entry " << i
                      << " (block " << i / block_size << "): gpu " << int(g) << " cpu " << int(r);
        break;
      }
    }
    std::printf("[candidate_mask %d x %d] row %d width %d: %d kept\n", topk_blocks, block_size, t,
                wd, kept);
  }
  EXPECT_EQ(n_bad_rows, 0);

  DeviceBuffer<uint8_t> d1(static_cast<size_t>(d.max_width));
  for (int t = 0; t < d.T; ++t) {
    d1.poison();
    candidate_mask(dscore.get() + int64_t(t) * d.max_width, 1, d.max_width, dwidth.get() + t,
                   dvis.get() + t, topk_blocks, block_size, d1.get(), nullptr);
    sync_and_check();
    const auto one = d1.download();
    EXPECT_TRUE(std::equal(one.begin(), one.end(), got.begin() + int64_t(t) * d.max_width))
        << "spec != plain: candidate row " << t;
  }
}

TEST(CudaOpsAttention, CandidateMaskReal) {
  UF_REQUIRE_GPU();
  check_candidate(kSelRows, 2048, 8, 401);
}

TEST(CudaOpsAttention, CandidateMaskTiny) {
  UF_REQUIRE_GPU();
  check_candidate(kSelRows, 3, 4, 402);
  // The pinned block (holding compress_len - 1) mid-block and in the last partial block.
  check_candidate({{30, 13, RowKind::kFewValues}, {30, 30, RowKind::kNormal}}, 2, 4, 403);
}

TEST(CudaOpsAttention, MaskScores) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(501);
  const std::vector<int32_t> width = {0, 5, 300, 1000};
  const int T = int(width.size()), max_width = 1003;
  auto score = normal_bf16(size_t(T) * max_width, rng, 1.f);
  std::vector<uint8_t> keep = random_bytes(size_t(T) * max_width, rng, 0, 1);
  DeviceBuffer<float> dscore(score);
  DeviceBuffer<uint8_t> dkeep(keep);
  DeviceBuffer<int32_t> dwidth(width);
  mask_scores(dscore.get(), dkeep.get(), T, max_width, dwidth.get(), nullptr);
  sync_and_check();
  const auto got = dscore.download();
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < max_width; ++i) {
      const size_t o = size_t(t) * max_width + size_t(i);
      const float want = i < width[size_t(t)] && !keep[o] ? -INFINITY : score[o];
      if (!bits_equal(got[o], want)) {
        ADD_FAILURE() << "mask_scores row " << t << " entry " << i << ": " << got[o] << " want "
                      << want;
        return;
      }
    }
}

}  // namespace
}  // namespace uf::cuda::test
