#include "cli/backend_factory.h"

#include <spdlog/spdlog.h>

#include "core/error.h"
#include "cpu/cpu_backend.h"
#include "tokenizer/engram_token_map.h"
#include "tokenizer/tokenizer.h"

#ifdef UF_HAVE_CUDA
#include "cuda/backend/cuda_backend.h"
#endif

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
  UF_CHECK(choice.tp >= 1, "--tp {} must be at least 1", choice.tp);
  if (choice.kind == "cpu") {
    UF_CHECK(choice.tp == 1, "--tp {}: tensor parallelism needs --backend cuda", choice.tp);
    cpu::ModelOptions opts;
    if (choice.reference_index_keys) opts.index_keys = cpu::IndexKeys::kReference;
    spdlog::info("loading {} on the CPU backend", model_dir.string());
    auto b = std::make_unique<cpu::CpuBackend>(model_dir, engram_map_for(model_dir), opts);
    out.profile = engine::resolve_hardware_profile({"cpu", "", 0}, b->config().dspark_block_size);
    out.backend = std::move(b);
    return out;
  }
  if (choice.kind == "cuda") {
#ifdef UF_HAVE_CUDA
    UF_CHECK(!choice.reference_index_keys,
             "the reference's stale-index-key mode runs on the CPU backend only (--backend cpu)");
    const int gpus = cuda::CudaBackend::device_count();
    UF_CHECK(gpus > 0, "--backend cuda: no CUDA device is visible to this process");
    UF_CHECK(choice.tp <= gpus,
             "--tp {} needs {} GPUs but {} CUDA device(s) are visible to this process", choice.tp,
             choice.tp, gpus);
    if (choice.tp == 1)
      spdlog::info("loading {} on the CUDA backend (device 0 of {})", model_dir.string(), gpus);
    else
      spdlog::info("loading {} on the CUDA backend, tensor-parallel over devices 0..{} of {}",
                   model_dir.string(), choice.tp - 1, gpus);
    cuda::CudaModelOptions opts;
    if (choice.max_chunk > 0) opts.max_chunk = choice.max_chunk;
    opts.tp = choice.tp;
    opts.cuda_graphs = choice.cuda_graphs;
    opts.device_verify = choice.device_verify;
    opts.tp_p2p_allreduce = choice.p2p_allreduce;
    opts.max_seq = choice.max_seq;
    opts.prefill_gemm_bf16 = choice.prefill_gemm_bf16;
    auto b = std::make_unique<cuda::CudaBackend>(model_dir, engram_map_for(model_dir), opts);
    // The profile is keyed by the GPUs' architecture and the count serving the model.
    out.profile = engine::resolve_hardware_profile(
        {"cuda", cuda::CudaBackend::device_arch(0), choice.tp}, b->config().dspark_block_size);
    out.backend = std::move(b);
    return out;
#else
    core::fail(
        "this binary was built without the CUDA backend (configure with -DUF_ENABLE_CUDA=ON on a "
        "machine with nvcc); use --backend cpu");
#endif
  }
  core::fail("unknown backend '{}': expected cpu or cuda", choice.kind);
}

void CudaSwitches::apply(BackendChoice& choice) const {
  choice.cuda_graphs = !no_cuda_graphs;
  choice.device_verify = !no_device_verify;
  choice.p2p_allreduce = !no_p2p_allreduce;
  choice.prefill_gemm_bf16 = prefill_gemm == "bf16";
}

void add_cuda_switches(CLI::App* cmd, CudaSwitches& s) {
  cmd->add_flag("--no-cuda-graphs", s.no_cuda_graphs,
                "--backend cuda: launch every kernel of a step instead of replaying a CUDA graph");
  cmd->add_flag("--no-device-verify", s.no_device_verify,
                "--backend cuda: sample and verify drafts on the host instead of on the GPU");
  cmd->add_flag("--no-p2p-allreduce", s.no_p2p_allreduce,
                "--backend cuda --tp N: sum the ranks' partials with NCCL instead of the one-shot "
                "peer-to-peer all-reduce");
  cmd->add_option("--prefill-gemm", s.prefill_gemm,
                  "--backend cuda: the prefill linear layers and mHC mixes on bf16 (exact bf16 "
                  "operands, the default) or bitwise the decode kernels (fp8: ~2.6 GB less device "
                  "memory a TP8 rank, slower prefill)")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "fp8"}));
}

}  // namespace uf::cli
