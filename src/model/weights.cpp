#include "model/weights.h"

#include <fmt/format.h>

#include "core/dtypes.h"
#include "core/error.h"

namespace uf::model {

using core::DType;

float Weight::at(int64_t r, int64_t c) const {
  switch (format) {
    case WFormat::kF32:
      return reinterpret_cast<const float*>(data)[r * cols + c];
    case WFormat::kBF16:
      return core::bf16_to_float(reinterpret_cast<const uint16_t*>(data)[r * cols + c]);
    case WFormat::kFP8: {
      const int64_t sc = (cols + 31) / 32;
      return core::e4m3_to_float(data[r * cols + c]) *
             core::e8m0_to_float(scale[(row_scale ? r : r / 32) * sc + c / 32]);
    }
    case WFormat::kFP4: {
      const uint8_t byte = data[r * (cols / 2) + c / 2];
      const uint8_t code = (c & 1) ? core::e2m1_odd(byte) : core::e2m1_even(byte);
      return core::e2m1_to_float(code) * core::e8m0_to_float(scale[r * (cols / 32) + c / 32]);
    }
  }
  return 0.f;
}

void Weight::row(int64_t r, float* out) const {
  for (int64_t c = 0; c < cols; ++c) out[c] = at(r, c);
}

std::vector<float> Weight::to_vector() const {
  std::vector<float> v(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) row(r, v.data() + r * cols);
  return v;
}

namespace {

class Binder {
 public:
  Binder(const Checkpoint& ckpt) : ckpt_(ckpt) {}

  // A tensor of logical shape [rows, cols] (cols = 0 for a vector [rows]) in one of `allowed`.
  Weight get(const std::string& name, int64_t rows, int64_t cols) {
    UF_CHECK(ckpt_.has(name), "checkpoint {}: tensor '{}' is missing", ckpt_.dir().string(), name);
    const auto& v = ckpt_.get(name);
    Weight w;
    w.name = name;
    w.rows = rows;
    w.cols = cols == 0 ? 1 : cols;
    w.data = v.data;
    std::vector<int64_t> want =
        cols == 0 ? std::vector<int64_t>{rows} : std::vector<int64_t>{rows, cols};
    switch (v.dtype) {
      case DType::kF32:
        w.format = WFormat::kF32;
        break;
      case DType::kBF16:
        w.format = WFormat::kBF16;
        break;
      case DType::kF8E4M3: {
        w.format = WFormat::kFP8;
        const std::string sname = scale_name(name);
        UF_CHECK(ckpt_.has(sname), "checkpoint: FP8 tensor '{}' has no scale '{}'", name, sname);
        const auto& s = ckpt_.get(sname);
        // Engram tables carry one scale per row and 32 columns; everything else 32x32 blocks.
        w.row_scale = name.find("engram.embed") != std::string::npos;
        const int64_t sr = w.row_scale ? rows : (rows + 31) / 32;
        check_shape(sname, s.shape, {sr, (w.cols + 31) / 32});
        UF_CHECK(s.dtype == DType::kF8E8M0, "checkpoint: scale '{}' is not F8_E8M0", sname);
        w.scale = s.data;
        break;
      }
      case DType::kI8: {
        w.format = WFormat::kFP4;
        want = {rows, cols / 2};
        const std::string sname = scale_name(name);
        UF_CHECK(ckpt_.has(sname), "checkpoint: FP4 tensor '{}' has no scale '{}'", name, sname);
        const auto& s = ckpt_.get(sname);
        check_shape(sname, s.shape, {rows, cols / 32});
        UF_CHECK(s.dtype == DType::kF8E8M0, "checkpoint: scale '{}' is not F8_E8M0", sname);
        w.scale = s.data;
        break;
      }
      default:
        core::fail("checkpoint: tensor '{}' has unsupported dtype {}", name,
                   core::dtype_name(v.dtype));
    }
    check_shape(name, v.shape, want);
    return w;
  }
  Weight opt(const std::string& name, int64_t rows, int64_t cols) {
    return ckpt_.has(name) ? get(name, rows, cols) : Weight{};
  }

