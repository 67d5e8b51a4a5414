#pragma once
// RankWorkers: one persistent thread per tensor-parallel rank. run(f) runs f(rank) on every worker
// at once and returns when all are done, rethrowing the lowest rank's error. Host code only (no
// CUDA here: the backend binds each thread to its device through `bind`), so it is tested
// without a GPU (tests/cuda/host/test_rank_workers.cpp).
//
// Why both sides spin before they sleep: a TP decode step is three backend calls (draft, verify
// forward, commit) of a few milliseconds each, every one a run(). Waking a thread blocked on a
// condition variable costs tens of microseconds (a futex wake and the scheduler), paid by every
// rank at the start of each call (the last to wake holds the others up in their first collective)
// and by the caller at its end. So a worker that finished a job polls for the next one for
// `worker_spin` before it sleeps (a step's next call comes within that), and the caller polls for
// the job's end for `caller_spin` (about a step) before it sleeps. Polling yields the CPU between
// looks, so a machine with fewer cores than threads still makes progress.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace uf::cuda {

class RankWorkers {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::microseconds kWorkerSpin{2000};
  static constexpr std::chrono::microseconds kCallerSpin{20000};

  // n workers; bind(rank) runs once on worker `rank`'s thread before any job (its error is
  // rethrown by every run, as if the job had thrown it).
  RankWorkers(int n, std::function<void(int)> bind,
              std::chrono::microseconds worker_spin = kWorkerSpin,
              std::chrono::microseconds caller_spin = kCallerSpin)
      : bind_(std::move(bind)),
        worker_spin_(worker_spin),
        caller_spin_(caller_spin),
        errors_(size_t(std::max(n, 0))) {
    for (int r = 0; r < n; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankWorkers() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  RankWorkers(const RankWorkers&) = delete;
  RankWorkers& operator=(const RankWorkers&) = delete;

  int size() const { return int(threads_.size()); }

  void run(const std::function<void(int)>& f) {
    // One call at a time: two callers must not interleave their ranks' collectives.
    std::lock_guard<std::mutex> call(call_mu_);
    job_ = &f;
    for (auto& e : errors_) e = nullptr;
    pending_.store(int(threads_.size()), std::memory_order_relaxed);
    {
      // Under the lock, so that a worker about to sleep sees either the old generation (and
      // then the notify) or the new one: no lost wake-up.
      std::lock_guard<std::mutex> lock(mu_);
      gen_.fetch_add(1, std::memory_order_release);  // publishes job_, errors_, pending_
    }
    cv_.notify_all();
    const auto until = Clock::now() + caller_spin_;
    while (pending_.load(std::memory_order_acquire) != 0 && Clock::now() < until)
      std::this_thread::yield();
    if (pending_.load(std::memory_order_acquire) != 0) {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    }
    job_ = nullptr;
    for (auto& e : errors_)
      if (e) std::rethrow_exception(e);
  }

 private:
  void loop(int rank) {
    std::exception_ptr bind_error;
    try {
      if (bind_) bind_(rank);
    } catch (...) {
      bind_error = std::current_exception();
    }
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = gen_.load(std::memory_order_acquire);
      if (g == seen && !stop_.load(std::memory_order_acquire)) {
        const auto until = Clock::now() + worker_spin_;
        while ((g = gen_.load(std::memory_order_acquire)) == seen &&
               !stop_.load(std::memory_order_acquire) && Clock::now() < until)
          std::this_thread::yield();
        if (g == seen) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] {
            return stop_.load(std::memory_order_acquire) ||
                   gen_.load(std::memory_order_acquire) != seen;
          });
          g = gen_.load(std::memory_order_acquire);
        }
      }
      if (stop_.load(std::memory_order_acquire)) return;
      seen = g;
      std::exception_ptr err = bind_error;
      if (!err) {
        try {
          (*job_)(rank);
        } catch (...) {
          err = std::current_exception();
        }
      }
      errors_[size_t(rank)] = err;
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mu_);  // the caller may be between its check and its sleep
        done_.notify_all();
      }
    }
  }

  std::function<void(int)> bind_;
  std::chrono::microseconds worker_spin_, caller_spin_;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

}  // namespace uf::cuda
