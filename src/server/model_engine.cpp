#include "server/model_engine.h"

#include <spdlog/spdlog.h>

#include <mutex>
#include <random>

namespace uf::server {

namespace {
struct CachedPrefix : PreparedState {
  std::shared_ptr<const kv::SessionSnapshot> snapshot;
};

EngineFinish to_engine_finish(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kStop:
      return EngineFinish::kStopToken;
    case engine::FinishReason::kLength:
      return EngineFinish::kLength;
    case engine::FinishReason::kCancelled:
      return EngineFinish::kCancelled;
  }
  return EngineFinish::kError;
}

uint64_t fresh_seed() {
  static std::mt19937_64 rng{std::random_device{}()};
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  return rng();
}
}  // namespace

ModelEngine::ModelEngine(std::unique_ptr<engine::Backend> backend,
                         const engine::HardwareProfile& profile, ModelEngineOptions options)
    : backend_(std::move(backend)),
      loop_(*backend_, profile),
      options_(std::move(options)),
      cache_(options_.host_cache_bytes) {}

void ModelEngine::warm_up(int32_t bos_id) {
  auto session = backend_->new_session(options_.max_seq);
  engine::GenerationParams p;
  p.max_new_tokens = 2;
  p.mode = options_.mode;
  p.verify = options_.verify;
  const std::vector<int32_t> prompt = {bos_id};
  loop_.run(*session, prompt, p, [](auto, const auto&) { return true; });
}

std::shared_ptr<PreparedState> ModelEngine::prepare(const GenerationRequest& request) {
  auto out = std::make_shared<CachedPrefix>();
  if (request.session_key.empty()) return out;
  out->snapshot = cache_.find_prefix(request.session_key, request.prompt_ids);
  if (out->snapshot) {
    out->reused_tokens = int(out->snapshot->tokens.size());
    out->reused_bytes = out->snapshot->bytes.size();
    out->kv_source = KvSource::kLocal;
  }
  return out;
}

GenerationResult ModelEngine::generate(const GenerationRequest& request,
                                       const std::shared_ptr<PreparedState>& prepared,
                                       TokenSink& sink) {
  GenerationResult result;
  try {
    auto session = backend_->new_session(options_.max_seq);
    std::span<const int32_t> prompt(request.prompt_ids);
    auto* cached = dynamic_cast<CachedPrefix*>(prepared.get());
    if (cached && cached->snapshot) {
      backend_->restore(*session, cached->snapshot->bytes);
      prompt = prompt.subspan(cached->snapshot->tokens.size());
    }
    engine::GenerationParams p;
    p.sampling.temperature = float(request.sampling.temperature);
    p.sampling.top_p = float(request.sampling.top_p);
    p.sampling.top_k = request.sampling.top_k;
    p.seed = request.sampling.seed ? *request.sampling.seed : fresh_seed();
    p.max_new_tokens = request.max_new_tokens;
    p.stop_token_ids = request.stop_token_ids;
    p.mode = options_.mode;
    p.verify = options_.verify;
    p.draft_tokens = options_.draft_tokens;

    const bool keep = !request.session_key.empty();
    auto store = [&](engine::SessionState& s) {
      cache_.put(request.session_key, kv::SessionSnapshot{s.tokens(), backend_->snapshot(s)});
    };
    bool first = true;
    auto r = loop_.run(
        *session, prompt, p,
        [&](std::span<const int32_t> tokens, const engine::StepStats& st) {
          sink.on_step(StepEvent{tokens, st.ms, first});
          first = false;
          return !(request.cancel && request.cancel->load(std::memory_order_relaxed));
        },
        request.cancel, keep ? engine::PrefillCallback(store) : nullptr);
    if (keep) store(*session);
    result.finish = to_engine_finish(r.finish);
    result.generated_tokens = int(r.tokens.size());
    result.decode_steps = r.steps;
    result.decode_ms = r.step_ms;
  } catch (const std::exception& e) {
    spdlog::error("request {}: generation failed: {}", request.request_id, e.what());
    result.finish = EngineFinish::kError;
    result.error = e.what();
  }
  return result;
}

}  // namespace uf::server
