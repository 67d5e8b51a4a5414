#pragma once
// The CUDA forward of DeepSeek-V4.1-Flash: the host orchestration of cpu::CpuModel (cpu/model.h)
// with every op on the device (cuda/ops). The span logic is the CPU's line by line: the same
// prefill layout (first chunk of a fresh session) and ring layout (decode, verify rows, later
// chunks), the same slot order, the same compressor emission and the same DSpark rings. Slot lists
// are built on the host (from the position tags) as arrays of device pointers and uploaded.
//
// Scratch for a span is allocated once for max_span_rows() rows, so decode steps never allocate
// device memory; the index-score rows grow with the largest session capacity (at new_session).
// One CUDA stream; every call that returns values to the host synchronises it first.
//
// Tensor parallelism (CudaBackend with CudaModelOptions::tp = N > 1): one CudaModel per rank,
// each on its own device and stream, built from the rank's shards of model/tp_plan.h (attention
// heads, index heads, expert intermediate rows; head, embedding and Engram replicated). Every rank
// runs the same forward on the same tokens; the split-K partials (wo_b, the index scores, the MoE
// output) are summed in fp32 with TpGroup::all_reduce_sum_rank on the rank's stream and rounded to
// bf16 once after the sum. Everything else (KV, compressor, index keys, rings) is replicated: every
// rank computes the same values. N = 1 (no group) runs no collective and is today's code path.
//
// Index keys: only the owner-keys mode (cpu::IndexKeys::kOwner, the default); the reference's
// stale-key mode is not implemented on the device (use the CPU backend for it).

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/backend/cuda_session.h"
#include "cuda/device_memory.h"
#include "cuda/device_weights.h"
#include "cuda/ops/elementwise.h"
#include "cuda/ops/engram.h"
#include "cuda/ops/linear.h"
#include "cuda/ops/moe.h"
#include "cuda/verify.h"
#include "engine/backend.h"
#include "engine/hardware_profile.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/engram_hash.h"
#include "model/tp_plan.h"
#include "model/weights.h"

