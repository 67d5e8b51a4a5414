// `ultrafast generate --model <dir> --prompt "..."`: generation on a backend through the engine's
// generation loop, speculative (DSpark drafts + block verification) by default or plain with
// --no-spec. The prompt is BOS + the tokenized text as is (no chat template), so tiny fixture
// models can be driven directly (--prompt-ids for tokenizers without a pre-tokenizer). Prints the
// text as it is generated, then the average accepted length and step time.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/backend_factory.h"
#include "cli/command_registry.h"
#include "core/error.h"
#include "engine/generation_loop.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"

namespace {

struct GenerateArgs {
  std::string model;
  std::string backend = "cpu";
  std::string prompt;
  std::vector<int32_t> prompt_ids;
  int max_tokens = 32;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  uint64_t seed = 0;
  bool no_spec = false;
  uf::cli::CudaSwitches cuda;
  std::string verify = "block";
  int draft_tokens = 0;
  bool ced = false;
  bool reference_keys = false;
  bool no_bos = false;
  int tp = 1;
};

void run_generate(const GenerateArgs& a) {
  const std::filesystem::path dir(a.model);
  const auto tok = uf::tokenizer::Tokenizer::from_file(dir / "tokenizer.json");
  uf::cli::BackendChoice choice{a.backend, a.reference_keys};
  choice.tp = a.tp;
  a.cuda.apply(choice);
  auto loaded = uf::cli::load_backend(dir, choice);
  auto& be = *loaded.backend;
  const auto& cfg = be.config();

  std::vector<int32_t> ids;
  if (!a.no_bos) ids.push_back(cfg.bos_token_id);
  tok.encode_append(a.prompt, ids);
  ids.insert(ids.end(), a.prompt_ids.begin(), a.prompt_ids.end());

  uf::engine::GenerationParams p;
  p.sampling.temperature = a.temperature;
  p.sampling.top_p = a.top_p;
  p.sampling.top_k = a.top_k;
  p.seed = a.seed;
  p.max_new_tokens = a.max_tokens;
  p.stop_token_ids = {cfg.eos_token_id};
  p.mode = a.no_spec ? uf::engine::DecodeMode::kPlain : uf::engine::DecodeMode::kSpeculative;
  p.verify =
      a.verify == "token" ? uf::sampling::VerifyMode::kTokenWise : uf::sampling::VerifyMode::kBlock;
  p.draft_tokens = a.draft_tokens;
  p.prefill.ced_shortcut = a.ced;

  uf::engine::GenerationLoop loop(be, loaded.profile);
  auto session = be.new_session(int64_t(ids.size()) + a.max_tokens + be.max_rows() + 1);
  std::vector<int32_t> out;
  std::string shown;
  const auto r = loop.run(*session, ids, p, [&](std::span<const int32_t> t, const auto&) {
    out.insert(out.end(), t.begin(), t.end());
    const std::string text = tok.decode(out);
    // Print only what is new; a partial UTF-8 character waits for its next token.
    if (text.size() > shown.size() && text.compare(0, shown.size(), shown) == 0) {
      std::fputs(text.substr(shown.size()).c_str(), stdout);
      std::fflush(stdout);
      shown = text;
    }
    return true;
  });
  std::fprintf(stderr,
               "\n[%zu prompt tokens in %.2f s; %zu generated in %d steps (%s): average accepted "
               "length %.2f tokens/step, average step %.2f ms; finish %s]\n",
               ids.size(), r.prefill_ms / 1000.0, r.tokens.size(), r.steps,
               a.no_spec ? "plain" : "speculative", r.average_accept_length(),
               r.average_iteration_ms(), uf::engine::finish_reason_name(r.finish));
}

void setup_generate(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("generate", "Generate text from a prompt (no chat template)");
  auto a = std::make_shared<GenerateArgs>();
  cmd->add_option("--model", a->model, "Model folder (config.json, checkpoint, tokenizer.json)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--backend", a->backend, "Compute backend: cpu or cuda")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--tp", a->tp, "Tensor-parallel GPUs for --backend cuda (devices 0..N-1)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--prompt", a->prompt, "Prompt text (tokenized as is, after BOS)");
  cmd->add_option("--prompt-ids", a->prompt_ids,
                  "Prompt token ids appended after the text (e.g. 5,17,42)")
      ->delimiter(',');
  cmd->add_option("--max-tokens", a->max_tokens, "Tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", a->temperature, "0 = greedy, up to 2")->capture_default_str();
  cmd->add_option("--top-p", a->top_p, "Nucleus sampling mass (0, 1]")->capture_default_str();
  cmd->add_option("--top-k", a->top_k, "Top-k filter (0 = off)")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Sampling seed (Philox streams)")->capture_default_str();
  cmd->add_flag("--no-spec", a->no_spec, "Plain decoding: one token per step, no drafting");
  uf::cli::add_cuda_switches(cmd, a->cuda);
  cmd->add_option("--verify", a->verify, "Draft verification: block or token (token-wise)")
      ->capture_default_str()
      ->check(CLI::IsMember({"block", "token"}));
  cmd->add_option("--draft-tokens", a->draft_tokens,
                  "Draft tokens per step, 1..7 (0: the hardware profile's value)")
      ->capture_default_str()
      ->check(CLI::Range(0, 7));
  cmd->add_flag("--ced", a->ced, "Use the CED prefill shortcut (an approximation)");
  cmd->add_flag("--reference-index-keys", a->reference_keys,
                "Reproduce the reference's stale index keys at decode");
  cmd->add_flag("--no-bos", a->no_bos, "Do not prepend BOS");
  cmd->callback([a, &exit_code] {
    UF_CHECK(!a->prompt.empty() || !a->prompt_ids.empty(),
             "generate: give --prompt or --prompt-ids");
    run_generate(*a);
    exit_code = 0;
  });
}

}  // namespace

UF_REGISTER_COMMAND("generate", setup_generate);
