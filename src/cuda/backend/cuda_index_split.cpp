// The indexer under tensor parallelism, split by entries (CudaModelOptions::
// tp_index_split_entries; the ops and why the merge is exact: ops/index_split.h).
//
// Per index layer, on every rank, in the same order (the P2P gathers need the same calls):
//   1. the rank's range of the row's positions (block-aligned for the candidate pool's maxima):
//      index_range_rows narrows vis / width (and shifts the key pointers) to it;
//   2. index_scores over the range with every index head (the whole indexer is replicated), or
//      index_scores_list over the range of the candidate pool's list (Reindex layers);
//   3. candidate source only: the range's block maxima, gathered into whole rows, candidate_mask
//      over them with blocks of one, and the kept blocks expanded into the pool's entry list;
//   4. topk_select over the range, the picks packed as (score, entry) pairs, gathered
//      (T x tp x 2k floats), merged into one ascending list and selected once more.
// Against the head split this moves T x tp x top-k pairs instead of summing T x entries scores
// (at 1M tokens, 250k floats a row per index layer), and every selection is one GPU's bit for bit.
// At tp = 1 with CudaModelOptions::index_split_simulated_ranks (tests) the ranks' parts run in
// turn on the one GPU, each "gather" a copy of its block into the rows' columns.
// Small calls (rows x positions under CudaModelOptions::index_split_min_work) skip all this:
// every rank holds every index head, so it scores the whole rows as one GPU does, and the
// selections are the same as the merge's (exact either way).
#include <algorithm>

#include "core/error.h"
#include "cuda/backend/cuda_model.h"
#include "cuda/backend/model_internal.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/index_split.h"
#include "cuda/tp/nccl_comm.h"

