// The sparse indexer's device ops at long context (cuda/ops/attention.h: index_scores,
// candidate_mask, topk_select with their workspaces) against the CPU reference (cpu/indexer.h):
// widths 262144 (1M tokens at ratio 4) and 65536, 1 and 7 rows, heavy ties, -inf holes,
// vis < width, one to three selection rounds, the one-CTA-per-row fallback, and a CUDA-graph
// capture of the whole index_select sequence. Every comparison is bitwise (tolerance 0): the
// kernels keep the CPU's arithmetic order and its exact selection rule (score desc, position
// asc). Outputs are poisoned first; entries past a row's width must keep the poison.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "core/dtypes.h"
#include "cpu/indexer.h"
#include "cpu/linear.h"
#include "cuda/ops/attention.h"
#include "cuda_test_util.h"
#include "score_rows_test_util.h"

namespace uf::cuda::test {
namespace {

// ------------------------------------------------------------------------------------------
// index_scores

struct ScoreCase {
  const char* name;
  int n_heads;
  std::vector<int> vis, width;
  int banks;        // rows read bank t % banks (1: the decode case, every row one bank)
  bool misaligned;  // banks start 2 bytes past an 8-byte boundary (2-byte key loads)
  bool spec_plain;  // also check each row alone
};

// The tensor-parallel partial: the op's head sum without the final rounding.
void partial_row(const float* q, const float* w, int n_heads, int hd, const float* keys, int nv,
                 int width, float* out) {
  for (int i = 0; i < nv; ++i) {
    float s = 0.f;
    for (int h = 0; h < n_heads; ++h) {
      const float d =
          core::round_bf16(cpu::dot_f32(q + int64_t(h) * hd, keys + int64_t(i) * hd, hd));
      s += core::round_bf16(std::max(d, 0.0f) * w[h]);
    }
    out[i] = s;
  }
  for (int i = nv; i < width; ++i) out[i] = -INFINITY;
}

// Both head_dim-128 kernels: the tensor-core one (the default) on the model's operand class (FP4
// QDQ q and keys), the fp32 one on those and on arbitrary bf16 values; bitwise the CPU each.
void check_scores_with(const ScoreCase& c, uint32_t seed, bool mma, bool qdq);
void check_scores(const ScoreCase& c, uint32_t seed) {
  check_scores_with(c, seed, true, true);
  check_scores_with(c, seed, false, true);
  check_scores_with(c, seed, false, false);
  set_index_scores_mma(true);
}

void check_scores_with(const ScoreCase& c, uint32_t seed, bool mma, bool qdq) {
  SCOPED_TRACE(::testing::Message() << c.name << (mma ? ", tensor cores" : ", fp32")
                                    << (qdq ? ", FP4 QDQ operands" : ", bf16 operands"));
  set_index_scores_mma(mma);
  constexpr int hd = 128;
  std::mt19937 rng(seed);
  const int T = int(c.vis.size()), Hi = c.n_heads;
  const int max_width = *std::max_element(c.width.begin(), c.width.end()) + 3;
  const int max_vis = std::max(1, *std::max_element(c.vis.begin(), c.vis.end()));
  auto operand = [&](std::vector<float> v, size_t offset) {
    return qdq ? fp4_qdq(std::move(v), offset) : v;
  };
  const auto q = operand(normal_bf16(size_t(T) * Hi * hd, rng, 1.f), 0);
  const auto w = normal_bf16(size_t(T) * Hi, rng, 0.1f);  // negative weights included
  std::vector<std::vector<float>> banks;
  const int off = c.misaligned ? 1 : 0;
  for (int b = 0; b < c.banks; ++b)
    banks.push_back(operand(normal_bf16(size_t(max_vis) * hd + off, rng, 1.f), size_t(off)));
  DeviceBuffer<float> dq(q), dw(w);
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> dbanks;
  for (const auto& b : banks)
    dbanks.push_back(std::make_unique<DeviceBuffer<uint16_t>>(bf16_bits(b)));
  std::vector<const uint16_t*> kp(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) kp[size_t(t)] = dbanks[size_t(t % c.banks)]->get() + off;
  DeviceBuffer<const uint16_t*> dkeys(kp);
  DeviceBuffer<int32_t> dvis(std::vector<int32_t>(c.vis.begin(), c.vis.end()));
  DeviceBuffer<int32_t> dwidth(std::vector<int32_t>(c.width.begin(), c.width.end()));
  DeviceBuffer<float> dscore(size_t(T) * max_width);

  for (const bool round_sum : {true, false}) {
    dscore.poison();
    index_scores(dq.get(), dw.get(), T, Hi, hd, dkeys.get(), dvis.get(), dwidth.get(), max_width,
                 dscore.get(), nullptr, round_sum);
    sync_and_check();
    const auto got = dscore.download();
    int64_t n_bad = 0, n_nan = 0, n_exact = 0;
    for (int t = 0; t < T; ++t) {
      const int wd = c.width[size_t(t)], nv = std::min(c.vis[size_t(t)], wd);
      const float* bank = banks[size_t(t % c.banks)].data() + off;
      const float* qt = q.data() + int64_t(t) * Hi * hd;
      const float* wt = w.data() + int64_t(t) * Hi;
      std::vector<float> ref(size_t(std::max(wd, 1)));
      if (wd > 0) {
        if (round_sum)
          cpu::index_scores_row(qt, wt, Hi, hd, bank, nv, wd, ref.data());
        else
          partial_row(qt, wt, Hi, hd, bank, nv, wd, ref.data());
      }
      const float* g = got.data() + int64_t(t) * max_width;
      for (int i = 0; i < max_width; ++i) {
        const uint32_t want =
            i < wd ? f32_bits(ref[size_t(i)]) : 0xffffffffu;  // past width: poison
        if (std::isnan(g[i]) && i < wd && n_nan++ == 0)
          ADD_FAILURE() << "NaN at row " << t << " entry " << i;
        if (f32_bits(g[i]) == want) {
          ++n_exact;
        } else if (n_bad++ < 3) {
          ADD_FAILURE() << "index_scores (round_sum " << round_sum << ") row " << t << " (width "
                        << wd << ", vis " << c.vis[size_t(t)] << ") entry " << i << ": gpu " << g[i]
                        << " cpu " << (i < wd ? ref[size_t(i)] : NAN);
        }
      }
    }
    std::printf(
        "[index_scores long %s, %s, %s round_sum=%d] %d rows x %d heads, max width %d: %lld "
        "exact, %lld bad, %lld NaN\n",
        c.name, mma ? "mma" : "fp32", qdq ? "qdq" : "bf16", int(round_sum), T, Hi, max_width,
        (long long)n_exact, (long long)n_bad, (long long)n_nan);
    EXPECT_EQ(n_bad, 0);
    EXPECT_EQ(n_nan, 0);

    if (!c.spec_plain) continue;
    DeviceBuffer<float> d1(static_cast<size_t>(max_width));
    for (int t = 0; t < T; ++t) {
      d1.poison();
      index_scores(dq.get() + int64_t(t) * Hi * hd, dw.get() + int64_t(t) * Hi, 1, Hi, hd,
                   dkeys.get() + t, dvis.get() + t, dwidth.get() + t, max_width, d1.get(), nullptr,
                   round_sum);
      sync_and_check();
      const auto one = d1.download();
      for (int i = 0; i < max_width; ++i)
        if (f32_bits(one[size_t(i)]) != f32_bits(got[size_t(t) * max_width + size_t(i)])) {
          ADD_FAILURE() << "spec != plain: index_scores row " << t << " entry " << i << ": alone "
                        << one[size_t(i)] << " in the call "
                        << got[size_t(t) * max_width + size_t(i)];
          break;
        }
    }
  }
}

TEST(CudaIndexerLong, IndexScoresDecode7Rows64k) {
  UF_REQUIRE_GPU();
  check_scores({"7 rows, one bank, 64k",
                4,
                {65536, 65536, 65000, 64000, 12345, 0, 65536},
                {65536, 65536, 65536, 65536, 65536, 65536, 65536},
                1,
                false,
                true},
               601);
}

TEST(CudaIndexerLong, IndexScoresDecode1Row1M) {
  UF_REQUIRE_GPU();
  check_scores({"1 row, 1M", 4, {262144}, {262144}, 1, false, false}, 602);
}

TEST(CudaIndexerLong, IndexScoresMixedBanksAndGroups) {
  UF_REQUIRE_GPU();
  // Two banks alternating (keys reloaded per row), prefill-like vis < width.
  check_scores({"7 rows, two banks",
                4,
                {40000, 39000, 100, 0, 40000, 25000, 12},
                {40000, 40000, 40000, 40000, 40000, 30000, 64},
                2,
                false,
                true},
               603);
  // 17 rows: row groups of 8, 8 and 1 (prefill chunk shape).
  std::vector<int> vis, width;
  for (int t = 0; t < 17; ++t) {
    width.push_back(10000);
    vis.push_back(9000 + 61 * t);
  }
  check_scores({"17 rows", 4, vis, width, 1, false, true}, 604);
  // 32 heads (one GPU): fewer rows per CTA (shared memory), misaligned banks (scalar loads).
  check_scores({"32 heads, misaligned", 32, {5000, 4999, 1}, {5000, 5000, 5000}, 2, true, true},
               605);
  // 64 heads (the whole model's indexer on one GPU): one row per CTA and two passes of 4 column
  // tiles in the tensor-core kernel; 96 heads: past its 64 columns, the fp32 kernel serves.
  check_scores({"64 heads", 64, {3000, 2999, 2500}, {3000, 3000, 3000}, 1, false, true}, 606);
  check_scores({"96 heads", 96, {700, 699}, {700, 700}, 1, false, true}, 607);
}

// ------------------------------------------------------------------------------------------
// topk_select and candidate_mask

struct Row {
  int width, vis;
  RowKind kind;
};

struct Rows {
  int T = 0, max_width = 0;
  std::vector<float> score;  // [T, max_width], NaN past width (never read)
  std::vector<int32_t> width, vis;
};

// pad: max_width - the widest row (5: unaligned row starts, scalar loads; 0: 16-byte loads).
Rows make_rows(const std::vector<Row>& rows, std::mt19937& rng, int pad) {
  Rows d;
  d.T = int(rows.size());
  for (const auto& r : rows) d.max_width = std::max(d.max_width, r.width);
  d.max_width += pad;
  d.score.assign(size_t(d.T) * d.max_width, NAN);
  for (int t = 0; t < d.T; ++t) {
    const auto s =
        make_score_row(rows[size_t(t)].kind, rows[size_t(t)].width, rows[size_t(t)].vis, rng);
    std::copy(s.begin(), s.end(), d.score.begin() + int64_t(t) * d.max_width);
    d.width.push_back(rows[size_t(t)].width);
    d.vis.push_back(rows[size_t(t)].vis);
  }
  return d;
}

// 7 decode/verify rows at one width: the kinds in turn, vis < width on some.
std::vector<Row> verify_rows(int width, int T) {
  const RowKind kinds[] = {RowKind::kNormal,      RowKind::kFewValues, RowKind::kNormal,
                           RowKind::kSignedZeros, RowKind::kAllEqual,  RowKind::kFewValues,
                           RowKind::kAllNegInf};
  std::vector<Row> rows;
  for (int t = 0; t < T; ++t) {
    const int vis = t % 3 == 1 ? width - 777 * (t + 1) : width;
    rows.push_back({width, vis, kinds[t % 7]});
  }
  return rows;
}

// A GPU topk result against the CPU's; returns the number of bad rows (prints the first slot).
int compare_topk(const Rows& d, int k, const std::vector<int32_t>& got, const char* what) {
  int n_bad = 0;
  for (int t = 0; t < d.T; ++t) {
    const int wd = d.width[size_t(t)], kk = std::min(k, wd);
    std::vector<int32_t> ref(size_t(k), -1);
    if (kk > 0)
      cpu::topk_select(d.score.data() + int64_t(t) * d.max_width, wd, kk, d.vis[size_t(t)],
                       ref.data());
    int mism = 0, first = -1;
    for (int j = 0; j < k; ++j)
      if (got[size_t(t) * k + size_t(j)] != ref[size_t(j)] && mism++ == 0) first = j;
    if (mism > 0) {
      ++n_bad;
      const float* s = d.score.data() + int64_t(t) * d.max_width;
      auto sc = [&](int32_t p) { return p >= 0 && p < wd ? s[p] : NAN; };
      const int32_t g = got[size_t(t) * k + size_t(first)];
      ADD_FAILURE() << what << ": topk k=" << k << " row " << t << " (width " << wd << ", vis "
                    << d.vis[size_t(t)] << "): " << mism << " slots differ, first slot " << first
                    << ": gpu " << g << " (score " << sc(g) << ") cpu " << ref[size_t(first)]
                    << " (score " << sc(ref[size_t(first)]) << ")";
    }
  }
  return n_bad;
}

void check_topk(const std::vector<Row>& rows, int k, uint32_t seed, const char* name, int pad = 5) {
  SCOPED_TRACE(name);
  std::mt19937 rng(seed);
  const Rows d = make_rows(rows, rng, pad);
  DeviceBuffer<float> dscore(d.score);
  DeviceBuffer<int32_t> dwidth(d.width), dvis(d.vis);
  DeviceBuffer<int32_t> dout(size_t(d.T) * k);
  const size_t ws_bytes = topk_select_workspace_bytes(d.T, d.max_width, k);
  DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 1));
  ws.poison();  // the rounds must not depend on the workspace's previous contents

