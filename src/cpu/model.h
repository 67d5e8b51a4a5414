#pragma once
// The CPU reference forward of DeepSeek-V4.1-Flash (model-arch.md §4-5) in fp32 with the model's
// QAT semantics and the reference's bf16 roundings, driven entirely by the config.
//
// A "span" is T consecutive new positions p0 .. p0+T-1 run through the stack together: a prefill
// chunk, one decode row, or up to max_rows verify rows. Every op computes each row with the same
// code and reduction order whatever T is, so a verify row equals the plain decode of its prefix
// bit for bit. Two layouts of the attention slot lists exist because the reference builds them
// differently and its online softmax (blocks of 64 slots) depends on slot order:
//  - prefill layout (the reference's start_pos == 0 path): window slots [lo .. lo+min(T,W)) with
//    lo = max(p0, p-W+1), -1 past p; compressed top-k over the whole span's entries.
//  - ring layout (the reference's decode path, also used for later prefill chunks): W window
//    slots for positions p-W+1 .. p oldest first, -1 before the sequence start.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "cpu/mhc.h"
#include "cpu/model_types.h"
#include "cpu/moe.h"
#include "cpu/session.h"
#include "engine/backend.h"
#include "engine/hardware_profile.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/engram_hash.h"

namespace uf::cpu {

// Observation points of the forward, for fixture checks and traces. A hook may overwrite the data
// (teacher forcing: feed the reference's recorded input to the next sublayer).
enum class Tap {
  kEngramHash,   // i64 [T, n_engram_layers * n_cols]
  kEngramOut,    // [T, hc, dim] stream after an Engram module
  kAttnIn,       // [T, dim]
  kAttnOut,      // [T, dim]
  kFfnIn,        // [T, dim]
  kFfnOut,       // [T, dim]
  kGateW,        // [T, top_k]
  kGateI,        // i32 [T, top_k]
  kLayerOut,     // [T, hc, dim]
  kPreMix,       // [T, hc]
  kIndexScores,  // one row: [width] (what top-k ranked; -inf = not visible / outside the pool)
  kTopk,         // i32, one row: [k] compressed entry ids ascending, -1 = none
  kMainHidden,   // [T, taps * dim]
  kFinalHidden,  // [T, dim]
};

struct TapInfo {
  Tap tap;
  int layer = -1;
  int64_t p0 = 0;  // position of the first row
  int rows = 0;
  int width = 0;
  bool prefill_layout = false;
  int64_t bank_offset = 0;  // reference top-k values = bank_offset + entry (prefill: T; ring: W)
};

class Hooks {
 public:
  virtual ~Hooks() = default;
  virtual void on(const TapInfo&, float*) {}
  virtual void on_i32(const TapInfo&, int32_t*) {}
  virtual void on_i64(const TapInfo&, int64_t*) {}
};

// Which index keys a non-publishing owner scores at decode (model-arch.md §11 quirk 1).
enum class IndexKeys {
  kOwner,      // always the owner's own keys (transformers, vLLM, ...): the default
  kReference,  // the official reference: the last publisher's keys
};

struct ModelOptions {
  IndexKeys index_keys = IndexKeys::kOwner;
  int max_rows = engine::kMaxVerifyRows;  // verify rows per step (ring slots = window + this)
};

class CpuModel {
 public:
  // engram_token_map: compressed Engram id of every token id (required if the model has Engram).
  CpuModel(model::ModelConfig cfg, const model::Checkpoint& ckpt,
           std::vector<int64_t> engram_token_map, ModelOptions opts = {});

  const model::ModelConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opts_; }
  void set_index_keys(IndexKeys k) { opts_.index_keys = k; }
  const ModelWeights& weights() const { return w_; }

  std::unique_ptr<CpuSession> new_session(int64_t max_seq) const;

  // Forwards `tokens` at positions s.len ..; state is written keyed by position but nothing is
  // committed. logits: [T or 1, vocab] (all rows or the last). main_hidden: [T, taps*dim] (may be
  // null); publisher: [T] publisher after each row (may be null).
  void forward(CpuSession& s, std::span<const int32_t> tokens, bool prefill_layout, bool all_logits,
               float* logits, float* main_hidden, int* publisher, Hooks* hooks = nullptr) const;
  // Commits the first n rows of a forward: appends tokens, advances, writes the DSpark rings.
  void commit(CpuSession& s, std::span<const int32_t> tokens, const float* main_hidden, int n,
              int publisher_after) const;

  // CED prefill shortcut (design.md §3): encoder layers and the first decoder layer's KV path on
  // every token, decoder layers only on the last `replay` tokens (windows truncated there).
  // Commits. logits: [1, vocab] of the last position.
  void prefill_ced(CpuSession& s, std::span<const int32_t> tokens, int replay, float* logits,
                   Hooks* hooks = nullptr) const;

  // One DSpark round at the last committed position (model-arch.md §5).
  engine::DraftBlock draft(CpuSession& s, int32_t anchor,
                           const engine::DraftSampler& sampler) const;

  int n_taps() const { return int(cfg_.dspark_target_layer_ids.size()); }
  int64_t compressed_id(int32_t token) const;

 private:
  struct Span;
  void init_span(Span& sp, CpuSession& s, std::span<const int32_t> tokens, bool prefill_layout,
                 Hooks* hooks) const;
  void embed(const Span& sp, std::span<const int32_t> tokens, float* X, float* pre_mix) const;
  void run_layers(Span& sp, float* X, float* pre_mix, int l0, int l1, float* main_hidden) const;
  void block(Span& sp, int l, float* X, float* pre_mix) const;
  void attention(Span& sp, int l, const float* x, float* out) const;
  void kv_path(Span& sp, int l, const float* x) const;
  void indexer(Span& sp, int l, const float* x, const float* qr) const;
  void head(const Span& sp, const float* X, const float* pre_mix, int row0, int n,
            float* logits) const;
  int keys_source(const Span& sp, int l, int row) const;
  int last_emitter(int64_t p) const;  // the last KV source (layer order) emitting at p, or -1
  bool needs_row_by_row(const CpuSession& s, int T) const;
  // Shared by backbone and DSpark attention: q projection with RoPE, window KV with RoPE + FP8.
  void project_q(int l, const float* x, int T, const int64_t* pos, float* qr, float* q) const;
  void project_kv(int l, const float* x, int T, const int64_t* pos, float* kv) const;
  void output_proj(int l, float* o, int T, const int64_t* pos, float* out) const;
  void dspark_write(CpuSession& s, const float* main_hidden, int n, int64_t p0) const;

  model::ModelConfig cfg_;
  ModelOptions opts_;
  ModelWeights w_;
  std::vector<Rope> ropes_;
  std::vector<MoeParams> moe_;
  HcParams hc_;
  std::vector<int64_t> token_map_;
  std::optional<model::EngramHasher> hasher_;
};

}  // namespace uf::cpu
