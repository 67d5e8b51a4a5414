// `ultrafast bench --synthetic tp8-rank`: the decode step of one rank of an 8-GPU tensor-parallel
// server, on ONE GPU, against its memory floor. (`--synthetic tp2 / tp4 / tp8`: the whole model
// over that many GPUs, collectives included: cmd_bench_tp_model.cpp.)
//
// Builds the weights rank 0 of a TP8 server holds for the released DeepSeek-V4.1-Flash
// (model/synthetic.h: rank_slice_config, real dimensions, random values in the checkpoint
// formats, Engram tables shrunk to --engram-rows), loads them into a cuda::CudaModel (tp 1),
// brings a session to --context committed tokens, then times the verify forward of T rows (for
// each T of --rows) and one DSpark draft round. The floor of each is the bytes the step must read
// (model::step_floor, per component) over the device copy bandwidth measured here (a 16-byte
// vector copy kernel and cudaMemcpy over 2 GiB buffers, read + write bytes, the better of the
// two), as bench/bench_cuda_decode does. No collectives run: a real rank adds their latency.
//
// Timing: steady_clock around each call (forward and draft synchronise their stream before they
// return), --warmup calls first, then median and min of --iters. The session is never committed,
// so every call sees the same state. Each forward also copies its T x vocab fp32 logits to the
// host (pinned buffer); the "no head" column runs the same forward with no logits (the head and
// the copy are skipped) against the floor without the head. The session comes from
// CudaModel::fast_forward (ring tags and entry counts of a real prefill, device state random).
// --trace FILE traces one more call of each timed forward with CUPTI (cuda/trace/kernel_trace.h:
// every kernel's device start / end inside the graph replay) and writes the per-kernel summary
// and the raw records there; the table goes to stdout too. It also traces one device draft round
// of each sampling mode. The traces run after every timing: once CUPTI is initialised, every
// launch of the process is slower (a traced run's 8k step read 4470 / 7013 us at 1 / 7 rows
// against 4105 / 6599 untraced, session 17).
// --no-graphs sets CudaModelOptions::cuda_graphs = false (the verify spans then launch eagerly);
// --no-branches clears CudaModelOptions::graph_branches (one stream, the launches in order);
// --no-candidate-lists clears candidate_lists.
// --index-scores-fp32 runs index_scores on its fp32 kernel instead of the tensor cores
// (set_index_scores_mma(false)); --attention-cpu-order runs the decode attention's chunk records
// on the CPU-order scores + P.V kernels instead of the tensor cores
// (set_sparse_attn_chunk_mma(false)).
//
// --floor-only prints the floors (bytes per component) without a GPU.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "cli/bench_tp_model.h"
#include "cli/cmd_bench_common.h"
#include "cli/command_registry.h"
#include "core/error.h"
#include "model/config.h"
#include "model/synthetic.h"
#include "model/tensor_contract.h"

#ifdef UF_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/backend/cuda_model.h"
#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/moe.h"
#include "cuda/probe.h"
#include "cuda/trace/kernel_trace.h"
#endif

namespace {

using nlohmann::json;
using uf::model::ModelConfig;
using uf::model::StepFloor;

struct BenchArgs {
  std::string synthetic;
  std::string rows = "1,2,3,4,5,6,7,8";
  int64_t context = 8192;
  int iters = 20;
  int warmup = 3;
  int64_t engram_rows = int64_t(1) << 22;
  bool no_graphs = false;
  bool no_branches = false;
  bool no_candidate_lists = false;
  bool fold_moe_combine = false;
  bool index_scores_fp32 = false;
  bool attention_cpu_order = false;
  bool shared_beside_router = false;
  bool floor_only = false;
  // Vocab slices of the head: 8 = rank 0's eighth (TP8 splits the head by vocab rows; the
  // logits' all-gather is bench-tp's), 1 = the whole head on the rank.
  int head_slices = 8;
  // --synthetic tpN only (bench_tp_model.h): more contexts in one load, and the prefill.
  std::string contexts;
  std::string prefill_contexts;
  std::string prefill_tokens = "131072,1000000";
  int chunk = 512;
  int prefill_iters = 2;
  int slice_of = 1;
  int64_t max_seq = 0;                // tpN: CudaModelOptions::max_seq (a server's --max-seq)
  bool no_tp_score_buckets = false;   // tpN: CudaModelOptions::tp_score_buckets off
  bool tp_index_heads = false;        // tpN: CudaModelOptions::tp_index_split_entries off
  int64_t index_split_min_work = -1;  // tpN: CudaModelOptions' (-1: its default)
  std::string json_file;
  std::string trace_file;
  uint64_t seed = 1;
  int device = 0;
};

std::vector<int> parse_rows(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int v = 0;
    try {
      size_t used = 0;
      v = std::stoi(item, &used);
      UF_CHECK(used == item.size(), "bench: --rows entry '{}' is not an integer", item);
    } catch (const std::logic_error&) {
      uf::core::fail("bench: --rows entry '{}' is not an integer", item);
    }
    UF_CHECK(v >= 1 && v <= 8, "bench: --rows entry {} is outside 1..8 (verify rows per step)", v);
    out.push_back(v);
  }
  UF_CHECK(!out.empty(), "bench: --rows '{}' lists no row count", s);
  return out;
}