  dout.poison();
  topk_select(dscore.get(), d.T, d.max_width, dwidth.get(), k, dvis.get(), dout.get(), nullptr,
              ws.get());
  sync_and_check();
  const auto got = dout.download();
  const int n_bad = compare_topk(d, k, got, "with workspace");
  std::printf("[topk long %s k=%d] %d rows, max width %d, workspace %zu bytes: %d bad rows\n", name,
              k, d.T, d.max_width, ws_bytes, n_bad);
  EXPECT_EQ(n_bad, 0);

  // Without the workspace: the one-CTA-per-row kernel where rounds would need it; same result.
  dout.poison();
  topk_select(dscore.get(), d.T, d.max_width, dwidth.get(), k, dvis.get(), dout.get(), nullptr);
  sync_and_check();
  EXPECT_EQ(compare_topk(d, k, dout.download(), "without workspace"), 0);

  // spec == plain: each row alone gives the same slots.
  DeviceBuffer<int32_t> d1(static_cast<size_t>(k));
  for (int t = 0; t < d.T; ++t) {
    d1.poison();
    topk_select(dscore.get() + int64_t(t) * d.max_width, 1, d.max_width, dwidth.get() + t, k,
                dvis.get() + t, d1.get(), nullptr, ws.get());
    sync_and_check();
    const auto one = d1.download();
    EXPECT_TRUE(std::equal(one.begin(), one.end(), got.begin() + int64_t(t) * k))
        << "spec != plain: topk row " << t;
  }
}

