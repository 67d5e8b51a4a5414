// `ultrafast bench-tp`: benchmark 2 of the performance issue, the projected 8-GPU decode step.
//
// step(T) = the TP8 rank slice's verify forward of T rows + one DSpark draft round, both measured
// on one GPU by `ultrafast bench --synthetic tp8-rank --json FILE` (read with --step-json), plus
// the collectives a real TP8 rank adds, which that bench does not run. The collectives are
// counted from the CUDA backend's code (model::tp_verify_collectives / tp_draft_collectives: the
// CudaModel::all_reduce_round call sites, 82 per verify step (wo_b, MoE, the Engram row-split
// tables) and 6 per draft round, the index layers' gathers of the entry-split indexer (the
// backend's defaults: none in a decode step at 8k, 5 at 1M), plus the split head's logit gather
// in each) with their
// message sizes; the backend runs each as one kernel of the one-shot P2P all-reduce where the
// GPUs have peer access (tp_p2p_allreduce), else at tp > 2 as an NCCL all-gather of the fp32
// partials plus an fp32 sum in rank order (tp_ordered_sum), at tp = 2 as an NCCL all-reduce.
//
// Per-call time, in order of precedence:
//  - --allreduce-us X [--allreduce-gbs G]: given (modelled): X us per call, plus, with G, the
//    bytes each rank receives ((tp - 1) x message) at G GB/s;
//  - measured: with >= 2 GPUs visible (and NCCL: UF_NCCL_LIB or libnccl.so.2 on the loader path),
//    the all-gather + rank-order sum on the largest power of two <= 8 of them, at every message
//    size the step uses (T x 5120 fp32 for T = 1..8, the index-score rows, the draft's), plus the
//    NCCL all-reduce (fp32 and bf16) for reference, and the one-shot peer-to-peer all-reduce +
//    bf16 rounding (cuda/tp/p2p_allreduce.h, the backend's default where the GPUs have peer
//    access, with the backend's capacity), timed two ways: launched back to back from one thread
//    (each call pays N host launches: an upper bound) and as the step runs it, 32 calls a CUDA
//    graph per rank (the 'graph' column), with and without its low-latency protocol. The
//    projection uses the P2P graph column when it was measured (--no-p2p: the gather + sum
//    column, the path without peer access). Measured on fewer
//    than 8 GPUs, a ring over 8 ranks takes more steps: the projection is then marked a lower
//    bound;
//  - neither: no projection; the inputs and the break-even per-call time (the time per
//    collective at which the step meets the target) are printed instead.
// The draft figure is the step bench's device draft at temperature 1 (CudaModel::draft_on_device,
// what a TP server runs: rank 0 runs the Markov loop, the peers the stages beside it), or its
// host-loop draft (CudaModel::draft) when the step JSON has no device figure.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/cmd_bench_common.h"
#include "cli/command_registry.h"
#include "core/error.h"
#include "model/config.h"
#include "model/synthetic.h"

#ifdef UF_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/backend/backend_kernels.h"
#include "cuda/cuda_check.h"
#include "cuda/tp/nccl_comm.h"
#include "cuda/tp/p2p_allreduce.h"
#endif

