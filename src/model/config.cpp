#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/json_file.h"
#include "model/engram_primes.h"

namespace uf::model {

using core::fail;
using nlohmann::json;

const char* attn_mode_name(AttnMode m) {
  switch (m) {
    case AttnMode::kWindowOnly:
      return "window-only";
    case AttnMode::kFull:
      return "Full";
    case AttnMode::kReindex:
      return "Reindex";
    case AttnMode::kReuse:
      return "Reuse";
  }
  return "?";
}

namespace {

// One row per config value: its flat key (inference/config.json, "" if the file lacks it), its
// path in the HF config.json ("" if absent there) and whether a file that has the section must
// carry it. Both parsers, both writers and the agreement check walk this one table, so a field
// can never be read from one file and forgotten in the other.
enum Need { kOptional, kRequired };

template <typename F>
void visit_fields(ModelConfig& c, F&& f) {
  f("vocab_size", "text_config.vocab_size", c.vocab_size, kRequired);
  f("dim", "text_config.hidden_size", c.dim, kRequired);
  f("moe_inter_dim", "text_config.moe_intermediate_size", c.moe_inter_dim, kRequired);
  f("n_layers", "text_config.num_hidden_layers", c.n_layers, kRequired);
  f("n_mtp_layers", "text_config.num_nextn_predict_layers", c.n_mtp_layers, kRequired);
  f("n_heads", "text_config.num_attention_heads", c.n_heads, kRequired);
  f("head_dim", "text_config.head_dim", c.head_dim, kRequired);
  f("rope_head_dim", "text_config.qk_rope_head_dim", c.rope_head_dim, kRequired);
  f("q_lora_rank", "text_config.q_lora_rank", c.q_lora_rank, kRequired);
  f("o_groups", "text_config.o_groups", c.o_groups, kRequired);
  f("o_lora_rank", "text_config.o_lora_rank", c.o_lora_rank, kRequired);
  f("window_size", "text_config.sliding_window", c.window_size, kRequired);
  f("norm_eps", "text_config.rms_norm_eps", c.norm_eps, kRequired);
  f("n_routed_experts", "text_config.n_routed_experts", c.n_routed_experts, kRequired);
  f("n_shared_experts", "text_config.n_shared_experts", c.n_shared_experts, kRequired);
  f("n_activated_experts", "text_config.num_experts_per_tok", c.n_activated_experts, kRequired);
  f("score_func", "text_config.scoring_func", c.score_func, kRequired);
  f("route_scale", "text_config.routed_scaling_factor", c.route_scale, kRequired);
  f("swiglu_limit", "text_config.swiglu_limit", c.swiglu_limit, kOptional);
  f("gate_temp", "", c.gate_temp, kOptional);
  f("compress_ratios", "text_config.compress_ratios", c.compress_ratios, kRequired);
  f("kv_source_layers", "text_config.kv_source_layer_ids", c.kv_source_layers, kRequired);
  f("index_source_layers", "text_config.index_source_layer_ids", c.index_source_layers, kRequired);
  f("index_n_heads", "text_config.index_n_heads", c.index_n_heads, kRequired);
  f("index_head_dim", "text_config.index_head_dim", c.index_head_dim, kRequired);
  f("index_topk", "text_config.index_topk", c.index_topk, kRequired);
  f("candidate_source_layer", "text_config.candidate_source_layer_id", c.candidate_source_layer,
    kOptional);
  f("candidate_topk_blocks", "text_config.candidate_topk_blocks", c.candidate_topk_blocks,
    kOptional);
  f("candidate_block_size", "text_config.candidate_block_size", c.candidate_block_size, kOptional);
  f("rope_theta", "text_config.rope_theta", c.rope_theta, kRequired);
  f("compress_rope_theta", "text_config.compress_rope_theta", c.compress_rope_theta, kRequired);
  f("original_seq_len", "text_config.rope_scaling.original_max_position_embeddings",
    c.original_seq_len, kOptional);
  f("rope_factor", "text_config.rope_scaling.factor", c.rope_factor, kOptional);
  f("beta_fast", "text_config.rope_scaling.beta_fast", c.beta_fast, kOptional);
  f("beta_slow", "text_config.rope_scaling.beta_slow", c.beta_slow, kOptional);
  f("", "text_config.max_position_embeddings", c.max_position_embeddings, kOptional);
  f("hc_mult", "text_config.hc_mult", c.hc_mult, kRequired);
  f("hc_sinkhorn_iters", "text_config.hc_sinkhorn_iters", c.hc_sinkhorn_iters, kRequired);
  f("hc_eps", "text_config.hc_eps", c.hc_eps, kRequired);
  f("engram_layer_ids", "text_config.engram_layer_ids", c.engram_layer_ids, kOptional);
  f("engram_num_embeddings", "text_config.engram_num_embeddings", c.engram_num_embeddings,
    kOptional);
  f("engram_max_ngram_size", "text_config.engram_max_ngram_size", c.engram_max_ngram_size,
    kOptional);
  f("engram_vocab_size", "text_config.engram_vocab_size", c.engram_vocab_size, kOptional);
  f("engram_n_heads", "text_config.engram_n_heads", c.engram_n_heads, kOptional);
  f("engram_head_dim", "text_config.engram_head_dim", c.engram_head_dim, kOptional);
  f("engram_pad_id", "text_config.engram_pad_token_id", c.engram_pad_id, kOptional);
  f("engram_compressed_vocab_size", "text_config.engram_compressed_vocab_size",
    c.engram_compressed_vocab_size, kOptional);
  f("dspark_block_size", "text_config.dspark_block_size", c.dspark_block_size, kOptional);
  f("dspark_noise_token_id", "text_config.dspark_noise_token_id", c.dspark_noise_token_id,
    kOptional);
  f("dspark_target_layer_ids", "text_config.dspark_target_layer_ids", c.dspark_target_layer_ids,
    kOptional);
  f("dspark_markov_rank", "text_config.dspark_markov_rank", c.dspark_markov_rank, kOptional);
  f("dspark_n_routed_experts", "text_config.dspark_n_routed_experts", c.dspark_n_routed_experts,
    kOptional);
  f("dspark_n_activated_experts", "text_config.dspark_num_experts_per_tok",
    c.dspark_n_activated_experts, kOptional);
  f("", "bos_token_id", c.bos_token_id, kOptional);
  f("", "eos_token_id", c.eos_token_id, kOptional);
  f("", "pad_token_id", c.pad_token_id, kOptional);
  f("image_token_id", "image_token_id", c.image_token_id, kOptional);
  f("dtype", "quantization_config.quant_method", c.dtype, kRequired);
  f("expert_dtype", "quantization_config.expert_dtype", c.expert_dtype, kOptional);
  f("vision_n_layers", "vision_config.num_hidden_layers", c.vision_n_layers, kOptional);
  f("vision_dim", "vision_config.hidden_size", c.vision_dim, kOptional);
  f("vision_n_heads", "vision_config.num_attention_heads", c.vision_n_heads, kOptional);
  f("vision_inter_dim", "vision_config.intermediate_size", c.vision_inter_dim, kOptional);
  f("vision_patch_size", "vision_config.patch_size", c.vision_patch_size, kOptional);
  f("vision_rope_theta", "vision_config.rope_theta", c.vision_rope_theta, kOptional);
  f("vision_downsample_ratio", "vision_config.downsample_ratio", c.vision_downsample_ratio,
    kOptional);
  f("vision_max_n_token", "vision_config.max_image_tokens", c.vision_max_n_token, kOptional);
  f("vision_min_pixels", "vision_config.min_pixels", c.vision_min_pixels, kOptional);
}

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::stringstream ss(path);
  std::string p;
  while (std::getline(ss, p, '.')) parts.push_back(p);
  return parts;
}

// Returns the value at `path`, or nullptr when any step is missing or null.
const json* find_path(const json& root, const std::string& path) {
  const json* cur = &root;
  for (const auto& key : split_path(path)) {
    if (!cur->is_object()) return nullptr;
    auto it = cur->find(key);
    if (it == cur->end() || it->is_null()) return nullptr;
    cur = &*it;
  }
  return cur;
}

void set_path(json& root, const std::string& path, json value) {
  json* cur = &root;
  for (const auto& key : split_path(path)) cur = &(*cur)[key];
  *cur = std::move(value);
}

template <typename T>
T read_value(const json& v, const std::string& where) {
  if constexpr (std::is_same_v<T, std::string>) {
    UF_CHECK(v.is_string(), "{} must be a string, got {}", where, v.dump());
    return v.get<std::string>();
  } else if constexpr (std::is_same_v<T, double>) {
    UF_CHECK(v.is_number(), "{} must be a number, got {}", where, v.dump());
    return v.get<double>();
  } else if constexpr (std::is_integral_v<T>) {
    // Integer fields written as 16.0 are accepted; 2.5 is not.
    if (v.is_number_float()) {
      const double d = v.get<double>();
      UF_CHECK(std::floor(d) == d && std::fabs(d) < 9.2e18, "{} must be an integer, got {}", where,
               v.dump());
      return T(d);
    }
    UF_CHECK(v.is_number_integer(), "{} must be an integer, got {}", where, v.dump());
    const int64_t x = v.get<int64_t>();
    UF_CHECK(
        x >= int64_t(std::numeric_limits<T>::min()) && x <= int64_t(std::numeric_limits<T>::max()),
        "{} = {} is out of range", where, x);
    return T(x);
  } else {  // std::vector<int> / std::vector<int64_t>
    UF_CHECK(v.is_array(), "{} must be a list, got {}", where, v.dump());
    T out;
    for (size_t i = 0; i < v.size(); ++i)
      out.push_back(read_value<typename T::value_type>(v[i], fmt::format("{}[{}]", where, i)));
    return out;
  }
}

struct Parsed {
  ModelConfig cfg;
  std::set<std::string> present;  // flat-or-hf key of every field the file carried
};

std::string field_id(const char* flat, const char* hf) { return *flat ? flat : hf; }

Parsed parse(const json& j, bool hf, const std::string& source) {
  UF_CHECK(j.is_object(), "{}: the config must be a JSON object", source);
  Parsed p;
  const json* text = hf ? find_path(j, "text_config") : &j;
  UF_CHECK(text && text->is_object(), "{}: missing the 'text_config' object", source);
  visit_fields(p.cfg, [&](const char* flat, const char* hf_path, auto& member, Need need) {
    const std::string key = hf ? hf_path : flat;
    if (key.empty()) return;
    // Sections other than text_config are optional as a whole (no vision_config: no vision).
    const json* v = find_path(j, key);
    const bool section_present =
        key.find('.') == std::string::npos || find_path(j, key.substr(0, key.find('.'))) != nullptr;
    if (!v) {
      UF_CHECK(need == kOptional || !section_present, "{}: missing required field '{}'", source,
               key);
      return;
    }
    using T = std::decay_t<decltype(member)>;
    member = read_value<T>(*v, fmt::format("{}: field '{}'", source, key));
    p.present.insert(field_id(flat, hf_path));
  });
  if (hf) {
    // Constants of the architecture that only the HF file states: refuse anything else rather
    // than silently running a different model.
    auto expect = [&](const std::string& path, const json& want) {
      const json* v = find_path(j, path);
      if (v && *v != want)
        fail("{}: field '{}' is {} but this engine supports only {}", source, path, v->dump(),
             want.dump());
    };
    expect("text_config.num_key_value_heads", 1);
    expect("text_config.hidden_act", "silu");
    expect("text_config.attention_bias", false);
    expect("text_config.tie_word_embeddings", false);
    expect("tie_word_embeddings", false);
    expect("text_config.topk_method", "noaux_tc");
    expect("text_config.norm_topk_prob", true);
    expect("text_config.rope_scaling.rope_type", "yarn");
    expect("quantization_config.weight_block_size", json::array({32, 32}));
    expect("quantization_config.scale_fmt", "ue8m0");
    expect("quantization_config.activation_scheme", "dynamic");
  }
  return p;
}

json to_json(const ModelConfig& c, bool hf) {
  json j = json::object();
  auto& mc = const_cast<ModelConfig&>(c);  // visit_fields is shared with the parser; read-only here
  visit_fields(mc, [&](const char* flat, const char* hf_path, auto& member, Need) {
    const std::string key = hf ? hf_path : flat;
    if (key.empty()) return;
    set_path(j, key, json(member));
  });
  return j;
}

std::string show(const json& v) { return v.dump(); }

bool contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

void check_layer_list(const std::vector<int>& v, int lo, int hi, const char* name) {
  for (size_t i = 0; i < v.size(); ++i) {
    UF_CHECK(v[i] >= lo && v[i] < hi, "config field '{}' lists layer {}, outside [{}, {})", name,
             v[i], lo, hi);
    UF_CHECK(i == 0 || v[i] > v[i - 1],
             "config field '{}' must list distinct layers in ascending order, got {}", name,
             json(v).dump());
  }
}

}  // namespace

