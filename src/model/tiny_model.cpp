#include "model/tiny_model.h"

#include <cmath>
#include <fstream>
#include <map>

#include "core/dtypes.h"
#include "core/error.h"
#include "core/json_file.h"
#include "core/quant.h"
#include "model/checkpoint.h"
#include "model/engram_primes.h"
#include "model/tensor_contract.h"

namespace uf::model {

namespace fs = std::filesystem;
using core::DType;
using nlohmann::json;

ModelConfig tiny_model_config(int engram_compressed_vocab_size) {
  // The released configuration with its sizes shrunk (the tiny-a fixture's dimensions and layer
  // pattern); everything not set here (vocabulary and token ids, norm eps, routing function and
  // scale, SwiGLU limit, RoPE/YaRN, mHC, n-gram size, DSpark block and noise token, formats) stays
  // as released. No vision tower.
  ModelConfig c = ModelConfig::deepseek_v41_flash();
  c.dim = 256;
  c.moe_inter_dim = 128;
  c.n_layers = 8;
  c.n_heads = 4;
  c.head_dim = 128;
  c.q_lora_rank = 128;
  c.o_groups = 2;
  c.o_lora_rank = 64;
  c.window_size = 8;
  c.n_routed_experts = 8;
  c.n_activated_experts = 2;
  c.compress_ratios = {0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0};
  c.kv_source_layers = {2, 4};
  c.index_source_layers = {2, 4, 6};
  c.index_n_heads = 8;
  c.index_topk = 8;
  c.candidate_source_layer = 4;
  c.candidate_topk_blocks = 3;
  c.candidate_block_size = 4;
  c.engram_layer_ids = {1, 2};
  c.engram_vocab_size = 500;
  c.engram_head_dim = 64;
  c.engram_compressed_vocab_size = engram_compressed_vocab_size;
  c.engram_num_embeddings = engram_prime_sums(c);  // the table rows the hash addresses
  c.dspark_target_layer_ids = {5, 6, 7};
  c.dspark_markov_rank = 64;
  c.dspark_n_routed_experts = 4;
  c.dspark_n_activated_experts = 2;
  c.vision_n_layers = 0;
  c.derive_roles();
  return c;
}

namespace {

// ---- deterministic random numbers: splitmix64 seeding, xoshiro256**, Box-Muller ----
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (auto& w : s_) w = splitmix64(seed);
  }
  uint64_t next() {
    const uint64_t r = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
    s_[2] ^= s_[0], s_[3] ^= s_[1], s_[1] ^= s_[2], s_[0] ^= s_[3], s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return r;
  }
  // Box-Muller in float: the generator draws ~2e8 normals (embedding and head at vocab 129,280),
  // and float log/sincos halve its time against double.
  void normal_pair(float& a, float& b) {
    const uint64_t u = next();
    const float u1 = float((u >> 40) + 1) * 0x1.0p-24f;  // (0, 1]
    const float u2 = float((u >> 16) & 0xffffff) * 0x1.0p-24f;
    const float r = std::sqrt(-2.0f * std::log(u1));
    float s, c;
    ::sincosf(6.2831853f * u2, &s, &c);
    a = r * c;
    b = r * s;
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

uint64_t hash_name(const std::string& s, uint64_t seed) {
  uint64_t h = 0xcbf29ce484222325ull ^ seed;
  for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return splitmix64(h);
}

// mean + sd * N(0,1), in chunks with their own streams: the result does not depend on threads.
std::vector<float> normals(size_t n, uint64_t seed, float mean, float sd) {
  std::vector<float> out(n);
  constexpr size_t kChunk = size_t(1) << 16;
  const int64_t chunks = int64_t((n + kChunk - 1) / kChunk);
  // Threads only for the few big tensors: on a busy machine, OpenMP's spinning at the end of
  // hundreds of small regions cost more than the work.
#pragma omp parallel for schedule(static) if (chunks >= 64)
  for (int64_t c = 0; c < chunks; ++c) {
    uint64_t s = seed + uint64_t(c) * 0xd1b54a32d192ed03ull;
    Rng rng(splitmix64(s));
    const size_t lo = size_t(c) * kChunk, hi = std::min(n, lo + kChunk);
    for (size_t i = lo; i < hi; i += 2) {
      float a, b;
      rng.normal_pair(a, b);
      out[i] = mean + sd * a;
      if (i + 1 < hi) out[i + 1] = mean + sd * b;
    }
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// How one tensor is drawn: mean + sd * N(0,1); `gain` (when > 0) instead sets sd to
// gain * fan_in^-0.5 for a weight matrix.
struct Init {
  float mean = 0;
  float sd = 0;
  float gain = 0;
};

// Per-projection gains and norm means measured on tiny-a's checkpoint (see tiny_model.h).
Init init_for(const std::string& full_name, bool clamp_layer) {
  // Strip "layers.N." / "mtp.N.".
  std::string n = full_name;
  for (const char* p : {"layers.", "mtp."}) {
    if (n.rfind(p, 0) == 0) {
      const size_t dot = n.find('.', std::string(p).size());
      n = n.substr(dot + 1);
      break;
    }
  }
  auto norm = [](float mean) { return Init{mean, 0.1f * mean, 0}; };
  auto gain = [](float g) { return Init{0, 0, g}; };
  if (n == "embed.weight") return {0, 1, 0};  // embedding RMS 1.0
  if (n == "head.weight") return gain(1.0f);
  if (n == "norm.weight" || n == "main_norm.weight") return norm(1.0f);
  if (n == "attn_norm.weight") return norm(0.025f);
  if (n == "ffn_norm.weight") return norm(clamp_layer ? 6.0f : 0.2f);
  if (n == "attn.q_norm.weight") return norm(0.97f);
  if (n == "attn.kv_norm.weight") return norm(0.4f);
  if (n == "attn.compressor.norm.weight") return norm(0.6f);
  if (n == "attn.indexer.k_norm.weight") return norm(0.5f);
  if (ends_with(n, "_fn")) return gain(1.0f);  // hc_attn_fn / hc_ffn_fn
  if (n == "ffn.gate.bias" || n == "ffn.gate.bias_vl") return {0, 0.1f, 0};
  if (n == "ffn.gate.weight") return gain(2.9f);
  if (n == "attn.wq_a.weight") return gain(1.6f);
  if (n == "attn.wq_b.weight") return gain(0.95f);
  if (n == "attn.wkv.weight") return gain(1.8f);
  if (n == "attn.wo_a.weight") return gain(1.6f);
  if (n == "attn.wo_b.weight") return gain(0.25f);  // residual branch kept small
  if (ends_with(n, ".w1.weight") || ends_with(n, ".w3.weight")) return gain(1.5f);
  // A clamp layer's large ffn_norm makes the clamps fire; its down projection is scaled down so
  // that the stream stays residual-dominated.
  if (ends_with(n, ".w2.weight")) return gain(clamp_layer ? 0.0025f : 1.05f);
  if (n == "attn.compressor.wkv.weight") return gain(1.0f);
  if (n == "attn.compressor.wgate.weight") return gain(40.0f);
  if (n == "attn.indexer.wk.weight" || n == "attn.indexer.wq_b.weight") return gain(1.0f);
  if (n == "attn.indexer.weights_proj.weight") return gain(40.0f);
  if (n == "engram.embed.weight") return {0, 1, 0};
  if (n == "engram.wkv.weight") return gain(0.05f);
  if (n == "engram.q_weight" || n == "engram.k_weight") return {1, 0.3f, 0};
  if (n == "main_proj.weight") return gain(1.0f);
  if (n == "markov_head.embed.weight") return {0, 0.12f, 0};
  if (n == "markov_head.head.weight") return {0, 0.5f, 0};
  if (n == "confidence_head.proj.weight") return gain(1.0f);
  // Vision tower and anything else: unit-gain matrices, norms at 1, biases and 1-D at 0.5 N.
  if (ends_with(n, "norm.weight") || ends_with(n, "norm1.weight") || ends_with(n, "norm2.weight"))
    return norm(1.0f);
  return {0, 0.5f, 0};
}

std::vector<uint8_t> to_bf16_bytes(const std::vector<float>& x) {
  std::vector<uint8_t> out(x.size() * 2);
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t h = core::float_to_bf16(x[i]);
    out[2 * i] = uint8_t(h);
    out[2 * i + 1] = uint8_t(h >> 8);
  }
  return out;
}

std::vector<uint8_t> to_f32_bytes(const std::vector<float>& x) {
  std::vector<uint8_t> out(x.size() * 4);
  std::memcpy(out.data(), x.data(), out.size());
  return out;
}

// Power-of-two scale for a block (as the reference's weight casts: 2^ceil(log2(amax/max))).
float block_scale(float amax, float max_inv) {
  return amax > 0 ? core::pow2_scale(amax, max_inv) : 1.0f;
}

// FP8 E4M3 with E8M0 scales over blocks of `br` rows x `bc` columns.
void quantize_fp8(const std::vector<float>& w, int64_t rows, int64_t cols, int64_t br, int64_t bc,
                  std::vector<uint8_t>& codes, std::vector<uint8_t>& scales) {
  const int64_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
  codes.assign(size_t(rows * cols), 0);
  scales.assign(size_t(sr * sc), 0);
  for (int64_t b = 0; b < sr * sc; ++b) {
    const int64_t r0 = (b / sc) * br, c0 = (b % sc) * bc;
    const int64_t r1 = std::min(rows, r0 + br), c1 = std::min(cols, c0 + bc);
    float amax = 0;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[size_t(r * cols + c)]));
    const float s = block_scale(amax, core::kFp8MaxInv);
    scales[size_t(b)] = core::float_to_e8m0(s);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c)
        codes[size_t(r * cols + c)] = core::float_to_e4m3(w[size_t(r * cols + c)] / s);
  }
}