// The bench's model: rank 0 of TP8 of the released config, Engram tables shrunk.
ModelConfig bench_config(const BenchArgs& a) {
  UF_CHECK(a.synthetic == "tp8-rank",
           "bench: --synthetic '{}' is not known (tp8-rank: one rank's slice on one GPU; tp2, "
           "tp4, tp8: the whole model over 2, 4, 8 GPUs)",
           a.synthetic);
  const auto full = ModelConfig::deepseek_v41_flash();
  return uf::model::with_engram_rows(uf::model::rank_slice_config(full, 8), a.engram_rows);
}

json floor_json(const std::vector<uf::model::FloorItem>& items, double bw_gbs) {
  json j = json::array();
  for (const auto& i : items) {
    json e = {{"name", i.name}, {"bytes", i.bytes}, {"detail", i.detail}};
    if (bw_gbs > 0) e["floor_us"] = i.bytes / (bw_gbs * 1e3);
    j.push_back(e);
  }
  return j;
}

uf::model::FloorOptions floor_opts(const BenchArgs& a) {
  uf::model::FloorOptions o;
  o.head_slices = a.head_slices;
  return o;
}

double us_of(double bytes, double bw_gbs) { return bw_gbs > 0 ? bytes / (bw_gbs * 1e3) : 0; }

// Per-component floors: one row per component, one column per T (MB, or us at bw_gbs > 0).
void print_components(const std::vector<StepFloor>& floors, double bw_gbs, int block) {
  if (floors.empty()) return;
  const bool us = bw_gbs > 0;
  auto& out = std::cout;
  auto table = [&](const char* title, auto pick) {
    out << fmt::format("\n{} floor by component ({}):\n{:<24}", title, us ? "us" : "MB",
                       "component");
    for (const auto& f : floors) out << fmt::format(" {:>9}", fmt::format("T={}", f.rows));
    out << "\n";
    for (size_t i = 0; i < pick(floors[0]).size(); ++i) {
      out << fmt::format("{:<24}", pick(floors[0])[i].name);
      for (const auto& f : floors) {
        const double b = pick(f)[i].bytes;
        out << fmt::format(" {:>9.1f}", us ? us_of(b, bw_gbs) : b * 1e-6);
      }
      out << "\n";
    }
  };
  table(
      "verify", [](const StepFloor& f) -> const auto& { return f.verify; });
  const auto& f0 = floors[0];
  out << fmt::format("\ndraft floor by component (one DSpark round, {} rows):\n", block);
  for (const auto& i : f0.draft)
    out << fmt::format("{:<24} {:>9.1f} {}  ({})\n", i.name,
                       us ? us_of(i.bytes, bw_gbs) : i.bytes * 1e-6, us ? "us" : "MB", i.detail);
  for (const auto& i : f0.commit)
    out << fmt::format("{:<24} {:>9.1f} {}  (not timed: {})\n", i.name,
                       us ? us_of(i.bytes, bw_gbs) : i.bytes * 1e-6, us ? "us" : "MB", i.detail);
}

#ifdef UF_HAVE_CUDA

using uf::cli::bench::Clock;

using uf::cli::bench::Stats;
using uf::cli::bench::stats_json;
using uf::cli::bench::time_calls;

