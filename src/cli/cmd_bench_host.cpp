// `ultrafast bench-host --synthetic tp8-rank`: benchmark 6 of the performance issue, the host
// time between decode steps (target < 20 us): the CPU time from a step's end (the previous call
// returned, its stream drained) to the launch of the next step's device work.
//
// Method: each backend call (a plain 1-row step with its logits to the host; the verify forward
// of --rows rows keeping its logits on the device, as with device verification; a DSpark draft
// round) is timed twice:
//  - plain: wall time W of the call (steady_clock; the call synchronises before returning), so
//    W = host work before the launch + device time + the wake-up after the sync;
//  - busy: a device-to-device copy (--busy-mb, about 0.5 ms) is queued on the model's stream
//    first, between events A and B, then the call, then event E after it returns. While the copy
//    runs the host prepares the step, so the device never idles: B -> E is the device time (+ the
//    wake-up) alone. host = median(W) - median(B -> E).
// Checks printed with it: "covered" counts the calls that started while the copy was still
// running, and the copy must last longer than the host work (else the copy is too short and the
// figure is not valid: raise --busy-mb); a host figure under 2 us
// means the call waits for its stream before launching (then the method cannot see the host
// work: it reads as ~0, a lower bound).
// The forward calls also time themselves (CudaModel::last_launch_host_us: from entering the
// forward to its launch returning), printed below their row: the direct figure, where the
// busy-copy difference stops resolving the host work of ~10 ms calls.
// The engine's own host work between steps (GenerationLoop: sampling, acceptance, bookkeeping)
// is not in these calls; neither is the draft's host Markov loop between its stages (inside the
// call, counted as device time here).
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cli/cmd_bench_common.h"
#include "cli/command_registry.h"
#include "core/error.h"
#include "model/synthetic.h"

#ifdef UF_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/backend/cuda_model.h"
#include "cuda/cuda_check.h"
#endif

namespace {

using nlohmann::json;
namespace bench = uf::cli::bench;

struct HostArgs {
  std::string synthetic;
  int64_t context = 8192;
  int rows = 7;
  int iters = 50, warmup = 5;
  int64_t engram_rows = int64_t(1) << 22;
  int busy_mb = 1024;
  double target_us = 20;
  std::string json_file;
  uint64_t seed = 1;
  bool no_branches = false;
  int device = 0;
};

#ifdef UF_HAVE_CUDA

struct HostFigure {
  double wall_us = 0, device_us = 0, host_us = 0, busy_copy_us = 0;
  int covered = 0, iters = 0;
};

HostFigure measure(const HostArgs& a, cudaStream_t st, void* dst, const void* src, size_t n,
                   const std::function<void()>& call) {
  HostFigure f;
  f.iters = a.iters;
  f.wall_us = bench::time_calls(a.warmup, a.iters, call).median_us;
  cudaEvent_t ea, eb, ee;
  UF_CUDA_CHECK(cudaEventCreate(&ea));
  UF_CUDA_CHECK(cudaEventCreate(&eb));
  UF_CUDA_CHECK(cudaEventCreate(&ee));
  std::vector<double> dev, copy;
  for (int i = 0; i < a.warmup + a.iters; ++i) {
    UF_CUDA_CHECK(cudaEventRecord(ea, st));
    UF_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, st));
    UF_CUDA_CHECK(cudaEventRecord(eb, st));
    const bool running = cudaEventQuery(eb) == cudaErrorNotReady;
    (void)cudaGetLastError();  // not-ready is no error: leave nothing for the call's own checks
    call();
    UF_CUDA_CHECK(cudaEventRecord(ee, st));
    UF_CUDA_CHECK(cudaEventSynchronize(ee));
    float ms_dev = 0, ms_copy = 0;
    UF_CUDA_CHECK(cudaEventElapsedTime(&ms_dev, eb, ee));
    UF_CUDA_CHECK(cudaEventElapsedTime(&ms_copy, ea, eb));
    if (i < a.warmup) continue;
    dev.push_back(ms_dev * 1e3);
    copy.push_back(ms_copy * 1e3);
    f.covered += running ? 1 : 0;
  }
  UF_CUDA_CHECK(cudaEventDestroy(ea));
  UF_CUDA_CHECK(cudaEventDestroy(eb));
  UF_CUDA_CHECK(cudaEventDestroy(ee));
  f.device_us = bench::stats_of(dev).median_us;
  f.busy_copy_us = bench::stats_of(copy).median_us;
  f.host_us = f.wall_us - f.device_us;
  return f;
}