ModelConfig ModelConfig::from_hf_json(const nlohmann::json& j) {
  ModelConfig c = parse(j, true, "config.json").cfg;
  c.validate();
  c.derive_roles();
  return c;
}

ModelConfig ModelConfig::from_flat_json(const nlohmann::json& j) {
  ModelConfig c = parse(j, false, "inference/config.json").cfg;
  c.validate();
  c.derive_roles();
  return c;
}

nlohmann::json ModelConfig::to_flat_json() const {
  json j = to_json(*this, false);
  // The released file has no gate_temp (a reference constant); write it only if it differs.
  if (gate_temp == 1.0) j.erase("gate_temp");
  j["vision_max_wh_ratio"] = nullptr;
  return j;
}

nlohmann::json ModelConfig::to_hf_json() const {
  json j = to_json(*this, true);
  json out = {{"architectures", {"DeepseekV41ForCausalLM"}},
              {"model_type", "deepseek_v41"},
              {"dtype", "bfloat16"},
              {"tie_word_embeddings", false}};
  out.update(j);
  auto& q = out["quantization_config"];
  q["activation_scheme"] = "dynamic";
  q["weight_block_size"] = {32, 32};
  q["scale_fmt"] = "ue8m0";
  auto& t = out["text_config"];
  t["model_type"] = "deepseek_v41_text";
  t["num_key_value_heads"] = 1;
  t["hidden_act"] = "silu";
  t["attention_bias"] = false;
  t["topk_method"] = "noaux_tc";
  t["norm_topk_prob"] = true;
  t["rope_scaling"]["rope_type"] = "yarn";
  out["vision_config"]["model_type"] = "deepseek_v41_vision";
  out["vision_config"]["max_wh_ratio"] = nullptr;
  return out;
}