namespace uf::cuda {

namespace tp {
class TpGroup;
}

// The sharding options of the CUDA TP path (cuda_tp.cpp): heads, experts and Engram table rows
// split; head (unless split_head), embedding and engram.wkv replicated.
// split_head: head.weight by vocab rows too (all-gather of the logits; CudaModelOptions).
// split_index_heads: the indexer's wq_b / weights_proj by index heads (else replicated: the
// indexer is split by entries, tp_index_heads_split below).
model::TpOptions backend_tp_options(bool split_head = false, bool split_index_heads = true);
// The weights the CUDA TP path splits (attention / index heads, experts, Engram tables), in a
// fixed order.
std::vector<model::Weight*> tp_split_weights(model::ModelWeights& w, bool split_head = false,
                                             bool split_index_heads = true);
// Replaces the split weights of `w` (bound on the whole checkpoint) by rank's shards of the
// backend_tp_options() plan, rows / cols narrowed: a row range as a view into the whole tensor,
// a column slice as a host copy appended to `storage` (which must outlive the weights; the copies
// run on up to 16 threads). Returns the tensors placed (weights and scales) and their bytes;
// throws when the plan splits a tensor this path does not place. Host only (no GPU needed).
// row_begin (optional): for every weight split by rows, its first row in the whole tensor
// (Engram tables split unevenly, so a rank's offset is not rank * rows).
using HostShards = std::vector<std::unique_ptr<uint8_t[]>>;
struct ShardResult {
  size_t tensors = 0;         // weights and scales placed
  uint64_t copied_bytes = 0;  // column slices, copied into `storage`
  uint64_t viewed_bytes = 0;  // row ranges, read in place
};
ShardResult shard_model_weights(model::ModelWeights& w, const model::ModelConfig& cfg, int tp,
                                int rank, HostShards& storage, bool split_head = false,
                                std::unordered_map<std::string, int64_t>* row_begin = nullptr,
                                bool split_index_heads = true);

struct CudaModelOptions;
// Whether a TP model with these options splits its indexer by index heads (the weights split,
// the scores summed) rather than by entries (CudaModelOptions::tp_index_split_entries).
bool tp_index_heads_split(const model::ModelConfig& cfg, const CudaModelOptions& o);

struct CudaModelOptions {
  bool reference_index_keys = false;      // rejected: not implemented on the device
  int max_rows = engine::kMaxVerifyRows;  // verify rows per step (ring slots = window + this)
  int max_chunk = 512;                    // prefill rows per span (scratch size)
  int device = 0;                         // CUDA device ordinal (TP: set per rank)
  int tp = 1;  // tensor-parallel ranks (CudaBackend: devices 0..tp-1); 1 = one GPU
  // TP sums by all-gather + an fp32 sum in rank order (sum_ranks_round_bf16) instead of NCCL's
  // all-reduce. Always on for tp > 2: NCCL's reduction order there depends on the element count
  // (ring chunking, algorithm choice), which would make a row depend on the span's row count
  // (spec != plain). At tp = 2 both give a + b exactly; the option exists to test that.
  bool tp_ordered_sum = false;
  // TP sums with the one-shot peer-to-peer all-reduce (cuda/tp/p2p_allreduce.h: one kernel, the
  // same rank-order fp32 sum on every rank, bitwise the ordered sum's / NCCL's a + b at 2 ranks)
  // instead of NCCL. Used where every pair of GPUs has peer access (CudaBackend checks; else
  // NCCL, with a log line) and tp_ordered_sum is off. --no-p2p-allreduce turns it off.
  bool tp_p2p_allreduce = true;
  // TP: split head.weight by vocab rows (each rank computes vocab/tp logits, all-gathered into
  // whole rows on every rank: one P2P gather kernel, or NCCL all-gather + copies). Every logit is
  // the same dot product as with the replicated head, so the logits are bitwise the same; each
  // rank reads 1/tp of the head (1.32 GB for the released model: ~1 ms a 7-row step at TP 8
  // against a ~15 us gather). CudaBackend replicates the head when the vocab does not divide.
  bool tp_split_head = true;
  // Benchmarks of one rank's slice on one GPU (tp = 1, `bench --synthetic tp8-rank`): N > 1
  // computes only vocab rows [0, V / N) of the head, as rank 0 of a TP N server with the split
  // head does, and fills the other slices with copies of it (the gather's writes; its time is
  // modelled by bench-tp). Such logits are not the model's output: for timing only.
  int head_slice_of = 1;
  // Ring-layout spans of up to max_rows rows (decode and verify steps) replay one CUDA graph per
  // (rows, all_logits), captured at first use (cuda_ring_span.cpp). Off: the same launches run
  // eagerly (the graph and the eager path are the same code). Under TP each rank replays its own
  // graphs, with the NCCL collectives captured in them.
  bool cuda_graphs = true;
  // Speculative verification on the device (CudaBackend::verify_last_rows, cuda/verify.h): the
  // verify step's logits never go to the host. Under TP, rank 0 verifies (it holds the logits).
  bool device_verify = true;
  // DSpark drafting on the device (CudaModel::draft_on_device): the Markov loop, the transform,
  // the draft sampling and the confidences of all slots in one launch sequence (one CUDA graph);
  // the q rows stay on the device for verification. Needs device_verify (under TP: rank 0 runs
  // it); off, or without device_verify: the host loop of draft() with the engine's sampler.
  bool device_draft = true;
  // Independent chains on side streams (graph branches): the compressor and the indexer beside
  // the q / kv projections, the shared expert beside the routed experts. Off: one stream, the
  // same launches in order (bitwise the same results). Measured on the H200 (`bench --synthetic
  // tp8-rank`, 8k; `--no-branches` turns them off): 1 row 5887 against 6076 us, 7 rows 9413
  // against 9432 us. A kernel that waits on another stream's event cannot start early under PDL,
  // which takes back most of what the overlap gives.
  bool graph_branches = true;
  // Candidate-restricted (Reindex) layers score only the candidate source's pool (16,384 entries
  // a row for the released model: its kept blocks, as a list written by candidate_mask) instead
  // of every visible entry followed by a mask: at 1M tokens a Reindex layer reads 16k index keys
  // a row, not 1M. The same scores and selections bit for bit (ops/attention.h EntryList); off:
  // the full scores and mask_scores (tests compare the two).
  bool candidate_lists = true;
  // Decode spans (T <= kMaxDecodeRows) at tp = 1: the MoE stops before its combine
  // (DeviceMoe::apply_partial_experts' slots) and the FFN's mHC expand computes the combine per
  // element (hc_post_mixes_moe, ops/mhc.cu): one kernel less a layer, bitwise the same outputs
  // (tests/cuda/test_mhc_combine_fold.cpp). Off: apply() + hc_post_mixes. One GPU only: a TP
  // rank's combine comes before its all-reduce, so `bench --synthetic tp8-rank` (the step of a
  // TP8 rank) leaves it off unless --fold-moe-combine (H200, session 8: 61 / 124 us a step
  // shorter at 1 / 7 rows).
  bool fold_moe_combine = true;
  // Prefill spans (more rows than a verify step and a draft block, and enough of them to give
  // every SM two CTAs of 8 heads: at fewer the split path is faster) attend on the tensor cores
  // (sparse_attn_mma, ops/attention_mma.cu); decode rows always take sparse_attn's split path,
  // so spec == plain is unaffected. Not the CPU's bits (within the bound the op tests state).
  // Off: prefill spans take the split path too (`bench-prefill --attention split`).
  bool prefill_attention_mma = true;
  // The prefill linear layers on the bf16 GEMM (PrefillGemm::kBf16, ops/linear.h: a bf16 copy of
  // every FP8 linear weight, ~2.3 GB a TP8 rank, and bf16 activation workspaces); off: the FP8
  // GEMM that is bitwise the decode GEMV (slower: a 512-row chunk of a TP8 rank 79 ms against 65
  // at 8k, session 15). CLI: --prefill-gemm fp8. Also the prefill mHC expand's mixes
  // (hc_post_mixes_mma, ops/mhc_prefill.h: fn as bf16 terms, ~3.3 MB a sublayer at dim 5120);
  // off: hc_post_mixes, bitwise the decode kernels.
  bool prefill_gemm_bf16 = true;
  // The largest session capacity callers will ask for (the server's --max-seq; 0: unknown). The
  // index-score scratch is sized for it at construction, before the decode graphs are captured:
  // otherwise the first session wider than any before drops the graphs (they hold the scratch and
  // its row stride) and its first steps capture them again while requests run.
  int64_t max_seq = 0;
  // TP: graph steps lay their index scores out (and all-reduce them) at the smallest of the
  // widths 4096, 16384, 65536, ... (entries; the last is the scratch's) that holds the step's
  // widest row, one captured graph per (key, width), instead of always at the scratch width: with
  // --max-seq 1M every step otherwise sums T x 250k floats per index layer whatever its context
  // (~0.65 ms a 7-row step on two ranks, session 13). The same bits either way (each score's
  // rank-order sum and the exact selections do not depend on the row stride;
  // CudaBackendTpBuckets.ScoreBucketsGiveTheSameLogits). Two TP8-shaped ranks with --max-seq 1M,
  // 7-row step at 8k: 8132 -> 7222 us (session 14); the graphs take ~4x their capture time and
  // memory (4 widths at 1M). No effect at tp = 1.
  bool tp_score_buckets = true;
  // TP: the indexer split by ENTRIES, not by index heads (ops/index_split.h, cuda_index_split.cpp):
  // every rank holds the whole indexer.wq_b / weights_proj, scores its 1/tp of a row's entries
  // (or of the candidate pool's list) with every head, and the ranks gather their best index_topk
  // (score, entry) pairs (T x tp x topk) and merge them; the candidate source gathers its block
  // maxima (T x entries / block_size). The head split summed T x entries scores per index layer
  // instead (at 1M tokens 1 ms a 7-row step on two ranks and 105 ms a 512-row prefill chunk,
  // session 14), and its selections were an fp32 rank-order sum's; these are one GPU's bit for
  // bit. Needs candidate_lists where the model has a candidate pool (else the head split).
  // `bench --synthetic tpN --tp-index-heads` for the head split.
  bool tp_index_split_entries = true;
  // With the whole indexer on every rank (the entry split, or its simulated ranks), an index layer
  // call whose rows x positions (a row's entries, or the candidate pool's list capped at the
  // call's score stride) fall below this scores the whole rows on every rank instead: the same
  // selections (the merge is exact), no gather and no merge. Two TP8-shaped ranks (docs/perf.md
  // session 17): an 8k context's graph steps (16384-entry width bucket, <= 8 rows: <= 131072)
  // are ~100 us faster with whole rows; from 128k the steps' full-width layers (262144 positions
  // and up) are faster split (~350 us a 1-row step at 128k), and prefill chunks (512 rows) gain
  // from the split from 128k on (8k: even). 0: always split (the tests of the split).
  int64_t index_split_min_work = model::kDefaultIndexSplitMinWork;  // 2^18
  // Tests only: at tp = 1, run the entry-split indexer as this many ranks in turn on the one GPU
  // (each rank's block copied where the gather would put it): selections, hence logits, bitwise
  // the unsplit indexer's, so one GPU checks the split's bookkeeping end to end. 0: off.
  int index_split_simulated_ranks = 0;
};

class CudaModel {
 public:
  // ckpt must outlive the model (host views of the Markov embedding and confidence projection
  // stay on it). engram_token_map: see cpu::CpuModel.
  // group (may be null = one GPU): the TP group this model is rank `rank` of; the model then holds
  // only its shards and runs the collectives on its stream (from its rank's own thread).
  CudaModel(model::ModelConfig cfg, const model::Checkpoint& ckpt,
            std::vector<int64_t> engram_token_map, CudaModelOptions opts = {},
            tp::TpGroup* group = nullptr, int rank = 0);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const model::ModelConfig& config() const { return cfg_; }
  const CudaModelOptions& options() const { return opts_; }
  cudaStream_t stream() const { return stream_; }
  // Host time of the last ring-layout span (a decode or verify step) from entering the forward to
  // its launch returning: the plan, the block upload and the graph launch, i.e. what the host adds
  // between two steps when the previous step's results are in hand (bench-host).
  double last_launch_host_us() const { return last_launch_host_us_; }
  // The part of it before the launch: the span plan and the block's upload (the rest is
  // cudaGraphLaunch).
  double last_plan_host_us() const { return last_plan_host_us_; }
  int max_span_rows() const { return tmax_; }
  int n_taps() const { return int(cfg_.dspark_target_layer_ids.size()); }
  int64_t compressed_id(int32_t token) const;
  int tp_size() const { return tp_; }
  int tp_rank() const { return rank_; }

