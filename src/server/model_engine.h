#pragma once
// The real engine behind the server: a compute backend (CPU or CUDA) driven by the generation loop
// (speculative decoding with block verification by default), with a host-memory session cache so
// that the next turn of a conversation continues from the previous turn's KV state.
//
// prepare() (preparation thread) looks the session up in the host cache; generate() (engine
// thread) restores the snapshot, prefills only the rest of the prompt, decodes, and stores two
// snapshots for the next turn: the prompt's state and the final state.

#include <memory>
#include <string>

#include "engine/backend.h"
#include "engine/generation_loop.h"
#include "kv/host_session_cache.h"
#include "server/generation_engine.h"

namespace uf::server {

struct ModelEngineOptions {
  std::string model_name = "deepseek-v4.1-flash";
  int64_t max_seq = 8192;
  uint64_t host_cache_bytes = uint64_t(1) << 30;
  engine::DecodeMode mode = engine::DecodeMode::kSpeculative;
  sampling::VerifyMode verify = sampling::VerifyMode::kBlock;
  int draft_tokens = 0;  // 0 = the hardware profile's value
};

class ModelEngine : public GenerationEngine {
 public:
  ModelEngine(std::unique_ptr<engine::Backend> backend, const engine::HardwareProfile& profile,
              ModelEngineOptions options);

  std::shared_ptr<PreparedState> prepare(const GenerationRequest& request) override;
  GenerationResult generate(const GenerationRequest& request,
                            const std::shared_ptr<PreparedState>& prepared,
                            TokenSink& sink) override;
  std::string model_name() const override { return options_.model_name; }

  // One short generation so that first requests do not pay for lazy initialisation.
  void warm_up(int32_t bos_id);

  kv::HostSessionCache& host_cache() { return cache_; }
  engine::Backend& backend() { return *backend_; }

 private:
  std::unique_ptr<engine::Backend> backend_;
  engine::GenerationLoop loop_;
  ModelEngineOptions options_;
  kv::HostSessionCache cache_;
};

}  // namespace uf::server