// MXFP4: per row, one E8M0 scale per 32 inputs; two E2M1 codes per byte, low nibble = even.
void quantize_fp4(const std::vector<float>& w, int64_t rows, int64_t cols,
                  std::vector<uint8_t>& packed, std::vector<uint8_t>& scales) {
  packed.assign(size_t(rows * cols / 2), 0);
  scales.assign(size_t(rows * cols / 32), 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += 32) {
      const float* x = &w[size_t(r * cols + c0)];
      float amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float s = block_scale(amax, core::kFp4MaxInv);
      scales[size_t(r * (cols / 32) + c0 / 32)] = core::float_to_e8m0(s);
      for (int i = 0; i < 32; i += 2)
        packed[size_t((r * cols + c0 + i) / 2)] =
            core::pack_e2m1(core::float_to_e2m1(x[i] / s), core::float_to_e2m1(x[i + 1] / s));
    }
  }
}

int shard_of(const std::string& name, const ModelConfig& c) {
  if (name.find(".engram.embed.") != std::string::npos) return 3;  // the big tables, as released
  if (name == "embed.weight") return 1;
  if (name.rfind("layers.", 0) == 0 && std::stoi(name.substr(7)) < c.n_layers / 2) return 1;
  return 2;
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  UF_CHECK(out, "cannot write {}", p.string());
  out << text;
  UF_CHECK(out.good(), "error writing {}", p.string());
}

}  // namespace

