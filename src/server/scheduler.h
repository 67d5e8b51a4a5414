#pragma once
// The serving loop: a FIFO of admitted requests, one preparation thread that readies queued
// requests ahead of their turn (GenerationEngine::prepare: KV reuse lookup / fetch; at most
// `max_prepared` waiting prepared), and one engine thread that decodes exactly one request at a
// time, in admission order. Cancelled requests leave the queue at once.

#include <deque>
#include <memory>
#include <thread>

#include "server/request_job.h"

namespace uf::server {

struct SchedulerConfig {
  size_t max_queue = 64;    // waiting requests beyond which submit() refuses (HTTP 429)
  size_t max_prepared = 6;  // prepared requests waiting for the engine
};

class Scheduler {
 public:
  Scheduler(GenerationEngine& engine, ServerMetrics& metrics, SchedulerConfig config);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  void start();
  // Cancels everything queued and running, then joins the threads.
  void stop();

  // Admits a job at the back of the queue; false when the queue is full.
  bool submit(const std::shared_ptr<RequestJob>& job);
  // Marks the job cancelled; a queued job leaves the queue now, a running one stops at the next
  // step. Safe to call any number of times, from any thread.
  void cancel(const std::shared_ptr<RequestJob>& job);

  size_t queue_depth() const;
  size_t prepared_count() const;

 private:
  void prep_loop();
  void engine_loop();
  void update_gauges();  // with mu_ held

  GenerationEngine& engine_;
  ServerMetrics& metrics_;
  SchedulerConfig config_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<RequestJob>> queue_;
  std::shared_ptr<RequestJob> running_;
  size_t prepared_ = 0;  // prepared jobs still in queue_
  bool stopping_ = false;
  std::thread prep_thread_, engine_thread_;
};

}  // namespace uf::server