  std::unique_ptr<CudaSession> new_session(int64_t max_seq);

  // As CpuModel::forward, T <= max_span_rows(). logits: HOST [T or 1, vocab], or null (TP ranks
  // other than 0: the head is skipped). main_hidden: DEVICE
  // [T, taps*dim] (may be null: model scratch). publisher: host [T] (may be null).
  // Synchronises the stream before returning.
  // keep_logits (ring layout): compute the head's rows even without `logits`; they stay in the
  // model for verify_last (CudaBackend::verify_last_rows).
  void forward(CudaSession& s, std::span<const int32_t> tokens, bool prefill_layout,
               bool all_logits, float* logits, float* main_hidden, int* publisher,
               bool keep_logits = false);
  // sampling::verify on logits_to_probs of the last forward's `rows` logits rows (on the
  // device, cuda/verify.h: bitwise the CPU path), with the draft rows q [rows - 1, vocab] (host)
  // and the drafts `tokens`; draws make_verify_draws(seed, step). Synchronises.
  sampling::VerifyResult verify_last(sampling::VerifyMode mode,
                                     const sampling::SamplingParams& params,
                                     std::span<const float> draft_probs,
                                     std::span<const int32_t> tokens, uint64_t seed, uint64_t step,
                                     int rows);
  // As CpuModel::commit; main_hidden: DEVICE rows of the forward (may be null).
  void commit(CudaSession& s, std::span<const int32_t> tokens, const float* main_hidden, int n,
              int publisher_after);
  // The main hidden rows of the last forward when it was given none (prefill chunks).
  float* scratch_main_hidden() const { return mh_; }
  // Waits for the stream (and releases the upload staging).
  void synchronize() { sync(); }