ModelConfig ModelConfig::load(const std::filesystem::path& model_dir) {
  const auto hf_path = model_dir / "config.json";
  const auto flat_path = model_dir / "inference" / "config.json";
  const bool has_hf = std::filesystem::exists(hf_path);
  const bool has_flat = std::filesystem::exists(flat_path);
  UF_CHECK(has_hf || has_flat, "{}: neither config.json nor inference/config.json exists",
           model_dir.string());
  std::optional<Parsed> hf, flat;
  if (has_hf) hf = parse(core::read_json_file(hf_path, "the config file"), true, hf_path.string());
  if (has_flat)
    flat = parse(core::read_json_file(flat_path, "the config file"), false, flat_path.string());
  ModelConfig c;
  if (hf && flat) {
    // Field by field: a value both files carry must agree; a value only one carries is taken.
    c = hf->cfg;
    ModelConfig& f = flat->cfg;
    std::vector<std::pair<std::string, json>> flat_values;
    visit_fields(f, [&](const char* fl, const char* hp, auto& member, Need) {
      flat_values.emplace_back(field_id(fl, hp), json(member));
    });
    size_t i = 0;
    visit_fields(c, [&](const char* fl, const char* hp, auto& member, Need) {
      const auto& [id, fv] = flat_values[i++];
      const bool in_hf = *hp && hf->present.count(id);
      const bool in_flat = *fl && flat->present.count(id);
      if (in_hf && in_flat) {
        const json hv(member);
        // Numbers compare as values (10000 == 10000.0).
        const bool same =
            (hv.is_number() && fv.is_number()) ? hv.get<double>() == fv.get<double>() : hv == fv;
        if (!same)
          fail("config files disagree on '{}': {} has {} = {} but {} has {} = {}", fl,
               hf_path.string(), hp, show(hv), flat_path.string(), fl, show(fv));
      } else if (in_flat) {
        using T = std::decay_t<decltype(member)>;
        member = fv.template get<T>();
      }
    });
  } else {
    c = hf ? hf->cfg : flat->cfg;
  }
  try {
    c.validate();
    c.derive_roles();
  } catch (const core::Error& e) {
    fail("{}: {}", model_dir.string(), e.what());
  }
  return c;
}

