#pragma once
// The sparse indexer (model-arch.md §4.4.3): bf16 index scores, the candidate-block pool of the
// candidate-source layer and the top-k selection. Selections among exactly equal scores are
// implementation-defined in the reference (torch.topk); here the lower position wins, always.

#include <cstdint>
#include <vector>

namespace uf::cpu {

// score[t] = bf16(sum_h bf16(relu(bf16(q_h . k_t)) * w_h)) for t < n_visible, -inf for
// n_visible <= t < width. q: [n_heads, head_dim] (FP4 QDQ values), w: [n_heads] (bf16 values),
// keys: [>= n_visible, head_dim].
void index_scores_row(const float* q, const float* w, int n_heads, int head_dim, const float* keys,
                      int n_visible, int width, float* score);

// Level one: block score = max over block_size positions; the block holding position
// compress_len - 1 is pinned in; the best topk_blocks blocks with a finite score are kept.
// keep[width] is 1 inside kept blocks.
void candidate_mask(const float* score, int width, int compress_len, int topk_blocks,
                    int block_size, uint8_t* keep);

// The k best positions by score (ties: lower position first), sorted ascending; positions
// >= compress_len become -1 (they sort last). out has k entries.
void topk_select(const float* score, int width, int k, int compress_len, int32_t* out);

}  // namespace uf::cpu
