#include "model/synthetic.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>

#include "core/dtypes.h"
#include "core/error.h"
#include "model/engram_primes.h"
#include "model/tp_plan.h"

namespace uf::model {

using core::fail;

// ---- Rank slice ----

ModelConfig rank_slice_config(const ModelConfig& c, int tp) {
  UF_CHECK(tp >= 1, "rank_slice_config: tp = {} must be at least 1", tp);
  // The CUDA backend's sharding (cuda/backend/cuda_model.h backend_tp_options()): heads, index
  // heads and experts split; head, embedding and Engram replicated.
  TpOptions o;
  o.split_head = false;
  o.split_wq_a = false;
  o.split_engram_tables = false;
  o.split_engram_wkv = false;
  validate_tp(c, tp, o);
  ModelConfig r = c;
  r.n_heads = c.n_heads / tp;
  r.o_groups = c.o_groups / tp;
  r.index_n_heads = c.index_n_heads / tp;
  r.moe_inter_dim = c.moe_inter_dim / tp;
  r.roles.clear();
  r.derive_roles();
  r.validate();
  return r;
}

ModelConfig with_engram_rows(const ModelConfig& c, int64_t rows) {
  if (c.engram_layer_ids.empty()) return c;
  const int64_t buckets = int64_t(c.engram_max_ngram_size - 1) * c.engram_n_heads;
  UF_CHECK(buckets > 0 && rows / buckets >= 64,
           "with_engram_rows: {} rows give fewer than 64 rows to each of the {} hash buckets of an "
           "Engram table",
           rows, buckets);
  ModelConfig r = c;
  // A table's rows are the sum of its bucket primes, each just above engram_vocab_size - 1.
  r.engram_vocab_size = std::min<int64_t>(c.engram_vocab_size, rows / buckets);
  r.engram_num_embeddings = engram_prime_sums(r);
  r.roles.clear();
  r.derive_roles();
  r.validate();
  return r;
}

std::vector<int64_t> synthetic_engram_token_map(const ModelConfig& c) {
  if (c.engram_layer_ids.empty()) return {};
  std::vector<int64_t> m(size_t(c.vocab_size));
  for (int64_t t = 0; t < c.vocab_size; ++t) m[size_t(t)] = t % c.engram_compressed_vocab_size;
  return m;
}

// ---- Value pools ----

namespace {

enum class PoolKind { kFp8, kE8m0, kFp4, kBf16, kBf16Norm, kF32, kCount };

const char* pool_name(PoolKind k) {
  switch (k) {
    case PoolKind::kFp8:
      return "fp8-e4m3";
    case PoolKind::kE8m0:
      return "e8m0-scale";
    case PoolKind::kFp4:
      return "fp4-packed";
    case PoolKind::kBf16:
      return "bf16";
    case PoolKind::kBf16Norm:
      return "bf16-norm";
    case PoolKind::kF32:
      return "f32";
    default:
      return "?";
  }
}

PoolKind pool_of(const ExpectedTensor& e) {
  switch (e.kind) {
    case TensorKind::kFp8Weight:
    case TensorKind::kEngramTable:
      return PoolKind::kFp8;
    case TensorKind::kFp8Scale:
    case TensorKind::kFp4Scale:
    case TensorKind::kEngramScale:
      return PoolKind::kE8m0;
    case TensorKind::kFp4Weight:
      return PoolKind::kFp4;
    case TensorKind::kF32:
      return PoolKind::kF32;
    case TensorKind::kBf16:
      // Every RMSNorm weight is named *norm*.weight (attn_norm, q_norm, compressor.norm, norm1,
      // ...): around 1 so that the stream keeps its scale.
      return e.name.find("norm") != std::string::npos ? PoolKind::kBf16Norm : PoolKind::kBf16;
  }
  return PoolKind::kBf16;
}

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Fills `n` bytes with the kind's values (whole elements: n is a multiple of 4).
void fill_values(PoolKind k, uint64_t seed, uint8_t* p, size_t n) {
  uint64_t s = seed * 0x2545f4914f6cdd1dull + uint64_t(k) + 1;
  auto uniform = [&](float lo, float hi) {
    return lo + (hi - lo) * float(double(splitmix64(s) >> 11) * 0x1.0p-53);
  };
  switch (k) {
    case PoolKind::kFp8:
      // E4M3 codes 0x00..0x38 (magnitude <= 1.0) with a random sign: never 0x7f / 0xff (NaN).
      for (size_t i = 0; i < n; ++i) {
        const uint64_t r = splitmix64(s);
        p[i] = uint8_t((r % 0x39) | ((r >> 32) & 1 ? 0x80 : 0));
      }
      break;
    case PoolKind::kE8m0:
      // 2^-9 .. 2^-5 (code 127 = 2^0).
      for (size_t i = 0; i < n; ++i) p[i] = uint8_t(118 + splitmix64(s) % 5);
      break;
    case PoolKind::kFp4:
      // Every byte is two valid E2M1 codes (|value| <= 6).
      for (size_t i = 0; i < n; ++i) p[i] = uint8_t(splitmix64(s));
      break;
    case PoolKind::kBf16:
    case PoolKind::kBf16Norm:
      for (size_t i = 0; i + 1 < n; i += 2) {
        const float v = k == PoolKind::kBf16Norm ? uniform(0.9f, 1.1f) : uniform(-0.05f, 0.05f);
        const uint16_t b = core::float_to_bf16(v);
        std::memcpy(p + i, &b, 2);
      }
      break;
    case PoolKind::kF32:
      for (size_t i = 0; i + 3 < n; i += 4) {
        const float v = uniform(-0.05f, 0.05f);
        std::memcpy(p + i, &v, 4);
      }
      break;
    default:
      break;
  }
}

size_t page_size() {
  static const size_t p = size_t(::sysconf(_SC_PAGESIZE));
  return p;
}

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

// A read-only virtual span of `span` bytes that repeats one physical block of `block` bytes.
// Never unmapped: views of every synthetic checkpoint of the process point into it.
struct Pool {
  PoolKind kind;
  uint64_t seed;
  size_t block = 0;
  size_t span = 0;
  const uint8_t* base = nullptr;
};

Pool make_pool(PoolKind kind, uint64_t seed, size_t block, size_t span) {
  const int fd = ::memfd_create("uf-synthetic-pool", MFD_CLOEXEC);
  UF_CHECK(fd >= 0, "synthetic checkpoint: memfd_create for the {} pool failed: {}",
           pool_name(kind), std::strerror(errno));
  if (::ftruncate(fd, off_t(block)) != 0) {
    ::close(fd);
    fail("synthetic checkpoint: cannot size the {} pool to {} bytes: {}", pool_name(kind), block,
         std::strerror(errno));
  }
  void* w = ::mmap(nullptr, block, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (w == MAP_FAILED) {
    ::close(fd);
    fail("synthetic checkpoint: cannot map the {} pool ({} bytes): {}", pool_name(kind), block,
         std::strerror(errno));
  }
  fill_values(kind, seed, static_cast<uint8_t*>(w), block);
  ::munmap(w, block);
  // Reserve the span, then map the block over it again and again.
  void* base = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    ::close(fd);
    fail("synthetic checkpoint: cannot reserve {} bytes of address space for the {} pool: {}", span,
         pool_name(kind), std::strerror(errno));
  }
  auto* b = static_cast<uint8_t*>(base);
  for (size_t off = 0; off < span; off += block) {
    void* m = ::mmap(b + off, block, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
    if (m == MAP_FAILED) {
      ::close(fd);
      fail(
          "synthetic checkpoint: cannot map the {} pool at offset {} of {} (vm.max_map_count?): "
          "{}",
          pool_name(kind), off, span, std::strerror(errno));
    }
  }
  ::close(fd);  // the mappings keep the memory alive
  return {kind, seed, block, span, b};
}

// Process-lifetime pools; a larger request makes a new pool (older views keep the old one).
const uint8_t* pool_base(PoolKind kind, uint64_t seed, size_t block, size_t span) {
  static std::mutex mu;
  static std::vector<Pool> pools;
  std::lock_guard<std::mutex> lock(mu);
  for (const Pool& p : pools)
    if (p.kind == kind && p.seed == seed && p.block == block && p.span >= span) return p.base;
  pools.push_back(make_pool(kind, seed, block, span));
  return pools.back().base;
}

struct PoolPlan {
  std::string largest;
  uint64_t largest_bytes = 0;
};

std::vector<PoolPlan> plan_pools(const std::vector<ExpectedTensor>& contract) {
  std::vector<PoolPlan> plan(size_t(PoolKind::kCount));
  for (const auto& e : contract) {
    PoolPlan& p = plan[size_t(pool_of(e))];
    if (e.nbytes() > p.largest_bytes) p = {e.name, e.nbytes()};
  }
  return plan;
}

// Physical block and virtual span of a pool whose largest tensor has `largest` bytes.
std::pair<size_t, size_t> block_and_span(uint64_t largest, size_t block_opt) {
  const size_t pg = page_size();
  const size_t need = round_up(std::max<size_t>(size_t(largest), 1), pg);
  const size_t block = std::min(round_up(std::max<size_t>(block_opt, 1), pg), need);
  return {block, round_up(need, block)};
}

}  // namespace

std::vector<SyntheticPool> synthetic_pools(const ModelConfig& c, const SyntheticOptions& o) {
  const auto plan = plan_pools(tensor_contract(c));
  std::vector<SyntheticPool> out;
  for (size_t k = 0; k < plan.size(); ++k) {
    if (plan[k].largest_bytes == 0) continue;
    const auto [block, span] = block_and_span(plan[k].largest_bytes, o.pool_block_bytes);
    out.push_back({pool_name(PoolKind(k)), plan[k].largest, plan[k].largest_bytes, block});
    (void)span;
  }
  return out;
}

Checkpoint synthetic_checkpoint(const ModelConfig& c, uint64_t seed, const SyntheticOptions& o) {
  const auto contract = tensor_contract(c);
  const auto plan = plan_pools(contract);
  std::vector<const uint8_t*> base(plan.size(), nullptr);
  for (size_t k = 0; k < plan.size(); ++k) {
    if (plan[k].largest_bytes == 0) continue;
    const auto [block, span] = block_and_span(plan[k].largest_bytes, o.pool_block_bytes);
    base[k] = pool_base(PoolKind(k), seed, block, span);
  }
  std::vector<TensorEntry> entries;
  entries.reserve(contract.size());
  for (const auto& e : contract) {
    TensorEntry t;
    t.name = e.name;
    t.file = "<synthetic>";
    t.view.dtype = e.dtype;
    t.view.shape = e.shape;
    t.view.data = base[size_t(pool_of(e))];
    t.view.nbytes = size_t(e.nbytes());
    t.begin = 0;
    t.end = e.nbytes();
    entries.push_back(std::move(t));
  }
  return Checkpoint::from_views("<synthetic>", std::move(entries));
}

// ---- Memory floor ----

double expected_distinct_experts(int n_experts, int top_k, int rows) {
  if (n_experts <= 0 || top_k <= 0 || rows <= 0) return 0;
  const double miss = 1.0 - double(std::min(top_k, n_experts)) / n_experts;
  return n_experts * (1.0 - std::pow(miss, rows));
}

double StepFloor::total(const std::vector<FloorItem>& items) {
  double t = 0;
  for (const auto& i : items) t += i.bytes;
  return t;
}

namespace {

const char* const kIndexerDetail =
    "FP8 wq_b + BF16 weights_proj (rank's index heads), BF16 wk/k_norm; FP4 index keys (68 B) "
    "scored at this context";

double c32(double x) { return std::ceil(x / 32); }
// FP8 E4M3 [out, in] + E8M0 [ceil(out/32), ceil(in/32)].
double fp8(double out, double in) { return out * in + c32(out) * c32(in); }
// Packed MXFP4 [out, in/2] + E8M0 [out, in/32].
double fp4(double out, double in) { return out * in / 2 + out * in / 32; }
double bf16(double n) { return 2 * n; }
double f32(double n) { return 4 * n; }

// Accumulates bytes per named component, in first-use order.
class Items {
 public:
  explicit Items(std::vector<FloorItem>& out) : out_(out) {}
  void add(const std::string& name, double bytes, const std::string& detail) {
    for (auto& i : out_)
      if (i.name == name) {
        i.bytes += bytes;
        return;
      }
    out_.push_back({name, bytes, detail});
  }

