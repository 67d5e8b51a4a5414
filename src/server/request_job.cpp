#include "server/request_job.h"

#include "server/metrics.h"

namespace uf::server {

void RequestJob::finish(GenerationResult r) {
  {
    std::lock_guard lock(mu);
    result = std::move(r);
    finished = true;
  }
  events.fetch_add(1, std::memory_order_release);
  cv.notify_all();
}

void JobSink::on_step(const StepEvent& step) {
  const auto now = Clock::now();
  const int n = static_cast<int>(step.tokens.size());
  bool first = false;
  {
    std::lock_guard lock(job_.mu);
    job_.pending.insert(job_.pending.end(), step.tokens.begin(), step.tokens.end());
    job_.generated += n;
    if (n > 0 && !job_.has_first_token) {
      job_.has_first_token = true;
      job_.first_token_at = now;
      first = true;
    }
    if (!step.is_prefill) {
      ++job_.decode_steps;
      job_.decode_tokens += n;
      job_.decode_ms += step.step_ms;
    }
  }
  job_.events.fetch_add(1, std::memory_order_release);
  job_.cv.notify_all();
  if (first) {
    metrics_.time_to_first_token.observe(
        std::chrono::duration<double>(now - job_.admitted).count());
  }
  if (!step.is_prefill) {
    metrics_.step_time.observe(step.step_ms / 1000.0);
    metrics_.accepted_length.observe(n);
    if (n > 0) metrics_.inter_token_latency.observe(step.step_ms / 1000.0 / n, uint64_t(n));
  }
  metrics_.generation_tokens.add(n);
}

}  // namespace uf::server
