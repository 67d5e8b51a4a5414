#pragma once
// The tensor-parallel sharding plan: for a ModelConfig, a TP degree N and a rank r, how rank r
// holds every tensor of the tensor contract (replicated, or a contiguous slice along one storage
// dimension), in the checkpoint's storage units, plus the collective the runtime owes after
// the split GEMV. No CUDA here: loaders and the `tp-plan` CLI use it.
//
// Choices (model-arch.md dims; the TP8 plan of bench/bench_cuda_decode.cpp):
//  - Split by attention heads: attn.wq_b (rows), attn.attn_sink, attn.wo_a (rows, whole output
//    groups: group g's input columns are exactly the heads of group g, so a rank holding the
//    groups of its own heads needs no communication between wq_b and wo_a), attn.wo_b (cols,
//    the matching o_groups*o_lora_rank slice; all-reduce after).
//  - Indexer split by index heads: indexer.wq_b (rows) and indexer.weights_proj (rows); the
//    per-head weighted score sum is then a partial sum per rank (all-reduce of the scores).
//    indexer.wk / k_norm stay replicated: the index key is one head, like the KV. With
//    split_index_heads off both are replicated: each rank scores a range of the entries with
//    every head and the ranks merge their selections (the CUDA backend's default: at 1M tokens
//    the scores' all-reduce is T x 250k floats per index layer).
//  - Experts (shared and routed): w1/w3 by intermediate rows, w2 by intermediate cols
//    (all-reduce after w2, shared with the attention's wo_b all-reduce where fused).
//  - head.weight split by vocab rows (default): it is 1.3 GB of BF16 read on every decode step,
//    the largest single read; slicing it costs one all-gather of the logits (vocab*4 bytes per
//    row). embed.weight stays replicated: a lookup reads one row, so only memory is at stake.
//  - Engram tables split by rows (default), unevenly if need be (chunk = ceil(rows/N); the owner
//    of row i is i / chunk): the released tables are ~98 GB each and cannot be replicated on one
//    GPU. Each rank gathers the rows it owns and zeros elsewhere; an all-reduce sums them.
//  - engram.wkv split by output rows (as the bench plan; all-gather after): 157 MB per layer.
//  - attn.wq_a replicated by default (an option splits its rows with an all-gather after):
//    5.7 MB per layer saved per rank is ~1.2 us of HBM time at TP8, less than one all-gather's
//    latency, and q_norm needs the whole vector anyway.
//  - Replicated: norms, mHC, routers and their biases, compressor, wkv and kv_norm (one KV head,
//    KV is replicated, model-arch.md §8), indexer wk, Engram q/k weights, DSpark main_proj /
//    markov / confidence heads, vision tower.
// FP8 weights split at 32-row/col block boundaries so their E8M0 32x32 scale blocks split with
// them; FP4 experts split packed bytes [out, in/2] and scales [out, in/32] consistently.

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "model/config.h"
#include "model/tensor_contract.h"

namespace uf::model {

enum class ShardMode { kReplicated, kSplit };
// What the runtime must do with the outputs of a split GEMV (or of a split lookup).
enum class TpCollective { kNone, kAllReduce, kAllGather };

const char* shard_mode_name(ShardMode m);
const char* tp_collective_name(TpCollective c);
const char* tensor_kind_name(TensorKind k);

struct TpOptions {
  bool split_head = true;   // head.weight by vocab rows (all-gather of logits)
  bool split_wq_a = false;  // attn.wq_a by rows (all-gather of the q latent)
  // attn.indexer.wq_b / weights_proj by index heads (all-reduce of the scores); off: replicated,
  // the runtime splits the entries a rank scores instead (the CUDA backend's default).
  bool split_index_heads = true;
  bool split_engram_tables = true;  // engram.embed.{weight,scale} by rows (uneven allowed)
  bool split_engram_wkv = true;     // engram.wkv by rows (all-gather after)
};

// How a TP step's indexer communicates (CudaModelOptions::tp_index_split_entries and
// index_split_min_work, whose defaults these are). By entries: an index-layer call of rows x
// positions (a row's entries, or the candidate pool's list) >= min_work gathers every rank's best
// index_topk (score, entry) pairs, and the candidate source also its block maxima; a smaller call
// none (every rank scores whole rows). By index heads: every call sums rows x positions scores.
inline constexpr int64_t kDefaultIndexSplitMinWork = int64_t(1) << 18;
struct TpIndexSplit {
  bool by_entries = true;
  int64_t min_work = kDefaultIndexSplitMinWork;
};
// The entry split's ranges (cuda/ops/index_split.h): a row's positions [begin, begin + len) on a
// rank, len a multiple of 4 (16-byte rows).
struct PositionRange {
  int64_t begin = 0;
  int64_t len = 0;
};
// Rank r of n's range of `positions` (ranges of ceil(positions / n) rounded up to `align`, a
// positive multiple of 4). Throws uf::core::Error on a bad rank, count or alignment.
PositionRange rank_position_range(int64_t positions, int n_ranks, int rank, int64_t align);
// What a full-width row's ranges are a multiple of: they start on a candidate block and hold
// whole 16-byte groups of positions and of block maxima (the P2P gather's vector path).
int64_t index_split_align(const ModelConfig& c);

struct TensorShard {
  std::string name;
  core::DType dtype;
  TensorKind kind;
  std::vector<int64_t> full_shape;  // the contract's shape
  ShardMode mode = ShardMode::kReplicated;
  int dim = -1;            // split storage dimension: 0 = rows (output features), 1 = cols (inputs)
  int64_t begin = 0;       // slice [begin, end) along `dim` in storage units (bytes of a packed FP4
  int64_t end = 0;         // row, 32-blocks of a scale); for replicated tensors [0, full_shape[0])
  int64_t feat_begin = 0;  // the same slice in logical features (elements of the unpacked,
  int64_t feat_end = 0;    // unscaled weight) so a scale can be matched with its weight
  std::vector<int64_t> shape;  // this rank's shard shape
  TpCollective collective = TpCollective::kNone;
  uint64_t nbytes = 0;  // this rank's shard bytes
};

struct TpPlan {
  int tp = 1;
  int rank = 0;
  TpOptions options;
  std::vector<TensorShard> shards;  // in tensor_contract order
  uint64_t total_bytes() const;
};

// Throws uf::core::Error naming the config field and the tensors affected when the config does
// not divide over `tp` ranks (heads, o_groups, index heads, expert intermediate blocks, ...).
void validate_tp(const ModelConfig& c, int tp, const TpOptions& o = {});
TpPlan make_tp_plan(const ModelConfig& c, int tp, int rank, const TpOptions& o = {});

// Copies rank's shard out of the whole tensor as stored in the checkpoint (`full`: row-major
// full_shape of dtype, as the safetensors bytes) into `dst` (s.nbytes, row-major s.shape).
// Rows: one contiguous block; cols: a strided copy per row; replicated: the whole tensor.
void copy_shard(const TensorShard& s, const void* full, void* dst);
// Whether the shard's s.nbytes bytes are contiguous in the whole tensor: replicated, or split
// along the outermost dimension (a row range); a column split is strided.
bool shard_contiguous(const TensorShard& s);
// The shard as a view into the whole tensor where it is contiguous there, else nullptr (a column
// split: copy_shard). The bytes are those copy_shard writes.
const uint8_t* shard_view(const TensorShard& s, const void* full);

}  // namespace uf::model
