#include "server/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace uf::server {
namespace {

void atomic_add(std::atomic<double>& a, double v) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt::format("{}", int64_t(v));
  return fmt::format("{}", v);
}

}  // namespace

void Counter::add(double v) { atomic_add(value_, v); }
void Gauge::add(double v) { atomic_add(value_, v); }

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  UF_CHECK(std::is_sorted(bounds_.begin(), bounds_.end()), "histogram bounds must be sorted");
  buckets_ = std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1);
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

void Histogram::observe(double value, uint64_t count) {
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  buckets_[i].fetch_add(count, std::memory_order_relaxed);
  count_.fetch_add(count, std::memory_order_relaxed);
  atomic_add(sum_, value * double(count));
}

Counter& LabeledCounter::with(const std::string& value) {
  std::lock_guard lock(mu_);
  auto& c = children_[value];
  if (!c) c = std::make_unique<Counter>();
  return *c;
}

std::map<std::string, double> LabeledCounter::snapshot() const {
  std::lock_guard lock(mu_);
  std::map<std::string, double> out;
  for (const auto& [k, c] : children_) out[k] = c->value();
  return out;
}

MetricsRegistry::Entry& MetricsRegistry::add(const std::string& name, const std::string& help,
                                             const std::string& type) {
  std::lock_guard lock(mu_);
  for (const auto& e : entries_) UF_CHECK(e->name != name, "metric {} registered twice", name);
  entries_.push_back(std::make_unique<Entry>());
  auto& e = *entries_.back();
  e.name = name;
  e.help = help;
  e.type = type;
  return e;
}

Counter& MetricsRegistry::counter(const std::string& name, const std::string& help) {
  auto& e = add(name, help, "counter");
  e.counter = std::make_unique<Counter>();
  return *e.counter;
}

Gauge& MetricsRegistry::gauge(const std::string& name, const std::string& help) {
  auto& e = add(name, help, "gauge");
  e.gauge = std::make_unique<Gauge>();
  return *e.gauge;
}

Histogram& MetricsRegistry::histogram(const std::string& name, const std::string& help,
                                      std::vector<double> upper_bounds) {
  auto& e = add(name, help, "histogram");
  e.histogram = std::make_unique<Histogram>(std::move(upper_bounds));
  return *e.histogram;
}

LabeledCounter& MetricsRegistry::labeled_counter(const std::string& name, const std::string& help,
                                                 const std::string& label) {
  auto& e = add(name, help, "counter");
  e.labeled = std::make_unique<LabeledCounter>(label);
  return *e.labeled;
}

std::string MetricsRegistry::render() const {
  std::lock_guard lock(mu_);
  std::string out;
  for (const auto& e : entries_) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", e->name, e->help, e->name, e->type);
    if (e->counter) {
      out += fmt::format("{} {}\n", e->name, number(e->counter->value()));
    } else if (e->gauge) {
      out += fmt::format("{} {}\n", e->name, number(e->gauge->value()));
    } else if (e->labeled) {
      for (const auto& [k, v] : e->labeled->snapshot()) {
        out += fmt::format("{}{{{}=\"{}\"}} {}\n", e->name, e->labeled->label(), k, number(v));
      }
    } else if (e->histogram) {
      const auto& h = *e->histogram;
      uint64_t cum = 0;
      for (size_t i = 0; i < h.bounds().size(); ++i) {
        cum += h.bucket(i);
        out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", e->name, number(h.bounds()[i]), cum);
      }
      cum += h.bucket(h.bounds().size());
      // Count from the buckets so that a concurrent observe never makes +Inf disagree with them.
      out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n", e->name, cum);
      out += fmt::format("{}_sum {}\n{}_count {}\n", e->name, number(h.sum()), e->name, cum);
    }
  }
  return out;
}

namespace {
std::vector<double> latency_buckets() {
  return {0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1,
          0.25,   0.5,   1,     2.5,   5,     10,     30,   60,   120};
}
}  // namespace

ServerMetrics::ServerMetrics(MetricsRegistry& r)
    : queue_depth(r.gauge("uf_queue_depth", "Requests waiting for the engine (FIFO).")),
      prepared_requests(r.gauge("uf_prepared_requests",
                                "Queued requests already readied by the preparation "
                                "thread (at most 6).")),
      running_requests(r.gauge("uf_running_requests", "Requests decoding now (0 or 1).")),
      requests_total(
          r.labeled_counter("uf_requests_total", "Finished requests by outcome.", "outcome")),
      queue_time(r.histogram("uf_queue_time_seconds", "Time from admission to engine start.",
                             latency_buckets())),
      time_to_first_token(r.histogram("uf_time_to_first_token_seconds",
                                      "Time from admission to the first generated token.",
                                      latency_buckets())),
      inter_token_latency(r.histogram(
          "uf_inter_token_latency_seconds",
          "Decode time per generated token after the first "
          "(step time / tokens of the step, one sample per token).",
          {0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1})),
      step_time(r.histogram("uf_step_time_seconds", "Wall time of one decode (verify) step.",
                            {0.0005, 0.001, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.005, 0.0075,
                             0.01, 0.02, 0.05, 0.1, 0.5, 1})),
      accepted_length(r.histogram("uf_accepted_length",
                                  "Tokens committed per verify step (bonus token included).",
                                  {1, 2, 3, 4, 5, 6, 7, 8})),
      request_duration(r.histogram("uf_request_duration_seconds",
                                   "Time from admission to the end of the response.",
                                   latency_buckets())),
      prompt_tokens(r.counter("uf_prompt_tokens_total", "Prompt tokens of admitted requests.")),
      generation_tokens(r.counter("uf_generation_tokens_total", "Generated tokens.")),
      kv_reuse_hits(r.counter("uf_kv_reuse_hits_total",
                              "Requests that reused cached KV state (local or remote).")),
      kv_reuse_misses(
          r.counter("uf_kv_reuse_misses_total", "Requests that found no reusable KV state.")),
      kv_reuse_bytes(r.counter("uf_kv_reuse_bytes_total", "Bytes of KV state reused.")),
      kv_reused_tokens(r.counter("uf_kv_reused_tokens_total",
                                 "Prompt tokens whose KV state was reused, not recomputed.")),
      kv_reuse_by_source(r.labeled_counter("uf_kv_reuse_by_source_total",
                                           "Requests that reused KV state, by where it came from.",
                                           "source")) {}

}  // namespace uf::server