namespace {

using nlohmann::json;
using uf::model::CollectiveCall;
using uf::model::CommSample;
namespace bench = uf::cli::bench;

struct TpArgs {
  std::string step_json, json_file;
  int rows = 7;
  int tp = 8;
  double allreduce_us = -1, allreduce_gbs = -1;
  double target_us = 2000;
  std::string accepted = "3.0,5.6";
  int iters = 50, warmup = 5;
  int max_gpus = 8;
  bool no_measure = false;
  bool no_p2p = false;
};

// The step figures of one `bench --synthetic tp8-rank --json` file.
struct StepFigures {
  int64_t context = 0;
  double verify_us = 0, draft_us = 0;
  std::string draft_path = "host loop";
  bool graphs = true;
};

StepFigures read_step(const std::string& file, int rows) {
  const json j = bench::read_json(file, "--step-json");
  StepFigures f;
  try {
    f.context = j.at("context").get<int64_t>();
    f.graphs = j.value("cuda_graphs", true);
    for (const auto& r : j.at("verify"))
      if (r.at("rows").get<int>() == rows) f.verify_us = r.at("step").at("median_us").get<double>();
    if (j.contains("draft_device_sampled")) {
      f.draft_us = j.at("draft_device_sampled").at("time").at("median_us").get<double>();
      f.draft_path = "device, temperature 1";
    } else {
      f.draft_us = j.at("draft").at("time").at("median_us").get<double>();
    }
  } catch (const nlohmann::json::exception& e) {
    uf::core::fail(
        "bench-tp: {} lacks a step figure ({}); is it the --json of `ultrafast bench "
        "--synthetic tp8-rank`{}?",
        file, e.what(), j.contains("error") ? " (it failed: see its 'error')" : "");
  }
  UF_CHECK(f.verify_us > 0,
           "bench-tp: {} has no verify figure for {} rows (run the step bench with --rows "
           "including {})",
           file, rows, rows);
  return f;
}

#ifdef UF_HAVE_CUDA

constexpr int kGraphCalls = 32;  // P2P sums per captured graph (p2p_graph_us)

struct Measured {
  int gpus = 0;
  std::vector<CommSample> gather_sum;  // the TP8 path without peer access (all-gather + sum)
  std::vector<CommSample> p2p;         // the default TP path: P2P all-reduce + bf16 rounding
  json table = json::array();
};

// Waits for every rank's stream.
void sync_all(const std::vector<int>& devs, const std::vector<cudaStream_t>& st) {
  for (size_t r = 0; r < devs.size(); ++r) {
    UF_CUDA_CHECK(cudaSetDevice(devs[r]));
    UF_CUDA_CHECK(cudaStreamSynchronize(st[r]));
  }
}

// Per-call wall time of `iters` back-to-back collectives on all ranks (their streams synchronised
// at the end), after `warmup`.
template <typename F>
double per_call_us(int warmup, int iters, const std::vector<int>& devs,
                   const std::vector<cudaStream_t>& st, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  sync_all(devs, st);
  const auto t0 = bench::Clock::now();
  for (int i = 0; i < iters; ++i) f();
  sync_all(devs, st);
  return bench::us_since(t0) / iters;
}

// Per-call device time of the P2P sum (bf16 rounding in the kernel) as the decode step runs it:
// each rank's `calls` back-to-back sums captured in one CUDA graph on its stream, every rank's
// graph replayed `reps` times (after one warm-up replay). The per-call host launch cost, which a
// loop of launches from one thread pays N times a call, is not in the figure (the step's graph
// pays it once).
double p2p_graph_us(uf::cuda::tp::PeerAllReduce& p2p, const std::vector<int>& devs,
                    const std::vector<cudaStream_t>& st, const std::vector<float*>& buf,
                    size_t count, int calls, int reps) {
  const size_t n = devs.size();
  std::vector<cudaGraphExec_t> exec(n, nullptr);
  for (size_t r = 0; r < n; ++r) {
    UF_CUDA_CHECK(cudaSetDevice(devs[r]));
    cudaGraph_t g = nullptr;
    UF_CUDA_CHECK(cudaStreamBeginCapture(st[r], cudaStreamCaptureModeThreadLocal));
    for (int c = 0; c < calls; ++c) p2p.sum_rank(int(r), buf[r], count, st[r], true);
    UF_CUDA_CHECK(cudaStreamEndCapture(st[r], &g));
    UF_CUDA_CHECK(cudaGraphInstantiate(&exec[r], g, 0));
    UF_CUDA_CHECK(cudaGraphDestroy(g));
  }
  auto replay = [&] {
    for (size_t r = 0; r < n; ++r) {
      UF_CUDA_CHECK(cudaSetDevice(devs[r]));
      UF_CUDA_CHECK(cudaGraphLaunch(exec[r], st[r]));
    }
  };
  replay();
  sync_all(devs, st);
  const auto t0 = bench::Clock::now();
  for (int i = 0; i < reps; ++i) replay();
  sync_all(devs, st);
  const double us = bench::us_since(t0) / (double(reps) * calls);
  for (auto e : exec) UF_CUDA_CHECK(cudaGraphExecDestroy(e));
  return us;
}

Measured measure_collectives(const TpArgs& a, const std::vector<double>& sizes_bytes) {
  Measured m;
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess) n_dev = 0;
  int n = 1;
  while (n * 2 <= std::min(n_dev, a.max_gpus)) n *= 2;
  std::cout << fmt::format("{} CUDA device(s) visible; collectives measured on {}\n", n_dev,
                           n >= 2 ? fmt::format("{} GPUs", n) : "none (need >= 2)");
  if (n < 2) return m;
  std::unique_ptr<uf::cuda::tp::TpGroup> g;
  try {
    g = uf::cuda::tp::TpGroup::create(n);
  } catch (const std::exception& e) {
    std::cout << fmt::format(
        "bench-tp: cannot start an NCCL group of {} GPUs: {}\n  (set UF_NCCL_LIB to the GPU "
        "machine's libnccl.so.2, e.g. find / -name 'libnccl.so*' 2>/dev/null)\n",
        n, e.what());
    return m;
  }
  std::cout << "NCCL " << uf::cuda::tp::nccl_version_string(uf::cuda::tp::nccl()) << "\n";
  size_t max_elems = 0;
  for (double b : sizes_bytes) max_elems = std::max(max_elems, size_t(b / 4));
  std::vector<int> devs;
  const auto un = static_cast<size_t>(n);
  std::vector<cudaStream_t> st(un);
  std::vector<float*> send(un), recv(un), out(un);
  for (int r = 0; r < n; ++r) {
    devs.push_back(g->device(r));
    UF_CUDA_CHECK(cudaSetDevice(devs.back()));
    UF_CUDA_CHECK(cudaStreamCreateWithFlags(&st[size_t(r)], cudaStreamNonBlocking));
    UF_CUDA_CHECK(cudaMalloc(&send[size_t(r)], max_elems * 4));
    UF_CUDA_CHECK(cudaMalloc(&recv[size_t(r)], max_elems * 4 * size_t(n)));
    UF_CUDA_CHECK(cudaMalloc(&out[size_t(r)], max_elems * 4));
    UF_CUDA_CHECK(cudaMemset(send[size_t(r)], 0, max_elems * 4));
  }
  // The backend's P2P all-reduce (cuda_backend.cpp: at least 1 Mi floats a kernel), and the same
  // without its low-latency protocol (every size on push + flag).
  std::unique_ptr<uf::cuda::tp::PeerAllReduce> p2p, p2p_flag;
  std::string why;
  if (!uf::cuda::tp::PeerAllReduce::supported(devs, &why)) {
    std::cout << "P2P all-reduce: not measured (" << why << ")\n";
  } else {
    p2p = std::make_unique<uf::cuda::tp::PeerAllReduce>(devs, size_t(1) << 20);
    p2p_flag = std::make_unique<uf::cuda::tp::PeerAllReduce>(
        devs, size_t(1) << 20, uf::cuda::tp::PeerAllReduce::kDefaultCtas, 0.0, 0);
  }
  std::cout << fmt::format(
      "\n{:>14} {:>14} {:>14} {:>14} {:>14} {:>14} {:>14}   (us per call, {} GPUs; bf16: the same "
      "count, half the bytes; p2p: one-shot P2P sum + bf16 rounding, 'launched': back-to-back "
      "launches from one thread, 'graph': {} calls a CUDA graph per rank, low-latency protocol up "
      "to {} floats, 'push+flag': without it)\n",
      "f32 bytes/rank", "gather+sum", "allreduce f32", "allreduce bf16", "p2p launched",
      "p2p graph", "push+flag", n, kGraphCalls, p2p ? p2p->low_latency_elems() : size_t(0));
  for (double b : sizes_bytes) {
    const size_t count = size_t(b / 4);
    const int iters = b > 16e6 ? std::max(5, a.iters / 10) : a.iters;
    const double gs = per_call_us(a.warmup, iters, devs, st, [&] {
      std::vector<const void*> s(send.begin(), send.end());
      std::vector<void*> rv(recv.begin(), recv.end());
      g->all_gather(s, rv, count, uf::cuda::tp::CommDType::kF32, st);
      for (int r = 0; r < n; ++r) {
        UF_CUDA_CHECK(cudaSetDevice(devs[size_t(r)]));
        uf::cuda::sum_ranks_round_bf16(recv[size_t(r)], n, int64_t(count), out[size_t(r)],
                                       st[size_t(r)]);
      }
    });
    const double ar32 = per_call_us(a.warmup, iters, devs, st, [&] {
      g->all_reduce_sum(std::vector<void*>(send.begin(), send.end()), count,
                        uf::cuda::tp::CommDType::kF32, st);
    });
    const double ar16 = per_call_us(a.warmup, iters, devs, st, [&] {
      g->all_reduce_sum(std::vector<void*>(send.begin(), send.end()), count,
                        uf::cuda::tp::CommDType::kBF16, st);
    });
    double pp = -1;
    if (p2p)
      pp = per_call_us(a.warmup, iters, devs, st, [&] {
        // One thread enqueues every rank: the launches are asynchronous, the ranks' kernels
        // meet on the devices.
        for (int r = 0; r < n; ++r) {
          UF_CUDA_CHECK(cudaSetDevice(devs[size_t(r)]));
          p2p->sum_rank(r, send[size_t(r)], count, st[size_t(r)], /*round_bf16=*/true);
        }
      });
    double pg = -1, pf = -1;
    if (p2p) {
      const int reps = b > 4e6 ? 3 : 20;
      pg = p2p_graph_us(*p2p, devs, st, send, count, kGraphCalls, reps);
      pf = p2p_graph_us(*p2p_flag, devs, st, send, count, kGraphCalls, reps);
    }
    auto cell = [](double v) { return v >= 0 ? fmt::format("{:.1f}", v) : std::string("-"); };
    std::cout << fmt::format("{:>14.0f} {:>14.1f} {:>14.1f} {:>14.1f} {:>14} {:>14} {:>14}\n", b,
                             gs, ar32, ar16, cell(pp), cell(pg), cell(pf));
    m.gather_sum.push_back({b, gs});
    if (pg >= 0) m.p2p.push_back({b, pg});
    auto opt = [](double v) { return v >= 0 ? json(v) : json(nullptr); };
    m.table.push_back({{"bytes", b},
                       {"gather_sum_us", gs},
                       {"allreduce_f32_us", ar32},
                       {"allreduce_bf16_same_count_us", ar16},
                       {"p2p_round_launched_us", opt(pp)},
                       {"p2p_round_graph_us", opt(pg)},
                       {"p2p_round_push_flag_graph_us", opt(pf)}});
  }
  p2p.reset();
  p2p_flag.reset();
  for (int r = 0; r < n; ++r) {
    UF_CUDA_CHECK(cudaSetDevice(devs[size_t(r)]));
    UF_CUDA_CHECK(cudaFree(send[size_t(r)]));
    UF_CUDA_CHECK(cudaFree(recv[size_t(r)]));
    UF_CUDA_CHECK(cudaFree(out[size_t(r)]));
    UF_CUDA_CHECK(cudaStreamDestroy(st[size_t(r)]));
  }
  m.gpus = n;
  return m;
}