void ModelConfig::validate() const {
  auto pos = [](int v, const char* name) {
    UF_CHECK(v > 0, "config field '{}' must be positive, got {}", name, v);
  };
  pos(vocab_size, "vocab_size");
  pos(dim, "dim");
  pos(moe_inter_dim, "moe_inter_dim");
  pos(n_layers, "n_layers");
  pos(n_heads, "n_heads");
  pos(head_dim, "head_dim");
  pos(rope_head_dim, "rope_head_dim");
  pos(q_lora_rank, "q_lora_rank");
  pos(o_groups, "o_groups");
  pos(o_lora_rank, "o_lora_rank");
  pos(window_size, "window_size");
  pos(n_routed_experts, "n_routed_experts");
  pos(n_activated_experts, "n_activated_experts");
  pos(index_n_heads, "index_n_heads");
  pos(index_head_dim, "index_head_dim");
  pos(index_topk, "index_topk");
  pos(hc_mult, "hc_mult");
  pos(hc_sinkhorn_iters, "hc_sinkhorn_iters");
  UF_CHECK(n_mtp_layers >= 0, "config field 'n_mtp_layers' must be >= 0, got {}", n_mtp_layers);
  UF_CHECK(norm_eps > 0 && norm_eps < 1, "config field 'norm_eps' = {} is not in (0, 1)", norm_eps);
  UF_CHECK(hc_eps >= 0 && hc_eps < 1, "config field 'hc_eps' = {} is not in [0, 1)", hc_eps);
  UF_CHECK(rope_theta > 0, "config field 'rope_theta' must be positive, got {}", rope_theta);
  UF_CHECK(compress_rope_theta > 0, "config field 'compress_rope_theta' must be positive, got {}",
           compress_rope_theta);
  UF_CHECK(original_seq_len >= 0, "config field 'original_seq_len' must be >= 0, got {}",
           original_seq_len);
  UF_CHECK(original_seq_len == 0 || rope_factor > 0,
           "config field 'rope_factor' must be positive with YaRN, got {}", rope_factor);
  UF_CHECK(rope_head_dim % 2 == 0 && rope_head_dim <= head_dim,
           "config field 'rope_head_dim' = {} must be even and at most head_dim = {}",
           rope_head_dim, head_dim);
  UF_CHECK(rope_head_dim <= index_head_dim,
           "config field 'rope_head_dim' = {} exceeds index_head_dim = {}", rope_head_dim,
           index_head_dim);
  UF_CHECK(n_heads % o_groups == 0, "n_heads = {} is not divisible by o_groups = {}", n_heads,
           o_groups);
  // Packed FP4 experts hold two values per byte and one scale per 32 inputs.
  UF_CHECK(dim % 32 == 0, "config field 'dim' = {} must be a multiple of 32 (MXFP4 blocks)", dim);
  UF_CHECK(moe_inter_dim % 32 == 0,
           "config field 'moe_inter_dim' = {} must be a multiple of 32 (MXFP4 blocks)",
           moe_inter_dim);
  UF_CHECK(n_activated_experts <= n_routed_experts,
           "n_activated_experts = {} exceeds n_routed_experts = {}", n_activated_experts,
           n_routed_experts);
  UF_CHECK(n_shared_experts == 1, "config field 'n_shared_experts' must be 1, got {}",
           n_shared_experts);
  UF_CHECK(score_func == "sqrtsoftplus" || score_func == "softmax" || score_func == "sigmoid",
           "config field 'score_func' = '{}' is not sqrtsoftplus, softmax or sigmoid", score_func);
  UF_CHECK(route_scale > 0, "config field 'route_scale' must be positive, got {}", route_scale);
  UF_CHECK(swiglu_limit >= 0, "config field 'swiglu_limit' must be >= 0, got {}", swiglu_limit);
  UF_CHECK(gate_temp > 0, "config field 'gate_temp' must be positive, got {}", gate_temp);
  UF_CHECK(dtype == "fp8", "config field 'dtype' = '{}': only fp8 checkpoints are supported",
           dtype);
  UF_CHECK(expert_dtype == "fp4",
           "config field 'expert_dtype' = '{}': only fp4 (MXFP4) experts are supported",
           expert_dtype);

  const int total = n_layers + n_mtp_layers;
  UF_CHECK(int(compress_ratios.size()) == total,
           "config field 'compress_ratios' has {} entries but n_layers + n_mtp_layers = {}",
           compress_ratios.size(), total);
  for (int i = 0; i < total; ++i) {
    UF_CHECK(compress_ratios[size_t(i)] >= 0, "compress_ratios[{}] = {} is negative", i,
             compress_ratios[size_t(i)]);
    UF_CHECK(i < n_layers || compress_ratios[size_t(i)] == 0,
             "compress_ratios[{}] = {}: DSpark stages are sliding-window only (ratio 0)", i,
             compress_ratios[size_t(i)]);
  }
  check_layer_list(kv_source_layers, 0, n_layers, "kv_source_layers");
  check_layer_list(index_source_layers, 0, n_layers, "index_source_layers");
  for (int l : kv_source_layers) {
    UF_CHECK(compress_ratios[size_t(l)] > 0,
             "kv source layer {} has compress ratio 0: a KV source must compress", l);
    // The reference would let a KV source take top-k from an earlier indexer, but that is not a
    // mode of this engine (nor of the released model): refuse it explicitly.
    UF_CHECK(contains(index_source_layers, l),
             "kv source layer {} is not an index source: its compressed KV would have no indexer",
             l);
  }
  for (int l : index_source_layers)
    UF_CHECK(compress_ratios[size_t(l)] > 0,
             "index source layer {} has compress ratio 0: an indexer needs compressed KV", l);
  if (candidate_source_layer >= 0) {
    UF_CHECK(contains(index_source_layers, candidate_source_layer),
             "candidate_source_layer {} is not an index source layer", candidate_source_layer);
    UF_CHECK(candidate_topk_blocks > 0 && candidate_block_size > 0,
             "candidate_topk_blocks = {} and candidate_block_size = {} must be positive with a "
             "candidate source",
             candidate_topk_blocks, candidate_block_size);
  } else {
    UF_CHECK(candidate_source_layer == -1, "candidate_source_layer = {} must be -1 or a layer",
             candidate_source_layer);
  }
  for (int l = 0; l < n_layers; ++l) {
    const int r = compress_ratios[size_t(l)];
    if (r == 0) continue;
    const int kv = latest_kv_source(l), idx = latest_index_source(l);
    UF_CHECK(kv >= 0, "layer {} has compress ratio {} but no kv source layer at or before it", l,
             r);
    UF_CHECK(compress_ratios[size_t(kv)] == r,
             "layer {} has compress ratio {} but reads the compressed KV of layer {} with ratio {}",
             l, r, kv, compress_ratios[size_t(kv)]);
    UF_CHECK(idx >= 0, "layer {} has compress ratio {} but no index source layer at or before it",
             l, r);
    UF_CHECK(compress_ratios[size_t(idx)] == r,
             "layer {} has compress ratio {} but reuses the top-k of layer {} with ratio {}", l, r,
             idx, compress_ratios[size_t(idx)]);
  }

  // Engram
  check_layer_list(engram_layer_ids, 0, n_layers, "engram_layer_ids");
  UF_CHECK(engram_num_embeddings.size() == engram_layer_ids.size(),
           "engram_num_embeddings has {} entries but engram_layer_ids has {}",
           engram_num_embeddings.size(), engram_layer_ids.size());
  if (!engram_layer_ids.empty()) {
    UF_CHECK(engram_max_ngram_size >= 2, "engram_max_ngram_size = {} must be at least 2",
             engram_max_ngram_size);
    pos(engram_n_heads, "engram_n_heads");
    pos(engram_compressed_vocab_size, "engram_compressed_vocab_size");
    UF_CHECK(engram_head_dim > 0 && engram_head_dim % 32 == 0,
             "engram_head_dim = {} must be a positive multiple of 32 (E8M0 row scales)",
             engram_head_dim);
    UF_CHECK(engram_vocab_size >= 2, "engram_vocab_size = {} must be at least 2",
             engram_vocab_size);
    UF_CHECK(engram_pad_id >= 0 && engram_pad_id < vocab_size,
             "engram_pad_id = {} is outside the vocabulary of {}", engram_pad_id, vocab_size);
    const auto sums = engram_prime_sums(*this);
    for (size_t i = 0; i < sums.size(); ++i)
      UF_CHECK(engram_num_embeddings[i] == sums[i],
               "engram_num_embeddings[{}] = {} (layer {}) but its Engram primes sum to {}", i,
               engram_num_embeddings[i], engram_layer_ids[i], sums[i]);
  }

  // DSpark
  if (n_mtp_layers > 0) {
    pos(dspark_block_size, "dspark_block_size");
    UF_CHECK(!dspark_target_layer_ids.empty(), "DSpark stages need dspark_target_layer_ids");
    pos(dspark_markov_rank, "dspark_markov_rank");
    UF_CHECK(dspark_noise_token_id >= 0 && dspark_noise_token_id < vocab_size,
             "dspark_noise_token_id = {} is outside the vocabulary of {}", dspark_noise_token_id,
             vocab_size);
    UF_CHECK(dspark_n_routed_experts >= 0 && dspark_n_activated_experts >= 0,
             "dspark expert counts must be >= 0");
    const int routed = dspark_n_routed_experts ? dspark_n_routed_experts : n_routed_experts;
    const int act = dspark_n_activated_experts ? dspark_n_activated_experts : n_activated_experts;
    UF_CHECK(act <= routed, "DSpark activates {} experts of {}", act, routed);
  }
  check_layer_list(dspark_target_layer_ids, 0, n_layers, "dspark_target_layer_ids");

  for (auto [v, name] : {std::pair{bos_token_id, "bos_token_id"},
                         {eos_token_id, "eos_token_id"},
                         {pad_token_id, "pad_token_id"}})
    UF_CHECK(v >= 0 && v < vocab_size, "{} = {} is outside the vocabulary of {}", name, v,
             vocab_size);
  UF_CHECK(image_token_id < vocab_size, "image_token_id = {} is outside the vocabulary of {}",
           image_token_id, vocab_size);
  UF_CHECK(vision_n_layers >= 0, "vision_n_layers = {} is negative", vision_n_layers);
  if (vision_n_layers > 0) {
    pos(vision_dim, "vision_dim");
    pos(vision_n_heads, "vision_n_heads");
    pos(vision_inter_dim, "vision_inter_dim");
    pos(vision_patch_size, "vision_patch_size");
    pos(vision_downsample_ratio, "vision_downsample_ratio");
    UF_CHECK(vision_dim % vision_n_heads == 0,
             "vision_dim = {} is not divisible by vision_n_heads = {}", vision_dim, vision_n_heads);
    UF_CHECK(image_token_id >= 0, "image_token_id must be set when vision is on");
  }
}