 private:
  std::vector<FloorItem>& out_;
};

// Weights every block has (backbone layer or DSpark stage) and the one-per-step reads of its
// attention and FFN; `experts` distinct routed experts.
void block_weights(const ModelConfig& c, const LayerRole& r, double experts, Items& it) {
  const double d = c.dim, hd = c.head_dim, H = c.n_heads, G = c.o_groups, hc = c.hc_mult;
  const double mix = (2 + hc) * hc, inter = c.moe_inter_dim, ne = r.n_routed_experts;
  // FP8 weights + their 32x32 E8M0 scales (wq_a, wq_b of this rank's heads, wkv, wo_a of its
  // groups, wo_b of its group columns), BF16 q_norm / kv_norm, F32 sinks.
  it.add("attention projections",
         fp8(c.q_lora_rank, d) + fp8(H * hd, c.q_lora_rank) + fp8(hd, d) +
             fp8(G * c.o_lora_rank, H * hd / G) + fp8(d, G * c.o_lora_rank) + bf16(c.q_lora_rank) +
             bf16(hd) + f32(H),
         "FP8 wq_a, wq_b, wkv, wo_a, wo_b + E8M0 32x32 scales; BF16 q/kv norms; F32 sinks");
  // mHC: two F32 hc_fn [(2+hc)hc, hc*d] (+ base, scale) per block, read whole for any row count;
  // BF16 attn / ffn norm weights.
  it.add("mHC + norms", 2 * f32(mix * hc * d + mix + 3) + 2 * bf16(d),
         "F32 hc_attn/hc_ffn fn [24, 4d] + base + scale; BF16 attn/ffn norms");
  // Router: BF16 gate [E, d] and the F32 bias (bias_vl only for image spans: not read).
  it.add("router", bf16(ne * d) + f32(ne), "BF16 gate [E, d] + F32 bias");
  it.add("shared expert", 2 * fp8(inter, d) + fp8(d, inter),
         "FP8 w1, w3 [inter, d], w2 [d, inter] (this rank's inter) + E8M0 scales");
  // Routed experts: each distinct expert the rows picked, w1 + w3 + w2 once.
  it.add("routed experts", experts * (2 * fp4(inter, d) + fp4(d, inter)),
         "MXFP4 w1, w3, w2 (this rank's inter) + E8M0 per-32 scales, x distinct experts");
}

}  // namespace

StepFloor step_floor(const ModelConfig& c, int rows, int64_t context, const FloorOptions& o) {
  UF_CHECK(rows >= 1, "step_floor: rows = {} must be at least 1", rows);
  UF_CHECK(context >= 1, "step_floor: context = {} must be at least 1 committed token", context);
  UF_CHECK(int(c.roles.size()) == c.n_total_layers(), "step_floor: the config has no layer roles");
  StepFloor f;
  f.rows = rows;
  f.context = context;
  f.routed_experts = o.routed_experts >= 0 ? o.routed_experts
                                           : expected_distinct_experts(c.n_routed_experts,
                                                                       c.n_activated_experts, rows);
  const int B = c.dspark_block_size;
  f.dspark_experts =
      o.dspark_experts >= 0
          ? o.dspark_experts
          : expected_distinct_experts(c.dspark_n_routed_experts, c.dspark_n_activated_experts, B);
  const double d = c.dim, hd = c.head_dim, V = c.vocab_size, T = rows;
  const double ihd = c.index_head_dim;
  // KV entries at the original engine's formats (model-arch.md §8).
  const double win_entry = hd + hd / 32;         // FP8 + E8M0 per 32: 528 B
  const double ckv_entry = hd / 2 + hd / 16;     // FP4 + E4M3 per 16: 288 B
  const double ikey_entry = ihd / 2 + ihd / 32;  // FP4 + E8M0 per 32: 68 B
  const int64_t end = context + rows;            // positions after the step's last row

  Items v(f.verify);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerRole& r = c.role(l);
    block_weights(c, r, f.routed_experts, v);
    // Window: the union of the rows' windows, [context - window + 1, context + T - 1].
    v.add("window KV",
          double(std::min<int64_t>(end, int64_t(c.window_size) + rows - 1)) * win_entry,
          "FP8 entries (512 B + 16 B E8M0) in the union of the rows' windows, per layer");
    if (r.kv_from >= 0) {
      const int ratio = c.role(r.kv_from).compress_ratio;
      const int64_t visible = end / ratio;
      // Floor: the rows of a step share their top-k (neighbouring positions select nearly the
      // same entries), so one selection per layer; all visible entries without an indexer.
      const int64_t n = r.topk_from >= 0 ? std::min<int64_t>(visible, c.index_topk) : visible;
      v.add("compressed KV (top-k)", double(n) * ckv_entry,
            "FP4 entries (256 B + 32 B E4M3) of one top-k selection, per compressed layer");
    }
    if (r.kv_source) {
      // BF16 wkv (+ wgate at ratio > 1) [hd, d] and norm, every row.
      v.add("compressor", bf16(hd * d) * (r.compress_ratio > 1 ? 2 : 1) + bf16(hd),
            "BF16 wkv (+ wgate at ratio 2) [512, d] + norm on the KV sources");
      // The owner's index-key projection of each emitted latent.
      v.add("indexer", bf16(ihd * hd) + bf16(ihd), kIndexerDetail);
    }
    if (r.index_source) {
      const double Hi = c.index_n_heads;
      int64_t keys = 0;
      if (r.index_keys_from >= 0) {
        keys = end / c.role(r.index_keys_from).compress_ratio;
        if (r.candidate_restricted)
          keys = std::min<int64_t>(keys, int64_t(c.candidate_topk_blocks) * c.candidate_block_size);
      }
      // FP8 wq_b of this rank's index heads, BF16 weights_proj; every visible key scored once
      // for all rows (the reindex layers only the candidate pool's).
      v.add("indexer", fp8(Hi * ihd, c.q_lora_rank) + bf16(Hi * d) + double(keys) * ikey_entry,
            kIndexerDetail);
    }
    if (r.engram) {
      const double n_cols = double(c.engram_max_ngram_size - 1) * c.engram_n_heads;
      const double ehd = c.engram_head_dim, hc = c.hc_mult;
      // 24 table rows per token (hash collisions between rows ignored).
      v.add("Engram rows", T * n_cols * (ehd + ehd / 32),
            "FP8 rows [256] + E8M0 [8], 24 per row per Engram layer");
      v.add("Engram projections", fp8(d * (hc + 1), n_cols * ehd) + 2 * bf16(hc * d),
            "FP8 wkv [d(hc+1), 24*256] (replicated) + BF16 q/k weights");
    }
  }
  v.add("embedding rows", T * bf16(d), "BF16 rows of the step's tokens");
  const double Vh = V / std::max(o.head_slices, 1);  // the rows of the head this rank reads
  const std::string head_what = o.head_slices > 1 ? "its vocab slice" : "replicated";
  v.add("head", bf16(Vh * d) + bf16(d),
        "BF16 head [V, d] once for all rows (" + head_what + ") + norm");

