#pragma once
// Synthetic models for benchmarks: the weights one tensor-parallel rank holds, on one device, with
// random values in the checkpoint formats, and the memory floor of a decode step on them.
//
// rank_slice_config(c, tp) is the config whose tp = 1 model has exactly one rank's per-rank
// shapes under the CUDA backend's sharding (cuda/backend/cuda_model.h, backend_tp_options():
// attention heads, output groups, index heads and the expert intermediate width, routed and
// shared, divided by tp; KV, compressor, embeddings and Engram replicated; the head is kept whole
// here, and the bench computes the rank's vocab slice of it: CudaModelOptions::head_slice_of).
// What differs from a real rank:
//  - no collectives: the all-reduces after wo_b / the index scores / the MoE (and nothing else)
//    are missing from the step; their latency is not in any figure here;
//  - scales computed from the whole-model head count use the rank's count instead (the indexer's
//    index_n_heads^-0.5 weight scale): numerics differ, shapes and bytes do not;
//  - the values are random, so routing, top-k and every number is meaningless: only timing and
//    bytes are. Routing is data-dependent, so the experts a step touches are whatever the random
//    router picks (step_floor counts the expected distinct experts of uniform routing).
//
// synthetic_checkpoint(cfg, seed) gives every tensor of tensor_contract(cfg) a view into a shared,
// read-only, process-lifetime value pool per kind (aliasing: many tensors point at the same bytes).
// A pool is a small physical block (SyntheticOptions::pool_block_bytes) mapped again and again
// (memfd) over a virtual span as long as the largest tensor of its kind, so a 1.3 GB head costs
// pool_block_bytes of host memory. Values are sane: FP8 E4M3 codes of magnitude <= 1 (never NaN),
// E8M0 scales in 2^-9..2^-5, BF16/F32 in +-0.05, BF16 norm weights in 0.9..1.1, FP4 any byte.

#include <cstdint>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "model/config.h"
#include "model/tensor_contract.h"
#include "model/tp_plan.h"

namespace uf::model {

// Throws uf::core::Error naming the field when `c` does not split over tp ranks (validate_tp with
// the CUDA backend's options: embedding and Engram replicated, the head kept whole).
ModelConfig rank_slice_config(const ModelConfig& c, int tp);

// `c` with Engram tables of about `rows` rows each: engram_vocab_size is lowered so that the
// hash's bucket primes sum to ~rows, and engram_num_embeddings is set to those sums (so the
// hasher and the config agree). The released tables are ~384M rows (~98 GB each); a decode step
// gathers 24 rows per token per Engram layer, so its time hardly depends on the row count as long
// as the table is far larger than L2. Throws if rows is too small for the primes (< 64 rows per
// bucket).
ModelConfig with_engram_rows(const ModelConfig& c, int64_t rows);

struct SyntheticOptions {
  // Physical bytes behind each value pool (rounded up to the page size; smaller when the largest
  // tensor of the kind is smaller).
  size_t pool_block_bytes = size_t(16) << 20;
};

// One value pool: its kind, the largest tensor it must cover (the virtual span) and the physical
// bytes behind it.
struct SyntheticPool {
  std::string kind;     // "fp8-weight", "bf16", "bf16-norm", ...
  std::string largest;  // name of the largest tensor of the kind
  uint64_t span_bytes = 0;
  uint64_t physical_bytes = 0;
};
std::vector<SyntheticPool> synthetic_pools(const ModelConfig& c, const SyntheticOptions& o = {});

// A checkpoint holding every tensor of tensor_contract(c), values from `seed` (per pool kind).
// Its dir() is "<synthetic>", every entry's file "<synthetic>". Views stay valid for the process.
Checkpoint synthetic_checkpoint(const ModelConfig& c, uint64_t seed,
                                const SyntheticOptions& o = {});

// A token map for the Engram hash without a tokenizer: token t -> t % compressed vocab.
std::vector<int64_t> synthetic_engram_token_map(const ModelConfig& c);

// ---- Memory floor of a decode step ----

// Expected number of distinct experts that `rows` rows touch, each picking top_k distinct experts
// of n uniformly at random: n * (1 - (1 - top_k/n)^rows).
double expected_distinct_experts(int n_experts, int top_k, int rows);

struct FloorItem {
  std::string name;    // component ("attention projections", "routed experts", ...)
  double bytes = 0;    // bytes the step must read from device memory for it
  std::string detail;  // what is counted, in which format
};

struct FloorOptions {
  // Distinct routed experts per backbone layer / per DSpark stage; < 0: expected value of
  // uniform routing (expected_distinct_experts).
  double routed_experts = -1;
  double dspark_experts = -1;
  // The head's share a rank reads: 1 = replicated; N = vocab / N rows (the split head of TP N).
  int head_slices = 1;
};

struct StepFloor {
  int rows = 1;
  int64_t context = 0;
  double routed_experts = 0;      // per backbone layer, as used
  double dspark_experts = 0;      // per DSpark stage, as used
  std::vector<FloorItem> verify;  // forward of `rows` verify rows at `context` committed tokens
  std::vector<FloorItem> draft;   // one DSpark round (block_size rows) at the same context
  std::vector<FloorItem> commit;  // not timed: DSpark ring write of committed rows (main_proj, wkv)
  static double total(const std::vector<FloorItem>& items);
  double verify_bytes() const { return total(verify); }
  double draft_bytes() const { return total(draft); }
};

// Bytes a decode step of the model `c` (one rank's slice: rank_slice_config) must read, by
// component. Every weight is counted once per step at its checkpoint format (the rows of a step
// share it); KV at the formats the original engine stores (FP8 window KV, 528 B per entry; FP4
// compressed KV, 288 B; FP4 index keys, 68 B; model-arch.md §8). Activations, scores and writes
// are not counted (they are small next to the weights at T <= 8). See synthetic.cpp per line.
StepFloor step_floor(const ModelConfig& c, int rows, int64_t context, const FloorOptions& o = {});

}  // namespace uf::model