TEST(CudaIndexerLong, TopkSelect1M) {
  UF_REQUIRE_GPU();
  check_topk(verify_rows(262144, 7), 512, 701, "1M x 7");
  check_topk(verify_rows(262144, 1), 512, 702, "1M x 1");
  check_topk(verify_rows(262144, 7), 512, 704, "1M x 7, aligned rows", 0);
  check_topk({{262144, 200003, RowKind::kFewValues}}, 512, 703, "1M x 1, vis < width, ties");
  // Scores that are not bf16 values: all four radix passes.
  check_topk({{262144, 262144, RowKind::kNormalF32},
              {262144, 200003, RowKind::kNormalF32},
              {262144, 262144, RowKind::kNormal}},
             512, 705, "1M x 3, fp32 and bf16 rows");
}

TEST(CudaIndexerLong, TopkSelect64k) {
  UF_REQUIRE_GPU();
  check_topk(verify_rows(65536, 7), 512, 711, "64k x 7");
  check_topk(verify_rows(65536, 1), 512, 712, "64k x 1");
  check_topk(verify_rows(2048, 7), 512, 713, "8k x 7 (one round)");
  // Lists of <= 4096 keys take the 8-keys-a-thread round kernel: full, short, tied rows, with
  // the score stride of an 8k-context session (2064) and at the list limit.
  check_topk({{2048, 2048, RowKind::kNormal},
              {2048, 1999, RowKind::kFewValues},
              {1500, 1500, RowKind::kAllEqual},
              {600, 550, RowKind::kSignedZeros},
              {3, 3, RowKind::kNormal}},
             512, 714, "<= 2048 keys, stride 2064 (small-list kernel)", 16);
  check_topk({{4096, 4096, RowKind::kNormal}, {4096, 4000, RowKind::kFewValues}}, 512, 715,
             "4096 keys (small-list kernel)", 0);
}

