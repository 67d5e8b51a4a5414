#include "server/stub_engine.h"

#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/error.h"

namespace uf::server {
namespace {

// splitmix64: tiny, fast and fully determined by the seed (reproducibility tests rely on it).
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int between(int lo, int hi) {  // inclusive
    if (hi <= lo) return lo;
    return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
};

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

const char* kv_source_name(KvSource s) {
  switch (s) {
    case KvSource::kLocal:
      return "local";
    case KvSource::kRemote:
      return "remote";
    default:
      return "none";
  }
}

StubEngine::StubEngine(StubEngineConfig config) : config_(std::move(config)) {
  UF_CHECK(!config_.vocabulary.empty(), "StubEngine needs a non-empty vocabulary");
  UF_CHECK(config_.tokens_per_step_min >= 1 &&
               config_.tokens_per_step_max >= config_.tokens_per_step_min,
           "StubEngine tokens_per_step range [{}, {}] is invalid", config_.tokens_per_step_min,
           config_.tokens_per_step_max);
}

std::vector<int32_t> StubEngine::planned_output(const GenerationRequest& request) const {
  if (config_.script) {
    if (auto scripted = config_.script(request)) return *scripted;
  }
  Rng rng{request.sampling.seed.value_or(0) ^ 0x243f6a8885a308d3ull};
  std::vector<int32_t> out;
  auto draw = [&] { return config_.vocabulary[rng.next() % config_.vocabulary.size()]; };
  bool thinking = !request.prompt_ids.empty() && config_.think_start_id >= 0 &&
                  request.prompt_ids.back() == config_.think_start_id;
  if (thinking) {
    int n = rng.between(config_.reasoning_tokens_min, config_.reasoning_tokens_max);
    for (int i = 0; i < n; ++i) out.push_back(draw());
    out.push_back(config_.think_end_id);
  }
  const bool unlimited = config_.content_tokens_max < 0;
  int n = unlimited ? request.max_new_tokens
                    : rng.between(config_.content_tokens_min, config_.content_tokens_max);
  for (int i = 0; i < n && static_cast<int>(out.size()) < request.max_new_tokens; ++i) {
    out.push_back(draw());
  }
  const bool eos_stops = std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(),
                                   config_.eos_id) != request.stop_token_ids.end();
  if (!unlimited && eos_stops) out.push_back(config_.eos_id);
  return out;
}

std::shared_ptr<PreparedState> StubEngine::prepare(const GenerationRequest& request) {
  auto state = std::make_shared<PreparedState>();
  if (request.session_key.empty()) return state;
  std::lock_guard lock(mu_);
  auto it = sessions_.find(request.session_key);
  if (it == sessions_.end()) return state;
  const auto& prev = it->second;
  size_t n = 0;
  // The last prompt token is always recomputed (its logits start the generation).
  size_t limit = std::min(prev.size(), request.prompt_ids.size() - 1);
  while (n < limit && prev[n] == request.prompt_ids[n]) ++n;
  state->reused_tokens = static_cast<int>(n);
  state->reused_bytes = n * 890;  // FP4 compressed KV per token, as the real cache stores it
  state->kv_source = n > 0 ? KvSource::kLocal : KvSource::kNone;
  return state;
}

GenerationResult StubEngine::generate(const GenerationRequest& request,
                                      const std::shared_ptr<PreparedState>& /*prepared*/,
                                      TokenSink& sink) {
  GenerationResult result;
  GenerationRequest seeded = request;
  if (!seeded.sampling.seed) {
    std::lock_guard lock(mu_);
    seeded.sampling.seed = next_seed_++;
  }
  const std::vector<int32_t> plan = planned_output(seeded);
  // Sub-100 µs step delays need the thread's timer slack (50 µs by default) at 1 µs.
  if (config_.step_delay_us > 0 && config_.step_delay_us < 1000) prctl(PR_SET_TIMERSLACK, 1000);
  Rng step_rng{*seeded.sampling.seed + 17};
  auto cancelled = [&] {
    return request.cancel && request.cancel->load(std::memory_order_relaxed);
  };
  auto is_stop = [&](int32_t id) {
    return std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(), id) !=
           request.stop_token_ids.end();
  };

  size_t pos = 0;
  bool first = true;
  result.finish = EngineFinish::kLength;
  while (true) {
    if (cancelled()) {
      result.finish = EngineFinish::kCancelled;
      break;
    }
    if (pos >= plan.size() || static_cast<int>(pos) >= request.max_new_tokens) {
      result.finish = EngineFinish::kLength;
      break;
    }
    auto t0 = std::chrono::steady_clock::now();
    int want =
        first ? 1 : step_rng.between(config_.tokens_per_step_min, config_.tokens_per_step_max);
    int delay = first ? config_.prefill_delay_us : config_.step_delay_us;
    if (delay > 0 && config_.spin_delay) {
      while (ms_since(t0) * 1000.0 < delay) std::this_thread::yield();
    } else if (delay > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(delay));
    }
    size_t end = std::min({plan.size(), pos + static_cast<size_t>(want),
                           static_cast<size_t>(request.max_new_tokens)});
    bool stop = false;
    for (size_t i = pos; i < end; ++i) {
      if (is_stop(plan[i])) {
        end = i + 1;
        stop = true;
        break;
      }
    }
    StepEvent ev;
    ev.tokens = std::span<const int32_t>(plan.data() + pos, end - pos);
    ev.is_prefill = first;
    ev.step_ms = ms_since(t0);
    if (!first) {
      ++result.decode_steps;
      result.decode_ms += ev.step_ms;
    }
    sink.on_step(ev);
    result.generated_tokens += static_cast<int>(end - pos);
    pos = end;
    first = false;
    if (stop) {
      result.finish = EngineFinish::kStopToken;
      break;
    }
  }
  if (!request.session_key.empty()) {
    std::vector<int32_t> all = request.prompt_ids;
    all.insert(all.end(), plan.begin(), plan.begin() + static_cast<long>(pos));
    std::lock_guard lock(mu_);
    if (sessions_.size() >= 4096 && !sessions_.count(request.session_key)) {
      sessions_.erase(sessions_.begin());  // bounded: the stub is not a real cache
    }
    sessions_[request.session_key] = std::move(all);
  }
  return result;
}

}  // namespace uf::server