  // CED prefill shortcut (cpu::CpuModel::prefill_ced's twin). A prompt longer than the span
  // capacity runs its encoder part in chunks (ring layout), the decoder on the last chunk's tail.
  void prefill_ced(CudaSession& s, std::span<const int32_t> tokens, int replay, float* logits);

  // One DSpark round at the last committed position (cpu::CpuModel::draft's twin). TP ranks other
  // than 0 run the stages (their collectives) and return an empty block.
  engine::DraftBlock draft(CudaSession& s, int32_t anchor, const engine::DraftSampler& sampler);

  // --- DSpark drafting on the device (cuda_dspark.cpp) ---
  // Whether draft_on_device can run (options().device_draft, device verification on: rank 0).
  bool device_draft_available() const;
  // Allocates the device draft's buffers (and the Markov embedding table on the device) and
  // captures its graph on a scratch session (tp = 1; under TP at the first draft, with the
  // peers); CudaBackend calls it at construction. Idempotent.
  void prepare_device_draft();
  // One DSpark round as draft(), with the engine's draft sampler on the device: slot i is drawn
  // from logits_to_probs(head_i + markov_bias_i) with u_i = stream_uniform(seed, step, kDraft, i)
  // (greedy: argmax). Returns tokens and confidences (bitwise the host loop's); logits and
  // markov_bias stay empty. The q rows stay on the device for verify_last_drafted.
  engine::DraftBlock draft_on_device(CudaSession& s, int32_t anchor,
                                     const sampling::SamplingParams& params, uint64_t seed,
                                     uint64_t step);
  // verify_last with the q rows of the last draft_on_device (tokens: its first g drafts).
  sampling::VerifyResult verify_last_drafted(sampling::VerifyMode mode,
                                             const sampling::SamplingParams& params,
                                             std::span<const int32_t> tokens, uint64_t seed,
                                             uint64_t step, int rows);
  // Test hooks (synchronous): the last draft_on_device's q rows [rows, vocab] and its logits rows
  // (head + Markov bias) [rows, vocab]; the logits are overwritten by the next forward.
  std::vector<float> device_draft_probs(int rows) const;
  std::vector<float> device_draft_logits(int rows) const;

  // Device state <-> host vectors (snapshot / restore).
  void download_ring(const DeviceRing& r, std::vector<float>& out) const;
  void upload_ring(DeviceRing& r, const std::vector<float>& in) const;

  // Benchmarks only: makes `s` hold `len` committed tokens (random ids from `seed`) without running
  // the model: ring tags and entry counts as after a real prefill, device state random (not zeros).
  // The step cost at a context then depends on len exactly as after a real prefill of len tokens.
  void fast_forward(CudaSession& s, int64_t len, uint64_t seed);
  // CUDA graphs held now (one per (rows, all_logits, head) used, and the draft's), and captured
  // since construction (recaptures after a wider session dropped them included).
  int graphs_captured() const { return int(graphs_.size()); }
  int64_t graph_captures_total() const { return graph_captures_; }
  // The ranks the indexer's entries are split over (tp_index_split_entries, or simulated at tp = 1;
  // 0: not split by entries).
  int index_split_ranks() const { return index_split_ ? split_ranks_ : 0; }
  // Captures the decode loop's graphs (verify of 1..max_rows rows with all logits, the draft) on a
  // scratch session, before serving: a capture on stream_ while another thread used the legacy
  // default stream would fail, so none should happen once requests run. No-op without graphs.
  void capture_step_graphs();
  // TP: NCCL connects the ranks at the first collective of each kind, which allocates and so must
  // not happen inside a graph capture: this runs each kind the programs use once, eagerly. Every
  // rank calls it at once, AFTER every rank's constructor has returned (a constructor frees its
  // pinned upload staging, and a free may wait for the peer devices: tp::TpGroup::host_barrier
  // says why). No-op at tp = 1.
  void connect_collectives();

