#pragma once
// Sparse single-KV-head attention with a per-head sink (the reference's sparse_attn): the slots of
// one query row are visited in blocks of 64 in list order with an online softmax; probabilities are
// rounded to bf16 before P.V (relative to the running max), the denominator stays fp32, the sink
// joins the denominator only, and the running max starts at -1e30 so an all-empty row gives 0.

namespace uf::cpu {

inline constexpr int kAttnBlock = 64;

// q: [H, hd]; kv[i]: the i-th slot's vector (hd values) or nullptr for an empty slot (-1).
// out: [H, hd], bf16 values.
void sparse_attn_row(const float* q, int H, int hd, const float* const* kv, int n_slots,
                     const float* sink, float scale, float* out);

}  // namespace uf::cpu
