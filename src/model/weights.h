#pragma once
// Views of the checkpoint's weights in their stored formats (mmap, never expanded to fp32):
// FP8 E4M3 with 32x32 E8M0 block scales, packed FP4 E2M1 with one E8M0 scale per 32 along K,
// BF16 and F32. The ops in linear.h dequantise them on the fly.

#include <cstdint>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "model/config.h"

namespace uf::model {

enum class WFormat : uint8_t { kBF16, kF32, kFP8, kFP4 };

struct Weight {
  WFormat format = WFormat::kF32;
  int64_t rows = 0;  // output features (or table rows)
  int64_t cols = 0;  // input features (logical, unpacked)
  const uint8_t* data = nullptr;
  // E8M0 codes: FP8 [ceil(rows/32), ceil(cols/32)] (32x32 blocks), or [rows, cols/32] for FP4
  // and for FP8 tables with per-row scales (row_scale).
  const uint8_t* scale = nullptr;
  bool row_scale = false;
  std::string name;
  bool empty() const { return data == nullptr; }
  float at(int64_t r, int64_t c) const;  // dequantised element (tests and small vectors)
  // Row r dequantised into out[cols] (fp32; exact for every format).
  void row(int64_t r, float* out) const;
  // All rows*cols elements dequantised, row-major (1-D parameters bind as [n, 1]).
  std::vector<float> to_vector() const;
};

struct AttentionWeights {
  Weight attn_sink;  // F32 [n_heads]
  Weight wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b;
  // compressor (KV sources)
  Weight c_wkv, c_wgate, c_norm;
  // indexer (index sources; wk/k_norm only on KV sources)
  Weight i_wq_b, i_weights_proj, i_wk, i_k_norm;
};

struct ExpertWeights {
  Weight w1, w2, w3;
};

struct MoeWeights {
  Weight gate, gate_bias;
  std::vector<ExpertWeights> experts;
  ExpertWeights shared;
};

struct EngramWeights {
  Weight table, wkv, q_weight, k_weight;  // table: FP8 rows with per-32 E8M0 scales
};

struct LayerWeights {
  Weight attn_norm, ffn_norm;
  Weight hc_attn_fn, hc_attn_base, hc_attn_scale, hc_ffn_fn, hc_ffn_base, hc_ffn_scale;
  AttentionWeights attn;
  MoeWeights moe;
  EngramWeights engram;  // empty unless the layer has an Engram module
  // DSpark stage extras
  Weight main_proj, main_norm;                        // stage 0
  Weight norm, markov_embed, markov_head, conf_proj;  // last stage
};

struct ModelWeights {
  Weight embed, head, norm;
  std::vector<LayerWeights> layers;  // backbone then DSpark stages
};

// Binds every tensor the config needs; an absent or mis-shaped tensor is an error naming it.
ModelWeights bind_weights(const ModelConfig& cfg, const Checkpoint& ckpt);

}  // namespace uf::model