void write_random_checkpoint(const fs::path& dir, const ModelConfig& cfg, uint64_t seed) {
  cfg.validate();
  fs::create_directories(dir / "inference");
  write_text(dir / "config.json", cfg.to_hf_json().dump(2) + "\n");
  write_text(dir / "inference" / "config.json", cfg.to_flat_json().dump(4) + "\n");

  const auto contract = tensor_contract(cfg);
  const int clamp_backbone = cfg.n_layers / 2 - 1;
  const int clamp_stage = cfg.n_mtp_layers >= 2 ? 1 : -1;
  constexpr int kShards = 3;
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  for (int shard = 1; shard <= kShards; ++shard) {
    std::vector<TensorData> tensors;
    for (size_t i = 0; i < contract.size(); ++i) {
      const ExpectedTensor& e = contract[i];
      if (shard_of(e.name, cfg) != shard) continue;
      // Scales are produced together with their weight.
      if (e.kind == TensorKind::kFp8Scale || e.kind == TensorKind::kFp4Scale ||
          e.kind == TensorKind::kEngramScale)
        continue;
      const bool clamp = e.name.rfind(fmt::format("layers.{}.", clamp_backbone), 0) == 0 ||
                         e.name.rfind(fmt::format("mtp.{}.", clamp_stage), 0) == 0;
      const Init init = init_for(e.name, clamp);
      const int64_t rows = e.shape.empty() ? 1 : e.shape[0];
      int64_t cols = e.shape.size() > 1 ? e.shape[1] : 1;
      if (e.kind == TensorKind::kFp4Weight) cols *= 2;  // logical in-features
      const size_t n = size_t(rows * cols);
      const float sd = init.gain > 0 ? init.gain / std::sqrt(float(cols)) : init.sd;
      const auto w = normals(n, hash_name(e.name, seed), init.mean, sd);
      const std::string scale_name = e.name.substr(0, e.name.size() - 7) + ".scale";
      switch (e.kind) {
        case TensorKind::kBf16:
          tensors.push_back({e.name, DType::kBF16, e.shape, to_bf16_bytes(w)});
          break;
        case TensorKind::kF32:
          tensors.push_back({e.name, DType::kF32, e.shape, to_f32_bytes(w)});
          break;
        case TensorKind::kFp8Weight:
        case TensorKind::kEngramTable: {
          UF_CHECK(i + 1 < contract.size() && contract[i + 1].name == scale_name,
                   "tiny model: no scale follows {}", e.name);
          std::vector<uint8_t> codes, scales;
          const bool table = e.kind == TensorKind::kEngramTable;
          quantize_fp8(w, rows, cols, table ? 1 : 32, 32, codes, scales);
          tensors.push_back({e.name, DType::kF8E4M3, e.shape, std::move(codes)});
          tensors.push_back({scale_name, DType::kF8E8M0, contract[i + 1].shape, std::move(scales)});
          break;
        }
        case TensorKind::kFp4Weight: {
          UF_CHECK(i + 1 < contract.size() && contract[i + 1].name == scale_name,
                   "tiny model: no scale follows {}", e.name);
          std::vector<uint8_t> packed, scales;
          quantize_fp4(w, rows, cols, packed, scales);
          tensors.push_back({e.name, DType::kI8, e.shape, std::move(packed)});
          tensors.push_back({scale_name, DType::kF8E8M0, contract[i + 1].shape, std::move(scales)});
          break;
        }
        default:
          core::fail("tiny model: unexpected tensor kind for {}", e.name);
      }
    }
    const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", shard, kShards);
    for (const auto& t : tensors) {
      weight_map[t.name] = file;
      total += t.bytes.size();
    }
    write_safetensors(dir / file, tensors);
  }
  write_safetensors_index(dir, weight_map, total);
}

