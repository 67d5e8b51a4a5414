#pragma once
// The model configuration: both files of a checkpoint folder (HF `config.json` with its
// `text_config`, and the flat `inference/config.json` read by the reference), checked to agree,
// plus every layer's role derived from the config lists (model-arch.md §2.3). Nothing here is a
// literal of the released model: a tiny fixture and the 40-layer model go through the same code.

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace uf::model {

// How a layer's attention gets its compressed (global) KV and its top-k selection.
enum class AttnMode {
  kWindowOnly,  // compress ratio 0: sliding window only (also every DSpark stage)
  kFull,        // KV source: own compressor, own index keys, own indexer
  kReindex,     // own indexer scoring another layer's keys (restricted to the candidate pool)
  kReuse,       // reads the latest KV source's compressed KV and the latest top-k unchanged
};
const char* attn_mode_name(AttnMode m);

struct LayerRole {
  int layer = 0;         // 0..n_layers-1 backbone, n_layers.. DSpark stages (mtp.{layer-n_layers})
  bool dspark = false;   // a DSpark draft stage
  bool decoder = false;  // backbone layer in the decoder half (layer >= n_layers / 2)
  int compress_ratio = 0;  // 0 = window only
  AttnMode mode = AttnMode::kWindowOnly;
  bool kv_source = false;             // owns a compressor (and the index keys of its compressed KV)
  bool index_source = false;          // owns an indexer (wq_b, weights_proj)
  bool candidate_source = false;      // its indexer also builds the candidate-block pool
  bool candidate_restricted = false;  // Reindex: scores restricted to the candidate pool
  int kv_from = -1;                   // layer whose compressed KV this layer attends (-1: none)
  int index_keys_from = -1;           // layer whose index keys its indexer scores (-1: no indexer)
  int topk_from = -1;                 // layer whose top-k indices this layer uses (-1: none)
  bool engram = false;                // an Engram module runs on the stream before this block
  int engram_index = -1;              // index into engram_layer_ids
  bool dspark_tap = false;            // its input (mean over hc copies) feeds DSpark
  double rope_theta = 0;              // compress_rope_theta with YaRN if ratio > 0, else rope_theta
  bool yarn = false;
  int n_routed_experts = 0;
  int n_activated_experts = 0;
};

struct ModelConfig {
  // Dimensions (flat names of inference/config.json; HF names in comments where they differ).
  int vocab_size = 0;
  int dim = 0;            // hidden_size
  int moe_inter_dim = 0;  // moe_intermediate_size
  int n_layers = 0;       // num_hidden_layers
  int n_mtp_layers = 0;   // num_nextn_predict_layers
  int n_heads = 0;        // num_attention_heads
  int head_dim = 0;
  int rope_head_dim = 0;  // qk_rope_head_dim
  int q_lora_rank = 0;
  int o_groups = 0;
  int o_lora_rank = 0;
  int window_size = 0;  // sliding_window
  double norm_eps = 0;  // rms_norm_eps
  // MoE
  int n_routed_experts = 0;
  int n_shared_experts = 0;
  int n_activated_experts = 0;  // num_experts_per_tok
  std::string score_func;       // scoring_func: "sqrtsoftplus"
  double route_scale = 1;       // routed_scaling_factor
  double swiglu_limit = 0;
  double gate_temp = 1;  // reference constant, not in the files
  // Compressed sparse attention
  std::vector<int> compress_ratios;  // one per layer, DSpark stages included
  std::vector<int> kv_source_layers;
  std::vector<int> index_source_layers;
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;
  int candidate_source_layer = -1;
  int candidate_topk_blocks = 0;
  int candidate_block_size = 0;
  // RoPE / YaRN
  double rope_theta = 0;
  double compress_rope_theta = 0;
  int original_seq_len = 0;  // rope_scaling.original_max_position_embeddings
  double rope_factor = 1;
  double beta_fast = 0;
  double beta_slow = 0;
  int max_position_embeddings = 0;
  // mHC
  int hc_mult = 0;
  int hc_sinkhorn_iters = 0;
  double hc_eps = 0;
  // Engram
  std::vector<int> engram_layer_ids;
  std::vector<int64_t> engram_num_embeddings;
  int engram_max_ngram_size = 0;
  int64_t engram_vocab_size = 0;
  int engram_n_heads = 0;
  int engram_head_dim = 0;
  int engram_pad_id = 0;
  int engram_compressed_vocab_size = 0;
  // DSpark
  int dspark_block_size = 0;
  int dspark_noise_token_id = 0;
  std::vector<int> dspark_target_layer_ids;
  int dspark_markov_rank = 0;
  int dspark_n_routed_experts = 0;
  int dspark_n_activated_experts = 0;
  // Tokens and formats
  int bos_token_id = 0;
  int eos_token_id = 1;
  int pad_token_id = 2;
  int image_token_id = -1;
  std::string dtype;         // "fp8"
  std::string expert_dtype;  // "fp4"
  int vision_n_layers = 0;   // 0: no vision tower (no vision.*/aligner.* tensors)
  int vision_dim = 0;
  int vision_n_heads = 0;
  int vision_inter_dim = 0;
  int vision_patch_size = 0;
  double vision_rope_theta = 0;
  int vision_downsample_ratio = 0;
  int vision_max_n_token = 0;
  int vision_min_pixels = 0;

  // Derived: one role per layer, backbone then DSpark stages.
  std::vector<LayerRole> roles;

  // Reads `<dir>/config.json` and `<dir>/inference/config.json` (either may be absent, not both),
  // checks that the two agree field by field (error names the field and both values), validates
  // every value and derives the roles.
  static ModelConfig load(const std::filesystem::path& model_dir);
  static ModelConfig from_hf_json(const nlohmann::json& j);    // top level with text_config
  static ModelConfig from_flat_json(const nlohmann::json& j);  // inference/config.json
  nlohmann::json to_hf_json() const;
  nlohmann::json to_flat_json() const;

  void derive_roles();  // fills `roles`; throws uf::core::Error on an inconsistent config
  void validate() const;
  const LayerRole& role(int layer) const { return roles.at(size_t(layer)); }
  int n_total_layers() const { return n_layers + n_mtp_layers; }
  // Latest kv/index source at or before `layer` (-1 if none).
  int latest_kv_source(int layer) const;
  int latest_index_source(int layer) const;

  // The released DeepSeek-V4.1-Flash configuration (model-arch.md §2), for contract tests and
  // synthetic benchmarks.
  static ModelConfig deepseek_v41_flash();
};

}  // namespace uf::model
