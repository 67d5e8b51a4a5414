#pragma once
// One admitted request as the scheduler and the HTTP worker share it. The engine thread appends
// generated tokens and step statistics (JobSink); the HTTP worker that owns the connection takes
// them out, detokenises and writes the response. Everything behind `mu` is guarded by it.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "server/generation_engine.h"

namespace uf::server {

struct ServerMetrics;

using Clock = std::chrono::steady_clock;

struct RequestJob {
  GenerationRequest gen;
  std::atomic<bool> cancel{false};
  Clock::time_point admitted = Clock::now();

  std::mutex mu;
  std::condition_variable cv;
  // Scheduler state.
  bool in_queue = false;
  bool prep_started = false;
  bool prepared = false;
  std::shared_ptr<PreparedState> prepared_state;  // released when the engine is done with it
  int reused_tokens = 0;                          // copied from prepared_state for the log
  uint64_t reused_bytes = 0;
  KvSource kv_source = KvSource::kNone;
  // Engine progress.
  bool started = false;
  std::atomic<bool> started_flag{false};  // `started`, readable without `mu`
  Clock::time_point started_at{};
  bool has_first_token = false;
  Clock::time_point first_token_at{};
  std::vector<int32_t> pending;  // generated, not yet taken by the HTTP worker
  // Bumped (outside `mu`) after every step and at the end, so that the worker can poll briefly
  // before sleeping on `cv`: a futex wake-up costs tens of microseconds on a VM.
  std::atomic<uint64_t> events{0};
  int generated = 0;
  int decode_steps = 0;
  int decode_tokens = 0;
  double decode_ms = 0;
  bool finished = false;
  GenerationResult result;

  // Called by the scheduler when the job ends (engine done, or dropped from the queue).
  void finish(GenerationResult r);
};

// Forwards engine steps into a job and records per-step metrics.
class JobSink : public TokenSink {
 public:
  JobSink(RequestJob& job, ServerMetrics& metrics) : job_(job), metrics_(metrics) {}
  void on_step(const StepEvent& step) override;

 private:
  RequestJob& job_;
  ServerMetrics& metrics_;
};

}  // namespace uf::server