TEST(CudaIndexerLong, TopkSelectMixedWidthsAndRounds) {
  UF_REQUIRE_GPU();
  // Rows that finish in different rounds of one call, chunk edges, tiny rows.
  const std::vector<Row> mixed = {
      {0, 0, RowKind::kNormal},           {1, 1, RowKind::kNormal},
      {7, 0, RowKind::kNormal},           {600, 550, RowKind::kSignedZeros},
      {16384, 16384, RowKind::kAllEqual}, {16385, 16000, RowKind::kFewValues},
      {32768, 32768, RowKind::kNormal},   {150001, 149990, RowKind::kFewValues},
      {262144, 262144, RowKind::kNormal}};
  check_topk(mixed, 512, 721, "mixed k=512");
  check_topk(mixed, 8, 722, "mixed k=8");
  check_topk(mixed, 1, 723, "mixed k=1");
  // Three rounds (list B): k = 512 at 600000 keys, k = 4096 at 100000 keys.
  check_topk({{600000, 600000, RowKind::kNormal}, {600000, 590000, RowKind::kFewValues}}, 512, 724,
             "3 rounds k=512");
  check_topk({{100000, 100000, RowKind::kFewValues},
              {99999, 50000, RowKind::kNormal},
              {40000, 40000, RowKind::kAllEqual}},
             4096, 725, "3 rounds k=4096");
  // k above the rounds' limit: no workspace needed, one CTA per row.
  check_topk({{70000, 70000, RowKind::kNormal}}, 4097, 726, "k=4097 fallback");
}