int run_cuda(const BenchArgs& a, const ModelConfig& cfg, const std::vector<int>& rows, json& out) {
  int n_dev = 0;
  const cudaError_t e = cudaGetDeviceCount(&n_dev);
  UF_CHECK(e == cudaSuccess && n_dev > 0, "bench: no CUDA device is visible ({})",
           e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
  UF_CHECK(a.device >= 0 && a.device < n_dev, "bench: --device {} but {} device(s) are visible",
           a.device, n_dev);
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, a.device));
  std::cout << fmt::format("device {}: {}, {} SMs, {:.1f} GB, L2 {} MB\n", a.device, prop.name,
                           prop.multiProcessorCount, double(prop.totalGlobalMem) * 1e-9,
                           prop.l2CacheSize >> 20);
  out["device"] = {{"index", a.device},
                   {"name", prop.name},
                   {"sms", prop.multiProcessorCount},
                   {"memory_bytes", prop.totalGlobalMem}};

  spdlog::info("bench: measuring the device copy bandwidth (2 GiB buffers)");
  const auto bw = uf::cli::bench::measure_bandwidth(a.device);
  std::cout << fmt::format(
      "copy bandwidth (read + write): cudaMemcpy D2D {:.0f} GB/s, copy kernel {:.0f} GB/s; floor "
      "uses {:.0f} GB/s\n",
      bw.memcpy_gbs, bw.copy_kernel_gbs, bw.best());
  out["bandwidth"] = {{"memcpy_gbs", bw.memcpy_gbs},
                      {"copy_kernel_gbs", bw.copy_kernel_gbs},
                      {"floor_gbs", bw.best()}};
  const double bwg = bw.best();

  spdlog::info("bench: building the synthetic checkpoint (seed {})", a.seed);
  const auto ck = uf::model::synthetic_checkpoint(cfg, a.seed);
  spdlog::info("bench: {} tensors, {:.2f} GB of views", ck.size(), double(ck.total_bytes()) * 1e-9);

  uf::cuda::CudaModelOptions opts;
  opts.device = a.device;
  opts.cuda_graphs = !a.no_graphs;
  opts.graph_branches = !a.no_branches;
  opts.fold_moe_combine = a.fold_moe_combine;
  uf::cuda::set_moe_shared_after_router(!a.shared_beside_router);
  uf::cuda::set_index_scores_mma(!a.index_scores_fp32);
  out["index_scores"] = a.index_scores_fp32 ? "fp32" : "tensor cores";
  uf::cuda::set_sparse_attn_chunk_mma(!a.attention_cpu_order);
  out["attention_records"] = a.attention_cpu_order ? "cpu order" : "tensor cores";
  opts.candidate_lists = !a.no_candidate_lists;
  opts.head_slice_of = a.head_slices;
  out["cuda_graphs"] = opts.cuda_graphs;
  out["head_slices"] = a.head_slices;
  UF_CUDA_CHECK(cudaSetDevice(a.device));
  const double used0 = uf::cli::bench::device_used_gb(a.device);
  {
    size_t free_b = 0, total_b = 0;
    UF_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    // Weights plus ~2 GB of scratch, session and index scores.
    const double need = double(ck.total_bytes()) + 2e9;
    UF_CHECK(double(free_b) >= need,
             "bench: device {} has {:.2f} GB free but the rank slice needs about {:.2f} GB "
             "(weights {:.2f} GB + scratch); lower --engram-rows or free the device",
             a.device, double(free_b) * 1e-9, need * 1e-9, double(ck.total_bytes()) * 1e-9);
  }
  spdlog::info("bench: loading the rank slice on device {} ({:.2f} GB in use before)", a.device,
               used0);
  const auto t_load = Clock::now();
  auto model = std::make_unique<uf::cuda::CudaModel>(
      cfg, ck, uf::model::synthetic_engram_token_map(cfg), opts);
  const double load_s = std::chrono::duration<double>(Clock::now() - t_load).count();
  const double used_model = uf::cli::bench::device_used_gb(a.device);
  std::cout << fmt::format("model loaded in {:.1f} s: {:.2f} GB of device memory in use\n", load_s,
                           used_model);

  const int64_t cap = a.context + 64;
  auto s = model->new_session(cap);
  const double used_session = uf::cli::bench::device_used_gb(a.device);
  std::cout << fmt::format("session of capacity {}: {:.2f} GB in use\n", cap, used_session);
  spdlog::info("bench: fast_forward to {} committed tokens", a.context);
  model->fast_forward(*s, a.context, a.seed);
  UF_CHECK(s->len == a.context, "bench: the session holds {} tokens after fast forward, not {}",
           s->len, a.context);
  out["memory_gb"] = {{"before_load", used0},
                      {"after_load", used_model},
                      {"after_session", used_session},
                      {"after_fast_forward", uf::cli::bench::device_used_gb(a.device)}};
  out["load_seconds"] = load_s;

  const int V = cfg.vocab_size;
  float* host_logits = nullptr;
  UF_CUDA_CHECK(cudaMallocHost(&host_logits, size_t(8) * size_t(V) * sizeof(float)));
  std::mt19937_64 rng(a.seed + 17);

  std::ofstream trace_out;
  if (!a.trace_file.empty()) {
    trace_out.open(a.trace_file);
    UF_CHECK(bool(trace_out), "bench: cannot write the trace file {}", a.trace_file);
  }
  std::vector<std::vector<int32_t>> row_tokens;  // each row count's tokens, traced after timing
  std::vector<StepFloor> floors;
  json jrows = json::array();
  std::cout << fmt::format(
      "\nverify forward at context {} ({} iterations after {} warm-up; us):\n{:>2} {:>9} {:>9} "
      "{:>9} {:>7} | {:>9} {:>9} {:>7}\n",
      a.context, a.iters, a.warmup, "T", "step", "min", "floor", "x floor", "no head", "floor",
      "x floor");
  for (int T : rows) {
    const auto toks = uf::cli::bench::random_tokens(rng, T, V);
    row_tokens.push_back(toks);
    spdlog::info("bench: verify T = {}", T);
    const Stats st = time_calls(a.warmup, a.iters, [&] {
      model->forward(*s, toks, /*prefill_layout=*/false, /*all_logits=*/true, host_logits, nullptr,
                     nullptr);
    });
    const Stats nh = time_calls(a.warmup, a.iters, [&] {
      model->forward(*s, toks, false, true, nullptr, nullptr, nullptr);
    });
    UF_CHECK(s->len == a.context, "bench: the verify forward committed tokens (len {} != {})",
             s->len, a.context);
    const auto f = uf::model::step_floor(cfg, T, a.context, floor_opts(a));
    double head_bytes = 0;
    for (const auto& i : f.verify)
      if (i.name == "head") head_bytes = i.bytes;
    const double fl = us_of(f.verify_bytes(), bwg),
                 fl_nh = us_of(f.verify_bytes() - head_bytes, bwg);
    std::cout << fmt::format(
                     "{:>2} {:>9.1f} {:>9.1f} {:>9.1f} {:>7.2f} | {:>9.1f} {:>9.1f} {:>7.2f}\n", T,
                     st.median_us, st.min_us, fl, st.median_us / fl, nh.median_us, fl_nh,
                     nh.median_us / fl_nh)
              << std::flush;
    jrows.push_back({{"rows", T},
                     {"step", stats_json(st)},
                     {"no_head", stats_json(nh)},
                     {"floor_bytes", f.verify_bytes()},
                     {"floor_us", fl},
                     {"no_head_floor_us", fl_nh},
                     {"x_floor", st.median_us / fl},
                     {"routed_experts", f.routed_experts},
                     {"components", floor_json(f.verify, bwg)}});
    floors.push_back(f);
  }
  out["verify"] = jrows;

  // One DSpark round from the last committed position, greedy on the host (CudaModel::draft: the
  // Markov loop on the host, slot by slot).
  const auto f1 = uf::model::step_floor(cfg, 1, a.context, floor_opts(a));
  const int32_t anchor = int32_t(3 + rng() % uint64_t(V - 3));
  const uf::engine::DraftSampler greedy = [](int, std::span<const float> lg) {
    return int32_t(std::max_element(lg.begin(), lg.end()) - lg.begin());
  };
  spdlog::info("bench: DSpark draft");
  size_t drafted = 0;
  const Stats ds = time_calls(a.warmup, a.iters,
                              [&] { drafted = model->draft(*s, anchor, greedy).tokens.size(); });
  const double dfl = us_of(f1.draft_bytes(), bwg);
  std::cout << fmt::format(
      "\nDSpark draft ({} tokens): {:.1f} us median, {:.1f} min; floor {:.1f} us; x floor {:.2f}\n",
      drafted, ds.median_us, ds.min_us, dfl, ds.median_us / dfl);
  // The serving path: the Markov loop, the transform and the draft sampling on the device
  // (CudaModel::draft_on_device, one graph): greedy, sampled, and sampled with top-p. Random
  // weights give near-flat logits, the worst case of top-p (the nucleus is most of the vocab).
  struct DraftMode {
    uf::sampling::SamplingParams params;
    const char* name;
    const char* key;
  };
  auto draft_mode = [](float temperature, float top_p, const char* name, const char* key) {
    DraftMode m{{}, name, key};
    m.params.temperature = temperature;
    m.params.top_p = top_p;
    return m;
  };
  const DraftMode draft_modes[] = {
      draft_mode(0.0f, 1.0f, "greedy", "draft_device_greedy"),
      draft_mode(1.0f, 1.0f, "temperature 1", "draft_device_sampled"),
      draft_mode(1.0f, 0.95f, "temperature 1, top-p 0.95", "draft_device_top_p")};
  uint64_t step = 0;
  if (model->device_draft_available()) {
    for (const DraftMode& m : draft_modes) {
      const Stats dd = time_calls(a.warmup, a.iters, [&] {
        drafted = model->draft_on_device(*s, anchor, m.params, a.seed, ++step).tokens.size();
      });
      std::cout << fmt::format(
          "DSpark draft on the device, {} ({} tokens): {:.1f} us median, {:.1f} min; x floor "
          "{:.2f}\n",
          m.name, drafted, dd.median_us, dd.min_us, dd.median_us / dfl);
      out[m.key] = {{"time", stats_json(dd)}, {"x_floor", dd.median_us / dfl}};
    }
  }
  out["draft"] = {{"time", stats_json(ds)},
                  {"tokens", drafted},
                  {"floor_bytes", f1.draft_bytes()},
                  {"floor_us", dfl},
                  {"x_floor", ds.median_us / dfl},
                  {"experts_per_stage", f1.dspark_experts},
                  {"components", floor_json(f1.draft, bwg)},
                  {"commit_components", floor_json(f1.commit, bwg)}};
  print_components(floors, bwg, cfg.dspark_block_size);
  std::cout << fmt::format("\nCUDA graphs captured: {}\n", model->graphs_captured());
  if (trace_out.is_open()) {
    // After every timed call: CUPTI, once initialised, slows every launch of the process (~10% of
    // a decode step), so the traces come last and the figures above are untraced.
    uf::cuda::KernelTrace trace;
    for (size_t i = 0; i < rows.size(); ++i) {
      const int T = rows[i];
      const auto& toks = row_tokens[i];
      // Probe builds (cmake -DUF_PROBE=ON) also stamp phases inside chosen kernels of the same
      // call (cuda/probe.h), written after the trace's records.
      if (uf::cuda::probe::enabled()) uf::cuda::probe::begin(1 << 16);
      trace.start();
      model->forward(*s, toks, false, true, host_logits, nullptr, nullptr);
      const auto recs = trace.stop();
      const auto probes = uf::cuda::probe::enabled() ? uf::cuda::probe::end()
                                                     : std::vector<uf::cuda::probe::Record>{};
      const std::string table = uf::cuda::summarize_trace(recs, 40);
      std::cout << fmt::format("trace of one {}-row verify forward (logits to the host):\n{}", T,
                               table);
      trace_out << fmt::format("== {} rows\n{}", T, table) << uf::cuda::trace_records_text(recs);
      if (!probes.empty()) {
        // The first kernel's start on both clocks, to line the probes up with the records.
        trace_out << fmt::format(
                         "== {} rows probes (first record start {} ns, first probe {} ns)\n", T,
                         recs.empty() ? 0 : recs[0].start_ns, probes[0].t[0])
                  << uf::cuda::probe::probe_text(probes);
      }
    }
    if (model->device_draft_available()) {
      for (const DraftMode& m : draft_modes) {
        trace.start();
        (void)model->draft_on_device(*s, anchor, m.params, a.seed, ++step);
        const auto recs = trace.stop();
        const std::string table = uf::cuda::summarize_trace(recs, 24);
        std::cout << fmt::format("trace of one device draft round, {}:\n{}", m.name, table);
        trace_out << fmt::format("== draft {}\n{}", m.name, table)
                  << uf::cuda::trace_records_text(recs);
      }
    }
  }
  out["graphs_captured"] = model->graphs_captured();
  UF_CUDA_CHECK(cudaFreeHost(host_logits));
  return 0;
}

