// The entry-split indexer's ops (cuda/ops/index_split.h) on one GPU, the ranks simulated: each
// "rank" takes its rank_position_range of every row, selects there (topk_select, the ops the
// backend runs), packs its picks, and the packed pairs are laid out as the TP gather lays them
// out; the merge and its selection must then be the CPU's selection over the whole row (tolerance
// 0: cpu::topk_select / cpu::candidate_mask, score desc then position asc), and the pool's list
// the CPU's kept visible entries. Heavy ties (scores on a 1/8 grid), -inf past vis, vis < k,
// vis = 0, width > vis, 2 / 3 / 8 ranks, one and several selection rounds, lists whose entries
// jump. Outputs are poisoned first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/indexer.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/index_split.h"
#include "cuda_test_util.h"

namespace uf::cuda::test {
namespace {

struct Rows {
  int T = 0;
  int64_t stride = 0;  // score row stride (the positions a row may have)
  std::vector<int32_t> vis, width;
  std::vector<float> score;  // [T, stride]: finite below vis, -inf in [vis, width)
};

Rows make_rows(const std::vector<int>& vis, const std::vector<int>& width, uint32_t seed) {
  Rows r;
  r.T = int(vis.size());
  r.vis.assign(vis.begin(), vis.end());
  r.width.assign(width.begin(), width.end());
  r.stride = (*std::max_element(width.begin(), width.end()) + 3) / 4 * 4;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> grid(-40, 40);  // 81 values: heavy ties
  r.score.assign(size_t(r.T) * size_t(r.stride), NAN);
  for (int t = 0; t < r.T; ++t)
    for (int i = 0; i < width[size_t(t)]; ++i)
      r.score[size_t(t) * size_t(r.stride) + size_t(i)] =
          i < vis[size_t(t)] ? float(grid(rng)) * 0.125f : -INFINITY;
  return r;
}

// The range's scores at row stride len (what index_scores writes on that rank); NaN past the
// rows' positions.
void range_scores(const Rows& r, const float* score, const PositionRange& range,
                  DeviceBuffer<float>& local) {
  local.poison();
  const int64_t copy = std::max<int64_t>(0, std::min(range.len, r.stride - range.begin));
  if (copy > 0)
    UF_CUDA_CHECK(cudaMemcpy2D(local.get(), size_t(range.len) * sizeof(float), score + range.begin,
                               size_t(r.stride) * sizeof(float), size_t(copy) * sizeof(float),
                               size_t(r.T), cudaMemcpyDeviceToDevice));
}

// cpu::topk_select with the device's conventions for rows narrower than k (slots past the width
// are -1).
std::vector<int32_t> cpu_topk(const float* score, int width, int k, int vis) {
  std::vector<int32_t> out(size_t(k), -1);
  const int kk = std::min(k, width);
  if (kk > 0) cpu::topk_select(score, width, kk, vis, out.data());
  return out;
}

// Every simulated rank's selection, packed, in the gathered layout [T, n_ranks, 2k]; then the
// merge and its selection. map (optional): a list's entries [T, map_cap] (positions index it).
std::vector<int32_t> split_select(const Rows& r, int k, int n_ranks, int64_t align,
                                  const std::vector<int32_t>* map, int64_t map_cap) {
  const int T = r.T;
  DeviceBuffer<float> score(r.score);
  DeviceBuffer<int32_t> vis(r.vis), width(r.width), vis_l(static_cast<size_t>(T)),
      width_l(static_cast<size_t>(T));
  DeviceBuffer<int32_t> sel(size_t(T) * size_t(k));
  DeviceBuffer<float> pairs(size_t(T) * 2 * size_t(k));
  DeviceBuffer<float> gathered(size_t(T) * size_t(n_ranks) * 2 * size_t(k));
  std::unique_ptr<DeviceBuffer<int32_t>> map_dev;
  if (map) map_dev = std::make_unique<DeviceBuffer<int32_t>>(*map);
  gathered.poison();
  const size_t ws_bytes = std::max<size_t>(1, topk_select_workspace_bytes(T, int(r.stride), k));
  DeviceBuffer<uint8_t> ws(ws_bytes);
  for (int q = 0; q < n_ranks; ++q) {
    const PositionRange range = rank_position_range(r.stride, n_ranks, q, align);
    EXPECT_EQ(range.len % align, 0);
    DeviceBuffer<float> local(size_t(T) * size_t(range.len));
    range_scores(r, score.get(), range, local);
    RangeRows rows;
    rows.vis = vis_l.get();
    rows.width = width_l.get();
    index_range_rows(vis.get(), width.get(), nullptr, T, range, 128, rows, nullptr);
    topk_select(local.get(), T, int(range.len), width_l.get(), k, vis_l.get(), sel.get(), nullptr,
                ws.get());
    pairs.poison();
    index_pack_selection(sel.get(), T, k, local.get(), range.len, range.begin,
                         map_dev ? map_dev->get() : nullptr, map_cap, pairs.get(), nullptr);
    UF_CUDA_CHECK(cudaMemcpy2D(gathered.get() + size_t(q) * 2 * size_t(k),
                               size_t(n_ranks) * 2 * size_t(k) * sizeof(float), pairs.get(),
                               2 * size_t(k) * sizeof(float), 2 * size_t(k) * sizeof(float),
                               size_t(T), cudaMemcpyDeviceToDevice));
    sync_and_check();
  }
  const int64_t cap = int64_t(n_ranks) * k;
  DeviceBuffer<float> mscore(size_t(T) * size_t(cap));
  DeviceBuffer<int32_t> mentries(size_t(T) * size_t(cap)), mn(static_cast<size_t>(T)),
      out(size_t(T) * size_t(k));
  mn.poison();
  out.poison();
  index_merge_pairs(gathered.get(), T, n_ranks, k, cap * 2, 2 * int64_t(k), mscore.get(),
                    mentries.get(), mn.get(), cap, nullptr);
  topk_select(mscore.get(), T, int(cap), mn.get(), k, mn.get(), out.get(), nullptr, nullptr,
              mentries.get(), cap);
  sync_and_check();
  return out.download();
}

void check_topk(const std::vector<int>& vis, const std::vector<int>& width, int k, uint32_t seed) {
  const Rows r = make_rows(vis, width, seed);
  for (int n_ranks : {2, 3, 8}) {
    SCOPED_TRACE(::testing::Message() << n_ranks << " ranks, k " << k);
    const auto got = split_select(r, k, n_ranks, 8, nullptr, 0);
    for (int t = 0; t < r.T; ++t) {
      const auto want = cpu_topk(r.score.data() + size_t(t) * size_t(r.stride), r.width[size_t(t)],
                                 k, r.vis[size_t(t)]);
      const std::vector<int32_t> row(got.begin() + int64_t(t) * k,
                                     got.begin() + int64_t(t + 1) * k);
      ASSERT_EQ(row, want) << "row " << t << " (vis " << r.vis[size_t(t)] << ", width "
                           << r.width[size_t(t)] << ")";
    }
  }
}

TEST(IndexSplit, MergedTopkIsTheWholeRowsSelection) {
  UF_REQUIRE_GPU();
  // Decode rows (vis == width), one under k, one empty; one round per range.
  check_topk({3000, 2999, 100, 0, 1}, {3000, 2999, 100, 0, 1}, 512, 1);
  // Prefill layout (width > vis) and a small k with many ties at the boundary.
  check_topk({700, 64, 5}, {900, 900, 900}, 64, 2);
}

TEST(IndexSplit, MergedTopkAcrossSelectionRounds) {
  UF_REQUIRE_GPU();
  // 1M tokens at ratio 4 (250k entries): several rounds within a range at 2 ranks.
  check_topk({250000, 249999, 40000}, {250000, 250000, 250000}, 512, 3);
}

TEST(IndexSplit, MergedListSelectionMapsEntries) {
  UF_REQUIRE_GPU();
  // A candidate pool's list: ascending entries (with jumps), scored by position; n < cap rows.
  constexpr int k = 512;
  const int T = 3;
  const int64_t cap = 16384;
  std::mt19937 rng(7);
  std::vector<int32_t> list(size_t(T) * cap, -1);
  std::vector<int> n = {16384, 9001, 300};
  for (int t = 0; t < T; ++t) {
    int32_t e = 0;
    for (int j = 0; j < n[size_t(t)]; ++j) {
      e += 1 + int32_t(rng() % 9);
      list[size_t(t) * cap + size_t(j)] = e;
    }
  }
  Rows r = make_rows(n, n, 8);
  // The rows' stride must be the list's cap (index_scores_list writes [T, cap]).
  Rows wide;
  wide.T = T;
  wide.stride = cap;
  wide.vis = r.vis;
  wide.width = r.width;
  wide.score.assign(size_t(T) * cap, NAN);
  for (int t = 0; t < T; ++t)
    std::copy_n(r.score.begin() + int64_t(t) * r.stride, n[size_t(t)],
                wide.score.begin() + int64_t(t) * cap);
  for (int n_ranks : {2, 8}) {
    SCOPED_TRACE(::testing::Message() << n_ranks << " ranks");
    const auto got = split_select(wide, k, n_ranks, 4, &list, cap);
    for (int t = 0; t < T; ++t) {
      auto want = cpu_topk(wide.score.data() + size_t(t) * cap, n[size_t(t)], k, n[size_t(t)]);
      for (auto& p : want)
        if (p >= 0) p = list[size_t(t) * cap + size_t(p)];
      const std::vector<int32_t> row(got.begin() + int64_t(t) * k,
                                     got.begin() + int64_t(t + 1) * k);
      ASSERT_EQ(row, want) << "row " << t;
    }
  }
}

// The candidate pool through the gathered block maxima (blocks of one) and the expansion, against
// cpu::candidate_mask's kept visible entries.
void check_pool(const std::vector<int>& vis, const std::vector<int>& width, int topk_blocks, int bs,
                uint32_t seed) {
  const Rows r = make_rows(vis, width, seed);
  const int T = r.T;
  for (int n_ranks : {2, 8}) {
    SCOPED_TRACE(::testing::Message()
                 << n_ranks << " ranks, " << topk_blocks << " blocks of " << bs);
    const int64_t align = std::lcm<int64_t>(4, bs);
    const int64_t nb = rank_position_range(r.stride, n_ranks, 0, align).len / bs;
    DeviceBuffer<float> score(r.score), bmax(size_t(T) * size_t(nb));
    DeviceBuffer<float> bgathered(size_t(T) * size_t(n_ranks) * size_t(nb));
    DeviceBuffer<int32_t> vis_d(r.vis), width_d(r.width), vis_l(static_cast<size_t>(T)),
        width_l(static_cast<size_t>(T)), vis_b(static_cast<size_t>(T)),
        width_b(static_cast<size_t>(T));
    bgathered.poison();
    for (int q = 0; q < n_ranks; ++q) {
      const PositionRange range = rank_position_range(r.stride, n_ranks, q, align);
      ASSERT_EQ(range.len / bs, nb);
      DeviceBuffer<float> local(size_t(T) * size_t(range.len));
      range_scores(r, score.get(), range, local);
      RangeRows rows;
      rows.vis = vis_l.get();
      rows.width = width_l.get();
      rows.block_size = bs;
      rows.vis_blocks = vis_b.get();
      rows.width_blocks = width_b.get();
      index_range_rows(vis_d.get(), width_d.get(), nullptr, T, range, 128, rows, nullptr);
      bmax.poison();
      index_block_max(local.get(), T, range.len, width_l.get(), bs, nb, bmax.get(), nullptr);
      UF_CUDA_CHECK(cudaMemcpy2D(bgathered.get() + size_t(q) * size_t(nb),
                                 size_t(n_ranks) * size_t(nb) * sizeof(float), bmax.get(),
                                 size_t(nb) * sizeof(float), size_t(nb) * sizeof(float), size_t(T),
                                 cudaMemcpyDeviceToDevice));
      sync_and_check();
    }
    const int mw = int(n_ranks * nb);
    DeviceBuffer<uint8_t> keep(size_t(T) * size_t(mw));
    DeviceBuffer<uint8_t> ws(
        std::max<size_t>(1, candidate_mask_workspace_bytes(T, mw, topk_blocks, 1)));
    DeviceBuffer<int32_t> blocks(size_t(T) * size_t(topk_blocks)), blocks_n(static_cast<size_t>(T));
    const int64_t cap = int64_t(topk_blocks) * bs;
    DeviceBuffer<int32_t> entries(size_t(T) * size_t(cap)), n(static_cast<size_t>(T));
    entries.poison();
    n.poison();
    const EntryListOut out{blocks.get(), blocks_n.get(), topk_blocks};
    ASSERT_TRUE(candidate_mask(bgathered.get(), T, mw, width_b.get(), vis_b.get(), topk_blocks, 1,
                               keep.get(), nullptr, ws.get(), &out));
    index_expand_blocks(blocks.get(), blocks_n.get(), topk_blocks, T, bs, vis_d.get(),
                        entries.get(), n.get(), cap, nullptr);
    sync_and_check();
    const auto got = entries.download();
    const auto got_n = n.download();
    for (int t = 0; t < T; ++t) {
      const int w = r.width[size_t(t)], v = r.vis[size_t(t)];
      std::vector<uint8_t> keep_cpu(size_t(std::max(w, 1)));
      if (w > 0)
        cpu::candidate_mask(r.score.data() + size_t(t) * size_t(r.stride), w, v, topk_blocks, bs,
                            keep_cpu.data());
      std::vector<int32_t> want;
      for (int i = 0; i < std::min(v, w); ++i)
        if (keep_cpu[size_t(i)]) want.push_back(i);
      ASSERT_EQ(got_n[size_t(t)], int(want.size())) << "row " << t;
      const std::vector<int32_t> row(got.begin() + int64_t(t) * cap,
                                     got.begin() + int64_t(t) * cap + int64_t(want.size()));
      ASSERT_EQ(row, want) << "row " << t;
    }
  }
}

TEST(IndexSplit, PoolFromGatheredBlockMaxima) {
  UF_REQUIRE_GPU();
  // The released model's pool (2048 blocks of 8) at 1M tokens (ratio 1 at the candidate source:
  // 1M entries would be 64 MB a row here; 300k keeps several rounds), a short row (every block
  // kept), an empty row, and a prefill-layout row.
  check_pool({300000, 20000, 0, 12345}, {300000, 20000, 0, 30000}, 2048, 8, 11);
  // Tiny pools with ties between block maxima.
  check_pool({500, 97, 1}, {512, 97, 1}, 8, 4, 12);
}

}  // namespace
}  // namespace uf::cuda::test