#endif  // UF_HAVE_CUDA

void print_calls(const char* title, const std::vector<CollectiveCall>& v) {
  std::cout << fmt::format("{}: {} collectives\n", title, uf::model::total_calls(v));
  for (const auto& c : v)
    std::cout << fmt::format("  {:<34} {:>3} x {:>10} fp32 ({:>10.0f} bytes per rank)\n", c.what,
                             c.calls, c.elements, c.bytes());
}

int run_tp(const TpArgs& a) {
  std::cout << std::unitbuf;
  UF_CHECK(a.tp >= 2, "bench-tp: --tp {} must be at least 2", a.tp);
  UF_CHECK(!a.step_json.empty(), "bench-tp: --step-json is required");
  const auto cfg = uf::model::ModelConfig::deepseek_v41_flash();
  const StepFigures sf = read_step(a.step_json, a.rows);
  // The step bench's session capacity (cmd_bench.cpp: context + 64) sets the index-score width.
  const int64_t cap = sf.context + 64;
  const auto vcalls = uf::model::tp_verify_collectives(cfg, a.tp, a.rows, cap);
  const auto dcalls = uf::model::tp_draft_collectives(cfg, a.tp);
  const int n_calls = uf::model::total_calls(vcalls) + uf::model::total_calls(dcalls);
  const double compute_us = sf.verify_us + sf.draft_us;
  std::cout << fmt::format(
      "projected TP{} step: {} verify rows at context {} + one DSpark draft round\n"
      "one-GPU rank slice ({}, {}): verify {:.1f} us + draft ({}) {:.1f} us = {:.1f} us\n",
      a.tp, a.rows, sf.context, a.step_json, sf.graphs ? "CUDA graphs" : "eager", sf.verify_us,
      sf.draft_path, sf.draft_us, compute_us);
  print_calls("verify forward", vcalls);
  print_calls("draft round", dcalls);
  int index_calls = 0;
  for (const auto& c : vcalls)
    if (c.what.rfind("index", 0) == 0 || c.what.rfind("candidate", 0) == 0) index_calls += c.calls;
  std::cout << fmt::format(
      "per backbone layer: 2 (wo_b, MoE); the Engram layers' row-split tables: 1; the indexer "
      "split by entries: {} gathers (index-layer calls of >= {} rows x positions); per DSpark "
      "stage: 2\n",
      index_calls, uf::model::kDefaultIndexSplitMinWork);
  json out = {{"tp", a.tp},
              {"rows", a.rows},
              {"context", sf.context},
              {"verify_us", sf.verify_us},
              {"draft_us", sf.draft_us},
              {"draft_path", sf.draft_path},
              {"collectives_per_step", n_calls},
              {"target_us", a.target_us}};

  // Message sizes to measure: every size the step uses, and T x 5120 fp32 for T = 1..8.
  std::vector<double> sizes;
  for (int T = 1; T <= 8; ++T) sizes.push_back(4.0 * T * cfg.dim);
  for (const auto* v : {&vcalls, &dcalls})
    for (const auto& c : *v) sizes.push_back(c.bytes());
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());

  std::vector<CommSample> table;
  std::string source;
  bool lower_bound = false;
  if (a.allreduce_us >= 0) {
    for (double b : sizes)
      table.push_back(
          {b, a.allreduce_us +
                  (a.allreduce_gbs > 0 ? double(a.tp - 1) * b / (a.allreduce_gbs * 1e3) : 0.0)});
    source = a.allreduce_gbs > 0
                 ? fmt::format(
                       "modelled: --allreduce-us {} per call + (tp - 1) x bytes at "
                       "--allreduce-gbs {} GB/s (given on the command line)",
                       a.allreduce_us, a.allreduce_gbs)
                 : fmt::format(
                       "modelled: --allreduce-us {} per call whatever its size (given on "
                       "the command line; the index-score calls' bytes are not counted: "
                       "pass --allreduce-gbs)",
                       a.allreduce_us);
    lower_bound = a.allreduce_gbs <= 0;
  } else if (!a.no_measure) {
#ifdef UF_HAVE_CUDA
    const Measured m = measure_collectives(a, sizes);
    if (m.gpus >= 2) {
      const bool use_p2p = !a.no_p2p && !m.p2p.empty();
      table = use_p2p ? m.p2p : m.gather_sum;
      lower_bound = m.gpus < a.tp;
      source = fmt::format(
          "measured: {} on {} GPUs of this machine{}",
          use_p2p ? "one-shot P2P all-reduce + bf16 rounding" : "NCCL all-gather + rank-order sum",
          m.gpus, lower_bound ? fmt::format(" (a lower bound for {} ranks)", a.tp) : "");
      out["measured"] = {{"gpus", m.gpus}, {"table", m.table}};
    }
#else
    std::cout << "bench-tp: built without CUDA: nothing measured\n";
#endif
  }

  const auto accepted = bench::parse_list<double>(a.accepted, "--accepted");
  if (table.empty()) {
    const double room = a.target_us - compute_us;
    std::cout << fmt::format(
        "\nNOT PROJECTED: no collective time (one GPU and no --allreduce-us).\n"
        "inputs: {:.1f} us of compute + {} collectives per step (sizes above)\n"
        "break-even: the {:.0f} us target holds if a collective takes at most {:.2f} us on "
        "average{}\n",
        compute_us, n_calls, a.target_us, room / n_calls,
        room <= 0 ? " (the one-GPU compute alone exceeds the target)" : "");
    out["projection"] = {{"status", "not projected: no collective time"},
                         {"break_even_us_per_call", room / n_calls}};
    bench::write_json(a.json_file, out);
    return 0;
  }
  const double comm_v = uf::model::comm_step_us(vcalls, table);
  const double comm_d = uf::model::comm_step_us(dcalls, table);
  const double total = compute_us + comm_v + comm_d;
  std::cout << fmt::format("\nper-call time: {}\n", source);
  for (const auto* v : {&vcalls, &dcalls})
    for (const auto& c : *v)
      std::cout << fmt::format("  {:<34} {:>3} x {:>8.1f} us = {:>9.1f} us\n", c.what, c.calls,
                               uf::model::comm_time_us(table, c.bytes()),
                               c.calls * uf::model::comm_time_us(table, c.bytes()));
  std::cout << fmt::format(
      "\nPROJECTED TP{} step ({}): {:.1f} us = compute {:.1f} + collectives {:.1f} (verify {:.1f}, "
      "draft {:.1f}); target < {:.0f} us: {}{}\n",
      a.tp, source.substr(0, source.find(':')), total, compute_us, comm_v + comm_d, comm_v, comm_d,
      a.target_us, total < a.target_us ? "MET" : "NOT MET", lower_bound ? " (lower bound)" : "");
  json tps = json::object();
  for (double acc : accepted) {
    const double t = uf::model::tokens_per_second(acc, total);
    std::cout << fmt::format("  accepted length {:.1f}: {:.0f} tokens/s (target at 5.6: > 2500)\n",
                             acc, t);
    tps[fmt::format("{:.1f}", acc)] = t;
  }
  json proj = {{"source", source},
               {"lower_bound", lower_bound},
               {"comm_verify_us", comm_v},
               {"comm_draft_us", comm_d},
               {"step_us", total},
               {"tokens_per_s", tps},
               {"target_met", total < a.target_us}};
  out["projection"] = proj;
  bench::write_json(a.json_file, out);
  return 0;
}