#endif  // UF_HAVE_CUDA

using uf::cli::bench::write_json;

// `--synthetic tpN`: the whole model over N GPUs (cmd_bench_tp_model.cpp).
int run_tp_model(const BenchArgs& a, int tp, const std::vector<int>& rows) {
  namespace bench = uf::cli::bench;
  UF_CHECK(!a.floor_only && !a.no_branches && !a.no_candidate_lists && !a.fold_moe_combine &&
               !a.index_scores_fp32 && !a.attention_cpu_order && !a.shared_beside_router,
           "bench: --synthetic tp{} takes --rows, --context(s), --iters, --warmup, --engram-rows, "
           "--no-graphs, the prefill options, --json, --trace and --seed only",
           tp);
  bench::TpModelArgs t;
  t.tp = tp;
  t.slice_of = a.slice_of;
  t.rows = rows;
  t.contexts = a.contexts.empty() ? std::vector<int64_t>{a.context}
                                  : bench::parse_list<int64_t>(a.contexts, "--contexts");
  t.iters = a.iters;
  t.warmup = a.warmup;
  t.engram_rows = a.engram_rows;
  if (!a.prefill_contexts.empty())
    t.prefill_contexts = bench::parse_list<int64_t>(a.prefill_contexts, "--prefill-contexts");
  t.prefill_tokens = bench::parse_list<int64_t>(a.prefill_tokens, "--prefill-tokens");
  UF_CHECK(a.chunk >= 1 && a.prefill_iters >= 1, "bench: --chunk {} / --prefill-iters {} < 1",
           a.chunk, a.prefill_iters);
  t.chunk = a.chunk;
  t.prefill_iters = a.prefill_iters;
  t.trace_file = a.trace_file;
  t.seed = a.seed;
  t.no_graphs = a.no_graphs;
  UF_CHECK(a.max_seq >= 0, "bench: --max-seq {} must be >= 0", a.max_seq);
  t.max_seq = a.max_seq;
  t.score_buckets = !a.no_tp_score_buckets;
  t.index_split_entries = !a.tp_index_heads;
  UF_CHECK(a.index_split_min_work >= -1,
           "bench: --index-split-min-work {} must be >= 0 (-1: the default)",
           a.index_split_min_work);
  t.index_split_min_work = a.index_split_min_work;
  json out = {{"iters", a.iters},
              {"warmup", a.warmup},
              {"seed", a.seed},
              {"max_seq", a.max_seq},
              {"tp_score_buckets", !a.no_tp_score_buckets},
              {"tp_index_split_entries", !a.tp_index_heads},
              {"index_split_min_work", a.index_split_min_work}};
  try {
    bench::run_tp_model_bench(t, out);
  } catch (const std::exception& e) {
    out["error"] = e.what();  // keep what was measured before the failure
    write_json(a.json_file, out);
    throw;
  }
  write_json(a.json_file, out);
  return 0;
}

