// The TP backend's per-rank threads (src/cuda/backend/rank_workers.h): the host latency of one
// run() of an empty job on N workers, the cost every backend call of a TP step pays before and
// after its GPU work. "poll": the default spins (workers 2 ms after a job, the caller 20 ms);
// "sleep": spins of 0, every hand-off through the condition variables (the backend before
// session 12). "gap" runs sleep 0.2 ms between calls (a step's host work and rank-0-only
// verification between two calls), so the workers are idle when the call comes.
// Floor: 0 (an empty job); the figure is the hand-off itself. Needs N + 1 free cores to mean what
// it says: on a machine with fewer, polling threads take turns (they yield).
#include <benchmark/benchmark.h>

#include <chrono>
#include <thread>

#include "cuda/backend/rank_workers.h"

namespace {

using std::chrono::microseconds;
using uf::cuda::RankWorkers;

void run_empty(benchmark::State& state, bool poll, bool gap) {
  const int n = int(state.range(0));
  RankWorkers w(n, nullptr, poll ? RankWorkers::kWorkerSpin : microseconds(0),
                poll ? RankWorkers::kCallerSpin : microseconds(0));
  const std::function<void(int)> job = [](int) {};
  for (auto _ : state) {
    if (gap) {
      state.PauseTiming();
      std::this_thread::sleep_for(microseconds(200));
      state.ResumeTiming();
    }
    w.run(job);
  }
  state.counters["floor_us"] = 0;
}

void BM_RunPoll(benchmark::State& s) { run_empty(s, true, false); }
void BM_RunSleep(benchmark::State& s) { run_empty(s, false, false); }
void BM_RunPollAfterGap(benchmark::State& s) { run_empty(s, true, true); }
void BM_RunSleepAfterGap(benchmark::State& s) { run_empty(s, false, true); }

BENCHMARK(BM_RunPoll)->Arg(2)->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RunSleep)->Arg(2)->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RunPollAfterGap)->Arg(2)->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RunSleepAfterGap)->Arg(2)->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