int ModelConfig::latest_kv_source(int layer) const {
  int best = -1;
  for (int l : kv_source_layers)
    if (l <= layer) best = std::max(best, l);
  return best;
}

int ModelConfig::latest_index_source(int layer) const {
  int best = -1;
  for (int l : index_source_layers)
    if (l <= layer) best = std::max(best, l);
  return best;
}

void ModelConfig::derive_roles() {
  validate();
  roles.clear();
  const int total = n_layers + n_mtp_layers;
  for (int i = 0; i < total; ++i) {
    LayerRole r;
    r.layer = i;
    r.dspark = i >= n_layers;
    r.decoder = !r.dspark && i >= n_layers / 2;
    r.compress_ratio = compress_ratios[size_t(i)];
    if (r.dspark) {
      r.n_routed_experts = dspark_n_routed_experts ? dspark_n_routed_experts : n_routed_experts;
      r.n_activated_experts =
          dspark_n_activated_experts ? dspark_n_activated_experts : n_activated_experts;
    } else {
      r.n_routed_experts = n_routed_experts;
      r.n_activated_experts = n_activated_experts;
    }
    // Only layers with a compressed branch rotate at compress_rope_theta with YaRN
    // (Attention.__init__): one latent stands for `ratio` tokens.
    r.rope_theta = r.compress_ratio > 0 ? compress_rope_theta : rope_theta;
    r.yarn = r.compress_ratio > 0 && original_seq_len > 0;
    if (!r.dspark) {
      auto eit = std::find(engram_layer_ids.begin(), engram_layer_ids.end(), i);
      if (eit != engram_layer_ids.end()) {
        r.engram = true;
        r.engram_index = int(eit - engram_layer_ids.begin());
      }
      r.dspark_tap = contains(dspark_target_layer_ids, i);
    }
    if (!r.dspark && r.compress_ratio > 0) {
      r.kv_source = contains(kv_source_layers, i);
      r.index_source = contains(index_source_layers, i);
      r.candidate_source = i == candidate_source_layer;
      // Indexer.__init__: every indexer after the candidate source scores inside its pool.
      r.candidate_restricted =
          r.index_source && candidate_source_layer >= 0 && candidate_source_layer < i;
      r.kv_from = latest_kv_source(i);
      r.topk_from = latest_index_source(i);
      // A non-owner indexer reads the index keys the latest KV source published.
      r.index_keys_from = r.index_source ? r.kv_from : -1;
      r.mode =
          r.kv_source ? AttnMode::kFull : (r.index_source ? AttnMode::kReindex : AttnMode::kReuse);
    }
    roles.push_back(r);
  }
}