  if (c.n_mtp_layers > 0 && B > 0) {
    Items dr(f.draft);
    for (int s = 0; s < c.n_mtp_layers; ++s) {
      const LayerRole& r = c.role(c.n_layers + s);
      block_weights(c, r, f.dspark_experts, dr);
      // Ring entries up to the anchor's position (at most window) + the block's own rows.
      dr.add("window KV", double(std::min<int64_t>(context, c.window_size) + B) * win_entry,
             "FP8 ring entries + the block's rows, per stage");
    }
    dr.add("embedding rows", B * bf16(d), "BF16 rows of the block's tokens");
    dr.add("head", bf16(Vh * d) + bf16(d),
           "BF16 head [V, d] (" + head_what + ") once for the block + final norm");
    // The slots are sequential (slot i's bias needs slot i-1's sampled token) and H_m [V, rank]
    // (66 MB) does not stay in L2: read once per slot. E_m: one row per slot.
    const double rank = c.dspark_markov_rank;
    dr.add("Markov head", B * bf16(V * rank) + B * bf16(rank) + bf16(d + rank),
           "BF16 H_m [V, rank] once per slot + E_m rows + confidence proj");
    Items cm(f.commit);
    cm.add("DSpark ring write",
           fp8(d, d * double(c.dspark_target_layer_ids.size())) + bf16(d) +
               c.n_mtp_layers * (fp8(hd, d) + bf16(hd)),
           "FP8 main_proj [d, taps*d] + main_norm + each stage's wkv + kv_norm (at commit)");
  }
  return f;
}

}  // namespace uf::model

