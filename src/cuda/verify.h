#pragma once
// Speculative-decoding verification on the device: a port of src/sampling/verify.{h,cpp}
// (token-wise and block verification, Sun et al. 2024) and of the transform it needs
// (src/sampling/transform.h: temperature incl. greedy, top-k, top-p), so that from the raw logits
// rows on the device it computes what the CPU path of src/engine/generation_loop.cpp computes:
//   p_i = logits_to_probs(target_logits_i), q_i = logits_to_probs(draft_logits_i),
//   r = sampling::verify(mode, {g, V, p, q, tokens}, make_verify_draws(seed, step)).
// Kernels: src/cuda/kernels/verify.cu (verification, entry points), verify_cluster.cu (the cluster
// transform), verify_transform.cu (the single-CTA transform), verify_select.cuh (their radix
// top-k / top-p steps), verify_common.cuh. Tests: tests/cuda/test_verify.cpp.
//
// Exactness. Everything after exp() follows the CPU's operation order bit for bit:
//   - sums use the fixed order of sampling/row_ops.h (256 lanes of contiguous chunks, each lane
//     in index order, then the pairwise tree stride 128..1, the shared-memory tree of a block);
//   - inverse-CDF draws walk the lane sums then one chunk in index order on one thread;
//   - the top-k cut is the k-th largest value (radix select over the float bits, exact); the
//     top-p cut works on sampling/top_p_mass.h's integer masses, exact in any order: a radix
//     select over the float bits weighted by mass (three 10-bit passes, no sort);
//   - products that the CPU rounds before a subtraction (w * p(x) - q(x)) use __fmul_rn, so nvcc
//     cannot contract them into an FMA;
//   - the draws are make_verify_draws(seed, step) of sampling/rng.h (integer Philox, exact
//     uniform conversion), evaluated on the device from {seed, step} in device memory.
// The one step that is not bit-identical by construction is exp(): the CPU calls glibc's expf,
// the device evaluates exp in double and rounds to float (the correctly rounded value but for
// ~2^-28 of arguments; test DeviceExpMatchesHostDoubleExp counts them over all arguments).
// glibc's expf is not correctly rounded for ~6e-4 of the arguments in [-128, -2^-7] (exhaustive
// host check over all negative floats: 97,052 of 2^31 differ by 1 ulp from float(exp(double))),
// so on raw logits the device p, q rows differ from the CPU's by 1 ulp in about that fraction of
// entries, and tau / the extra token can then (rarely) differ. Given the same p, q rows, tau, the
// extra token and all diagnostics are bitwise the CPU's. If the CPU transform used
// float(std::exp(double(z))) as well, the two paths would agree on the rows too.
//
// Layout: each row of the transform (2g + 1 rows) over the 16 CTAs (8 where a 16-CTA cluster
// cannot be resident) of a thread-block cluster, 1024 threads each: CTA r owns row_ops.h's lanes
// [r 256/C, (r + 1) 256/C) (a contiguous slice, kept in shared memory), order-free reductions
// through distributed shared memory, each lane's sum in one thread, the 256-lane tree in every
// CTA (same bits), the top-p digit masses summed over the cluster and the digit chosen in every
// CTA; a vocab whose slice exceeds 128 KiB falls back to one 1024-thread block per row. Then one
// 256-thread block for the verification. No allocation inside the calls (the plan owns the
// probability rows); seed and step are read from device memory at run time, so the calls are
// graph-capturable (one graph per (g, mode, params), as those are launch arguments). Top-p costs
// the same few passes whatever the nucleus (a flat row's ~120k tokens or a peaked row's few).
// bench/bench_cuda_verify.cpp times the cluster kernels against the single-CTA ones.

#include <cuda_runtime.h>

#include <cstdint>

#include "sampling/rng.h"
#include "sampling/top_p_mass.h"
#include "sampling/transform.h"
#include "sampling/verify.h"

namespace uf::cuda {

// The probability rows of one verification at a time, sized once for max_vocab (the real vocab,
// 129280; at most sampling::kTopPMaxVocab).
class VerifyPlan {
 public:
  explicit VerifyPlan(int max_vocab);
  ~VerifyPlan();
  VerifyPlan(const VerifyPlan&) = delete;
  VerifyPlan& operator=(const VerifyPlan&) = delete;

  int max_vocab() const { return max_vocab_; }
  // After verify_on_device: the transformed rows p_0..p_g ([kMaxDraft + 1, V]) and q_1..q_g
  // ([kMaxDraft, V]), row-major with row stride V (the vocab of the call).
  float* target_probs() const { return probs_; }
  float* draft_probs() const { return probs_ + size_t(sampling::kMaxDraft + 1) * max_vocab_; }
  // Block verification's scratch (verify_probs_on_device): (kMaxDraft + 1) rows of 256 lane sums
  // and of each lane's last positive index.
  float* lane_sums() const { return lane_sum_; }
  int* lane_last() const { return lane_last_; }