void check_mask(const std::vector<Row>& rows, int topk_blocks, int block_size, uint32_t seed,
                const char* name, int pad = 5) {
  SCOPED_TRACE(name);
  std::mt19937 rng(seed);
  const Rows d = make_rows(rows, rng, pad);
  DeviceBuffer<float> dscore(d.score);
  DeviceBuffer<int32_t> dwidth(d.width), dvis(d.vis);
  DeviceBuffer<uint8_t> dkeep(size_t(d.T) * d.max_width);
  const size_t ws_bytes = candidate_mask_workspace_bytes(d.T, d.max_width, topk_blocks, block_size);
  DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 1));
  ws.poison();

  std::vector<std::vector<uint8_t>> refs(static_cast<size_t>(d.T));
  for (int t = 0; t < d.T; ++t) {
    const int wd = d.width[size_t(t)];
    refs[size_t(t)].resize(size_t(wd));
    if (wd > 0)
      cpu::candidate_mask(d.score.data() + int64_t(t) * d.max_width, wd, d.vis[size_t(t)],
                          topk_blocks, block_size, refs[size_t(t)].data());
  }
  auto compare = [&](const std::vector<uint8_t>& got, int64_t row_stride, int t0, int T,
                     const char* what) {
    int n_bad = 0;
    for (int t = t0; t < t0 + T; ++t) {
      const int wd = d.width[size_t(t)];
      int mism = 0, first = -1, kept = 0;
      for (int i = 0; i < d.max_width; ++i) {
        const uint8_t g = got[size_t(t - t0) * size_t(row_stride) + size_t(i)];
        const uint8_t r = i < wd ? refs[size_t(t)][size_t(i)] : uint8_t(0xff);  // past: untouched
        kept += i < wd && g == 1;
        if (g != r && mism++ == 0) first = i;
      }
      if (mism > 0) {
        ++n_bad;
        const uint8_t g = got[size_t(t - t0) * size_t(row_stride) + size_t(first)];
        ADD_FAILURE() << what << ": candidate_mask (" << topk_blocks << " x " << block_size
                      << ") row " << t << " (width " << wd << ", vis " << d.vis[size_t(t)]
                      << "): " << mism << " bytes differ, first " << first << " (block "
                      << first / block_size << "): gpu " << int(g) << " cpu "
                      << int(first < wd ? refs[size_t(t)][size_t(first)] : 0xff) << "; " << kept
                      << " kept";
      }
    }
    return n_bad;
  };

  dkeep.poison();
  candidate_mask(dscore.get(), d.T, d.max_width, dwidth.get(), dvis.get(), topk_blocks, block_size,
                 dkeep.get(), nullptr, ws.get());
  sync_and_check();
  const auto got = dkeep.download();
  const int n_bad = compare(got, d.max_width, 0, d.T, "with workspace");
  std::printf(
      "[candidate_mask long %s %d x %d] %d rows, max width %d, workspace %zu bytes: %d "
      "bad rows\n",
      name, topk_blocks, block_size, d.T, d.max_width, ws_bytes, n_bad);
  EXPECT_EQ(n_bad, 0);

  dkeep.poison();
  candidate_mask(dscore.get(), d.T, d.max_width, dwidth.get(), dvis.get(), topk_blocks, block_size,
                 dkeep.get(), nullptr);
  sync_and_check();
  EXPECT_EQ(compare(dkeep.download(), d.max_width, 0, d.T, "without workspace"), 0);

  DeviceBuffer<uint8_t> d1(static_cast<size_t>(d.max_width));
  for (int t = 0; t < d.T; ++t) {
    d1.poison();
    candidate_mask(dscore.get() + int64_t(t) * d.max_width, 1, d.max_width, dwidth.get() + t,
                   dvis.get() + t, topk_blocks, block_size, d1.get(), nullptr, ws.get());
    sync_and_check();
    const auto one = d1.download();
    EXPECT_TRUE(std::equal(one.begin(), one.end(), got.begin() + int64_t(t) * d.max_width))
        << "spec != plain: candidate row " << t;
  }
}

TEST(CudaIndexerLong, CandidateMask1M) {
  UF_REQUIRE_GPU();
  check_mask(verify_rows(262144, 7), 2048, 8, 801, "1M x 7");
  check_mask(verify_rows(262144, 1), 2048, 8, 802, "1M x 1");
  check_mask(verify_rows(262144, 7), 2048, 8, 803, "1M x 7, aligned rows", 0);
}

TEST(CudaIndexerLong, CandidateMask64k) {
  UF_REQUIRE_GPU();
  check_mask(verify_rows(65536, 7), 2048, 8, 811, "64k x 7 (one round)");
  check_mask(verify_rows(65536, 1), 2048, 8, 812, "64k x 1");
  check_mask(verify_rows(2048, 7), 2048, 8, 813, "8k x 7");
  // 1025 blocks, the best 512 kept: the small-list kernel's radix passes.
  check_mask(verify_rows(8192, 3), 512, 8, 814, "32k-entry rows, top 512 of 1025 blocks");
}

TEST(CudaIndexerLong, CandidateMaskMixedAndRounds) {
  UF_REQUIRE_GPU();
  const std::vector<Row> mixed = {{0, 0, RowKind::kNormal},
                                  {30, 13, RowKind::kFewValues},
                                  {600, 550, RowKind::kSignedZeros},
                                  {5000, 5000, RowKind::kAllNegInf},
                                  {131073, 131000, RowKind::kFewValues},
                                  {262144, 200003, RowKind::kNormal}};
  check_mask(mixed, 2048, 8, 821, "mixed");
  check_mask(mixed, 3, 4, 822, "mixed 3 x 4");
  // Block size 1 (every position a block): three rounds at 100000 blocks with 4096 kept.
  check_mask({{100000, 100000, RowKind::kFewValues}, {100000, 77777, RowKind::kNormal}}, 4096, 1,
             823, "3 rounds");
}

