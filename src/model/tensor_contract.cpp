#include "model/tensor_contract.h"

#include <unordered_map>

#include "core/error.h"
#include "core/tensor.h"

namespace uf::model {

using core::DType;

uint64_t ExpectedTensor::nbytes() const {
  uint64_t n = core::dtype_size(dtype);
  for (int64_t d : shape) n *= uint64_t(d);
  return n;
}

namespace {

int64_t ceil32(int64_t x) { return (x + 31) / 32; }

class Builder {
 public:
  std::vector<ExpectedTensor> out;

  void add(std::string name, DType dt, std::vector<int64_t> shape, TensorKind kind) {
    out.push_back({std::move(name), dt, std::move(shape), kind});
  }
  void bf16(const std::string& name, std::vector<int64_t> shape) {
    add(name, DType::kBF16, std::move(shape), TensorKind::kBf16);
  }
  void f32(const std::string& name, std::vector<int64_t> shape) {
    add(name, DType::kF32, std::move(shape), TensorKind::kF32);
  }
  // An FP8 linear `prefix` (weight + 32x32 block scales), [out, in].
  void fp8(const std::string& prefix, int64_t out_f, int64_t in_f) {
    add(prefix + ".weight", DType::kF8E4M3, {out_f, in_f}, TensorKind::kFp8Weight);
    add(prefix + ".scale", DType::kF8E8M0, {ceil32(out_f), ceil32(in_f)}, TensorKind::kFp8Scale);
  }
  // A packed MXFP4 linear: two E2M1 codes per byte, one E8M0 scale per 32 inputs.
  void fp4(const std::string& prefix, int64_t out_f, int64_t in_f) {
    add(prefix + ".weight", DType::kI8, {out_f, in_f / 2}, TensorKind::kFp4Weight);
    add(prefix + ".scale", DType::kF8E8M0, {out_f, in_f / 32}, TensorKind::kFp4Scale);
  }
};

// The tensors every block has (backbone layer or DSpark stage), prefix "layers.L." / "mtp.S.".
void add_block(Builder& b, const ModelConfig& c, const LayerRole& r, const std::string& p) {
  const int64_t d = c.dim, hc = c.hc_mult, mix = (2 + hc) * hc;
  b.bf16(p + "attn_norm.weight", {d});
  b.bf16(p + "ffn_norm.weight", {d});
  for (const char* s : {"attn", "ffn"}) {
    b.f32(p + "hc_" + s + "_fn", {mix, hc * d});
    b.f32(p + "hc_" + s + "_base", {mix});
    b.f32(p + "hc_" + s + "_scale", {3});
  }
  const int64_t hd = c.head_dim, heads = c.n_heads;
  b.f32(p + "attn.attn_sink", {heads});
  b.fp8(p + "attn.wq_a", c.q_lora_rank, d);
  b.bf16(p + "attn.q_norm.weight", {c.q_lora_rank});
  b.fp8(p + "attn.wq_b", heads * hd, c.q_lora_rank);
  b.fp8(p + "attn.wkv", hd, d);
  b.bf16(p + "attn.kv_norm.weight", {hd});
  b.fp8(p + "attn.wo_a", int64_t(c.o_groups) * c.o_lora_rank, heads * hd / c.o_groups);
  b.fp8(p + "attn.wo_b", d, int64_t(c.o_groups) * c.o_lora_rank);
  if (r.kv_source) {
    b.bf16(p + "attn.compressor.wkv.weight", {hd, d});
    if (r.compress_ratio > 1) b.bf16(p + "attn.compressor.wgate.weight", {hd, d});
    b.bf16(p + "attn.compressor.norm.weight", {hd});
    // The index keys are derived from the compressor's latent, so their owner is the KV source.
    b.bf16(p + "attn.indexer.wk.weight", {c.index_head_dim, hd});
    b.bf16(p + "attn.indexer.k_norm.weight", {c.index_head_dim});
  }
  if (r.index_source) {
    b.fp8(p + "attn.indexer.wq_b", int64_t(c.index_n_heads) * c.index_head_dim, c.q_lora_rank);
    b.bf16(p + "attn.indexer.weights_proj.weight", {c.index_n_heads, d});
  }
  const int64_t ne = r.n_routed_experts, inter = c.moe_inter_dim;
  b.bf16(p + "ffn.gate.weight", {ne, d});
  b.f32(p + "ffn.gate.bias", {ne});
  // The released checkpoint (and the fixtures) carry the image-span routing bias everywhere,
  // although the reference allocates it only with vision on.
  b.f32(p + "ffn.gate.bias_vl", {ne});
  for (int64_t e = 0; e < ne; ++e) {
    const std::string ep = p + "ffn.experts." + std::to_string(e) + ".";
    b.fp4(ep + "w1", inter, d);
    b.fp4(ep + "w3", inter, d);
    b.fp4(ep + "w2", d, inter);
  }
  b.fp8(p + "ffn.shared_experts.w1", inter, d);
  b.fp8(p + "ffn.shared_experts.w3", inter, d);
  b.fp8(p + "ffn.shared_experts.w2", d, inter);
  if (r.engram) {
    const int64_t rows = c.engram_num_embeddings[size_t(r.engram_index)];
    const int64_t ehd = c.engram_head_dim;
    b.add(p + "engram.embed.weight", DType::kF8E4M3, {rows, ehd}, TensorKind::kEngramTable);
    b.add(p + "engram.embed.scale", DType::kF8E8M0, {rows, ehd / 32}, TensorKind::kEngramScale);
    b.fp8(p + "engram.wkv", d * (hc + 1),
          int64_t(c.engram_max_ngram_size - 1) * c.engram_n_heads * ehd);
    b.bf16(p + "engram.q_weight", {hc, d});
    b.bf16(p + "engram.k_weight", {hc, d});
  }
}

// Vision tower and aligner, as the reference vision.py builds them (all BF16 on disk).
void add_vision(Builder& b, const ModelConfig& c) {
  const int64_t vd = c.vision_dim, inter = c.vision_inter_dim, d = c.dim;
  const int64_t patch = int64_t(c.vision_patch_size) * c.vision_patch_size;
  b.bf16("image_start", {d});
  b.bf16("image_end", {d});
  b.bf16("image_newline", {d});
  b.bf16("vision.patch_embed.proj.weight", {vd, 3 * patch});
  b.bf16("vision.patch_embed.proj.bias", {vd});
  for (int i = 0; i < c.vision_n_layers; ++i) {
    const std::string p = "vision.blocks." + std::to_string(i) + ".";
    b.bf16(p + "norm1.weight", {vd});
    b.bf16(p + "attn.wqkv.weight", {3 * vd, vd});
    b.bf16(p + "attn.wqkv.bias", {3 * vd});
    b.bf16(p + "attn.wo.weight", {vd, vd});
    b.bf16(p + "attn.wo.bias", {vd});
    b.bf16(p + "norm2.weight", {vd});
    b.bf16(p + "mlp.w1.weight", {2 * inter, vd});
    b.bf16(p + "mlp.w2.weight", {vd, inter});
  }
  b.bf16("vision.norm.weight", {vd});
  const int64_t ds = c.vision_downsample_ratio;
  b.bf16("aligner.w1.weight", {d, vd * ds * ds});
  b.bf16("aligner.w1.bias", {d});
  b.bf16("aligner.w2.weight", {d, d});
  b.bf16("aligner.w2.bias", {d});
}

std::string describe(DType dt, const std::vector<int64_t>& shape) {
  return fmt::format("{} {}", core::dtype_name(dt), core::shape_string(shape));
}

}  // namespace

std::vector<ExpectedTensor> tensor_contract(const ModelConfig& c) {
  UF_CHECK(int(c.roles.size()) == c.n_total_layers(),
           "tensor_contract: the config has no derived layer roles (call derive_roles)");
  Builder b;
  const int64_t v = c.vocab_size, d = c.dim;
  b.bf16("embed.weight", {v, d});
  b.bf16("head.weight", {v, d});
  b.bf16("norm.weight", {d});
  for (int l = 0; l < c.n_layers; ++l)
    add_block(b, c, c.role(l), "layers." + std::to_string(l) + ".");
  // The reference builds DSpark stages only with a draft block size.
  if (c.dspark_block_size > 0) {
    for (int s = 0; s < c.n_mtp_layers; ++s) {
      const std::string p = "mtp." + std::to_string(s) + ".";
      add_block(b, c, c.role(c.n_layers + s), p);
      if (s == 0) {
        b.fp8(p + "main_proj", d, d * int64_t(c.dspark_target_layer_ids.size()));
        b.bf16(p + "main_norm.weight", {d});
      }
      if (s == c.n_mtp_layers - 1) {
        b.bf16(p + "norm.weight", {d});
        b.bf16(p + "markov_head.embed.weight", {v, c.dspark_markov_rank});
        b.bf16(p + "markov_head.head.weight", {v, c.dspark_markov_rank});
        b.bf16(p + "confidence_head.proj.weight", {1, d + c.dspark_markov_rank});
      }
    }
  }
  if (c.vision_n_layers > 0) add_vision(b, c);
  return std::move(b.out);
}

std::vector<std::string> ContractReport::lines() const {
  std::vector<std::string> out = missing;
  out.insert(out.end(), mismatched.begin(), mismatched.end());
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

ContractReport check_contract(const ModelConfig& c, const Checkpoint& ck) {
  ContractReport rep;
  const auto expected = tensor_contract(c);
  rep.expected = expected.size();
  std::unordered_map<std::string_view, const ExpectedTensor*> by_name;
  by_name.reserve(expected.size());
  for (const auto& e : expected) {
    rep.expected_bytes += e.nbytes();
    by_name.emplace(e.name, &e);
    if (!ck.has(e.name)) {
      rep.missing.push_back(fmt::format("missing: {} ({})", e.name, describe(e.dtype, e.shape)));
      continue;
    }
    const auto& v = ck.get(e.name);
    if (v.dtype != e.dtype || v.shape != e.shape)
      rep.mismatched.push_back(fmt::format("mismatch: {} is {} in {}, expected {}", e.name,
                                           describe(v.dtype, v.shape), ck.entry(e.name).file,
                                           describe(e.dtype, e.shape)));
  }
  for (const auto& [name, entry] : ck.tensors())
    if (!by_name.count(name))
      rep.extra.push_back(fmt::format("extra: {} ({}) in {}", name,
                                      describe(entry.view.dtype, entry.view.shape), entry.file));
  return rep;
}

void require_contract(const ModelConfig& c, const Checkpoint& ck) {
  const auto rep = check_contract(c, ck);
  if (rep.ok()) return;
  const auto lines = rep.lines();
  std::string msg;
  const size_t shown = std::min<size_t>(lines.size(), 10);
  for (size_t i = 0; i < shown; ++i) msg += "\n  " + lines[i];
  if (lines.size() > shown) msg += fmt::format("\n  ... and {} more", lines.size() - shown);
  core::fail(
      "checkpoint {} does not match the model config ({} missing, {} mismatched, {} extra "
      "tensors):{}",
      ck.dir().string(), rep.missing.size(), rep.mismatched.size(), rep.extra.size(), msg);
}

}  // namespace uf::model
