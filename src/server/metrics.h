#pragma once
// A small Prometheus registry: counters, gauges and histograms, rendered in the text exposition
// format (version 0.0.4) for GET /metrics. Updates are lock-free atomics except the first use of a
// new label value, so the engine thread can record every step.

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace uf::server {

class Counter {
 public:
  void add(double v = 1.0);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void set(double v) { value_.store(v, std::memory_order_relaxed); }
  void add(double v);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  // Records `count` observations of `value` (e.g. the per-token latency of a step of k tokens).
  void observe(double value, uint64_t count = 1);
  const std::vector<double>& bounds() const { return bounds_; }
  uint64_t bucket(size_t i) const { return buckets_[i].load(std::memory_order_relaxed); }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  double sum() const { return sum_.load(std::memory_order_relaxed); }

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // non-cumulative, last = +Inf
  std::atomic<uint64_t> count_{0};
  std::atomic<double> sum_{0.0};
};

// A counter family with one label (e.g. requests_total{outcome="stop"}).
class LabeledCounter {
 public:
  explicit LabeledCounter(std::string label) : label_(std::move(label)) {}
  Counter& with(const std::string& value);
  std::map<std::string, double> snapshot() const;
  const std::string& label() const { return label_; }

 private:
  std::string label_;
  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<Counter>> children_;
};

class MetricsRegistry {
 public:
  Counter& counter(const std::string& name, const std::string& help);
  Gauge& gauge(const std::string& name, const std::string& help);
  Histogram& histogram(const std::string& name, const std::string& help,
                       std::vector<double> upper_bounds);
  LabeledCounter& labeled_counter(const std::string& name, const std::string& help,
                                  const std::string& label);
  std::string render() const;

 private:
  struct Entry {
    std::string name, help, type;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::unique_ptr<Histogram> histogram;
    std::unique_ptr<LabeledCounter> labeled;
  };
  Entry& add(const std::string& name, const std::string& help, const std::string& type);
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_;
};

// The server's metrics, registered once; members point into the registry.
struct ServerMetrics {
  explicit ServerMetrics(MetricsRegistry& r);
  Gauge& queue_depth;
  Gauge& prepared_requests;
  Gauge& running_requests;
  LabeledCounter& requests_total;  // outcome: stop, length, tool_calls, cancelled, error, ...
  Histogram& queue_time;
  Histogram& time_to_first_token;
  Histogram& inter_token_latency;
  Histogram& step_time;
  Histogram& accepted_length;
  Histogram& request_duration;
  Counter& prompt_tokens;
  Counter& generation_tokens;
  Counter& kv_reuse_hits;
  Counter& kv_reuse_misses;
  Counter& kv_reuse_bytes;
  Counter& kv_reused_tokens;
  LabeledCounter& kv_reuse_by_source;  // source: local (host cache), remote (fetched)
};

}  // namespace uf::server
