// RankWorkers (src/cuda/backend/rank_workers.h), the TP backend's per-rank threads, without a GPU:
//  (a) every run runs the job once on every rank, on the rank's own (bound) thread, and its
//      writes are visible to the caller when run returns; 2000 runs back to back, with the
//      workers spinning between them and with spins of 0 (every wait sleeps on the condition
//      variables): the hand-off in both directions, where a lost wake-up would hang the test;
//  (b) runs that arrive after the workers went to sleep (a pause longer than their spin);
//  (c) the lowest rank's exception is rethrown, and the workers serve the next run;
//  (d) a bind error is rethrown by every run;
//  (e) destruction while the workers spin, sleep, or were never used.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda/backend/rank_workers.h"

namespace uf::cuda {
namespace {

using std::chrono::microseconds;

void back_to_back(int n, microseconds worker_spin, microseconds caller_spin, int runs) {
  std::vector<std::thread::id> bound(static_cast<size_t>(n));
  RankWorkers w(
      n, [&](int r) { bound[size_t(r)] = std::this_thread::get_id(); }, worker_spin, caller_spin);
  ASSERT_EQ(w.size(), n);
  std::vector<int> count(static_cast<size_t>(n), 0);  // plain ints: run() must order them
  std::vector<int> last(static_cast<size_t>(n), -1);
  for (int k = 0; k < runs; ++k) {
    w.run([&](int r) {
      EXPECT_EQ(std::this_thread::get_id(), bound[size_t(r)]) << "rank " << r << " run " << k;
      ++count[size_t(r)];
      last[size_t(r)] = k;
    });
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(count[size_t(r)], k + 1) << "rank " << r << " after run " << k;
      ASSERT_EQ(last[size_t(r)], k) << "rank " << r;
    }
  }
}

TEST(RankWorkers, EveryRankRunsEveryJobOnceOnItsThread) {
  for (int n : {1, 2, 4, 8}) {
    SCOPED_TRACE("ranks " + std::to_string(n));
    back_to_back(n, RankWorkers::kWorkerSpin, RankWorkers::kCallerSpin, 2000);
    back_to_back(n, microseconds(0), microseconds(0), 2000);  // every wait sleeps
    back_to_back(n, microseconds(50), microseconds(0), 500);
  }
}

TEST(RankWorkers, RunsAfterTheWorkersSleptAreServed) {
  RankWorkers w(3, nullptr, microseconds(100), microseconds(100));
  std::atomic<int> total{0};
  for (int k = 0; k < 5; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(3));  // past both spins
    w.run([&](int) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the caller sleeps too
      total.fetch_add(1);
    });
    EXPECT_EQ(total.load(), 3 * (k + 1));
  }
}

TEST(RankWorkers, TheLowestRanksErrorIsRethrownAndTheWorkersGoOn) {
  RankWorkers w(4, nullptr);
  try {
    w.run([](int r) {
      if (r == 1 || r == 3) throw std::runtime_error("rank " + std::to_string(r) + " failed");
    });
    FAIL() << "run did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 1 failed");
  }
  std::atomic<int> ran{0};
  w.run([&](int) { ran.fetch_add(1); });  // no stale error from the failed run
  EXPECT_EQ(ran.load(), 4);
}

TEST(RankWorkers, ABindErrorIsRethrownByEveryRun) {
  RankWorkers w(2, [](int r) {
    if (r == 1) throw std::runtime_error("no device for rank 1");
  });
  for (int k = 0; k < 3; ++k) EXPECT_THROW(w.run([](int) {}), std::runtime_error);
}

TEST(RankWorkers, DestructionWhileSpinningSleepingOrUnused) {
  { RankWorkers unused(4, nullptr); }
  {
    RankWorkers spinning(4, nullptr, std::chrono::seconds(10), microseconds(0));
    spinning.run([](int) {});
  }  // the workers are in their 10 s spin: stop must end it
  {
    RankWorkers sleeping(4, nullptr, microseconds(0), microseconds(0));
    sleeping.run([](int) {});
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }  // a worker that missed the stop would hang the join (the test's time limit fails it)
}

}  // namespace
}  // namespace uf::cuda