// Candidate-restricted layers on the pool's list (EntryList): candidate_mask's list output, then
// index_scores_list + topk_select through the list, against the full path (every visible entry
// scored, mask_scores, topk_select): the same top-k slots bit for bit, and the list holds exactly
// the kept visible entries, ascending. Scores come from index_scores on bf16 keys (finite for
// visible entries, as in the model); `distinct` > 0 draws the key rows from that many distinct
// rows, so scores and block maxima tie heavily (the lower-index rule decides).
struct ListCase {
  const char* name;
  std::vector<int> vis, width;
  int topk_blocks, block_size, k, distinct;
};

void check_candidate_list(const ListCase& c, uint32_t seed) {
  SCOPED_TRACE(c.name);
  constexpr int hd = 128, Hi = 4;
  std::mt19937 rng(seed);
  const int T = int(c.vis.size());
  const int max_width = std::max(1, *std::max_element(c.width.begin(), c.width.end()));
  const int max_vis = std::max(1, *std::max_element(c.vis.begin(), c.vis.end()));
  // The model's operand class (FP4 QDQ q and keys): bitwise the CPU with either scores kernel.
  const auto q1 = fp4_qdq(normal_bf16(size_t(T) * Hi * hd, rng, 1.f));
  const auto q2 = fp4_qdq(normal_bf16(q1.size(), rng, 1.f));
  const auto w1 = normal_bf16(size_t(T) * Hi, rng, 0.1f), w2 = normal_bf16(w1.size(), rng, 0.1f);
  std::vector<float> bank = fp4_qdq(normal_bf16(size_t(max_vis) * hd, rng, 1.f));
  if (c.distinct > 0) {
    std::uniform_int_distribution<int> pick(0, c.distinct - 1);
    for (int i = c.distinct; i < max_vis; ++i)
      std::copy_n(bank.begin() + int64_t(pick(rng)) * hd, hd, bank.begin() + int64_t(i) * hd);
  }
  DeviceBuffer<float> dq1(q1), dq2(q2), dw1(w1), dw2(w2);
  DeviceBuffer<uint16_t> dbank(bf16_bits(bank));
  DeviceBuffer<const uint16_t*> dkeys(std::vector<const uint16_t*>(size_t(T), dbank.get()));
  DeviceBuffer<int32_t> dvis(std::vector<int32_t>(c.vis.begin(), c.vis.end()));
  DeviceBuffer<int32_t> dwidth(std::vector<int32_t>(c.width.begin(), c.width.end()));
  const int64_t cap = int64_t(c.topk_blocks) * c.block_size;
  const int cols = int(std::max<int64_t>(max_width, cap));
  DeviceBuffer<float> dscore(size_t(T) * cols);
  DeviceBuffer<uint8_t> dkeep(size_t(T) * max_width);
  DeviceBuffer<int32_t> dlist(size_t(T) * cap), dn(static_cast<size_t>(T));
  DeviceBuffer<int32_t> dfull(size_t(T) * c.k), dlisted(size_t(T) * c.k);
  const size_t ws_bytes =
      std::max(topk_select_workspace_bytes(T, cols, c.k),
               candidate_mask_workspace_bytes(T, max_width, c.topk_blocks, c.block_size));
  DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 1));
  for (auto* b : {&dlist, &dn, &dfull, &dlisted}) b->poison();
  dkeep.poison();
  ws.poison();

  // The candidate source: its scores, the pool as a mask and as lists.
  index_scores(dq1.get(), dw1.get(), T, Hi, hd, dkeys.get(), dvis.get(), dwidth.get(), max_width,
               dscore.get(), nullptr);
  const EntryListOut out{dlist.get(), dn.get(), cap};
  ASSERT_TRUE(candidate_mask(dscore.get(), T, max_width, dwidth.get(), dvis.get(), c.topk_blocks,
                             c.block_size, dkeep.get(), nullptr, ws.get(), &out))
      << "candidate_mask did not write the lists";
  // The restricted layer, full path.
  index_scores(dq2.get(), dw2.get(), T, Hi, hd, dkeys.get(), dvis.get(), dwidth.get(), max_width,
               dscore.get(), nullptr);
  mask_scores(dscore.get(), dkeep.get(), T, max_width, dwidth.get(), nullptr);
  topk_select(dscore.get(), T, max_width, dwidth.get(), c.k, dvis.get(), dfull.get(), nullptr,
              ws.get());
  sync_and_check();
  const auto full_scores = dscore.download();
  // The restricted layer on the lists.
  dscore.poison();
  const EntryList list{dlist.get(), dn.get(), cap};
  index_scores_list(dq2.get(), dw2.get(), T, Hi, hd, dkeys.get(), list, dscore.get(), nullptr);
  topk_select(dscore.get(), T, int(cap), dn.get(), c.k, dn.get(), dlisted.get(), nullptr, ws.get(),
              dlist.get(), cap);
  sync_and_check();
  const auto keep = dkeep.download();
  const auto lists = dlist.download(), ns = dn.download();
  const auto list_scores = dscore.download();
  const auto full = dfull.download(), listed = dlisted.download();

  int n_bad = 0;
  int64_t n_listed = 0;
  for (int t = 0; t < T; ++t) {
    const int wd = c.width[size_t(t)], cl = std::min(c.vis[size_t(t)], wd);
    std::vector<int32_t> want;  // the kept visible entries, ascending
    for (int i = 0; i < cl; ++i)
      if (keep[size_t(t) * max_width + size_t(i)] == 1) want.push_back(i);
    n_listed += int64_t(want.size());
    const int n = ns[size_t(t)];
    bool ok = n == int(want.size());
    for (int j = 0; ok && j < n; ++j) ok = lists[size_t(t) * cap + size_t(j)] == want[size_t(j)];
    for (int j = 0; ok && j < n; ++j)  // each listed score is bitwise the full row's
      ok = f32_bits(list_scores[size_t(t) * cap + size_t(j)]) ==
           f32_bits(full_scores[size_t(t) * max_width + size_t(want[size_t(j)])]);
    if (!ok && n_bad++ < 3)
      ADD_FAILURE() << "row " << t << " (width " << wd << ", vis " << c.vis[size_t(t)]
                    << "): list of " << n << " entries, " << want.size()
                    << " kept visible entries in the mask (or their scores differ)";
    const bool same =
        std::equal(full.begin() + int64_t(t) * c.k, full.begin() + int64_t(t + 1) * c.k,
                   listed.begin() + int64_t(t) * c.k);
    if (!same && n_bad++ < 3) {
      int j = 0;
      while (full[size_t(t) * c.k + size_t(j)] == listed[size_t(t) * c.k + size_t(j)]) ++j;
      ADD_FAILURE() << "row " << t << ": top-k on the list differs from the masked full scores at "
                    << "slot " << j << ": list " << listed[size_t(t) * c.k + size_t(j)] << ", full "
                    << full[size_t(t) * c.k + size_t(j)];
    }
  }
  std::printf("[candidate lists %s] %d rows, %lld listed entries, %d bad rows\n", c.name, T,
              (long long)n_listed, n_bad);
  EXPECT_EQ(n_bad, 0);

  // The tensor-parallel partial (no final rounding) on the lists: bitwise the full partial's.
  DeviceBuffer<float> dpart(size_t(T) * cols);
  index_scores(dq2.get(), dw2.get(), T, Hi, hd, dkeys.get(), dvis.get(), dwidth.get(), max_width,
               dpart.get(), nullptr, /*round_sum=*/false);
  dscore.poison();
  index_scores_list(dq2.get(), dw2.get(), T, Hi, hd, dkeys.get(), list, dscore.get(), nullptr,
                    /*round_sum=*/false);
  sync_and_check();
  const auto part = dpart.download(), lpart = dscore.download();
  int part_bad = 0;
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < ns[size_t(t)]; ++j)
      part_bad +=
          f32_bits(lpart[size_t(t) * cap + size_t(j)]) !=
          f32_bits(part[size_t(t) * max_width + size_t(lists[size_t(t) * cap + size_t(j)])]);
  EXPECT_EQ(part_bad, 0) << "partial scores on the lists differ from the full partial";
}