int run_bench(const BenchArgs& a) {
  std::cout << std::unitbuf;  // tables interleave with the log lines: keep them in order
  const auto rows = parse_rows(a.rows);
  UF_CHECK(a.context >= 1, "bench: --context {} must be at least 1", a.context);
  UF_CHECK(a.iters >= 1 && a.warmup >= 0, "bench: --iters {} / --warmup {} must be >= 1 / >= 0",
           a.iters, a.warmup);
  if (const int tp = uf::cli::bench::tp_model_ranks(a.synthetic); tp > 0)
    return run_tp_model(a, tp, rows);
  UF_CHECK(a.contexts.empty() && a.prefill_contexts.empty() && a.slice_of == 1 && a.max_seq == 0 &&
               !a.no_tp_score_buckets && !a.tp_index_heads && a.index_split_min_work == -1,
           "bench: --contexts, --prefill-contexts, --slice-of, --max-seq, --no-tp-score-buckets, "
           "--tp-index-heads and --index-split-min-work are options of --synthetic tp2 / tp4 / "
           "tp8 (tp8-rank: one --context a run; bench-prefill times its prefill)");
  const ModelConfig cfg = bench_config(a);
  uint64_t bytes = 0;
  for (const auto& e : uf::model::tensor_contract(cfg)) bytes += e.nbytes();
  std::cout << fmt::format(
      "synthetic tp8-rank: DeepSeek-V4.1-Flash rank 0 of TP8 on one GPU: {} heads, {} output "
      "groups, {} index heads, expert inter {}; Engram tables {} / {} rows; {:.2f} GB of weights\n",
      cfg.n_heads, cfg.o_groups, cfg.index_n_heads, cfg.moe_inter_dim,
      cfg.engram_num_embeddings.empty() ? 0 : cfg.engram_num_embeddings[0],
      cfg.engram_num_embeddings.size() > 1 ? cfg.engram_num_embeddings[1] : 0,
      double(bytes) * 1e-9);
  json out = {{"model", "synthetic tp8-rank"},
              {"context", a.context},
              {"iters", a.iters},
              {"warmup", a.warmup},
              {"engram_rows", cfg.engram_num_embeddings},
              {"weight_bytes", bytes},
              {"seed", a.seed}};
  json pools = json::array();
  for (const auto& p : uf::model::synthetic_pools(cfg))
    pools.push_back({{"kind", p.kind},
                     {"largest", p.largest},
                     {"span_bytes", p.span_bytes},
                     {"physical_bytes", p.physical_bytes}});
  out["host_pools"] = pools;
  for (const auto& p : uf::model::synthetic_pools(cfg))
    std::cout << fmt::format("host pool {:<10} {:>6.1f} MB physical behind {:>9.1f} MB ({})\n",
                             p.kind, p.physical_bytes * 1e-6, p.span_bytes * 1e-6, p.largest);

  int rc = 0;
  if (a.floor_only) {
    std::vector<StepFloor> floors;
    json jf = json::array();
    for (int T : rows) {
      floors.push_back(uf::model::step_floor(cfg, T, a.context, floor_opts(a)));
      jf.push_back({{"rows", T},
                    {"floor_bytes", floors.back().verify_bytes()},
                    {"routed_experts", floors.back().routed_experts},
                    {"components", floor_json(floors.back().verify, 0)}});
    }
    for (const auto& f : floors)
      std::cout << fmt::format("T={}: verify floor {:.1f} MB, draft floor {:.1f} MB\n", f.rows,
                               f.verify_bytes() * 1e-6, f.draft_bytes() * 1e-6);
    print_components(floors, 0, cfg.dspark_block_size);
    out["verify"] = jf;
    out["draft"] = {{"floor_bytes", floors.front().draft_bytes()},
                    {"components", floor_json(floors.front().draft, 0)}};
  } else {
#ifdef UF_HAVE_CUDA
    try {
      rc = run_cuda(a, cfg, rows, out);
    } catch (const std::exception& e) {
      // Keep the figures measured before the failure.
      out["error"] = e.what();
      write_json(a.json_file, out);
      throw;
    }
#else
    uf::core::fail(
        "bench: this binary was built without CUDA (configure with -DUF_ENABLE_CUDA=ON); "
        "--floor-only prints the floors without a GPU");
#endif
  }
  write_json(a.json_file, out);
  return rc;
}

