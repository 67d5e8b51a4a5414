#include "model/inspect.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <set>

#include "model/tensor_contract.h"

namespace uf::model {

namespace {
std::string layer_name(const ModelConfig& c, int l) {
  return l < c.n_layers ? std::to_string(l) : fmt::format("mtp.{}", l - c.n_layers);
}
std::string opt_layer(int l) { return l < 0 ? "-" : std::to_string(l); }
std::string human_bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}
}  // namespace

void print_config_summary(const ModelConfig& c, std::ostream& out) {
  out << fmt::format(
      "config: vocab {}, dim {}, {} layers + {} DSpark stages, {} heads x {} (rope {}), "
      "q_lora {}, o {} x {}, window {}\n",
      c.vocab_size, c.dim, c.n_layers, c.n_mtp_layers, c.n_heads, c.head_dim, c.rope_head_dim,
      c.q_lora_rank, c.o_groups, c.o_lora_rank, c.window_size);
  out << fmt::format(
      "  MoE: {} routed (top-{}) + {} shared, inter {}, {}, route_scale {}, swiglu_limit {}; "
      "DSpark {} routed (top-{})\n",
      c.n_routed_experts, c.n_activated_experts, c.n_shared_experts, c.moe_inter_dim, c.score_func,
      c.route_scale, c.swiglu_limit,
      c.dspark_n_routed_experts ? c.dspark_n_routed_experts : c.n_routed_experts,
      c.dspark_n_activated_experts ? c.dspark_n_activated_experts : c.n_activated_experts);
  out << fmt::format(
      "  CSA: kv sources {}, index sources {}, candidate source {} ({} blocks x {}), "
      "indexer {} x {} top-{}\n",
      c.kv_source_layers, c.index_source_layers, c.candidate_source_layer, c.candidate_topk_blocks,
      c.candidate_block_size, c.index_n_heads, c.index_head_dim, c.index_topk);
  out << fmt::format(
      "  RoPE: theta {} (window-only), {} with YaRN x{} over {} (beta {}/{}) on compressed "
      "layers; norm_eps {}\n",
      c.rope_theta, c.compress_rope_theta, c.rope_factor, c.original_seq_len, c.beta_fast,
      c.beta_slow, c.norm_eps);
  out << fmt::format("  mHC: {} copies, {} Sinkhorn iterations, hc_eps {}\n", c.hc_mult,
                     c.hc_sinkhorn_iters, c.hc_eps);
  out << fmt::format(
      "  Engram: layers {}, rows {}, {}-grams x {} heads x {}, compressed vocab {}, pad {}\n",
      c.engram_layer_ids, c.engram_num_embeddings, c.engram_max_ngram_size, c.engram_n_heads,
      c.engram_head_dim, c.engram_compressed_vocab_size, c.engram_pad_id);
  out << fmt::format(
      "  DSpark: block {}, noise token {}, taps {}, Markov rank {}; tokens bos {} eos {} pad {} "
      "image {}; vision layers {}; weights {} / experts {}\n",
      c.dspark_block_size, c.dspark_noise_token_id, c.dspark_target_layer_ids, c.dspark_markov_rank,
      c.bos_token_id, c.eos_token_id, c.pad_token_id, c.image_token_id, c.vision_n_layers, c.dtype,
      c.expert_dtype);
}

void print_layer_roles(const ModelConfig& c, std::ostream& out) {
  out << fmt::format("{:>6} {:>4} {:>5} {:<12} {:>7} {:>8} {:>9} {:<11} {:>6} {:>4} {:>13} {:>7}\n",
                     "layer", "half", "ratio", "mode", "kv_from", "idx_keys", "topk_from",
                     "candidates", "engram", "tap", "rope", "experts");
  for (const auto& r : c.roles) {
    const char* half = r.dspark ? "dsp" : (r.decoder ? "dec" : "enc");
    std::string cand =
        r.candidate_source ? "source" : (r.candidate_restricted ? "restricted" : "-");
    out << fmt::format(
        "{:>6} {:>4} {:>5} {:<12} {:>7} {:>8} {:>9} {:<11} {:>6} {:>4} {:>13} {:>7}\n",
        layer_name(c, r.layer), half, r.compress_ratio, attn_mode_name(r.mode),
        opt_layer(r.kv_from), opt_layer(r.index_keys_from), opt_layer(r.topk_from), cand,
        r.engram ? std::to_string(r.engram_index) : "-", r.dspark_tap ? "yes" : "-",
        fmt::format("{:g}{}", r.rope_theta, r.yarn ? "+yarn" : ""),
        fmt::format("{}/{}", r.n_activated_experts, r.n_routed_experts));
  }
}

void print_tensor_stats(const Checkpoint& ck, std::ostream& out) {
  std::map<std::string, std::pair<size_t, uint64_t>> by_dtype;
  std::set<std::string> files;
  for (const auto& [name, e] : ck.tensors()) {
    auto& s = by_dtype[std::string(core::dtype_name(e.view.dtype))];
    ++s.first;
    s.second += e.view.nbytes;
    files.insert(e.file);
  }
  out << fmt::format("tensors: {} in {} file(s), {} bytes ({})\n", ck.size(), files.size(),
                     ck.total_bytes(), human_bytes(ck.total_bytes()));
  out << fmt::format("  {:<8} {:>8} {:>18}\n", "dtype", "tensors", "bytes");
  for (const auto& [dt, s] : by_dtype)
    out << fmt::format("  {:<8} {:>8} {:>18}\n", dt, s.first, s.second);
}

int inspect_model(const std::filesystem::path& dir, std::ostream& out) {
  const auto cfg = ModelConfig::load(dir);
  out << "model: " << dir.string() << "\n";
  print_config_summary(cfg, out);
  print_layer_roles(cfg, out);
  const auto ck = Checkpoint::open(dir);
  print_tensor_stats(ck, out);
  const auto rep = check_contract(cfg, ck);
  if (rep.ok()) {
    out << fmt::format("contract: OK ({} tensors, {} bytes as expected)\n", rep.expected,
                       rep.expected_bytes);
    return 0;
  }
  out << fmt::format("contract: FAILED ({} missing, {} mismatched, {} extra)\n", rep.missing.size(),
                     rep.mismatched.size(), rep.extra.size());
  for (const auto& line : rep.lines()) out << "  " << line << "\n";
  return 1;
}

}  // namespace uf::model