 private:
  int max_vocab_ = 0;
  float* probs_ = nullptr;     // (2 kMaxDraft + 1) rows of max_vocab
  float* lane_sum_ = nullptr;  // block verification: (kMaxDraft + 1) rows x 256 lane sums
  int* lane_last_ = nullptr;   // and each lane's last positive index
};

// probs[r] = sampling::logits_to_probs(logits[r]) for r < rows (row stride vocab for both).
// rows <= 2 kMaxDraft + 1, vocab <= plan.max_vocab().
void logits_to_probs_on_device(const VerifyPlan& plan, const float* logits, int rows, int vocab,
                               const sampling::SamplingParams& params, float* probs,
                               cudaStream_t stream);

// sampling::verify on rows already transformed (device pointers, row stride vocab):
// target [(g + 1), vocab], draft [g, vocab] (may be null when g = 0), tokens [g] (X_1..X_g).
// Draws: `draws` (device) when not null, else make_verify_draws(seed_step[0], seed_step[1]).
// out (device): the same VerifyResult as the CPU (accepted, extra_token, diagnostics).
// draws_used (device, optional) receives the draws the kernel used. Block mode first sums the
// rows the verification reads (the residual of each draft row, the last target row) on many
// warps into the plan's lane buffers (one verification at a time per plan), in the CPU's order.
void verify_probs_on_device(const VerifyPlan& plan, sampling::VerifyMode mode, const float* target,
                            const float* draft, const int32_t* tokens, int g, int vocab,
                            const unsigned long long* seed_step, const sampling::VerifyDraws* draws,
                            sampling::VerifyResult* out, sampling::VerifyDraws* draws_used,
                            cudaStream_t stream);

// The engine's step: transform target_logits [(g + 1), vocab] and draft_logits [g, vocab] (the
// exact logits each draft was sampled from, Markov bias included) into plan.target_probs() /
// plan.draft_probs(), then verify with make_verify_draws(seed, step), seed_step = device
// {seed, step}. tokens [g] device. out (device) receives the result.
void verify_on_device(const VerifyPlan& plan, sampling::VerifyMode mode, const float* target_logits,
                      const float* draft_logits, const int32_t* tokens, int g, int vocab,
                      const sampling::SamplingParams& params, const unsigned long long* seed_step,
                      sampling::VerifyResult* out, cudaStream_t stream);

// ---- DSpark draft sampling on the device (CudaModel::draft_on_device) ---------------------------
// The sampling parameters as the draft kernels read them from device memory at run time (so one
// captured graph serves every request).
struct DeviceSamplingParams {
  float temperature = 1.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  int32_t pad = 0;
};
DeviceSamplingParams device_sampling_params(const sampling::SamplingParams& p);

// One draft slot, one cluster as above (all pointers device):
//   logits[x] += bias[x] (fp32 add, in place; bias may be null),
//   probs = sampling::logits_to_probs(logits, *params)   (the transform above, same bits),
//   *token = sampling::sample_from_logits' choice: greedy (temperature 0) the argmax with the
//            lowest index on ties, else row_ops.h's inverse_cdf_pick(probs, *u) in its order;
//            -1 if the row had no positive weight (NaN logits),
//   *prev = *token, or 0 when it is -1 (the next slot's Markov gather stays in range).
// Given bitwise-equal probs and the same u, the token is bitwise the CPU's (same fp operations in
// the same order), so no CDF-boundary tolerance is needed; probs differ only where exp differs
// (see above, ~2^-28 of arguments). vocab <= sampling::kTopPMaxVocab.
void sample_slot_on_device(float* logits, const float* bias, int vocab,
                           const DeviceSamplingParams* params, const float* u, float* probs,
                           int32_t* token, int32_t* prev, cudaStream_t stream);

// DSpark confidence logits: conf[b] = dot8(proj, [x5[b] (dim), emb[b] (rank)]) for b < rows, in
// cuda_dspark.cpp's dot8 order (8 interleaved partial sums, combined pairwise), no FMA: bitwise
// the host's value. proj [dim + rank], x5 [rows, dim], emb [rows, rank].
void draft_confidence_on_device(const float* proj, const float* x5, const float* emb, int rows,
                                int dim, int rank, float* conf, cudaStream_t stream);

// Bench/test hook: true makes the transforms launched afterwards use the single-CTA kernels (one
// 1024-thread block a row) instead of the cluster ones; same results.
// Process-wide, not thread-safe; default false.
void set_single_cta_transform_for_bench(bool single);

// Test hook: out[i] = the transform's exp of the float with bit pattern first_bits + i (i < n),
// so a test can compare every argument with the CPU's.
void exp_of_bits_on_device(uint32_t first_bits, int64_t n, float* out, cudaStream_t stream);

}  // namespace uf::cuda