void setup_bench(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "bench", "Time a decode step (verify rows, DSpark draft) against its memory floor");
  auto a = std::make_shared<BenchArgs>();
  cmd->add_option("--synthetic", a->synthetic,
                  "Synthetic model: tp8-rank (rank 0 of TP8 of DeepSeek-V4.1-Flash, one GPU), or "
                  "tp2 / tp4 / tp8 (the whole model over 2 / 4 / 8 GPUs, collectives included)")
      ->required();
  cmd->add_option("--rows", a->rows, "Verify rows per step to time, comma-separated (1..8)");
  cmd->add_option("--context", a->context, "Committed tokens in the session before the step");
  cmd->add_option("--iters", a->iters, "Timed calls per measurement (median and min reported)");
  cmd->add_option("--warmup", a->warmup, "Untimed calls before each measurement");
  cmd->add_option("--engram-rows", a->engram_rows,
                  "Rows per Engram table (released: ~384M, 98 GB each; a step gathers 24 rows per "
                  "token, so the time hardly depends on it)");
  cmd->add_flag("--no-graphs", a->no_graphs, "Run the decode path without CUDA graphs");
  cmd->add_flag("--fold-moe-combine", a->fold_moe_combine,
                "Fold the MoE combine into the mHC expand (one GPU only: a TP rank combines before "
                "its all-reduce, so the TP8 rank figure leaves it off)");
  cmd->add_flag(
      "--index-scores-fp32", a->index_scores_fp32,
      "index_scores on the fp32 kernel (the CPU's summation order), not the tensor cores");
  cmd->add_flag("--attention-cpu-order", a->attention_cpu_order,
                "Decode attention's chunk records on the CPU-order scores + P.V kernels, not the "
                "tensor cores");
  cmd->add_flag("--shared-beside-router", a->shared_beside_router,
                "Start the forked shared expert with the router (before session 8), not after it");
  cmd->add_flag("--no-candidate-lists", a->no_candidate_lists,
                "Reindex layers score every visible entry and mask (not the pool's list)");
  cmd->add_flag("--no-branches", a->no_branches,
                "One stream: no side streams for the compressor, indexer and shared expert");
  cmd->add_flag("--floor-only", a->floor_only, "Print the floors (bytes per component); no GPU");
  cmd->add_option("--head-slices", a->head_slices,
                  "Vocab slices of the head the rank computes: 8 = rank 0's eighth (TP8's split "
                  "head), 1 = the whole head")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--contexts", a->contexts,
                  "tpN: contexts to time in one load, comma-separated (default: --context)");
  cmd->add_option("--prefill-contexts", a->prefill_contexts,
                  "tpN: time one prefill chunk at these contexts, comma-separated (default: none)");
  cmd->add_option("--prefill-tokens", a->prefill_tokens,
                  "tpN: prompt lengths to project from the prefill chunks");
  cmd->add_option("--chunk", a->chunk, "tpN: prefill rows per chunk");
  cmd->add_option("--prefill-iters", a->prefill_iters, "tpN: timed prefill chunks per context");
  cmd->add_option(
      "--slice-of", a->slice_of,
      "tpN: split one TP K rank's slice over the N GPUs instead of the whole model (each "
      "GPU then holds a TP K*N rank's shapes: tp2 --slice-of 4 = two TP8 ranks)");
  cmd->add_option("--max-seq", a->max_seq,
                  "tpN: size the index scratch for sessions of this many tokens at load, as a "
                  "server with --max-seq does (0: the sessions the bench creates grow it)");
  cmd->add_flag("--no-tp-score-buckets", a->no_tp_score_buckets,
                "tpN: graph steps sum their index scores at the scratch's width, not at a width "
                "bucket of their context (CudaModelOptions::tp_score_buckets off)");
  cmd->add_flag("--tp-index-heads", a->tp_index_heads,
                "tpN: split the indexer by index heads (the ranks' scores summed), not by entries "
                "(CudaModelOptions::tp_index_split_entries off)");
  cmd->add_option(
      "--index-split-min-work", a->index_split_min_work,
      "tpN: rows x positions (a row's entries or the pool's list) from which an index layer "
      "splits them over the ranks; below, every rank scores whole rows (CudaModelOptions::"
      "index_split_min_work; 0: always split)");
  cmd->add_option("--json", a->json_file, "Write every figure to this JSON file");
  cmd->add_option("--trace", a->trace_file,
                  "Trace one more forward per row count (CUPTI kernel timeline) into this file");
  cmd->add_option("--seed", a->seed, "Seed of the synthetic weights and tokens");
  cmd->add_option("--device", a->device, "CUDA device ordinal");
  cmd->callback([a, &exit_code] { exit_code = run_bench(*a); });
}

UF_REGISTER_COMMAND("bench", setup_bench);

}  // namespace