 private:
  static std::string scale_name(const std::string& name) {
    const std::string suffix = ".weight";
    if (name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return name.substr(0, name.size() - suffix.size()) + ".scale";
    return name + ".scale";
  }
  static void check_shape(const std::string& name, const std::vector<int64_t>& got,
                          const std::vector<int64_t>& want) {
    UF_CHECK(got == want, "checkpoint: tensor '{}' has shape {} but the config implies {}", name,
             core::shape_string(got), core::shape_string(want));
  }
  const Checkpoint& ckpt_;
};

}  // namespace

ModelWeights bind_weights(const ModelConfig& cfg, const Checkpoint& ckpt) {
  Binder b(ckpt);
  ModelWeights w;
  const int64_t D = cfg.dim, V = cfg.vocab_size, hc = cfg.hc_mult;
  const int64_t mix = (2 + hc) * hc;
  w.embed = b.get("embed.weight", V, D);
  w.head = b.get("head.weight", V, D);
  w.norm = b.get("norm.weight", D, 0);
  for (int l = 0; l < cfg.n_total_layers(); ++l) {
    const auto& role = cfg.role(l);
    const std::string p =
        role.dspark ? fmt::format("mtp.{}.", l - cfg.n_layers) : fmt::format("layers.{}.", l);
    LayerWeights L;
    L.attn_norm = b.get(p + "attn_norm.weight", D, 0);
    L.ffn_norm = b.get(p + "ffn_norm.weight", D, 0);
    L.hc_attn_fn = b.get(p + "hc_attn_fn", mix, hc * D);
    L.hc_attn_base = b.get(p + "hc_attn_base", mix, 0);
    L.hc_attn_scale = b.get(p + "hc_attn_scale", 3, 0);
    L.hc_ffn_fn = b.get(p + "hc_ffn_fn", mix, hc * D);
    L.hc_ffn_base = b.get(p + "hc_ffn_base", mix, 0);
    L.hc_ffn_scale = b.get(p + "hc_ffn_scale", 3, 0);
    auto& A = L.attn;
    const int64_t H = cfg.n_heads, hd = cfg.head_dim, qr = cfg.q_lora_rank;
    A.attn_sink = b.get(p + "attn.attn_sink", H, 0);
    A.wq_a = b.get(p + "attn.wq_a.weight", qr, D);
    A.q_norm = b.get(p + "attn.q_norm.weight", qr, 0);
    A.wq_b = b.get(p + "attn.wq_b.weight", H * hd, qr);
    A.wkv = b.get(p + "attn.wkv.weight", hd, D);
    A.kv_norm = b.get(p + "attn.kv_norm.weight", hd, 0);
    A.wo_a = b.get(p + "attn.wo_a.weight", int64_t(cfg.o_groups) * cfg.o_lora_rank,
                   H * hd / cfg.o_groups);
    A.wo_b = b.get(p + "attn.wo_b.weight", D, int64_t(cfg.o_groups) * cfg.o_lora_rank);
    if (role.kv_source) {
      A.c_wkv = b.get(p + "attn.compressor.wkv.weight", hd, D);
      if (role.compress_ratio > 1) A.c_wgate = b.get(p + "attn.compressor.wgate.weight", hd, D);
      A.c_norm = b.get(p + "attn.compressor.norm.weight", hd, 0);
      A.i_wk = b.get(p + "attn.indexer.wk.weight", cfg.index_head_dim, hd);
      A.i_k_norm = b.get(p + "attn.indexer.k_norm.weight", cfg.index_head_dim, 0);
    }
    if (role.index_source) {
      A.i_wq_b = b.get(p + "attn.indexer.wq_b.weight",
                       int64_t(cfg.index_n_heads) * cfg.index_head_dim, qr);
      A.i_weights_proj = b.get(p + "attn.indexer.weights_proj.weight", cfg.index_n_heads, D);
    }
    auto& M = L.moe;
    const int64_t E = role.n_routed_experts, I = cfg.moe_inter_dim;
    M.gate = b.get(p + "ffn.gate.weight", E, D);
    M.gate_bias = b.get(p + "ffn.gate.bias", E, 0);
    for (int64_t e = 0; e < E; ++e) {
      const std::string q = p + fmt::format("ffn.experts.{}.", e);
      M.experts.push_back({b.get(q + "w1.weight", I, D), b.get(q + "w2.weight", D, I),
                           b.get(q + "w3.weight", I, D)});
    }
    const std::string s = p + "ffn.shared_experts.";
    M.shared = {b.get(s + "w1.weight", I, D), b.get(s + "w2.weight", D, I),
                b.get(s + "w3.weight", I, D)};
    if (role.engram) {
      const int64_t rows = cfg.engram_num_embeddings.at(size_t(role.engram_index));
      const int64_t cols = int64_t(cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads;
      L.engram.table = b.get(p + "engram.embed.weight", rows, cfg.engram_head_dim);
      L.engram.wkv = b.get(p + "engram.wkv.weight", D * (hc + 1), cols * cfg.engram_head_dim);
      L.engram.q_weight = b.get(p + "engram.q_weight", hc, D);
      L.engram.k_weight = b.get(p + "engram.k_weight", hc, D);
    }
    if (role.dspark) {
      const int stage = l - cfg.n_layers;
      if (stage == 0) {
        L.main_proj =
            b.get(p + "main_proj.weight", D, D * int64_t(cfg.dspark_target_layer_ids.size()));
        L.main_norm = b.get(p + "main_norm.weight", D, 0);
      }
      if (stage == cfg.n_mtp_layers - 1) {
        const int64_t R = cfg.dspark_markov_rank;
        L.norm = b.get(p + "norm.weight", D, 0);
        L.markov_embed = b.get(p + "markov_head.embed.weight", V, R);
        L.markov_head = b.get(p + "markov_head.head.weight", V, R);
        L.conf_proj = b.get(p + "confidence_head.proj.weight", 1, D + R);
      }
    }
    w.layers.push_back(std::move(L));
  }
  return w;
}

}  // namespace uf::model