void setup_bench_tp(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "bench-tp", "Project the TP8 decode step: the rank slice's step + its collectives");
  auto a = std::make_shared<TpArgs>();
  cmd->add_option("--step-json", a->step_json,
                  "JSON of `ultrafast bench --synthetic tp8-rank --json` (graphs)")
      ->required();
  cmd->add_option("--rows", a->rows, "Verify rows of the projected step");
  cmd->add_option("--tp", a->tp, "Tensor-parallel ranks of the projection");
  cmd->add_option("--allreduce-us", a->allreduce_us,
                  "Per-collective time to use instead of measuring (modelled)");
  cmd->add_option("--allreduce-gbs", a->allreduce_gbs,
                  "With --allreduce-us: GB/s at which a rank receives (tp - 1) x the message");
  cmd->add_option("--target-us", a->target_us, "Target step time (issue 9: 2000 us)");
  cmd->add_option("--accepted", a->accepted, "Accepted tokens per step, comma-separated");
  cmd->add_option("--iters", a->iters, "Timed collectives per size");
  cmd->add_option("--max-gpus", a->max_gpus, "Use at most this many GPUs for the measurement");
  cmd->add_flag("--no-measure", a->no_measure, "Do not measure collectives");
  cmd->add_flag(
      "--no-p2p", a->no_p2p,
      "Project with the NCCL all-gather + sum even where the P2P all-reduce was measured");
  cmd->add_option("--json", a->json_file, "Write every figure to this JSON file");
  cmd->callback([a, &exit_code] { exit_code = run_tp(*a); });
}

UF_REGISTER_COMMAND("bench-tp", setup_bench_tp);

}  // namespace
