#include "cli/backend_factory.h"

#include <spdlog/spdlog.h>

#include "core/error.h"
#include "cpu/cpu_backend.h"
#include "tokenizer/engram_token_map.h"
#include "tokenizer/tokenizer.h"

namespace uf::cli {

namespace {
// The Engram token map is part of the model: built from the model folder's tokenizer and checked
// against the config's class count.
std::vector<int64_t> engram_map_for(const std::filesystem::path& model_dir) {
  const auto cfg = model::ModelConfig::load(model_dir);
  if (cfg.engram_layer_ids.empty()) return {};
  const auto path = model_dir / "tokenizer.json";
  UF_CHECK(std::filesystem::exists(path),
           "{} is missing: the Engram token map is built from the model's tokenizer",
           path.string());
  const auto tok = tokenizer::Tokenizer::from_file(path);
  const auto m = tokenizer::build_engram_token_map(tok, cfg.engram_compressed_vocab_size);
  return std::vector<int64_t>(m.map.begin(), m.map.end());
}
}  // namespace

LoadedBackend load_backend(const std::filesystem::path& model_dir, const BackendChoice& choice) {
  UF_CHECK(std::filesystem::is_directory(model_dir), "model folder {} does not exist",
           model_dir.string());
  LoadedBackend out;
  if (choice.kind == "cpu") {
    cpu::ModelOptions opts;
    if (choice.reference_index_keys) opts.index_keys = cpu::IndexKeys::kReference;
    spdlog::info("loading {} on the CPU backend", model_dir.string());
    auto b = std::make_unique<cpu::CpuBackend>(model_dir, engram_map_for(model_dir), opts);
    out.profile = engine::resolve_hardware_profile({"cpu", "", 0}, b->config().dspark_block_size);
    out.backend = std::move(b);
    return out;
  }
  if (choice.kind == "cuda") {
    core::fail(
        "the CUDA backend cannot serve a model yet: its kernels are built and tested on their own "
        "(scripts/gpu-check) but the full forward pass is not wired; use --backend cpu");
  }
  core::fail("unknown backend '{}': expected cpu or cuda", choice.kind);
}

}  // namespace uf::cli