 private:
  struct Span;
  struct LayerOps;
  struct SpanBlock;
  // The CUDA-graph span program of ring-layout spans (cuda_ring_span.cpp): the host writes every
  // position- and session-dependent input into one pinned block (plan_ring_span), the program
  // copies it to the device and launches kernels that read it there (ring_program), so its
  // launches depend on (rows, all_logits) only and replay as one graph.
  SpanBlock span_block(int T) const;
  void forward_ring(CudaSession& s, std::span<const int32_t> tokens, bool all_logits, float* logits,
                    float* main_hidden, int* publisher, bool keep_logits);
  // ced_dec >= 0: a CED encoder chunk (layers [0, ced_dec) and layer ced_dec's KV path only).
  void plan_ring_span(Span& sp, SpanBlock& b, std::span<const int32_t> tokens, int ced_dec = -1);
  void ring_program(const SpanBlock& b, bool all_logits, bool head, int ced_dec = -1);
  void attention_program(const SpanBlock& b, int l, const float* x, float* out);
  void kv_program(const SpanBlock& b, int l, const float* x);
  // CED: the first decoder layer's KV path on the encoder output X [T rows] (cuda_ced.cpp).
  void ced_decoder_kv(Span& sp, float* X, float* pre_mix, int T);
  // CED: a ring-layout encoder chunk on a non-empty session (sp: its span). Returns the publisher
  // after it; commits it (no DSpark rows) unless it is the last chunk, whose rows stay in X_.
  int ced_encoder_chunk(CudaSession& s, std::span<const int32_t> tokens, Span& sp, bool last);
  // Device verification of the last verify rows (logits_) against g drafts whose q rows are at
  // q on the device: verify_last (host q rows, uploaded) and verify_last_drafted (the device
  // draft's) both end here.
  sampling::VerifyResult verify_on_device(sampling::VerifyMode mode,
                                          const sampling::SamplingParams& params, const float* q,
                                          std::span<const int32_t> tokens, uint64_t seed,
                                          uint64_t step, int rows);
  void drop_graphs();
  // The DSpark stages of a draft round as a program (cuda_dspark.cpp): block = draft_block(),
  // inputs p0 = the last committed position, ids = anchor + noise, pos = p0 + 1 + i, the stages'
  // rings; output: the last stage's x5 rows in x_ and, with head_rows, its head logits in logits_.
  SpanBlock draft_block() const;
  void fill_draft_block(const CudaSession& s, const SpanBlock& b, int32_t anchor, const char* who);
  void draft_program(const SpanBlock& b, bool head_rows);
  // Committed rows into the DSpark stages' window rings as a program with its own pinned block
  // (commit_block(n): pos, the stages' rings), so a decode commit is one graph replay that the
  // host does not wait for; main hidden rows come from commit_mh_.
  SpanBlock commit_block(int n) const;
  void commit_program(const SpanBlock& b);
  // The device draft's inputs appended to draft_block()'s layout (byte offsets in the block):
  // DeviceSamplingParams, then B uniforms (float).
  struct DraftInputs {
    size_t params = 0, uniforms = 0, bytes = 0;
  };
  DraftInputs draft_inputs(const SpanBlock& b) const;
  // After draft_program(b, true): the Markov loop, sampling and confidences of every slot.
  void device_draft_program(const SpanBlock& b, const DraftInputs& in);
  // Replays the graph `key` (captured from `program` at first use) or runs `program` eagerly.
  template <typename Program>
  void launch_program(int key, Program&& program);
  // upload_hash: also copy the Engram ids to hash_ (the host-driven path).
  void init_span(Span& sp, CudaSession& s, std::span<const int32_t> tokens, bool prefill_layout,
                 bool upload_hash = true);
  void upload_hash(const Span& sp);
  void embed(const Span& sp, std::span<const int32_t> tokens, float* X, float* pre_mix);
  void run_layers(Span& sp, float* X, float* pre_mix, int l0, int l1, float* main_hidden);
  void block(Span& sp, int l, float* X, float* pre_mix);
  // One layer on the hc-expanded stream X [T, hc, dim]: mHC around `attention` (x_ -> y_), then
  // around the MoE. Backbone layers (block) and DSpark stages (draft_program) differ only in the
  // attention they pass.
  void layer(int l, float* X, int T, float* pre_mix,
             const std::function<void(const float* x, float* out)>& attention);
  // A DSpark stage's attention of a draft program: over its window ring and the block itself.
  void draft_attention(const SpanBlock& b, int stage, const float* x, float* out);
  void attention(Span& sp, int l, const float* x, float* out);
  // sparse_attn of T rows on the fast chunked path, in groups of attn_rows_ rows (its scratch
  // grows with the rows): decode steps and draft blocks; prefill spans (T > decode_rows_) on the
  // tensor cores (sparse_attn_mma) unless opts_.prefill_attention_mma is off.
  void attend(int l, int T, const float* const* window, int n_window, const int32_t* topk, int k,
              const uint16_t* ckv, const uint16_t* const* ckv_ref, int64_t p0, const int64_t* pos);
  void kv_path(Span& sp, int l, const float* x);
  void indexer(Span& sp, int l, const float* x, const float* qr);
  // Shared by the host-driven path and the span programs. Rows are at positions p0 + t * stride,
  // or pos[t] (device) when pos is given.
  //   finish_entries: n pooled compressed entries `lat` [n, head_dim] (normed, fp32 scratch)
  //     become index keys `keys` [n, index_head_dim] (index sources) and RoPE'd FP4 latents (in
  //     place, and as bf16 to `lat_out`; the keys as bf16 only).
  //   index_queries: the indexer's FP4 queries iq_ and bf16 head weights iw_ of T rows.
  //   index_select: scores against keys[t] (vis / width per row, device), candidate pool, top-k.
  //     stride: the score rows' stride for this call, >= every row's width and <= index_width_.
  //     Graph-captured steps use index_width_ (fixed per graph); eager spans (prefill chunks) the
  //     span's widest row (score_stride), so that a TP rank's all-reduce of the scores moves the
  //     live columns, not the session's capacity (512 rows x 250k columns at a 1M capacity).
  void finish_entries(int l, float* lat, int n, uint16_t* lat_out, uint16_t* keys, int64_t p0,
                      int64_t stride, const int64_t* pos);
  void index_queries(int l, const float* x, const float* qr, int T, int64_t p0, const int64_t* pos);
  void index_select(int l, int T, const uint16_t* const* keys, const int32_t* vis,
                    const int32_t* width, int stride);
  // index_select under TP with the indexer split by entries (cuda_index_split.cpp), and whether
  // layer l's call of T rows at this score stride takes it (index_split_min_work).
  bool index_split_pays(int l, int T, int stride) const;
  void index_select_split(int l, int T, const uint16_t* const* keys, const int32_t* vis,
                          const int32_t* width, int stride);
  // (Re)allocates isplit_ for the scratch width (ensure_index_width) / frees it.
  void alloc_index_split(int64_t width);
  void free_index_split();
  // TP: every rank's src [rows, cols] into dst row t's columns [q * cols, (q + 1) * cols) on every
  // rank (dst row stride ld): the P2P gather kernel, or NCCL all-gather into scratch ([tp, rows,
  // cols]) + copies.
  void gather_columns(const float* src, size_t rows, size_t cols, float* dst, size_t ld,
                      float* scratch);
  // The score stride of an eager span whose widest index row has `widest` entries.
  int score_stride(int64_t widest) const;
  // A graph step's score width bucket for its widest index row (the index into score_buckets_;
  // forced_bucket_ when capture_step_graphs sets one).
  int score_bucket(int64_t widest) const;
  void head(const float* X, const float* pre_mix, int row0, int n, float* logits_dev);
  int last_emitter(int64_t p) const;
  // Rows t < T at positions p0 + t, or at pos[t] (device) when pos is given (span programs).
  // q (through the q latent qr; not yet rotated: attend rotates it) and the KV row of x (rotated,
  // quantised): wq_a and wkv in one grouped launch.
  void project_qkv(int l, const float* x, int T, int64_t p0, float* qr, float* q, float* kv,
                   const int64_t* pos = nullptr);
  void project_kv(int l, const float* x, int T, int64_t p0, float* kv,
                  const int64_t* pos = nullptr);
  void finish_q(int l, float* qr, int T, float* q);  // after wq_a: norm, wq_b (no rope)
  void finish_kv(int l, float* kv, int T, int64_t p0, const int64_t* pos);  // after wkv
  // wo_a (per group) + wo_b (+ the TP sum) of the attention output o, whose inverse rope attend
  // applied.
  void output_proj(int l, const float* o, int T, float* out);
  // The MoE sublayer y [T, dim] of x (one GPU: DeviceMoe::apply; TP: the ranks' fp32 partials
  // summed and rounded once).
  void moe(int l, const float* x, int T, float* y);
  void dspark_write(CudaSession& s, const float* main_hidden, int n, int64_t p0);
  void ensure_index_width(int64_t width);
  // TP (cuda_tp.cpp): replaces the split weights of w_ by this rank's shards (host copies).
  void shard_weights();
  // TP: in-place fp32 sum over the ranks on this model's stream, then bf16 rounding of the sum.
  // No-op at tp = 1 (callers use the one-GPU path there).
  void all_reduce_round(float* buf, size_t n);
  // Stream-ordered host -> device copy (the host buffer may be reused on return).
  template <typename T>
  void to_device(T* dst, const std::vector<T>& src);
  void sync();