nlohmann::json make_v41_tokenizer_json(const nlohmann::json& v3, int vocab_size) {
  UF_CHECK(v3.is_object() && v3.contains("added_tokens") && v3["added_tokens"].is_array() &&
               v3.contains("model") && v3["model"].contains("vocab"),
           "the base tokenizer.json has no added_tokens / model.vocab");
  std::map<int, json> added;
  for (const auto& t : v3["added_tokens"]) added[t.at("id").get<int>()] = t;
  int base_max = 0;
  for (const auto& [tok, id] : v3["model"]["vocab"].items())
    base_max = std::max(base_max, id.get<int>());
  auto token = [](int id, const std::string& content, bool special) {
    return json{{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", special}};
  };
  // V4.1 ids (model-arch.md §7); those without a published id on free added-token ids.
  const std::vector<std::pair<int, std::string>> v41 = {
      {128799, "<｜System｜>"},    {128803, "<｜User｜>"},
      {128804, "<｜Assistant｜>"}, {128821, "<think>"},
      {128822, "</think>"},        {129264, "<｜deepseek_image｜>"},
      {128815, "｜DSML｜"},        {128816, "<｜latest_reminder｜>"},
      {128817, "<｜action｜>"},    {128818, "<｜query｜>"},
      {128819, "<｜authority｜>"}, {128820, "<｜domain｜>"},
      {128823, "<｜title｜>"},     {128824, "<｜read_url｜>"}};
  for (const auto& [id, content] : v41) {
    UF_CHECK(id < vocab_size, "V4.1 token {} (id {}) does not fit a vocabulary of {}", content, id,
             vocab_size);
    UF_CHECK(id > base_max, "V4.1 token id {} collides with the base BPE vocabulary", id);
    added[id] = token(id, content, content == "<｜deepseek_image｜>");
  }
  for (int id = base_max + 1; id < vocab_size; ++id)
    if (!added.count(id))
      added[id] = token(id, fmt::format("<｜place▁holder▁no▁{}｜>", id - 128000), true);
  UF_CHECK(added.rbegin()->first < vocab_size, "the base tokenizer has ids past {}", vocab_size);
  json out = v3;
  out["added_tokens"] = json::array();
  for (auto& [id, t] : added) out["added_tokens"].push_back(t);
  return out;
}

void write_v41_tokenizer(const fs::path& v3_tokenizer_json, const fs::path& out_file,
                         int vocab_size) {
  const json v3 = core::read_json_file(v3_tokenizer_json, "the base tokenizer");
  write_text(out_file, make_v41_tokenizer_json(v3, vocab_size).dump(2) + "\n");
}

}  // namespace uf::model
