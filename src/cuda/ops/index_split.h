#pragma once
// The indexer split by ENTRIES (tensor parallelism, CudaModel::index_select_split): every rank
// scores one contiguous range of a row's positions with all index heads, selects that range's
// best k, and the ranks' (score, entry) pairs are gathered and merged by one more selection.
// Every global top-k entry is among its own range's best k (the same tie rule: lower entry), and
// the merged list is in ascending entry order (ranges ascend with the rank, each rank's picks
// ascend), so the merge's selection is one GPU's bit for bit. The candidate pool's blocks work
// the same way through their maxima: a rank's range starts on a block boundary, so each block's
// maximum is computed whole on one rank; the gathered maxima go through candidate_mask with
// blocks of one, and the kept blocks expand into the pool's entry list.
//
// None of these ops communicates; the backend gathers between them. No allocation, no host sync:
// graph-capturable. Every op is PDL-launched and waits before reading.

#include <cuda_runtime.h>

#include <cstdint>

#include "model/tp_plan.h"

namespace uf::cuda {

// A row's positions on this rank, and rank r of n's range (model/tp_plan.h: host arithmetic the
// collective count of model/synthetic.h shares).
using model::PositionRange;
using model::rank_position_range;

// Row t's view of the range: vis_l[t] = clamp(vis[t] - begin, 0, len), width_l likewise; keys_l
// (optional, with keys) = keys[t] + begin * head_dim. Blocks (optional, block_size > 0): vis_b[t]
// = ceil(vis[t] / block_size) and width_b[t] = ceil(width[t] / block_size), the whole row's block
// counts (candidate_mask's vis / width over the block maxima).
struct RangeRows {
  int32_t* vis = nullptr;
  int32_t* width = nullptr;
  const uint16_t** keys = nullptr;
  int block_size = 0;
  int32_t* vis_blocks = nullptr;
  int32_t* width_blocks = nullptr;
};
void index_range_rows(const int32_t* vis, const int32_t* width, const uint16_t* const* keys, int T,
                      PositionRange range, int head_dim, const RangeRows& out, cudaStream_t stream);

// The pairs a rank contributes: for row t and slot j < k, sel[t, j] = p (a range position from
// topk_select, or -1) becomes pairs[t, 2j .. 2j+1] = (score[t * stride + p], entry) with entry =
// map[t * map_cap + begin + p] (a list, map non-null) or begin + p; -1 gives (-inf, -1). The
// entry's int32 bits are stored in the float slot (copied, never computed on).
void index_pack_selection(const int32_t* sel, int T, int k, const float* score, int64_t stride,
                          int64_t begin, const int32_t* map, int64_t map_cap, float* pairs,
                          cudaStream_t stream);

// The merge's list: rank q's pairs of row t at gathered + t * row_stride + q * rank_stride (2k
// floats, rank_position_range order) become, without the -1 entries and in order, score[t, j] and
// entries[t, j] (j < n[t] <= n_ranks * k; rows of `cap`). Then topk_select(score, T, cap, n, k,
// n, out, ..., entries, cap) is one GPU's selection.
void index_merge_pairs(const float* gathered, int T, int n_ranks, int k, int64_t row_stride,
                       int64_t rank_stride, float* score, int32_t* entries, int32_t* n, int64_t cap,
                       cudaStream_t stream);

// cpu::candidate_mask's block maxima over a range: bmax[t, b] = max of score[t, i] for i in
// [b * block_size, min((b + 1) * block_size, width[t])) (rows of `stride`), -inf when empty, for
// b < n_blocks (rows of n_blocks).
void index_block_max(const float* score, int T, int64_t stride, const int32_t* width,
                     int block_size, int64_t n_blocks, float* bmax, cudaStream_t stream);

// candidate_mask's entry list from its kept-block list (candidate_mask over the block maxima with
// blocks of one: blocks[t, s] for s < n_blocks[t], rows of block_cap, -1 where not kept): slot s
// fills entries[t, s * block_size ...] with the block's visible entries (< vis[t]), -1 elsewhere,
// as candidate_mask's own list does; n[t] ends at the newest visible entry (its block is pinned
// and the last in the list).
void index_expand_blocks(const int32_t* blocks, const int32_t* n_blocks, int64_t block_cap, int T,
                         int block_size, const int32_t* vis, int32_t* entries, int32_t* n,
                         int64_t cap, cudaStream_t stream);

}  // namespace uf::cuda