TEST(CudaIndexerLong, CandidateListsEqualMaskedScores) {
  UF_REQUIRE_GPU();
  // 1M tokens at ratio 1 would be 1M entries; 262144 keeps the test short and still needs
  // several mask rounds (32768 blocks of 8, 2048 kept).
  std::vector<int> vis7, wid7;
  for (int t = 0; t < 7; ++t) {
    wid7.push_back(262144);
    vis7.push_back(262144 - 1001 * t - (t % 2));  // partial pinned blocks on odd rows
  }
  check_candidate_list({"262144 x 7, 2048 x 8", vis7, wid7, 2048, 8, 512, 0}, 1101);
  check_candidate_list({"262144 x 7, ties", vis7, wid7, 2048, 8, 512, 37}, 1102);
  check_candidate_list({"65536 x 1", {65531}, {65536}, 2048, 8, 512, 0}, 1103);
  // Pools larger than the visible entries (every visible block kept), empty rows, tiny-a's shape.
  check_candidate_list(
      {"mixed", {0, 13, 550, 16384, 16389}, {0, 30, 600, 16384, 20000}, 2048, 8, 512, 5}, 1104);
  check_candidate_list(
      {"tiny-a 3 x 4", {1, 5, 12, 13, 41, 40, 39}, {1, 5, 12, 13, 41, 41, 41}, 3, 4, 8, 3}, 1105);
  // Prefill rows (more than a verify step: the list scores on the tensor cores), a chunk's
  // prefill layout (width past vis), partial pools and empty rows among them.
  std::vector<int> vis20, wid20;
  for (int t = 0; t < 20; ++t) {
    wid20.push_back(30000);
    vis20.push_back(t == 3 ? 0 : t == 7 ? 9000 : 30000 - 997 * t);
  }
  check_candidate_list({"prefill 20 rows", vis20, wid20, 2048, 8, 512, 0}, 1106);
  check_candidate_list({"prefill 20 rows, ties", vis20, wid20, 2048, 8, 512, 29}, 1107);
}

