#pragma once
// The CPU reference backend behind the engine's Backend interface (engine/backend.h).

#include <filesystem>
#include <memory>

#include "cpu/model.h"
#include "engine/backend.h"

namespace uf::cpu {

class CpuBackend : public engine::Backend {
 public:
  // Loads config and checkpoint from `model_dir`; engram_token_map: see CpuModel.
  CpuBackend(const std::filesystem::path& model_dir, std::vector<int64_t> engram_token_map,
             ModelOptions opts = {});

  const model::ModelConfig& config() const override { return model_->config(); }
  std::string name() const override { return "cpu"; }
  int max_rows() const override { return model_->options().max_rows; }
  std::unique_ptr<engine::SessionState> new_session(int64_t max_seq) override;
  void prefill(engine::SessionState& s, std::span<const int32_t> tokens,
               const engine::PrefillOptions& opts, std::span<float> logits) override;
  void decode_rows(engine::SessionState& s, std::span<const int32_t> tokens,
                   std::span<float> logits) override;
  void commit(engine::SessionState& s, int n_accepted) override;
  engine::DraftBlock draft(engine::SessionState& s, int32_t anchor,
                           const engine::DraftSampler& sampler) override;
  std::vector<uint8_t> snapshot(const engine::SessionState& s) const override;
  void restore(engine::SessionState& s, std::span<const uint8_t> bytes) const override;

  CpuModel& model() { return *model_; }
  static CpuSession& session(engine::SessionState& s);

  static constexpr int kDefaultChunk = 4096;

 private:
  model::Checkpoint ckpt_;
  std::unique_ptr<CpuModel> model_;
};

}  // namespace uf::cpu
