// `ultrafast generate --model <dir> --prompt "..."`: plain (non-speculative) decoding on the CPU
// reference backend, greedy or sampled with a seed. The prompt is BOS + the tokenized text as is
// (no chat template), so tiny fixture models can be driven directly.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/command_registry.h"
#include "core/error.h"
#include "cpu/cpu_backend.h"
#include "model/config.h"
#include "sampling/rng.h"
#include "sampling/sampler.h"
#include "tokenizer/engram_token_map.h"
#include "tokenizer/tokenizer.h"

namespace {

struct GenerateArgs {
  std::string model;
  std::string prompt;
  int max_tokens = 32;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  uint64_t seed = 0;
  bool ced = false;
  bool reference_keys = false;
  bool no_bos = false;
};

void run_generate(const GenerateArgs& a) {
  namespace fs = std::filesystem;
  const fs::path dir(a.model);
  const auto tok = uf::tokenizer::Tokenizer::from_file(dir / "tokenizer.json");
  const auto cfg = uf::model::ModelConfig::load(dir);
  std::vector<int64_t> map;
  if (!cfg.engram_layer_ids.empty()) {
    const auto m = uf::tokenizer::build_engram_token_map(tok, cfg.engram_compressed_vocab_size);
    map.assign(m.map.begin(), m.map.end());
  }
  uf::cpu::ModelOptions mo;
  if (a.reference_keys) mo.index_keys = uf::cpu::IndexKeys::kReference;
  uf::cpu::CpuBackend be(dir, map, mo);
  std::vector<int32_t> ids;
  if (!a.no_bos) ids.push_back(cfg.bos_token_id);
  tok.encode_append(a.prompt, ids);
  const int V = cfg.vocab_size;
  auto s = be.new_session(int64_t(ids.size()) + a.max_tokens + be.max_rows());
  const size_t nv = static_cast<size_t>(V);
  std::vector<float> logits(nv), probs(nv), scratch(nv);
  uf::sampling::SamplingParams sp;
  sp.temperature = a.temperature;
  sp.top_p = a.top_p;
  sp.top_k = a.top_k;
  uf::sampling::validate(sp);
  const auto t0 = std::chrono::steady_clock::now();
  uf::engine::PrefillOptions po;
  po.ced_shortcut = a.ced;
  be.prefill(*s, ids, po, logits);
  const auto t1 = std::chrono::steady_clock::now();
  std::vector<int32_t> out;
  std::string shown;
  for (int step = 0; step < a.max_tokens; ++step) {
    const float u =
        uf::sampling::stream_uniform(a.seed, uint64_t(step), uf::sampling::RngPurpose::kPlain, 0);
    const int32_t next =
        uf::sampling::sample_from_logits(logits.data(), V, sp, u, probs.data(), scratch.data());
    out.push_back(next);
    const std::string text = tok.decode(out);
    // Print only what is new; a partial UTF-8 character waits for its next token.
    if (text.size() > shown.size() && text.compare(0, shown.size(), shown) == 0) {
      std::fputs(text.substr(shown.size()).c_str(), stdout);
      std::fflush(stdout);
      shown = text;
    }
    if (next == cfg.eos_token_id || step + 1 == a.max_tokens) break;
    be.decode_rows(*s, std::span<const int32_t>(&next, 1), logits);
    be.commit(*s, 1);
  }
  const auto t2 = std::chrono::steady_clock::now();
  std::fprintf(stderr, "\n[%zu prompt tokens in %.2f s, %zu generated in %.2f s]\n", ids.size(),
               std::chrono::duration<double>(t1 - t0).count(), out.size(),
               std::chrono::duration<double>(t2 - t1).count());
}

void setup_generate(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("generate", "Generate text on the CPU reference backend");
  auto a = std::make_shared<GenerateArgs>();
  cmd->add_option("--model", a->model, "Model folder (config.json, checkpoint, tokenizer.json)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--prompt", a->prompt, "Prompt text (tokenized as is, after BOS)")->required();
  cmd->add_option("--max-tokens", a->max_tokens, "Tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", a->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", a->top_p, "Nucleus sampling mass")->capture_default_str();
  cmd->add_option("--top-k", a->top_k, "Top-k filter (0 = off)")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Sampling seed (Philox stream)")->capture_default_str();
  cmd->add_flag("--ced", a->ced, "Use the CED prefill shortcut (approximation)");
  cmd->add_flag("--reference-index-keys", a->reference_keys,
                "Reproduce the reference's stale index keys at decode");
  cmd->add_flag("--no-bos", a->no_bos, "Do not prepend BOS");
  cmd->callback([a, &exit_code] {
    run_generate(*a);
    exit_code = 0;
  });
}

}  // namespace

UF_REGISTER_COMMAND("generate", setup_generate);
