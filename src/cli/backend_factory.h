#pragma once
// The composition root's backend factory: builds the compute backend a command asked for from a
// model folder (config, checkpoint, tokenizer), and the hardware profile that goes with it.

#include <CLI/CLI.hpp>
#include <filesystem>
#include <memory>
#include <string>

#include "engine/backend.h"
#include "engine/hardware_profile.h"

namespace uf::cli {

struct BackendChoice {
  std::string kind = "cpu";           // "cpu" or "cuda"
  bool reference_index_keys = false;  // the reference's stale-index-key decode quirk (CPU only)
  int max_chunk = 0;  // CUDA: prefill rows per span (its scratch size); 0 = the backend's default
  int tp = 1;         // CUDA: tensor-parallel GPUs (devices 0..tp-1); CPU: must be 1
  bool cuda_graphs = true;  // CUDA: decode / verify steps replay CUDA graphs (off: eager launches)
  bool device_verify = true;  // CUDA: speculative verification on the GPU (off: on the host)
  bool p2p_allreduce = true;  // CUDA TP: one-shot peer-to-peer sums where possible (off: NCCL)
  // CUDA: the largest session capacity the caller will ask for (the server's --max-seq; 0:
  // unknown), so the backend sizes its index scratch before capturing the decode graphs.
  int64_t max_seq = 0;
  // CUDA: the prefill linear layers and mHC mixes on bf16 tensor cores (default; ~2.6 GB more a
  // TP8 rank) or, off, on the kernels that are bitwise the decode ones (--prefill-gemm fp8).
  bool prefill_gemm_bf16 = true;
};

// The CUDA backend's switches that `generate` and `serve` share: one definition of the flags
// (add_cuda_switches) and of the BackendChoice fields they set (apply).
struct CudaSwitches {
  bool no_cuda_graphs = false;
  bool no_device_verify = false;
  bool no_p2p_allreduce = false;
  std::string prefill_gemm = "bf16";
  void apply(BackendChoice& choice) const;
};
void add_cuda_switches(CLI::App* cmd, CudaSwitches& s);

struct LoadedBackend {
  std::unique_ptr<engine::Backend> backend;
  engine::HardwareProfile profile;
};

// Throws uf::core::Error naming the folder or file when the model cannot be loaded, or when the
// backend kind is not built into this binary.
LoadedBackend load_backend(const std::filesystem::path& model_dir, const BackendChoice& choice);

}  // namespace uf::cli