// ---- Benchmark arithmetic ----

namespace uf::model {

int64_t index_score_width(const ModelConfig& c, int64_t capacity) {
  UF_CHECK(capacity > 0, "index_score_width: capacity {} must be positive", capacity);
  int64_t width = 1;
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& r = c.role(l);
    if (r.index_source && r.compress_ratio > 0)
      width = std::max(width, capacity / r.compress_ratio + 1);
  }
  return width;
}

std::vector<CollectiveCall> tp_verify_collectives(const ModelConfig& c, int tp, int rows,
                                                  int64_t capacity, TpIndexSplit index) {
  UF_CHECK(tp >= 1 && rows >= 1, "tp_verify_collectives: tp {} and rows {} must be >= 1", tp, rows);
  if (tp == 1) return {};
  // index_select runs on every index-source layer; the candidate-restricted ones (Reindex) score
  // only the candidate pool's list (CudaModelOptions::candidate_lists): topk_blocks * block_size
  // entries a row, or the width rounded up to whole blocks when that is less.
  const int64_t width = index_score_width(c, capacity);
  const int64_t bs = std::max(c.candidate_block_size, 1);
  const int64_t pool =
      std::min<int64_t>(int64_t(c.candidate_topk_blocks) * bs, (width + bs - 1) / bs * bs);
  int full = 0, pooled = 0, picks = 0, maxima = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& r = c.role(l);
    if (!r.index_source) continue;
    const bool listed = r.candidate_restricted && c.candidate_source_layer >= 0;
    if (!index.by_entries) {
      ++(listed ? pooled : full);
    } else if (int64_t(rows) * (listed ? pool : width) >= index.min_work) {
      ++picks;
      if (r.candidate_source) ++maxima;
    }
  }
  const int64_t d = int64_t(rows) * c.dim;
  std::vector<CollectiveCall> v = {{"wo_b partial (attention output)", c.n_layers, d},
                                   {"MoE partial", c.n_layers, d}};
  // Engram tables split by rows (cuda_tp.cpp): each rank gathers the rows it holds, +0 for the
  // others, summed over the ranks: (max_ngram - 1) x n_heads ids a row, head_dim values each.
  if (!c.engram_layer_ids.empty())
    v.push_back(
        {"Engram rows (row-split tables)", int(c.engram_layer_ids.size()),
         int64_t(rows) * (c.engram_max_ngram_size - 1) * c.engram_n_heads * c.engram_head_dim});
  if (full > 0) v.push_back({"index scores", full, int64_t(rows) * width});
  if (pooled > 0) v.push_back({"index scores (candidate pool)", pooled, int64_t(rows) * pool});
  if (picks > 0)
    v.push_back({"index picks (entry split, gather)", picks, int64_t(rows) * 2 * c.index_topk});
  if (maxima > 0) {
    // The blocks of a rank's range of a row (the backend's split_blocks).
    const int64_t len = rank_position_range(width, tp, 0, index_split_align(c)).len;
    v.push_back(
        {"candidate block maxima (entry split, gather)", maxima, int64_t(rows) * (len / bs)});
  }
  // The vocab-split head (CudaModelOptions::tp_split_head, on where the vocab divides): one
  // all-gather of the rows' logit slices.
  if (c.vocab_size % tp == 0)
    v.push_back({"head logits (gather)", 1, int64_t(rows) * (c.vocab_size / tp)});
  return v;
}

