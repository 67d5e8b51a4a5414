#include "model/tp_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string_view>

#include "core/error.h"
#include "core/tensor.h"

namespace uf::model {

const char* shard_mode_name(ShardMode m) { return m == ShardMode::kSplit ? "split" : "replicated"; }

const char* tp_collective_name(TpCollective c) {
  switch (c) {
    case TpCollective::kAllReduce:
      return "all-reduce";
    case TpCollective::kAllGather:
      return "all-gather";
    default:
      return "none";
  }
}

const char* tensor_kind_name(TensorKind k) {
  switch (k) {
    case TensorKind::kFp8Weight:
      return "fp8-weight";
    case TensorKind::kFp8Scale:
      return "fp8-scale";
    case TensorKind::kFp4Weight:
      return "fp4-weight";
    case TensorKind::kFp4Scale:
      return "fp4-scale";
    case TensorKind::kEngramTable:
      return "engram-table";
    case TensorKind::kEngramScale:
      return "engram-scale";
    case TensorKind::kBf16:
      return "bf16";
    case TensorKind::kF32:
      return "f32";
  }
  return "?";
}

uint64_t TpPlan::total_bytes() const {
  uint64_t n = 0;
  for (const auto& s : shards) n += s.nbytes;
  return n;
}

namespace {

struct Rule {
  ShardMode mode = ShardMode::kReplicated;
  int dim = -1;
  TpCollective collective = TpCollective::kNone;
  bool uneven = false;  // chunk = ceil(F / tp), the last ranks may hold fewer (or no) rows
};

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// The name inside its block ("attn.wq_b.weight" for "layers.3.attn.wq_b.weight"), or the whole
// name for top-level tensors.
std::string_view local_name(std::string_view name) {
  if (starts_with(name, "layers.") || starts_with(name, "mtp.")) {
    const size_t a = name.find('.');
    const size_t b = name.find('.', a + 1);
    if (b != std::string_view::npos) return name.substr(b + 1);
  }
  return name;
}

// The linear a `.weight` / `.scale` belongs to ("attn.wq_b").
std::string_view linear_of(std::string_view local) {
  for (std::string_view suf : {".weight", ".scale"})
    if (local.size() > suf.size() && local.substr(local.size() - suf.size()) == suf)
      return local.substr(0, local.size() - suf.size());
  return local;
}

Rule rule_for(const std::string& name, const TpOptions& o) {
  const std::string_view local = local_name(name);
  const bool in_block = local.size() != name.size();
  const std::string_view lin = linear_of(local);
  const Rule rows{ShardMode::kSplit, 0, TpCollective::kNone, false};
  const Rule rows_reduce{ShardMode::kSplit, 0, TpCollective::kAllReduce, false};
  const Rule rows_gather{ShardMode::kSplit, 0, TpCollective::kAllGather, false};
  const Rule cols_reduce{ShardMode::kSplit, 1, TpCollective::kAllReduce, false};
  if (!in_block) {
    if (name == "head.weight" && o.split_head) return rows_gather;
    return {};
  }
  if (lin == "attn.attn_sink" || lin == "attn.wq_b" || lin == "attn.wo_a") return rows;
  if (lin == "attn.indexer.wq_b" && o.split_index_heads) return rows;
  if (lin == "attn.wo_b") return cols_reduce;
  // Each rank's heads give a partial sum of the weighted index scores.
  if (lin == "attn.indexer.weights_proj" && o.split_index_heads) return rows_reduce;
  if (lin == "attn.wq_a" && o.split_wq_a) return rows_gather;
  if (lin == "ffn.shared_experts.w1" || lin == "ffn.shared_experts.w3") return rows;
  if (lin == "ffn.shared_experts.w2") return cols_reduce;
  if (starts_with(lin, "ffn.experts.")) {
    if (lin.ends_with(".w1") || lin.ends_with(".w3")) return rows;
    if (lin.ends_with(".w2")) return cols_reduce;
  }
  if (lin == "engram.embed" && o.split_engram_tables)
    return {ShardMode::kSplit, 0, TpCollective::kAllReduce, true};
  if (lin == "engram.wkv" && o.split_engram_wkv) return rows_gather;
  return {};
}

// Logical features per storage unit along `dim` (a packed FP4 byte holds 2 inputs, a scale
// entry covers 32 features of its weight).
int64_t features_per_unit(TensorKind k, int dim) {
  switch (k) {
    case TensorKind::kFp8Scale:
      return 32;
    case TensorKind::kFp4Weight:
      return dim == 1 ? 2 : 1;
    case TensorKind::kFp4Scale:
    case TensorKind::kEngramScale:
      return dim == 1 ? 32 : 1;
    default:
      return 1;
  }
}

// The block a split along `dim` must respect so the scales split with their weight.
int64_t block_align(TensorKind k, int dim) {
  switch (k) {
    case TensorKind::kFp8Weight:
    case TensorKind::kFp8Scale:
      return 32;
    case TensorKind::kFp4Weight:
    case TensorKind::kFp4Scale:
    case TensorKind::kEngramScale:
      return dim == 1 ? 32 : 1;
    default:
      return 1;
  }
}

uint64_t bytes_of(core::DType dt, const std::vector<int64_t>& shape) {
  uint64_t n = core::dtype_size(dt);
  for (int64_t d : shape) n *= uint64_t(d);
  return n;
}

bool any_role(const ModelConfig& c, bool LayerRole::*flag) {
  for (const auto& r : c.roles)
    if (r.*flag) return true;
  return false;
}

}  // namespace

void validate_tp(const ModelConfig& c, int tp, const TpOptions& o) {
  UF_CHECK(tp >= 1, "tensor parallelism: tp = {} must be at least 1", tp);
  if (tp == 1) return;
  UF_CHECK(c.n_heads % tp == 0,
           "tp = {}: n_heads = {} is not divisible by tp (attn.wq_b, attn.attn_sink are split by "
           "heads)",
           tp, c.n_heads);
  UF_CHECK(c.o_groups % tp == 0,
           "tp = {}: o_groups = {} is not divisible by tp (attn.wo_a is split by whole output "
           "groups, attn.wo_b by their columns)",
           tp, c.o_groups);
  UF_CHECK(int64_t(c.n_heads / tp) * c.head_dim % 32 == 0,
           "tp = {}: a rank's attn.wq_b rows (n_heads/tp * head_dim = {}) are not a multiple "
           "of the 32-row FP8 scale block",
           tp, int64_t(c.n_heads / tp) * c.head_dim);
  UF_CHECK(int64_t(c.o_groups / tp) * c.o_lora_rank % 32 == 0,
           "tp = {}: a rank's attn.wo_a rows / attn.wo_b cols (o_groups/tp * o_lora_rank = {}) "
           "are not a multiple of the 32 FP8 scale block",
           tp, int64_t(c.o_groups / tp) * c.o_lora_rank);
  if (o.split_index_heads && any_role(c, &LayerRole::index_source)) {
    UF_CHECK(c.index_n_heads % tp == 0,
             "tp = {}: index_n_heads = {} is not divisible by tp (attn.indexer.wq_b and "
             "attn.indexer.weights_proj are split by index heads)",
             tp, c.index_n_heads);
    UF_CHECK(int64_t(c.index_n_heads / tp) * c.index_head_dim % 32 == 0,
             "tp = {}: a rank's attn.indexer.wq_b rows ({}) are not a multiple of the 32-row FP8 "
             "scale block",
             tp, int64_t(c.index_n_heads / tp) * c.index_head_dim);
  }
  UF_CHECK(c.moe_inter_dim % tp == 0 && (c.moe_inter_dim / tp) % 32 == 0,
           "tp = {}: moe_inter_dim / tp = {}/{} is not a whole multiple of 32 (the expert w2 "
           "input columns split at the FP4 / FP8 32-wide scale blocks; w1/w3 rows with them)",
           tp, c.moe_inter_dim, tp);
  if (o.split_head)
    UF_CHECK(c.vocab_size % tp == 0,
             "tp = {}: vocab_size = {} is not divisible by tp (head.weight is split by vocab "
             "rows; turn split_head off to replicate it)",
             tp, c.vocab_size);
  if (o.split_wq_a)
    UF_CHECK(c.q_lora_rank % (32 * tp) == 0,
             "tp = {}: q_lora_rank = {} does not split into 32-row FP8 blocks (attn.wq_a)", tp,
             c.q_lora_rank);
  if (o.split_engram_wkv && !c.engram_layer_ids.empty()) {
    const int64_t rows = int64_t(c.dim) * (c.hc_mult + 1);
    UF_CHECK(rows % (32 * tp) == 0,
             "tp = {}: engram.wkv rows dim*(hc_mult+1) = {} do not split into 32-row FP8 "
             "blocks",
             tp, rows);
  }
}

TpPlan make_tp_plan(const ModelConfig& c, int tp, int rank, const TpOptions& o) {
  validate_tp(c, tp, o);
  UF_CHECK(rank >= 0 && rank < tp, "tensor parallelism: rank {} is outside 0..{}", rank, tp - 1);
  TpPlan plan;
  plan.tp = tp;
  plan.rank = rank;
  plan.options = o;
  for (const auto& e : tensor_contract(c)) {
    TensorShard s;
    s.name = e.name;
    s.dtype = e.dtype;
    s.kind = e.kind;
    s.full_shape = e.shape;
    s.shape = e.shape;
    const Rule r = rule_for(e.name, o);
    if (r.mode == ShardMode::kReplicated) {
      s.end = e.shape.empty() ? 1 : e.shape[0];
      s.feat_end = s.end * features_per_unit(e.kind, 0);
    } else {
      UF_CHECK(r.dim < int(e.shape.size()), "tp plan: {} has no dimension {} to split", e.name,
               r.dim);
      s.mode = ShardMode::kSplit;
      s.dim = r.dim;
      s.collective = r.collective;
      const int64_t unit = features_per_unit(e.kind, r.dim);
      const int64_t align = block_align(e.kind, r.dim);
      const int64_t feats = e.shape[size_t(r.dim)] * unit;
      int64_t chunk;
      if (r.uneven) {
        chunk = (feats + tp - 1) / tp;
      } else {
        UF_CHECK(feats % tp == 0 && (feats / tp) % align == 0,
                 "tp = {}: {} ({} {}) does not split along dim {} into {} slices of whole "
                 "{}-feature blocks",
                 tp, e.name, core::dtype_name(e.dtype), core::shape_string(e.shape), r.dim, tp,
                 align);
        chunk = feats / tp;
      }
      s.feat_begin = std::min(feats, chunk * rank);
      s.feat_end = std::min(feats, chunk * (rank + 1));
      s.begin = s.feat_begin / unit;
      s.end = s.feat_end / unit;
      s.shape[size_t(r.dim)] = s.end - s.begin;
    }
    s.nbytes = bytes_of(s.dtype, s.shape);
    plan.shards.push_back(std::move(s));
  }
  return plan;
}

namespace {
// A split shard's place in the whole tensor: `inner` bytes per index step along s.dim (the
// product of the later dims), `outer` repetitions (the product of the earlier ones).
struct ShardSpan {
  uint64_t inner, outer;
};
ShardSpan shard_span(const TensorShard& s) {
  ShardSpan r{core::dtype_size(s.dtype), 1};
  for (size_t d = size_t(s.dim) + 1; d < s.full_shape.size(); ++d)
    r.inner *= uint64_t(s.full_shape[d]);
  for (size_t d = 0; d < size_t(s.dim); ++d) r.outer *= uint64_t(s.full_shape[d]);
  return r;
}
}  // namespace

void copy_shard(const TensorShard& s, const void* full, void* dst) {
  const auto* src = static_cast<const uint8_t*>(full);
  auto* out = static_cast<uint8_t*>(dst);
  if (s.mode == ShardMode::kReplicated) {
    std::memcpy(out, src, s.nbytes);
    return;
  }
  const auto [inner, outer] = shard_span(s);
  const uint64_t full_span = uint64_t(s.full_shape[size_t(s.dim)]) * inner;
  const uint64_t part = uint64_t(s.end - s.begin) * inner;
  for (uint64_t o = 0; o < outer; ++o)
    std::memcpy(out + o * part, src + o * full_span + uint64_t(s.begin) * inner, part);
}

bool shard_contiguous(const TensorShard& s) {
  return s.mode == ShardMode::kReplicated || shard_span(s).outer == 1;
}

const uint8_t* shard_view(const TensorShard& s, const void* full) {
  const auto* src = static_cast<const uint8_t*>(full);
  if (s.mode == ShardMode::kReplicated) return src;
  const auto [inner, outer] = shard_span(s);
  return outer == 1 ? src + uint64_t(s.begin) * inner : nullptr;
}

PositionRange rank_position_range(int64_t positions, int n_ranks, int rank, int64_t align) {
  UF_CHECK(
      n_ranks >= 1 && rank >= 0 && rank < n_ranks && align >= 4 && align % 4 == 0 && positions >= 0,
      "rank_position_range: rank {} of {}, {} positions, align {}", rank, n_ranks, positions,
      align);
  const int64_t per = (positions + n_ranks - 1) / n_ranks;
  PositionRange r;
  r.len = std::max<int64_t>(align, (per + align - 1) / align * align);
  r.begin = int64_t(rank) * r.len;
  return r;
}

int64_t index_split_align(const ModelConfig& c) {
  const int64_t bs = c.candidate_source_layer >= 0 ? std::max(c.candidate_block_size, 1) : 1;
  return std::lcm<int64_t>(4, 4 * bs);
}

}  // namespace uf::model