// ---- Benchmark arithmetic (no GPU): TP collectives of a step, projections, prefill ----

namespace uf::model {

// Index-score row stride of a CUDA session of `capacity` tokens (the largest capacity / ratio + 1
// over the backbone's compressed index-source layers; 1 if none): CudaModel sizes its index
// scratch with it (new_session, CudaModelOptions::max_seq).
// Every index-score all-reduce moves whole rows of this width, whatever the live context.
int64_t index_score_width(const ModelConfig& c, int64_t capacity);

// One kind of collective of a TP step: the CudaModel::all_reduce_round call sites
// (cuda/backend: output_proj after wo_b, moe after the expert partials, the Engram gathers of
// row-split tables, index_select after the index-score partials) and its gathers (the split
// head's logits, the entry-split indexer's picks and block maxima), each moving `elements` fp32
// values per rank (a gather modelled as a sum of the same per-rank size: the P2P kernels push and
// read the same bytes).
struct CollectiveCall {
  std::string what;
  int calls = 0;         // per step
  int64_t elements = 0;  // fp32 values per rank per call
  double bytes() const { return 4.0 * double(elements); }
};
// One verify forward of `rows` rows on a session of `capacity` tokens (empty at tp = 1).
std::vector<CollectiveCall> tp_verify_collectives(const ModelConfig& c, int tp, int rows,
                                                  int64_t capacity, TpIndexSplit index = {});
// One DSpark draft round (dspark_block_size rows through every stage; empty at tp = 1).
std::vector<CollectiveCall> tp_draft_collectives(const ModelConfig& c, int tp);
int total_calls(const std::vector<CollectiveCall>& v);

// A measured per-call collective time at a message size (bytes per rank).
struct CommSample {
  double bytes = 0;
  double us = 0;
};
// Per-call time at `bytes` from measured samples (any order): linear between the two samples
// around it, the smallest sample's time below the smallest size (latency floor), linear
// extrapolation through the two largest above the largest. Throws on an empty table.
double comm_time_us(std::vector<CommSample> table, double bytes);
// Sum over `calls` of calls x comm_time_us(table, bytes of the call).
double comm_step_us(const std::vector<CollectiveCall>& calls, const std::vector<CommSample>& table);

// Tokens per second of a decode loop accepting `accepted` tokens per step of `step_us`.
double tokens_per_second(double accepted, double step_us);

// Prefill throughput measured at a context: a chunk's time over its rows.
struct PrefillPoint {
  int64_t context = 0;
  double us_per_token = 0;
};
// Seconds to prefill `tokens` tokens into an empty session, integrating the per-token time over
// the context: piecewise linear in context between the points (exact trapezoids), constant
// below the first point and beyond the last one. Points in any order, positive times; throws on
// none.
double prefill_seconds(std::vector<PrefillPoint> points, int64_t tokens);

}  // namespace uf::model