std::vector<CollectiveCall> tp_draft_collectives(const ModelConfig& c, int tp) {
  UF_CHECK(tp >= 1, "tp_draft_collectives: tp {} must be >= 1", tp);
  if (tp == 1 || c.n_mtp_layers == 0) return {};
  const int64_t d = int64_t(c.dspark_block_size) * c.dim;
  std::vector<CollectiveCall> v = {{"DSpark wo_b partial", c.n_mtp_layers, d},
                                   {"DSpark MoE partial", c.n_mtp_layers, d}};
  if (c.vocab_size % tp == 0)  // the block's logits from the split head
    v.push_back(
        {"DSpark head logits (gather)", 1, int64_t(c.dspark_block_size) * (c.vocab_size / tp)});
  return v;
}

int total_calls(const std::vector<CollectiveCall>& v) {
  int n = 0;
  for (const auto& x : v) n += x.calls;
  return n;
}

double comm_time_us(std::vector<CommSample> t, double bytes) {
  UF_CHECK(!t.empty(), "comm_time_us: no measured collective times");
  std::sort(t.begin(), t.end(),
            [](const CommSample& a, const CommSample& b) { return a.bytes < b.bytes; });
  // Below the smallest size the latency dominates; with one sample no slope is known.
  if (bytes <= t.front().bytes || t.size() == 1) return t.front().us;
  size_t i = 1;
  while (i + 1 < t.size() && t[i].bytes < bytes) ++i;
  const auto &a = t[i - 1], &b = t[i];
  if (b.bytes == a.bytes) return std::max(a.us, b.us);
  return a.us + (b.us - a.us) * (bytes - a.bytes) / (b.bytes - a.bytes);
}