#endif  // UF_HAVE_CUDA

int run_host(const HostArgs& a) {
  std::cout << std::unitbuf;
  const auto cfg = bench::synthetic_config(a.synthetic, a.engram_rows);
  UF_CHECK(a.rows >= 1 && a.rows <= 8, "bench-host: --rows {} outside 1..8", a.rows);
  UF_CHECK(a.iters >= 1 && a.warmup >= 0 && a.busy_mb >= 1, "bench-host: bad --iters / --busy-mb");
  json out = {{"model", "synthetic tp8-rank"}, {"context", a.context}, {"rows", a.rows}};
#ifdef UF_HAVE_CUDA
  int n_dev = 0;
  const cudaError_t e = cudaGetDeviceCount(&n_dev);
  UF_CHECK(e == cudaSuccess && n_dev > a.device, "bench-host: no CUDA device {} ({})", a.device,
           e == cudaSuccess ? fmt::format("{} visible", n_dev) : cudaGetErrorString(e));
  const auto ck = uf::model::synthetic_checkpoint(cfg, a.seed);
  uf::cuda::CudaModelOptions o;
  o.device = a.device;
  o.graph_branches = !a.no_branches;
  o.fold_moe_combine = false;  // a TP8 rank's combine precedes its all-reduce (cmd_bench.cpp)
  auto m =
      std::make_unique<uf::cuda::CudaModel>(cfg, ck, uf::model::synthetic_engram_token_map(cfg), o);
  auto s = m->new_session(a.context + 64);
  m->fast_forward(*s, a.context, a.seed);
  const size_t n = size_t(a.busy_mb) << 20;
  void *src = nullptr, *dst = nullptr;
  UF_CUDA_CHECK(cudaSetDevice(a.device));
  UF_CUDA_CHECK(cudaMalloc(&src, n));
  UF_CUDA_CHECK(cudaMalloc(&dst, n));
  UF_CUDA_CHECK(cudaMemset(src, 1, n));
  const int V = cfg.vocab_size;
  float* host_logits = nullptr;
  UF_CUDA_CHECK(cudaMallocHost(&host_logits, size_t(V) * sizeof(float)));
  std::mt19937_64 rng(a.seed + 3);
  const auto one = bench::random_tokens(rng, 1, V);
  const auto rows = bench::random_tokens(rng, a.rows, V);
  const uf::engine::DraftSampler greedy = [](int, std::span<const float> lg) {
    return int32_t(std::max_element(lg.begin(), lg.end()) - lg.begin());
  };
  struct Case {
    std::string name;
    std::function<void()> call;
  };
  const std::vector<Case> cases = {
      {"plain step (1 row, logits to host)",
       [&] { m->forward(*s, one, false, true, host_logits, nullptr, nullptr); }},
      {fmt::format("verify forward ({} rows, logits kept)", a.rows),
       [&] { m->forward(*s, rows, false, true, nullptr, nullptr, nullptr, true); }},
      {"DSpark draft round", [&] { m->draft(*s, one[0], greedy); }},
  };
  std::cout << fmt::format(
      "host time per backend call at context {} (median of {} after {} warm-up; busy copy {} MB; "
      "target < {:.0f} us):\n{:<40} {:>10} {:>10} {:>9} {:>9} {:>8}\n",
      a.context, a.iters, a.warmup, a.busy_mb, a.target_us, "call", "wall us", "device us",
      "host us", "copy us", "covered");
  json jc = json::array();
  for (const auto& c : cases) {
    try {
      const auto f = measure(a, m->stream(), dst, src, n, c.call);
      const bool low = f.host_us < 2;
      std::cout << fmt::format("{:<40} {:>10.1f} {:>10.1f} {:>9.1f} {:>9.1f} {:>5}/{}{}{}\n",
                               c.name, f.wall_us, f.device_us, f.host_us, f.busy_copy_us, f.covered,
                               f.iters, f.host_us < a.target_us ? "" : "  over target",
                               low ? "  (< 2 us: the call may wait for its stream first)" : "");
      if (f.covered < f.iters || f.host_us > 0.8 * f.busy_copy_us)
        std::cout << "  the busy copy did not outlast the host work of every call: raise "
                     "--busy-mb (the figure is not valid)\n";
      // The forward calls time their own host part up to the launch (CudaModel::
      // last_launch_host_us): the plan, the block upload and the graph launch, no inference.
      double launch_us = -1, plan_us = -1;
      if (&c != &cases.back()) {
        std::vector<double> v, plan;
        for (int i = 0; i < a.iters; ++i) {
          c.call();
          v.push_back(m->last_launch_host_us());
          plan.push_back(m->last_plan_host_us());
        }
        auto median = [](std::vector<double>& x) {
          std::nth_element(x.begin(), x.begin() + ptrdiff_t(x.size() / 2), x.end());
          return x[x.size() / 2];
        };
        launch_us = median(v);
        plan_us = median(plan);
        std::cout << fmt::format(
            "{:<40} {:>10.1f} us from the call to its launch returning{} (plan + block upload "
            "{:.1f} us, the rest cudaGraphLaunch)\n",
            "  measured inside the call", launch_us, launch_us < a.target_us ? "" : "  over target",
            plan_us);
      }
      jc.push_back({{"call", c.name},
                    {"launch_host_us", launch_us},
                    {"plan_host_us", plan_us},
                    {"wall_us", f.wall_us},
                    {"device_us", f.device_us},
                    {"host_us", f.host_us},
                    {"busy_copy_us", f.busy_copy_us},
                    {"covered", f.covered},
                    {"iters", f.iters},
                    {"target_us", a.target_us}});
    } catch (const std::exception& ex) {
      std::cout << fmt::format("{:<40} FAILED: {}\n", c.name, ex.what());
      jc.push_back({{"call", c.name}, {"error", ex.what()}});
    }
  }
  out["calls"] = jc;
  out["graphs"] = m->graphs_captured();
  std::cout << fmt::format("CUDA graphs: {} captured\n", m->graphs_captured());
  UF_CUDA_CHECK(cudaFreeHost(host_logits));
  UF_CUDA_CHECK(cudaFree(src));
  UF_CUDA_CHECK(cudaFree(dst));
#else
  uf::core::fail("bench-host: this binary was built without CUDA");
#endif
  bench::write_json(a.json_file, out);
  return 0;
}