  model::ModelConfig cfg_;
  CudaModelOptions opts_;
  model::ModelWeights w_;  // host views (Markov embedding, confidence projection)
  tp::TpGroup* group_ = nullptr;
  int tp_ = 1, rank_ = 0;
  // Rank-local counts (the whole model's at tp = 1): heads, output groups, index heads, expert
  // intermediate width.
  int H_ = 0, G_ = 0, Hi_ = 0, inter_ = 0;
  HostShards shard_bytes_;  // TP: host copies of column slices, freed after the upload
  std::unordered_map<std::string, int64_t> shard_row0_;  // TP: first row of row-split weights
  size_t engram_gather_ = 0;  // the largest Engram gather per row (floats)
  bool ordered_sum_ = false;
  bool split_head_ = false;
  int head_slices_ = 1;           // tp with the split head, else opts_.head_slice_of (bench)
  float* head_part_ = nullptr;    // split head: [tmax, vocab / head_slices_] (arena)
  float* head_gather_ = nullptr;  // split head: [tp, tmax, vocab / tp] (arena)
  // The head GEMV (whole, or split + all-gather) into logits_dev [n, vocab]; x: [n, dim].
  void apply_head(const float* x, int n, float* logits_dev);
  float* gather_ = nullptr;  // ordered sum: [tp, gather_cap_] (cudaMalloc; grows with index width)
  size_t gather_cap_ = 0;
  void ensure_gather(size_t n);
  std::vector<int64_t> token_map_;
  std::optional<model::EngramHasher> hasher_;
  HcShape hc_;
  int tmax_ = 0;
  // The stream every op of the model launches on: main_stream_, or a side stream while a graph
  // branch is open (fork .. unfork), so the ops themselves never name a stream.
  cudaStream_t stream_ = nullptr;
  cudaStream_t main_stream_ = nullptr;
  // Graph branches (opts_.graph_branches): work of a layer that does not depend on the main chain
  // (the compressor, the indexer) runs on a side stream; CUDA graph capture records the event
  // edges as dependencies and an eager run keeps them. Forks start from the main stream only.
  // Off, fork / unfork / join keep everything on the main stream.
  static constexpr int kSideStreams = 2;
  cudaStream_t side_[kSideStreams] = {};
  cudaEvent_t fork_ev_[kSideStreams] = {};
  cudaEvent_t side_done_[kSideStreams] = {};
  int open_side_ = -1;
  double last_launch_host_us_ = 0;
  double last_plan_host_us_ = 0;
  void fork(int side);  // side waits for the main stream's work so far; stream_ = side
  void unfork();        // stream_ = the main stream (the branch keeps running)
  void join(int side);  // stream_ (main or another side) waits for side's work so far
  DeviceArena arena_;   // weights and fixed scratch
  std::vector<std::vector<uint8_t>> staging_;  // host sources of uploads in flight