double comm_step_us(const std::vector<CollectiveCall>& calls,
                    const std::vector<CommSample>& table) {
  double us = 0;
  for (const auto& c : calls) us += double(c.calls) * comm_time_us(table, c.bytes());
  return us;
}

double tokens_per_second(double accepted, double step_us) {
  UF_CHECK(step_us > 0 && accepted > 0,
           "tokens_per_second: step {} us and accepted length {} must be positive", step_us,
           accepted);
  return accepted / (step_us * 1e-6);
}

double prefill_seconds(std::vector<PrefillPoint> p, int64_t tokens) {
  UF_CHECK(!p.empty(), "prefill_seconds: no measured prefill points");
  UF_CHECK(tokens >= 0, "prefill_seconds: {} tokens", tokens);
  for (const auto& x : p)
    UF_CHECK(x.us_per_token > 0 && x.context >= 0,
             "prefill_seconds: point at context {} has {} us per token", x.context, x.us_per_token);
  std::sort(p.begin(), p.end(),
            [](const PrefillPoint& a, const PrefillPoint& b) { return a.context < b.context; });
  // f(c): per-token time at context c. Integrate over [0, tokens] piece by piece.
  auto f = [&](double c) {
    if (c <= double(p.front().context)) return p.front().us_per_token;
    if (c >= double(p.back().context)) return p.back().us_per_token;
    size_t i = 1;
    while (double(p[i].context) < c) ++i;
    const auto &a = p[i - 1], &b = p[i];
    return a.us_per_token + (b.us_per_token - a.us_per_token) * (c - double(a.context)) /
                                double(b.context - a.context);
  };
  // Breakpoints: 0, the points' contexts inside (0, tokens), tokens. f is linear between them.
  std::vector<double> xs = {0};
  for (const auto& x : p)
    if (x.context > 0 && x.context < tokens) xs.push_back(double(x.context));
  xs.push_back(double(tokens));
  double us = 0;
  for (size_t i = 1; i < xs.size(); ++i) us += (xs[i] - xs[i - 1]) * (f(xs[i - 1]) + f(xs[i])) / 2;
  return us * 1e-6;
}

}  // namespace uf::model