ModelConfig ModelConfig::deepseek_v41_flash() {
  ModelConfig c;
  c.vocab_size = 129280;
  c.dim = 5120;
  c.moe_inter_dim = 2304;
  c.n_layers = 40;
  c.n_mtp_layers = 3;
  c.n_heads = 64;
  c.head_dim = 512;
  c.rope_head_dim = 64;
  c.q_lora_rank = 1280;
  c.o_groups = 8;
  c.o_lora_rank = 1024;
  c.window_size = 128;
  c.norm_eps = 1e-20;
  c.n_routed_experts = 384;
  c.n_shared_experts = 1;
  c.n_activated_experts = 6;
  c.score_func = "sqrtsoftplus";
  c.route_scale = 1.5;
  c.swiglu_limit = 10.0;
  c.gate_temp = 1.0;
  c.compress_ratios = {0, 0};
  c.compress_ratios.insert(c.compress_ratios.end(), 18, 2);
  c.compress_ratios.insert(c.compress_ratios.end(), 20, 1);
  c.compress_ratios.insert(c.compress_ratios.end(), 3, 0);
  c.kv_source_layers = {2, 8, 14, 20};
  c.index_source_layers = {2, 8, 14, 20, 24, 28, 32, 36};
  c.index_n_heads = 32;
  c.index_head_dim = 128;
  c.index_topk = 512;
  c.candidate_source_layer = 20;
  c.candidate_topk_blocks = 2048;
  c.candidate_block_size = 8;
  c.rope_theta = 10000;
  c.compress_rope_theta = 160000;
  c.original_seq_len = 65536;
  c.rope_factor = 16;
  c.beta_fast = 32;
  c.beta_slow = 1;
  c.max_position_embeddings = 1048576;
  c.hc_mult = 4;
  c.hc_sinkhorn_iters = 20;
  c.hc_eps = 1e-6;
  c.engram_layer_ids = {1, 14};
  c.engram_num_embeddings = {384006168, 384016682};
  c.engram_max_ngram_size = 4;
  c.engram_vocab_size = 16000000;
  c.engram_n_heads = 8;
  c.engram_head_dim = 256;
  c.engram_pad_id = 2;
  c.engram_compressed_vocab_size = 99092;
  c.dspark_block_size = 5;
  c.dspark_noise_token_id = 128799;
  c.dspark_target_layer_ids = {37, 38, 39};
  c.dspark_markov_rank = 256;
  c.dspark_n_routed_experts = 128;
  c.dspark_n_activated_experts = 3;
  c.bos_token_id = 0;
  c.eos_token_id = 1;
  c.pad_token_id = 2;
  c.image_token_id = 129264;
  c.dtype = "fp8";
  c.expert_dtype = "fp4";
  c.vision_n_layers = 32;
  c.vision_dim = 1024;
  c.vision_n_heads = 16;
  c.vision_inter_dim = 2816;
  c.vision_patch_size = 14;
  c.vision_rope_theta = 10000;
  c.vision_downsample_ratio = 3;
  c.vision_max_n_token = 1024;
  c.vision_min_pixels = 295936;
  c.derive_roles();
  return c;
}

}  // namespace uf::model
