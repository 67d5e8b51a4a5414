#pragma once
// Sparse attention and the indexer on the device: device twins of cpu/attention.h and
// cpu/indexer.h (same formulas, roundings, slot order and tie rules). A row's result never
// depends on the other rows of the call (spec == plain). Device pointers; stream last; no
// allocation inside (scratch comes from the caller where noted).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace uf::cuda {

// cpu::sparse_attn_row for T rows. Row t's slot list is its n_window window slots
// window[t * n_window + j] (device pointers to hd floats, nullptr = empty), followed by its k
// compressed slots topk[t * k + j] (entry ids into ckv [entries, hd], bf16 bits: the session's
// compressed KV, FP4 QDQ values that bf16 holds exactly; -1 = empty; topk may be null when
// k == 0). Slots are visited in blocks of 64 in list order exactly as the CPU does.
// q: [T, H, hd]; sink: [H]; out: [T, H, hd] (bf16 values). hd <= 1024.
// Trailing empty slots change nothing (an all-empty block of 64 leaves the running max, sum and
// accumulator bitwise unchanged), so a top-k row of k slots padded with -1 gives exactly the
// CPU result for its min(k, width) list. Matches the CPU bitwise except where glibc expf and the
// kernel's correctly rounded exp differ (rare; <= 1 bf16 ulp).
// ckv_ref (optional, device): where to read the ckv base pointer when the kernel runs, for CUDA
// graphs replayed against different sessions (ckv is then ignored).
// split_scratch (optional, device, sparse_attn_scratch_floats(T, H, hd, n) floats for any
// n >= n_window + k, 16-byte aligned; no initial contents needed): the fast chunked path (every
// span of CudaModel::attend but prefill spans on sparse_attn_mma): a record per (chunk of 16
// slots, row, head) and a merge in chunk order, all launched with PDL. The records come from
//  - by default (hd % 16 == 0, hd <= 512): one kernel on the tensor cores per (chunk, row, 8
//    heads) (ops/attention_chunk_mma.cu): bf16 mma.sync products (exact for the model's bf16 q
//    and FP8 / FP4 QDQ KV values), each chunk's p rounded to bf16 against its own max. Within
//    1 bf16 ulp + 2^-8 of the p-weighted mean |v| of the CPU (the bound sparse_attn_mma's tests
//    state);
//  - otherwise, or with set_sparse_attn_chunk_mma(false): a scores kernel (the CPU's s_j bits)
//    and a P.V kernel that rounds p to bf16 against the CPU's running max of the chunk's 64-slot
//    block (the CPU's bf16(p) exactly) (ops/attention.cu): the CPU's result up to fp32
//    re-association of the sums (a rare bf16 ulp, tests/cuda/test_ops_attention.cpp).
// Either way every order depends on the slot count and hd only, never on T (spec == plain).
// hd % 4 != 0, unaligned q / out, or a rope whose rotated channels do not start on a float4 take
// the reference path.
// rope (optional): the attention's rotary embedding, bitwise rope(freqs, rope_dim, q, T, H, hd,
// p0, 1, false, positions) on q before and rope(..., out, ..., inverse = true, ...) on the result
// after: q's rotated channels are rotated as q is staged (q in memory stays as given), the
// output's rotated back in the split path's merge; the reference path rotates q's shared-memory
// copy and runs the inverse rope() after. (Two launches fewer on the decode step's chain.)
struct AttnRope {
  const float* freqs = nullptr;  // device [rope_dim / 2]; null: no rope
  int rope_dim = 0;
  int64_t p0 = 0;
  const int64_t* positions = nullptr;  // device [T], optional: row t at positions[t], else p0 + t
};
void sparse_attn(const float* q, int T, int H, int hd, const float* const* window, int n_window,
                 const int32_t* topk, int k, const uint16_t* ckv, const float* sink, float scale,
                 float* out, cudaStream_t stream, const uint16_t* const* ckv_ref = nullptr,
                 float* split_scratch = nullptr, const AttnRope& rope = {});
size_t sparse_attn_scratch_floats(int T, int H, int hd, int n_slots);

// sparse_attn for prefill spans on the tensor cores (ops/attention_mma.cu): the same inputs,
// slot order, 64-slot softmax blocks, sink and rope as sparse_attn, both products as bf16
// mma.sync with fp32 accumulation (q split into bf16 hi + lo; KV rows converted to bf16, exact
// for the model's FP8 / FP4 QDQ values). Not the CPU's bits: each p_j and sum is re-associated
// (tests/cuda/test_ops_attention.cpp states the bound), so decode rows never use it (spec ==
// plain holds between the verify rows and plain decoding, which both take sparse_attn). A row's
// result depends on its own inputs only, and is the same at any T. No scratch. Returns false,
// launching nothing, where it does not apply (hd % 32 != 0, hd > 512, q or out not 16-byte
// aligned, an empty slot list, an odd rope offset): the caller then runs sparse_attn.
bool sparse_attn_mma(const float* q, int T, int H, int hd, const float* const* window, int n_window,
                     const int32_t* topk, int k, const uint16_t* ckv, const float* sink,
                     float scale, float* out, cudaStream_t stream,
                     const uint16_t* const* ckv_ref = nullptr, const AttnRope& rope = {});
// Benchmarks only (not thread-safe): 16 or 32 makes every later chunked call use chunks of that
// many slots on the CPU-order kernels; 0 restores the default (16).
void sparse_attn_chunk_override(int slots);
// Tests only (not thread-safe): 1, 2, 4 or 8 heads a CTA for the tensor-core chunk records
// (attn_split::chunk_mma_heads picks by the grid's size); 0 restores the rule.
void sparse_attn_chunk_heads_override(int heads);
// The split path's chunk records: true (default) = the tensor-core kernel where it applies,
// false = the CPU-order scores + P.V kernels. Process-wide, for tests and benchmarks (decode
// rows and the CPU comparison: tests/cuda/test_ops_attention.cpp); not thread-safe.
void set_sparse_attn_chunk_mma(bool on);

