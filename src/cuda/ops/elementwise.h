#pragma once
// Row-wise and elementwise ops of the forward on the device, each the device twin of a CPU
// reference function (named below): same formulas, same roundings, fp32 arithmetic. Reduction
// orders may differ from the CPU (tolerances in tests/cuda/test_ops_elementwise.cpp), but a row's
// result never depends on how many rows a call has (spec == plain).
// All pointers are device pointers; every launcher takes the stream last and never allocates.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/device_weights.h"

namespace uf::cuda {

// cpu::rms_norm (cpu/norm.h): y = bf16(x * rsqrt(mean(x^2) + eps) * weight). x, y: [T, n], may
// alias. weight: BF16 or F32 [n].
void rms_norm(const DeviceWeight& weight, float eps, const float* x, int T, int n, float* y,
              cudaStream_t stream);

// model::Rope::apply_many (model/rope.h) on T rows: row t holds `count` vectors of n channels;
// the last rope_dim channels of each are rotated by the angle fp32(pos_t) * freqs[i] (pos_t =
// p0 + t * stride; inverse = conjugate rotation) and rounded to bf16 as the CPU does.
// freqs: device [rope_dim / 2] (model::Rope::freqs()).
// positions (device [T], optional): row t's position is positions[t] instead of p0 + t * stride,
// so a captured CUDA graph can rotate rows at positions it reads when replayed.
void rope(const float* freqs, int rope_dim, float* v, int T, int count, int n, int64_t p0,
          int64_t stride, bool inverse, cudaStream_t stream, const int64_t* positions = nullptr);

// core/quant.h fake quantisation in place, per row of n values in blocks along the row:
//   fake_quant_fp8 (E4M3, UE8M0 power-of-two scale per `block`),
//   fake_quant_fp4_e4m3_scale (E2M1 with an E4M3 scale per `block`),
//   fake_quant_fp4_e8m0_scale (E2M1 with a UE8M0 scale per `block`).
void qdq_fp8(float* x, int64_t rows, int n, int block, cudaStream_t stream);
void qdq_fp4_e4m3_scale(float* x, int64_t rows, int n, int block, cudaStream_t stream);
void qdq_fp4_e8m0_scale(float* x, int64_t rows, int n, int block, cudaStream_t stream);
// x[i] = bf16(x[i]) (round to nearest even), n values.
void round_bf16(float* x, int64_t n, cudaStream_t stream);

// mHC (cpu/mhc.h). X: [T, hc, dim] stream. hc_mixes / hc_pre / hc_post take 1 <= hc <= 8.
struct HcShape {
  int hc = 0;
  int dim = 0;
  int sinkhorn_iters = 0;
  float norm_eps = 0;
  float hc_eps = 0;
};
// cpu::hc_mixes: pre [T, hc], post [T, hc], comb [T, hc, hc]. fn / scale / base as bound by
// model::bind_weights (hc_attn_fn, hc_attn_scale, hc_attn_base or the ffn ones).
// scratch: device, hc_mixes_scratch_floats(p, T) floats (the K-split partial sums).
void hc_mixes(const HcShape& p, const DeviceWeight& fn, const DeviceWeight& scale,
              const DeviceWeight& base, const float* X, int T, float* pre, float* post, float* comb,
              float* scratch, cudaStream_t stream);
size_t hc_mixes_scratch_floats(const HcShape& p, int T);
// cpu::hc_pre: y[T, dim] = bf16(sum_c pre[c] * X[c]).
void hc_pre(const HcShape& p, const float* X, const float* pre, int T, float* y,
            cudaStream_t stream);
// cpu::hc_post: out[T, hc, dim] = bf16(post[k] * x + sum_j comb[j,k] * R[j]); out may alias R
// (ops/mhc.cu: each thread loads its R[t, :, d] before writing out[t, :, d]). hc <= 8.
void hc_post(const HcShape& p, const float* x, const float* R, const float* post, const float* comb,
             int T, float* out, cudaStream_t stream);

// Fused mHC ops (ops/mhc.cu), bitwise the unfused ops above (tests/cuda/test_ops_mhc_fused.cpp):
// hc_mixes_partial: the first half of hc_mixes, the split-K partials of fn . X and of |X|^2 into
// `partial` (hc_mixes_scratch_floats(p, T) floats; the split is by channel, a function of
// (hc, dim) only).
void hc_mixes_partial(const HcShape& p, const DeviceWeight& fn, const float* X, int T,
                      float* partial, cudaStream_t stream);
// The second half of hc_mixes: pre / post / comb of T rows from their partials (one block per
// row; the Sinkhorn is ~40 dependent steps on one warp, ~2 us whatever T). Bitwise the pre / post
// / comb of hc_mixes and hc_mix_pre_norm. Nothing of the sublayer needs pre / post / comb before
// its hc_post_mixes, but running this on a forked graph branch beside hc_pre_norm + the sublayer
// (joined before hc_post_mixes) was measured slower, not faster (session 9, H200: +540 us a
// 1-row step): the joined kernel waits on another stream's event and loses its PDL early launch,
// which costs more than the 2 us of Sinkhorn it takes off the chain.
void hc_mixes_finish(const HcShape& p, const DeviceWeight& scale, const DeviceWeight& base,
                     const float* partial, int T, float* pre, float* post, float* comb,
                     cudaStream_t stream);
// hc_post (out must NOT overlap R: ping-pong the stream) and, when fn is not empty, the next
// sublayer's hc_mixes_partial(fn, out) computed from the values as they are written.
void hc_post_mixes(const HcShape& p, const float* x, const float* R, const float* post,
                   const float* comb, int T, float* out, const DeviceWeight& fn, float* partial,
                   cudaStream_t stream);
// The FFN output of a decode step before the MoE's combine: DeviceMoe::apply_partial_experts'
// slots [T, topk + 1, dim] fp32 (slot k < topk: expert ids[t, k]'s UNROUNDED w2 output, slot
// topk: the shared expert's) and ids [T, topk] int32 (the gate_i apply_partial_experts was
// given). topk <= 8; ids outside [0, n_experts) are skipped (their slots are never read).
struct MoeSlots {
  const float* slots = nullptr;
  const int32_t* ids = nullptr;
  int topk = 0;
  int n_experts = 0;
};
// hc_post_mixes with x = DeviceMoe::combine_experts(moe.slots, moe.ids) computed per element in
// the kernel (bf16(sum over the row's valid experts in ascending id (ties in k order), fp32 from
// 0, of bf16(slot) + bf16(shared slot)): that kernel's operations in its order), instead of read:
// bitwise combine_experts + hc_post_mixes (tests/cuda/test_mhc_combine_fold.cpp), one kernel
// less. At one GPU that is bitwise DeviceMoe::apply + hc_post_mixes (ops/moe.h). hc <= 4; any T;
// spec == plain; set_mhc_legacy_kernels / set_mhc_post_groups apply as to hc_post_mixes. out may
// overlap neither R nor the slots. The combine's output x is not written anywhere.
void hc_post_mixes_moe(const HcShape& p, const MoeSlots& moe, const float* R, const float* post,
                       const float* comb, int T, float* out, const DeviceWeight& fn, float* partial,
                       cudaStream_t stream);
// The rest of hc_mixes from `partial` (scale, base -> pre, post, comb; partial null: skipped)
// together with hc_pre(X, pre_in) and rms_norm(norm, eps) of the collapsed rows into y [T, dim].
// The collapse uses pre_in (the previous sublayer's pre), so pre must not overlap pre_in.
// dim <= 8192.
void hc_mix_pre_norm(const HcShape& p, const DeviceWeight& scale, const DeviceWeight& base,
                     const float* partial, const float* X, const float* pre_in,
                     const DeviceWeight& norm, float eps, int T, float* y, float* pre, float* post,
                     float* comb, cudaStream_t stream);
// hc_pre + rms_norm in one kernel (the head).
void hc_pre_norm(const HcShape& p, const float* X, const float* pre_in, const DeviceWeight& norm,
                 float eps, int T, float* y, cudaStream_t stream);
// Bench / test switch (host-side, read when a call launches or is captured): true launches the
// session-6 kernels of hc_post_mixes / hc_mixes_partial / hc_mixes / hc_mix_pre_norm (every
// output bitwise the same as the current kernels'), false (the default) the current ones.
void set_mhc_legacy_kernels(bool on);
// hc_post_mixes / hc_mixes_partial (hc <= 4): the warp groups a block spreads its 8 rows over, 4
// (512 threads at hc 4) or 2 (256, the default: faster on the H200); the same outputs either way.
void set_mhc_post_groups(int groups);

// CpuModel::embed: X[t, c, :] = embed row of ids[t] (dequantised, any weight format) for every
// copy c < hc; pre_mix[t, c] = (c == 0). ids: device [T], already range-checked by the caller.
void embed_rows(const DeviceWeight& table, const int32_t* ids, int T, int hc, float* X,
                float* pre_mix, cudaStream_t stream);

// DSpark tap (CpuModel::run_layers): out[t * out_stride + d] = bf16(sum_c X[t, c, d] / hc).
void tap_mean(const float* X, int T, int hc, int dim, float* out, int64_t out_stride,
              cudaStream_t stream);

// cpu::compress_pool for n_groups groups: group g pools rows kv[g * r + i], gate[g * r + i]
// (i < r, oldest first; device arrays of device row pointers, hd floats each) into out[g, hd]
// (fp32, no rounding: the caller rounds).
void compress_pool(const float* const* kv, const float* const* gate, int n_groups, int r, int hd,
                   float* out, cudaStream_t stream);

// ---- Fused row chains (ops/fused_rows.cu): several short sequences of the ops above in ONE
// launch, each chain bitwise the unfused sequence (tests/cuda/test_fused_rows.cpp): every stage
// uses the op's own per-element formulas (elementwise_common.cuh), rms_norm its row partition,
// and the stages of a row run in order in one block (in place on y, a barrier between stages).
// A chain of `rows` rows of n floats at y (row stride n); the stages that are set run in this
// order:
//   1. pool: y = compress_pool(pool_kv, pool_gate, rows, pool_r, n), then round_bf16 if
//      pool_round (pool_kv null: y holds the rows already);
//   2. scale_round: y = bf16(y * scale) (backend_kernels.h scale_round_bf16);
//   3. norm (not empty): rms_norm(norm, eps) in place (n <= kRowChainMaxNorm);
//   4. rope (freqs set): rope(freqs, rope_dim, y, rows, count, n / count, p0, stride, inverse,
//      positions): `count` vectors of n / count channels per row;
//   5. qdq (not kNone): qdq_fp8 / qdq_fp4_e4m3_scale / qdq_fp4_e8m0_scale(y, rows, n, qdq_block);
//   6. copy (copy_dst set): copy_rows_to(y, rows, n, copy_n, copy_dst) (backend_kernels.h); with
//      copy_dst_bf16 instead, the same rows as bf16 (round to nearest even: exact for the QDQ
//      values the session stores this way, cuda_session.h);
//   7. ring (ring set): put_ring_rows(y, rows, n, ring_pos, ring, ring_slots);
//   8. y_bf16 (set): every row as bf16 to y_bf16 [rows, n] as well (a plain device pointer).
// Chains must not overlap one another's rows or destinations, and no chain may read what another
// writes (the blocks of one launch run in any order); a chain reading ring rows that another
// chain's ring stage writes needs the caller's argument that the slots differ.
enum class QdqKind { kNone, kFp8, kFp4E4m3, kFp4E8m0 };
struct RowChain {
  int rows = 0;
  int n = 0;
  float* y = nullptr;
  const float* const* pool_kv = nullptr;
  const float* const* pool_gate = nullptr;
  int pool_r = 0;
  bool pool_round = false;
  bool scale_round = false;
  float scale = 1.f;
  DeviceWeight norm;
  float eps = 0.f;
  const float* freqs = nullptr;
  int rope_dim = 0;
  int count = 1;
  int64_t p0 = 0;
  int64_t stride = 1;
  bool inverse = false;
  const int64_t* positions = nullptr;
  QdqKind qdq = QdqKind::kNone;
  int qdq_block = 0;
  const int32_t* copy_n = nullptr;
  float* const* copy_dst = nullptr;
  uint16_t* const* copy_dst_bf16 = nullptr;
  const int64_t* ring_pos = nullptr;
  float* const* ring = nullptr;
  int ring_slots = 0;
  uint16_t* y_bf16 = nullptr;
};
// build_window_slots (backend_kernels.h) as a job of the same launch.
struct WindowSlotsJob {
  const int64_t* pos = nullptr;
  const int64_t* p0 = nullptr;
  int T = 0;
  int W = 0;
  const float* const* ring = nullptr;
  int ring_slots = 0;
  const float* local = nullptr;
  int hd = 0;
  const float** out = nullptr;
};
constexpr int kMaxRowChains = 4;
constexpr int kRowChainMaxNorm = 4096;  // the longest row a chain's norm stage takes
// Up to kMaxRowChains chains (and optionally the window slots) in one launch (PDL: it waits for
// the previous kernel before touching any activation). Read BEFORE that wait (and the next
// kernel may start then): norm weights, rope frequencies, and the positions, pointer cells
// (copy_dst, ring, WindowSlotsJob's p0 / ring) and copy_n, so no kernel of the same stream may
// write those: the span programs' blocks are filled by the copy at the program's head.
void row_chains(const RowChain* chains, int n_chains, const WindowSlotsJob* slots,
                cudaStream_t stream);

}  // namespace uf::cuda
