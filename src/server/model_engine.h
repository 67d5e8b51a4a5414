#pragma once
// The real engine behind the server: a compute backend (CPU or CUDA) driven by the generation loop
// (speculative decoding with block verification by default), with a host-memory session cache so
// that the next turn of a conversation continues from the previous turn's KV state.
//
// prepare() (preparation thread) looks the session up in the host cache; generate() (engine
// thread) restores the snapshot, prefills only the rest of the prompt, decodes, and stores two
// snapshots for the next turn: the prompt's state and the final state.
//
// With KV sharing (ModelEngineOptions::sharing), prepare() also asks the session directory who
// owns the session; when another server does, it fetches that server's snapshot over UCX
// (BLAKE3-verified) and claims the session; generate() then publishes this server's snapshots
// for the next server. Every sharing failure falls back to the local cache or to recomputing.

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "engine/backend.h"
#include "engine/generation_loop.h"
#include "kv/host_session_cache.h"
#include "kv/session_sharing.h"
#include "server/generation_engine.h"
#include "server/kv_sharing_options.h"

namespace uf::server {

struct ModelEngineOptions {
  std::string model_name = "deepseek-v4.1-flash";
  int64_t max_seq = 8192;
  uint64_t host_cache_bytes = uint64_t(1) << 30;
  engine::DecodeMode mode = engine::DecodeMode::kSpeculative;
  sampling::VerifyMode verify = sampling::VerifyMode::kBlock;
  int draft_tokens = 0;  // 0 = the hardware profile's value
  // Absent: single server, local host cache only.
  std::optional<KvSharingOptions> sharing;
};

class ModelEngine : public GenerationEngine {
 public:
  // Throws uf::core::Error when KV sharing is configured but UCX cannot start.
  ModelEngine(std::unique_ptr<engine::Backend> backend, const engine::HardwareProfile& profile,
              ModelEngineOptions options);
  ~ModelEngine() override;

  std::shared_ptr<PreparedState> prepare(const GenerationRequest& request) override;
  GenerationResult generate(const GenerationRequest& request,
                            const std::shared_ptr<PreparedState>& prepared,
                            TokenSink& sink) override;
  std::string model_name() const override { return options_.model_name; }

  // One short generation so that first requests do not pay for lazy initialisation.
  void warm_up(int32_t bos_id);

  kv::HostSessionCache& host_cache() { return cache_; }
  engine::Backend& backend() { return *backend_; }
  // KV sharing's UCX address ("host:port"), empty without sharing.
  std::string kv_address() const;

 private:
  void publish_snapshots(const std::string& key, const kv::SessionVersion& version,
                         const std::vector<kv::SessionSnapshot>& snapshots);
  void drop_local(const std::string& sharing_key);

  std::unique_ptr<engine::Backend> backend_;
  engine::GenerationLoop loop_;
  ModelEngineOptions options_;
  kv::HostSessionCache cache_;

  // KV sharing (all null without it). Declared after what its callbacks touch, so it stops first.
  std::mutex versions_mu_;
  // Per session key: the directory version of the snapshot this server published last.
  std::unordered_map<std::string, kv::SessionVersion> published_;
  // SessionSharing's key (SHA-256 of our session key) -> our session key, for drop notifications.
  std::unordered_map<std::string, std::string> sharing_keys_;
  std::unique_ptr<kv::SessionDirectory> directory_;
  std::unique_ptr<kv::UcxNode> node_;
  std::unique_ptr<kv::SessionSharing> sharing_;
};

}  // namespace uf::server