  // Weights on the device.
  DeviceWeight embed_, norm_;
  DeviceLinear head_;
  std::vector<std::unique_ptr<LayerOps>> layers_;

  // Fixed scratch [tmax rows].
  float *X_ = nullptr, *R_ = nullptr, *pre_ = nullptr, *apre_ = nullptr, *apost_ = nullptr,
        *acomb_ = nullptr, *fpost_ = nullptr, *fcomb_ = nullptr;
  float *x_ = nullptr, *y_ = nullptr, *qr_ = nullptr, *q_ = nullptr, *kv_ = nullptr, *o_ = nullptr,
        *o2_ = nullptr;
  float *ckv_kv_ = nullptr, *ckv_gate_ = nullptr, *pool_ = nullptr;
  float *iq_ = nullptr, *iw_ = nullptr;
  float* mix_scratch_ = nullptr;  // hc_mixes' split-K partials
  // layer(): the partials in mix_scratch_ are layer `layer`'s attention mixes over X, T rows
  // (computed by the previous layer()'s fused FFN expand); layer -1: none.
  struct MixReady {
    int layer = -1;
    const float* X = nullptr;
    int T = 0;
  };
  MixReady mix_ready_;
  float* attn_scratch_ = nullptr;  // sparse_attn's split mode, attn_rows_ rows (attend)
  int decode_rows_ = 0;  // max(max_rows, draft block): spans up to this many rows are decode
  int attn_rows_ = 0;
  float *mh_ = nullptr, *logits_ = nullptr, *emb_ = nullptr;
  int32_t *ids_ = nullptr, *gate_i_ = nullptr, *vis_ = nullptr, *width_ = nullptr;
  float* gate_w_ = nullptr;
  // fold_moe_combine: apply_partial_experts' slots [kMaxDecodeRows, max top-k + 1, dim].
  float* moe_slots_ = nullptr;
  int64_t* hash_ = nullptr;                 // [n_engram, tmax, n_cols]
  const float** win_ptrs_ = nullptr;        // [tmax * max(window + block, window)]
  const float** pool_kv_ptrs_ = nullptr;    // [tmax * max ratio]
  const float** pool_gate_ptrs_ = nullptr;  // [tmax * max ratio]
  const uint16_t** key_ptrs_ = nullptr;     // [tmax]
  std::vector<int32_t*> topk_;              // [layer] [tmax, index_topk] (index sources)
  // Index scores and the candidate pool: [tmax, index_width_] (grown with session capacity).
  int64_t index_width_ = 0;
  float* score_ = nullptr;
  uint8_t* keep_ = nullptr;
  void* index_ws_ = nullptr;  // candidate_mask / topk_select workspace (sized with score_)
  // The candidate pool as lists (opts_.candidate_lists): [tmax, cand_cap_] entries and [tmax]
  // counts, written by the candidate source's candidate_mask; cand_listed_: it wrote them in this
  // forward (host state at launch / capture time: layers run in order, the source first).
  int32_t* cand_list_ = nullptr;
  int32_t* cand_n_ = nullptr;
  int64_t cand_cap_ = 0;
  bool cand_listed_ = false;
  // TP, the indexer split by entries (tp_index_split_entries; cuda_index_split.cpp): each
  // rank's row views [tmax] (range vis / width / keys, the whole row's block counts), its
  // selection [tmax, k] and pairs [tmax, 2k], the gathered pairs [tmax, tp * 2k] and the merge
  // list [tmax, tp * k] (+ counts); for the candidate pool the block maxima [tmax, split_blocks_]
  // and gathered [tmax, tp * split_blocks_], their keep mask and kept-block list [tmax,
  // topk_blocks] (+ counts).
  bool index_split_ = false;
  int split_ranks_ = 1;  // tp_, or opts_.index_split_simulated_ranks at tp = 1
  struct IndexSplitScratch {
    int32_t *vis = nullptr, *width = nullptr, *vis_blocks = nullptr, *width_blocks = nullptr;
    const uint16_t** keys = nullptr;
    int32_t* sel = nullptr;
    float *pairs = nullptr, *gathered = nullptr, *merge_score = nullptr;
    int32_t *merge_entries = nullptr, *merge_n = nullptr;
    float *bmax = nullptr, *bgathered = nullptr;
    uint8_t* bkeep = nullptr;
    int32_t *blocks = nullptr, *blocks_n = nullptr;
    int64_t split_blocks = 0;  // block maxima a rank's range holds at the scratch width
  } isplit_;