void setup_bench_host(CLI::App& app, int& exit_code) {
  auto* cmd =
      app.add_subcommand("bench-host", "Host time between decode steps (backend calls, CUDA)");
  auto a = std::make_shared<HostArgs>();
  cmd->add_option("--synthetic", a->synthetic, "Synthetic model: tp8-rank")->required();
  cmd->add_option("--context", a->context, "Committed tokens before the steps");
  cmd->add_option("--rows", a->rows, "Verify rows of the speculative step");
  cmd->add_option("--iters", a->iters, "Timed calls per measurement");
  cmd->add_option("--warmup", a->warmup, "Untimed calls first");
  cmd->add_option("--busy-mb", a->busy_mb, "Size of the busy copy queued before each call");
  cmd->add_option("--engram-rows", a->engram_rows, "Rows per Engram table");
  cmd->add_option("--target-us", a->target_us, "Target host time per step");
  cmd->add_option("--json", a->json_file, "Write every figure to this JSON file");
  cmd->add_option("--seed", a->seed, "Seed of the synthetic weights and tokens");
  cmd->add_flag("--no-branches", a->no_branches,
                "One stream: no side streams for the compressor, indexer and shared expert");
  cmd->add_option("--device", a->device, "CUDA device ordinal");
  cmd->callback([a, &exit_code] { exit_code = run_host(*a); });
}

UF_REGISTER_COMMAND("bench-host", setup_bench_host);

}  // namespace
