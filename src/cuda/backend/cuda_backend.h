#pragma once
// The CUDA backend behind the engine's Backend interface (engine/backend.h): CudaModel on one GPU,
// or tensor-parallel over CudaModelOptions::tp = N GPUs (devices 0..N-1).
// Prefill chunking, validation and the snapshot byte format are CpuBackend's (cpu/cpu_backend.h),
// so a snapshot taken on one backend restores on the other (and across TP degrees).
//
// TP (N > 1): one CudaModel per rank (its shards, its device, its stream) and one persistent
// worker thread per rank (cudaSetDevice once); every call runs the same per-rank step on all
// workers at once and waits for them (the collectives pair up across the workers' streams). The
// session is a CudaTpSession holding one CudaSession per rank; the KV is replicated, so every
// rank holds the same state. Rank 0's logits come to the host. N = 1 runs today's code on the
// calling thread (no workers, no NCCL). A rank that throws makes the call throw (the first
// error); checks that can fail (sizes, capacities, tokens) are the same on every rank, so all
// ranks stop at the same point.

#include <filesystem>
#include <functional>
#include <memory>

#include "cuda/backend/cuda_model.h"
#include "engine/backend.h"

namespace uf::cuda {

namespace tp {
class TpGroup;
}
class RankWorkers;

// A tensor-parallel session: rank r's state on device r.
class CudaTpSession : public engine::SessionState {
 public:
  ~CudaTpSession() override;
  int64_t length() const override { return ranks[0]->len; }
  int64_t max_seq() const override { return ranks[0]->cap; }
  const std::vector<int32_t>& tokens() const override { return ranks[0]->toks; }

  std::vector<std::unique_ptr<CudaSession>> ranks;
  std::vector<int> devices;
};

class CudaBackend : public engine::Backend {
 public:
  // Loads config and checkpoint from `model_dir`; engram_token_map: see cpu::CpuModel.
  // opts.tp > 1: throws when the plan rejects the config (model::validate_tp's message), when
  // fewer GPUs are visible, or when NCCL cannot be loaded.
  CudaBackend(const std::filesystem::path& model_dir, std::vector<int64_t> engram_token_map,
              CudaModelOptions opts = {});
  // The same from a config and a checkpoint in memory (`bench --synthetic tpN`: the released
  // model's shapes with synthetic weights, model/synthetic.h). The checkpoint's views must stay
  // valid for the backend's lifetime.
  CudaBackend(model::ModelConfig cfg, model::Checkpoint ckpt, std::vector<int64_t> engram_token_map,
              CudaModelOptions opts = {});
  ~CudaBackend() override;

  const model::ModelConfig& config() const override { return models_[0]->config(); }
  std::string name() const override { return "cuda"; }
  int max_rows() const override { return models_[0]->options().max_rows; }
  std::unique_ptr<engine::SessionState> new_session(int64_t max_seq) override;
  void prefill(engine::SessionState& s, std::span<const int32_t> tokens,
               const engine::PrefillOptions& opts, std::span<float> logits) override;
  void decode_rows(engine::SessionState& s, std::span<const int32_t> tokens,
                   std::span<float> logits) override;
  void commit(engine::SessionState& s, int n_accepted) override;
  // One GPU: the verify step's logits stay on the device (cuda/verify.h, bitwise the CPU path).
  bool device_verify() const override;
  sampling::VerifyResult verify_last_rows(engine::SessionState& s, sampling::VerifyMode mode,
                                          const sampling::SamplingParams& params,
                                          std::span<const float> draft_probs,
                                          std::span<const int32_t> tokens, uint64_t seed,
                                          uint64_t step) override;
  engine::DraftBlock draft(engine::SessionState& s, int32_t anchor,
                           const engine::DraftSampler& sampler) override;
  // Device verification and CudaModelOptions::device_draft: the Markov loop and the draft
  // sampling on the device (CudaModel::draft_on_device); verify_last_rows with an empty
  // draft_probs span then verifies against those q rows. Under TP rank 0 runs the loop, the
  // other ranks the stages beside it.
  bool device_draft() const override;
  engine::DraftBlock draft_on_device(engine::SessionState& s, int32_t anchor,
                                     const sampling::SamplingParams& params, uint64_t seed,
                                     uint64_t step) override;
  std::vector<uint8_t> snapshot(const engine::SessionState& s) const override;
  void restore(engine::SessionState& s, std::span<const uint8_t> bytes) const override;

  int tp() const { return int(models_.size()); }
  // Benchmarks: every rank's session brought to `len` committed tokens without running the model
  // (CudaModel::fast_forward with the same seed on every rank, so every rank holds the same state),
  // the ranks in parallel.
  void fast_forward(engine::SessionState& s, int64_t len, uint64_t seed);
  // Rank r's own state in the snapshot format (tests: every rank must hold the same bytes).
  std::vector<uint8_t> snapshot_of_rank(const engine::SessionState& s, int rank) const;
  CudaModel& model(int rank = 0) { return *models_.at(size_t(rank)); }
  // The one-GPU session (throws for a TP session: use rank_session).
  static CudaSession& session(engine::SessionState& s);
  // Rank r's session of a TP session, or the session itself at TP = 1 (r = 0).
  static CudaSession& rank_session(engine::SessionState& s, int rank);

  // The device's architecture as engine/hardware_profile.h names it ("sm90", "sm100", ...).
  static std::string device_arch(int device = 0);
  static int device_count();

 private:
  // f(rank, model, session of that rank) on every rank (N = 1: on this thread).
  void each_rank(engine::SessionState& s,
                 const std::function<void(int, CudaModel&, CudaSession&)>& f) const;

  model::Checkpoint ckpt_;
  std::unique_ptr<tp::TpGroup> group_;    // N > 1
  std::unique_ptr<RankWorkers> workers_;  // N > 1
  std::vector<std::unique_ptr<CudaModel>> models_;
};

}  // namespace uf::cuda