  // Span programs: the inputs block (pinned host + device, sized for tmax rows), the emitted
  // compressed entries before they are copied into the session ([tmax, head_dim] and
  // [tmax, index_head_dim]), and the captured graphs by (rows, all_logits).
  uint8_t* block_host_ = nullptr;
  uint8_t* block_dev_ = nullptr;
  size_t block_bytes_ = 0;
  // The commit program's block and main hidden rows; commit_done_ marks its block copied.
  uint8_t* commit_host_ = nullptr;
  uint8_t* commit_dev_ = nullptr;
  size_t commit_bytes_ = 0;
  float* commit_mh_ = nullptr;
  cudaEvent_t commit_done_ = nullptr;
  float *emit_ = nullptr, *emit_keys_ = nullptr;
  // The captured step graphs by key (launch_program). Launched from the host: a device-side
  // launch (a one-node graph tail-launching the step) was tried in session 7 and cut the launch
  // call by ~14 us but made the step 40-120 us longer on the device (docs/perf.md).
  std::map<int, cudaGraphExec_t> graphs_;
  int64_t graph_captures_ = 0;  // graph_captures_total()
  // Graph steps' score widths (CudaModelOptions::tp_score_buckets; else {index_width_}), set by
  // ensure_index_width; forced_bucket_ >= 0: capture_step_graphs' bucket.
  std::vector<int64_t> score_buckets_;
  int forced_bucket_ = -1;
  // Device verification: its plan (transformed rows, sort scratch) and inputs / result.
  std::unique_ptr<VerifyPlan> verify_plan_;
  float* verify_q_ = nullptr;                  // [kMaxDraft, vocab]
  int32_t* verify_tokens_ = nullptr;           // [kMaxDraft]
  unsigned long long* verify_seed_ = nullptr;  // {seed, step}
  sampling::VerifyResult* verify_out_ =
      nullptr;  // device  // key: rows * 4 + all_logits * 2 + head
  // Device draft (prepare_device_draft; null until then): the Markov embedding table, the
  // confidence projection (fp32), per-slot Markov rows [B, rank], one bias row [vocab], the q
  // rows [B, vocab], a pre-mix scratch float, the sampled tokens and the clamped previous tokens
  // [B], and the result {tokens [B] int32, confidences [B] fp32} that comes back in one copy.
  DeviceWeight markov_embed_dev_;
  float *conf_proj_dev_ = nullptr, *draft_emb_ = nullptr, *draft_bias_ = nullptr,
        *draft_q_ = nullptr, *draft_pre_ = nullptr;
  int32_t *draft_prev_ = nullptr, *draft_result_ = nullptr;
  // The drafts whose q rows draft_q_ holds (empty: none valid, e.g. after a host draft()).
  std::vector<int32_t> device_drafts_;
};

}  // namespace uf::cuda