// cpu::index_scores_row for T rows: score[t, i] for i < width[t] (i >= vis[t]: -inf); entries
// width[t] <= i < max_width are left untouched. q: [T, n_heads, head_dim] (FP4 QDQ values),
// w: [T, n_heads] (bf16 values), keys[t]: device pointer to row t's key bank [>= vis[t],
// head_dim]; vis, width: device [T]. Bitwise equal to the CPU (same summation order, no FMA).
// round_sum = false: the tensor-parallel partial (backend_kernels.h index_scores_partial): the
// head sum is left unrounded. Limits: T <= 65535, head_dim <= 160. head_dim 128: the tensor-core
// kernel (set_index_scores_mma below) or the fp32 one (keys in registers, shared by up to 8 rows).
void index_scores(const float* q, const float* w, int T, int n_heads, int head_dim,
                  const uint16_t* const* keys, const int32_t* vis, const int32_t* width,
                  int max_width, float* score, cudaStream_t stream, bool round_sum = true);
// index_scores' head_dim-128 kernel: true (default) = the tensor cores (bf16 mma.sync; bitwise
// the CPU when every dot product is exact in fp32, as for the model's FP4 QDQ operands:
// ops/index_scores_mma.cu), false = the fp32 kernel in the CPU's summation order (bitwise for any
// bf16 operands). Process-wide, for tests and benchmarks; not thread-safe.
void set_index_scores_mma(bool on);

// Candidate-restricted layers, scored on the candidate pool only (not on every visible entry and
// then masked): entry j of row t is entries[t * cap + j], j < n[t], ascending, the kept visible
// entries of the candidate source's pool (candidate_mask's list output). An entry of -1 (a gap:
// never written by the model, whose visible scores are finite) scores -inf.
struct EntryList {
  const int32_t* entries = nullptr;  // device [T, cap]
  const int32_t* n = nullptr;        // device [T]
  int64_t cap = 0;
};
// index_scores on a list: score[t, j] = index_scores' score of entry entries[t, j] (bitwise: the
// same per-entry arithmetic) for j < n[t]; the rest of the row [n[t], cap) is left untouched.
// score: [T, list.cap]. head_dim 128 only (the model's index head dim).
void index_scores_list(const float* q, const float* w, int T, int n_heads, int head_dim,
                       const uint16_t* const* keys, const EntryList& list, float* score,
                       cudaStream_t stream, bool round_sum = true);

// cpu::candidate_mask per row (row t: score[t, 0..width[t]), compress_len = vis[t]) into
// keep[t, 0..width[t]). Rows with width 0 are skipped. Exact (ties: lower block).
// workspace: device scratch of candidate_mask_workspace_bytes(T, max_width, topk_blocks,
// block_size) bytes (0: none needed), allocated by the caller; with it, a row is split over many
// CTAs (selection rounds, ops/indexer.cu); without it where one is needed: one CTA per row.
// No allocation, no host sync: graph-capturable.
size_t candidate_mask_workspace_bytes(int T, int max_width, int topk_blocks, int block_size);
// list (optional): also the row's kept visible entries, ascending, into list->entries [T,
// list->cap] and their count into list->n (cap >= topk_blocks * block_size, or >= max_width).
// Returns whether the list was written: only the selection rounds write it (a workspace where one
// is needed, topk_blocks <= 4096); the one-CTA-per-row fallback returns false (keep alone).
struct EntryListOut {
  int32_t* entries = nullptr;  // device [T, cap]
  int32_t* n = nullptr;        // device [T]
  int64_t cap = 0;
};
bool candidate_mask(const float* score, int T, int max_width, const int32_t* width,
                    const int32_t* vis, int topk_blocks, int block_size, uint8_t* keep,
                    cudaStream_t stream, void* workspace = nullptr,
                    const EntryListOut* list = nullptr);

// Candidate-restricted layers: score[t, i] = -inf where keep[t, i] == 0, i < width[t].
// T <= 65535.
void mask_scores(float* score, const uint8_t* keep, int T, int max_width, const int32_t* width,
                 cudaStream_t stream);

// cpu::topk_select per row: the min(k, width[t]) best of score[t, 0..width[t]) (ties: lower
// position), ascending, positions >= vis[t] become -1 (sorting last), written to out[t, 0..k);
// slots past min(k, width[t]) are -1. Rows with width 0 get all -1. Exact with the tie rule.
// workspace: device scratch of topk_select_workspace_bytes(T, max_width, k) bytes (0: none
// needed, max_width <= 16384), allocated by the caller: rows are split over many CTAs
// (selection rounds, ops/indexer.cu); without it where one is needed: one CTA per row (slow at
// long context). No allocation, no host sync: graph-capturable. The same workspace may serve
// candidate_mask and topk_select on one stream (size it for the larger).
size_t topk_select_workspace_bytes(int T, int max_width, int k);
// index_map (optional, device [T, map_cap]): the selected position p of row t is written as
// index_map[t * map_cap + p] (a list's entries: topk over index_scores_list's scores, with width =
// vis = the list's n). Needs the selection rounds (max_width <= 16384, or a workspace).
void topk_select(const float* score, int T, int max_width, const int32_t* width, int k,
                 const int32_t* vis, int32_t* out, cudaStream_t stream, void* workspace = nullptr,
                 const int32_t* index_map = nullptr, int64_t map_cap = 0);

}  // namespace uf::cuda