// The index_select sequence (scores, candidate pool, mask, top-k) captured in a CUDA graph and
// replayed: the same bytes as the eager calls (no host sync or allocation inside).
TEST(CudaIndexerLong, GraphCapture) {
  UF_REQUIRE_GPU();
  constexpr int T = 7, Hi = 4, hd = 128, k = 512, width = 65536, max_width = 65536;
  std::mt19937 rng(901);
  const auto q = fp4_qdq(normal_bf16(size_t(T) * Hi * hd, rng, 1.f));
  const auto w = normal_bf16(size_t(T) * Hi, rng, 0.1f);
  const auto bank = fp4_qdq(normal_bf16(size_t(width) * hd, rng, 1.f));
  DeviceBuffer<float> dq(q), dw(w);
  DeviceBuffer<uint16_t> dbank(bf16_bits(bank));
  DeviceBuffer<const uint16_t*> dkeys(std::vector<const uint16_t*>(T, dbank.get()));
  std::vector<int32_t> vis(T), wid(T, width);
  for (int t = 0; t < T; ++t) vis[size_t(t)] = width - 13 * t;
  DeviceBuffer<int32_t> dvis(vis), dwidth(wid);
  DeviceBuffer<float> dscore(size_t(T) * max_width);
  DeviceBuffer<uint8_t> dkeep(size_t(T) * max_width);
  DeviceBuffer<int32_t> dtop(size_t(T) * k), dcand(size_t(T) * k);
  const size_t ws_bytes = std::max(topk_select_workspace_bytes(T, max_width, k),
                                   candidate_mask_workspace_bytes(T, max_width, 2048, 8));
  DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 1));
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto body = [&] {
    index_scores(dq.get(), dw.get(), T, Hi, hd, dkeys.get(), dvis.get(), dwidth.get(), max_width,
                 dscore.get(), s);
    topk_select(dscore.get(), T, max_width, dwidth.get(), k, dvis.get(), dtop.get(), s, ws.get());
    candidate_mask(dscore.get(), T, max_width, dwidth.get(), dvis.get(), 2048, 8, dkeep.get(), s,
                   ws.get());
    mask_scores(dscore.get(), dkeep.get(), T, max_width, dwidth.get(), s);
    topk_select(dscore.get(), T, max_width, dwidth.get(), k, dvis.get(), dcand.get(), s, ws.get());
  };
  body();
  UF_CUDA_CHECK(cudaStreamSynchronize(s));
  const auto top_eager = dtop.download(), cand_eager = dcand.download();
  const auto keep_eager = dkeep.download();

  // The eager result against the CPU chain.
  int n_bad = 0;
  for (int t = 0; t < T; ++t) {
    std::vector<float> sc(static_cast<size_t>(width));
    cpu::index_scores_row(q.data() + int64_t(t) * Hi * hd, w.data() + int64_t(t) * Hi, Hi, hd,
                          bank.data(), vis[size_t(t)], width, sc.data());
    std::vector<int32_t> ref(static_cast<size_t>(k));
    cpu::topk_select(sc.data(), width, k, vis[size_t(t)], ref.data());
    n_bad += !std::equal(ref.begin(), ref.end(), top_eager.begin() + int64_t(t) * k);
    std::vector<uint8_t> keep(static_cast<size_t>(width));
    cpu::candidate_mask(sc.data(), width, vis[size_t(t)], 2048, 8, keep.data());
    n_bad += !std::equal(keep.begin(), keep.end(), keep_eager.begin() + int64_t(t) * max_width);
    for (int i = 0; i < width; ++i)
      if (!keep[size_t(i)]) sc[size_t(i)] = -INFINITY;
    cpu::topk_select(sc.data(), width, k, vis[size_t(t)], ref.data());
    n_bad += !std::equal(ref.begin(), ref.end(), cand_eager.begin() + int64_t(t) * k);
  }
  std::printf("[indexer graph] eager vs CPU: %d bad (row, output) pairs\n", n_bad);
  EXPECT_EQ(n_bad, 0);

  dtop.poison();
  dcand.poison();
  dkeep.poison();
  dscore.poison();
  cudaGraph_t g;
  UF_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  body();
  UF_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t exec;
  UF_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  for (int rep = 0; rep < 2; ++rep) UF_CUDA_CHECK(cudaGraphLaunch(exec, s));
  UF_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_TRUE(dtop.download() == top_eager) << "graph replay: topk differs from eager";
  EXPECT_TRUE(dcand.download() == cand_eager) << "graph replay: candidate topk differs";
  EXPECT_TRUE(dkeep.download() == keep_eager) << "graph replay: keep differs";
  UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
  UF_CUDA_CHECK(cudaGraphDestroy(g));
  UF_CUDA_CHECK(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace uf::cuda::test
