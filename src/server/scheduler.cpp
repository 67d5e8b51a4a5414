#include "server/scheduler.h"

#include <algorithm>

#include "core/log.h"
#include "server/metrics.h"

namespace uf::server {

Scheduler::Scheduler(GenerationEngine& engine, ServerMetrics& metrics, SchedulerConfig config)
    : engine_(engine), metrics_(metrics), config_(config) {}

Scheduler::~Scheduler() { stop(); }

void Scheduler::start() {
  std::lock_guard lock(mu_);
  if (prep_thread_.joinable()) return;
  stopping_ = false;
  prep_thread_ = std::thread([this] { prep_loop(); });
  engine_thread_ = std::thread([this] { engine_loop(); });
}

void Scheduler::stop() {
  std::deque<std::shared_ptr<RequestJob>> dropped;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    dropped.swap(queue_);
    prepared_ = 0;
    if (running_) running_->cancel.store(true);
    for (auto& j : dropped) {
      j->cancel.store(true);
      std::lock_guard jl(j->mu);
      j->in_queue = false;
    }
    update_gauges();
  }
  cv_.notify_all();
  for (auto& j : dropped) j->finish({EngineFinish::kCancelled, 0, 0, 0, "server shutting down"});
  if (prep_thread_.joinable()) prep_thread_.join();
  if (engine_thread_.joinable()) engine_thread_.join();
}

bool Scheduler::submit(const std::shared_ptr<RequestJob>& job) {
  {
    std::lock_guard lock(mu_);
    if (stopping_ || queue_.size() >= config_.max_queue) return false;
    {
      std::lock_guard jl(job->mu);
      job->in_queue = true;
    }
    queue_.push_back(job);
    update_gauges();
  }
  cv_.notify_all();
  return true;
}

void Scheduler::cancel(const std::shared_ptr<RequestJob>& job) {
  job->cancel.store(true);
  bool removed = false;
  {
    std::lock_guard lock(mu_);
    auto it = std::find(queue_.begin(), queue_.end(), job);
    if (it != queue_.end()) {
      std::lock_guard jl(job->mu);
      if (job->prepared) --prepared_;
      job->in_queue = false;
      queue_.erase(it);
      removed = true;
      update_gauges();
    }
  }
  cv_.notify_all();
  if (removed) job->finish({EngineFinish::kCancelled, 0, 0, 0, ""});
}

size_t Scheduler::queue_depth() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

size_t Scheduler::prepared_count() const {
  std::lock_guard lock(mu_);
  return prepared_;
}

void Scheduler::update_gauges() {
  metrics_.queue_depth.set(double(queue_.size()));
  metrics_.prepared_requests.set(double(prepared_));
  metrics_.running_requests.set(running_ ? 1.0 : 0.0);
}

void Scheduler::prep_loop() {
  std::unique_lock lock(mu_);
  while (true) {
    std::shared_ptr<RequestJob> next;
    cv_.wait(lock, [&] {
      if (stopping_) return true;
      if (prepared_ >= config_.max_prepared) return false;
      for (auto& j : queue_) {
        std::lock_guard jl(j->mu);
        if (!j->prep_started) {
          next = j;
          return true;
        }
      }
      return false;
    });
    if (stopping_) return;
    {
      std::lock_guard jl(next->mu);
      next->prep_started = true;
    }
    lock.unlock();
    std::shared_ptr<PreparedState> state;
    try {
      state = engine_.prepare(next->gen);
    } catch (const std::exception& e) {
      // prepare() must not throw; if it does, recompute the prompt rather than fail the request.
      spdlog::warn("prepare() failed for request {}: {}; recomputing the prompt",
                   next->gen.request_id, e.what());
    }
    if (!state) state = std::make_shared<PreparedState>();
    if (state->reused_tokens > 0) {
      metrics_.kv_reuse_hits.add();
      metrics_.kv_reuse_bytes.add(double(state->reused_bytes));
      metrics_.kv_reused_tokens.add(state->reused_tokens);
      metrics_.kv_reuse_by_source.with(kv_source_name(state->kv_source)).add();
    } else {
      metrics_.kv_reuse_misses.add();
    }
    lock.lock();
    {
      std::lock_guard jl(next->mu);
      next->reused_tokens = state->reused_tokens;
      next->reused_bytes = state->reused_bytes;
      next->kv_source = state->kv_source;
      next->prepared_state = std::move(state);
      next->prepared = true;
      if (next->in_queue) ++prepared_;
    }
    update_gauges();
    cv_.notify_all();
  }
}

void Scheduler::engine_loop() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] {
      if (stopping_) return true;
      if (queue_.empty()) return false;
      std::lock_guard jl(queue_.front()->mu);
      return queue_.front()->prepared;
    });
    if (stopping_) return;
    auto job = queue_.front();
    queue_.pop_front();
    {
      std::lock_guard jl(job->mu);
      job->in_queue = false;
      job->started = true;
      job->started_at = Clock::now();
      job->started_flag.store(true, std::memory_order_release);
    }
    --prepared_;
    running_ = job;
    update_gauges();
    lock.unlock();
    cv_.notify_all();  // the preparation thread may ready the next one

    metrics_.queue_time.observe(
        std::chrono::duration<double>(job->started_at - job->admitted).count());
    GenerationResult result;
    if (job->cancel.load()) {
      result.finish = EngineFinish::kCancelled;
    } else {
      JobSink sink(*job, metrics_);
      try {
        result = engine_.generate(job->gen, job->prepared_state, sink);
      } catch (const std::exception& e) {
        result.finish = EngineFinish::kError;
        result.error = e.what();
      }
    }
    {
      std::lock_guard jl(job->mu);
      job->prepared_state.reset();  // engine state is released before the next request runs
    }
    lock.lock();
    running_.reset();
    update_gauges();
    lock.unlock();
    job->finish(std::move(result));
    lock.lock();
  }
}

}  // namespace uf::server