namespace uf::cuda {

namespace {

template <typename T>
T* device_alloc(size_t n) {
  T* p = nullptr;
  UF_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

}  // namespace

void CudaModel::free_index_split() {
  auto& s = isplit_;
  for (void* p :
       {static_cast<void*>(s.vis), static_cast<void*>(s.width), static_cast<void*>(s.vis_blocks),
        static_cast<void*>(s.width_blocks), static_cast<void*>(s.keys), static_cast<void*>(s.sel),
        static_cast<void*>(s.pairs), static_cast<void*>(s.gathered),
        static_cast<void*>(s.merge_score), static_cast<void*>(s.merge_entries),
        static_cast<void*>(s.merge_n), static_cast<void*>(s.bmax), static_cast<void*>(s.bgathered),
        static_cast<void*>(s.bkeep), static_cast<void*>(s.blocks), static_cast<void*>(s.blocks_n)})
    if (p) cudaFree(p);
  s = IndexSplitScratch{};
}

void CudaModel::alloc_index_split(int64_t width) {
  free_index_split();
  auto& s = isplit_;
  const size_t T = size_t(tmax_), k = size_t(cfg_.index_topk), N = size_t(split_ranks_);
  s.vis = device_alloc<int32_t>(T);
  s.width = device_alloc<int32_t>(T);
  s.vis_blocks = device_alloc<int32_t>(T);
  s.width_blocks = device_alloc<int32_t>(T);
  s.keys = device_alloc<const uint16_t*>(T);
  s.sel = device_alloc<int32_t>(T * k);
  s.pairs = device_alloc<float>(T * 2 * k);
  s.gathered = device_alloc<float>(T * N * 2 * k);
  s.merge_score = device_alloc<float>(T * N * k);
  s.merge_entries = device_alloc<int32_t>(T * N * k);
  s.merge_n = device_alloc<int32_t>(T);
  size_t nccl_scratch = T * 2 * k;  // gather_columns without P2P: [tp, rows, cols]
  if (cfg_.candidate_source_layer >= 0) {
    const int64_t bs = std::max(cfg_.candidate_block_size, 1);
    s.split_blocks =
        rank_position_range(width, split_ranks_, 0, model::index_split_align(cfg_)).len / bs;
    const size_t nb = size_t(s.split_blocks), tb = size_t(cfg_.candidate_topk_blocks);
    s.bmax = device_alloc<float>(T * nb);
    s.bgathered = device_alloc<float>(T * N * nb);
    UF_CUDA_CHECK(cudaMalloc(&s.bkeep, std::max<size_t>(T * N * nb, 1)));
    s.blocks = device_alloc<int32_t>(T * tb);
    s.blocks_n = device_alloc<int32_t>(T);
    nccl_scratch = std::max(nccl_scratch, T * nb);
  }
  if (tp_ > 1 && (!group_->peer_all_reduce() || !opts_.tp_p2p_allreduce || opts_.tp_ordered_sum))
    ensure_gather(nccl_scratch);
}

bool CudaModel::index_split_pays(int l, int T, int stride) const {
  if (!index_split_) return false;
  const auto& role = cfg_.role(l);
  const bool listed = role.candidate_restricted && cfg_.candidate_source_layer >= 0;
  // The split scores a pool only as its list; a source that ran whole rows may have left a mask.
  if (listed && !cand_listed_) return false;
  // A pool holds no more of a row's entries than the stride has columns (a graph step's width
  // bucket): a short context's list is short whatever its capacity.
  const int64_t positions = listed ? std::min<int64_t>(cand_cap_, stride) : int64_t(stride);
  return int64_t(T) * positions >= opts_.index_split_min_work;
}

void CudaModel::index_select_split(int l, int T, const uint16_t* const* keys, const int32_t* vis,
                                   const int32_t* width, int stride) {
  const auto& role = cfg_.role(l);
  const int ihd = cfg_.index_head_dim, k = cfg_.index_topk, N = split_ranks_;
  auto& s = isplit_;
  const bool listed = role.candidate_restricted && cfg_.candidate_source_layer >= 0;
  const int64_t bs = std::max(cfg_.candidate_block_size, 1);
  // A full row's ranges (the candidate source's hold whole blocks), or the pool list's.
  const int64_t positions = listed ? cand_cap_ : int64_t(stride);
  const int64_t align = listed ? 4 : model::index_split_align(cfg_);
  const int64_t len = rank_position_range(positions, N, 0, align).len;
  const int64_t nb = role.candidate_source ? len / bs : 0;
  UF_CHECK(len <= std::max(index_width_, cand_cap_) && nb <= s.split_blocks,
           "layer {}: a rank's {} index positions ({} blocks) exceed the scratch's", l, len, nb);
  UF_CHECK(!listed || cand_listed_,
           "layer {}: the entry-split indexer needs the candidate source's list (it runs first)",
           l);
  const size_t pair_cols = 2 * size_t(k);
  // Rank q's [T, cols] block into columns [q * cols, (q + 1) * cols) of every rank's rows: the
  // gather under TP; one GPU standing in for N ranks copies its own block.
  auto gather = [&](int q, const float* src, size_t cols, float* dst) {
    if (tp_ > 1) {
      gather_columns(src, size_t(T), cols, dst, size_t(N) * cols, gather_);
      return;
    }
    UF_CUDA_CHECK(cudaMemcpy2DAsync(dst + size_t(q) * cols, size_t(N) * cols * sizeof(float), src,
                                    cols * sizeof(float), cols * sizeof(float), size_t(T),
                                    cudaMemcpyDeviceToDevice, stream_));
  };
  // Rank q's part: its range's scores (and block maxima), its best k as (score, entry) pairs.
  auto rank_part = [&](int q) {
    const PositionRange range = rank_position_range(positions, N, q, align);
    RangeRows rows;
    rows.vis = s.vis;
    rows.width = s.width;
    int64_t score_stride = range.len;
    if (listed) {
      index_range_rows(cand_n_, cand_n_, nullptr, T, range, ihd, rows, stream_);
      const EntryList list{cand_list_ + range.begin, s.vis, cand_cap_};
      index_scores_list(iq_, iw_, T, Hi_, ihd, keys, list, score_, stream_);
      score_stride = cand_cap_;
    } else {
      rows.keys = s.keys;
      if (role.candidate_source) {
        rows.block_size = int(bs);
        rows.vis_blocks = s.vis_blocks;
        rows.width_blocks = s.width_blocks;
      }
      index_range_rows(vis, width, keys, T, range, ihd, rows, stream_);
      index_scores(iq_, iw_, T, Hi_, ihd, s.keys, s.vis, s.width, int(range.len), score_, stream_);
      if (role.candidate_source) {  // each block lies in one rank's range
        index_block_max(score_, T, range.len, s.width, int(bs), nb, s.bmax, stream_);
        gather(q, s.bmax, size_t(nb), s.bgathered);
      }
    }
    topk_select(score_, T, int(score_stride), s.width, k, s.vis, s.sel, stream_, index_ws_);
    index_pack_selection(s.sel, T, k, score_, score_stride, range.begin,
                         listed ? cand_list_ : nullptr, cand_cap_, s.pairs, stream_);
    gather(q, s.pairs, pair_cols, s.gathered);
  };
  if (tp_ > 1) {
    rank_part(rank_);
  } else {
    for (int q = 0; q < N; ++q) rank_part(q);  // in turn: each reuses the score scratch
  }
  if (role.candidate_source) {
    // The pool from the whole rows' block maxima, as candidate_mask's list of kept entries.
    const int tb = cfg_.candidate_topk_blocks;
    const EntryListOut blocks{s.blocks, s.blocks_n, tb};
    const bool listed_blocks =
        candidate_mask(s.bgathered, T, int(N * nb), s.width_blocks, s.vis_blocks, tb, 1, s.bkeep,
                       stream_, index_ws_, &blocks);
    UF_CHECK(listed_blocks, "layer {}: candidate_mask over the block maxima wrote no list", l);
    index_expand_blocks(s.blocks, s.blocks_n, tb, T, int(bs), vis, cand_list_, cand_n_, cand_cap_,
                        stream_);
    cand_listed_ = true;
  }
  // Every rank's picks in rank order (ascending entries), selected once more.
  const int64_t cap = int64_t(N) * k;
  index_merge_pairs(s.gathered, T, N, k, cap * 2, int64_t(pair_cols), s.merge_score,
                    s.merge_entries, s.merge_n, cap, stream_);
  topk_select(s.merge_score, T, int(cap), s.merge_n, k, s.merge_n, topk_[size_t(l)], stream_,
              index_ws_, s.merge_entries, cap);
}

}  // namespace uf::cuda
