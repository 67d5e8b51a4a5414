// `ultrafast bench --synthetic tpN` (N = 2, 4, 8; bench_tp_model.h): the released
// DeepSeek-V4.1-Flash sharded over N GPUs of this machine by the CUDA backend
// (CudaModelOptions::tp = N: one rank per GPU, its own thread and stream, the collectives for real:
// the one-shot P2P all-reduce where every pair of GPUs has peer access, else NCCL), synthetic
// weights (model/synthetic.h: real dimensions, random values in the checkpoint formats, Engram
// tables shrunk to --engram-rows; sharded by the backend exactly as a real checkpoint is).
//
// At each context of --contexts (a session fast-forwarded there on every rank with the same seed,
// CudaModel::fast_forward, so that every rank holds the same state as real TP ranks do), never
// committed, so every call sees the same state:
//  - "forward": the verify forward of T rows for each T of --rows, logits to the host
//    (CudaBackend::decode_rows into a pinned buffer): `bench --synthetic tp8-rank`'s step, now with
//    its collectives and the split head's gather;
//  - "kept": the same forward with the logits left on rank 0 for device verification;
//  - "served": the decode step GenerationLoop runs with device drafting: a DSpark round on the
//    device (temperature 1), the forward of the anchor + T - 1 drafts (kept), block verification on
//    rank 0 (draft_on_device + decode_rows + verify_last_rows), for each T whose T - 1 drafts the
//    round produced;
//  - one traced forward of the largest T (CUPTI, every GPU): per rank the collective kernels'
//    count and advance (the time the chain waited for them, their wait for the slowest rank
//    included), beside the count the backend's code implies (model::tp_verify_collectives);
//    every context's after all the timings (and --trace FILE's prefill chunks), because CUPTI,
//    once initialised, slows every later launch of the process by ~10%.
// Floors: the ranks run at once and each reads its own slice (model::rank_slice_config(cfg, N),
// the head split N ways), so a step's floor is one rank's bytes over the copy bandwidth measured
// on device 0.
// Prefill (--prefill-contexts; empty = skipped): one --chunk-row chunk through CudaBackend::prefill
// (forward + commit on every rank, collectives included) on a fresh session fast-forwarded to each
// context; a prompt of each --prefill-tokens length is projected by integrating the per-token
// time over the context (model::prefill_seconds), as bench-prefill does for the one-GPU slice.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli/bench_tp_model.h"
#include "cli/cmd_bench_common.h"
#include "core/error.h"
#include "model/config.h"
#include "model/synthetic.h"
#include "model/tensor_contract.h"

#ifdef UF_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/backend/cuda_backend.h"
#include "cuda/cuda_check.h"
#include "cuda/trace/kernel_trace.h"
#include "sampling/transform.h"
#endif

namespace uf::cli::bench {

int tp_model_ranks(const std::string& synthetic) {
  for (int n : {2, 4, 8})
    if (synthetic == fmt::format("tp{}", n)) return n;
  return 0;
}

#ifdef UF_HAVE_CUDA

namespace {

using nlohmann::json;

// A fresh session of `cap` tokens with `context` committed on every rank.
std::unique_ptr<engine::SessionState> session_at(cuda::CudaBackend& be, int64_t context,
                                                 int64_t cap, uint64_t seed) {
  auto s = be.new_session(cap);
  if (context > 0) be.fast_forward(*s, context, seed);
  return s;
}

struct PinnedFree {
  void operator()(float* p) const { cudaFreeHost(p); }
};

bool is_collective(const std::string& kernel) {
  return kernel.find("p2p_") != std::string::npos || kernel.find("nccl") != std::string::npos;
}

// Rank r's records of a trace of every GPU (rank r = device r).
std::vector<cuda::KernelRecord> records_of(const std::vector<cuda::KernelRecord>& recs, int r) {
  std::vector<cuda::KernelRecord> mine;
  for (const auto& k : recs)
    if (int(k.device) == r) mine.push_back(k);
  return mine;
}

// The traced forward's records of each rank: span, and the collective kernels' count and advance
// (cuda::trace_advances_us: a PDL-launched collective's duration would include the time it sat
// resident waiting for the kernel before it). A collective's advance includes its wait for the
// other ranks.
json collective_table(const std::vector<cuda::KernelRecord>& recs, int tp, int expected) {
  json ranks = json::array();
  std::cout << fmt::format("{:>4} {:>9} {:>8} {:>12} {:>10}\n", "rank", "span us", "calls",
                           "advance us", "us / call");
  for (int r = 0; r < tp; ++r) {
    const auto mine = records_of(recs, r);
    const auto adv = cuda::trace_advances_us(mine);
    double span = 0, coll = 0;
    int calls = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      span += adv[i];  // the advances add up to the span
      if (is_collective(mine[i].name)) {
        ++calls;
        coll += adv[i];
      }
    }
    std::cout << fmt::format("{:>4} {:>9.1f} {:>8} {:>12.1f} {:>10.2f}\n", r, span, calls, coll,
                             calls ? coll / calls : 0.0);
    ranks.push_back(
        {{"rank", r}, {"span_us", span}, {"calls", calls}, {"collective_advance_us", coll}});
  }
  std::cout << fmt::format("(the backend's code implies {} collective calls per forward)\n",
                           expected);
  return {{"ranks", ranks}, {"expected_calls", expected}};
}

}  // namespace

void run_tp_model_bench(const TpModelArgs& a, json& out) {
  const int N = a.tp;
  UF_CHECK(N == 2 || N == 4 || N == 8, "bench: tp{} is not a TP degree the bench runs (2, 4, 8)",
           N);
  int n_dev = 0;
  const cudaError_t e = cudaGetDeviceCount(&n_dev);
  UF_CHECK(e == cudaSuccess && n_dev >= N,
           "bench: --synthetic tp{} runs one rank per GPU and needs {} GPUs; {} visible "
           "(`--synthetic tp8-rank` times one rank's slice on one GPU)",
           N, N, e == cudaSuccess ? n_dev : 0);
  for (int64_t c : a.contexts) UF_CHECK(c >= 1, "bench: context {} must be at least 1", c);
  UF_CHECK(a.slice_of >= 1, "bench: --slice-of {} must be at least 1", a.slice_of);
  const auto released = model::ModelConfig::deepseek_v41_flash();
  const auto cfg = model::with_engram_rows(
      a.slice_of > 1 ? model::rank_slice_config(released, a.slice_of) : released, a.engram_rows);
  const auto slice = model::rank_slice_config(cfg, N);  // the split must be valid
  uint64_t all_bytes = 0, rank_bytes = 0;
  for (const auto& t : model::tensor_contract(cfg)) all_bytes += t.nbytes();
  for (const auto& t : model::tensor_contract(slice)) rank_bytes += t.nbytes();
  const std::string what =
      a.slice_of > 1
          ? fmt::format("one TP{} rank's slice of DeepSeek-V4.1-Flash (ranks shaped like TP{}'s)",
                        a.slice_of, a.slice_of * N)
          : std::string("DeepSeek-V4.1-Flash");
  std::cout << fmt::format(
      "synthetic tp{}: {} on {} GPUs, {:.1f} GB of weights in all; a rank holds {:.1f} GB (its "
      "slice, the head counted whole; it keeps 1/{} of the head)\n",
      N, what, N, double(all_bytes) * 1e-9, double(rank_bytes) * 1e-9, N);
  out["model"] = fmt::format("synthetic tp{}", N);
  out["slice_of"] = a.slice_of;
  out["tp"] = N;
  out["weight_bytes"] = all_bytes;
  out["rank_slice_bytes"] = rank_bytes;
  for (int r = 0; r < N; ++r) {
    UF_CUDA_CHECK(cudaSetDevice(r));
    size_t free_b = 0, total_b = 0;
    UF_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    UF_CHECK(double(free_b) >= double(rank_bytes) + 4e9,
             "bench: device {} has {:.1f} GB free; a tp{} rank needs about {:.1f} GB (weights + "
             "scratch)",
             r, double(free_b) * 1e-9, N, (double(rank_bytes) + 4e9) * 1e-9);
  }
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  out["device"] = {{"name", prop.name}, {"count", N}, {"sms", prop.multiProcessorCount}};

  spdlog::info("bench: measuring the copy bandwidth of device 0 (2 GiB buffers)");
  const Bandwidth bw = measure_bandwidth(0);
  const double bwg = bw.best();
  std::cout << fmt::format("{}: copy bandwidth {:.0f} GB/s (the floors use it)\n", prop.name, bwg);
  out["bandwidth"] = {{"memcpy_gbs", bw.memcpy_gbs}, {"copy_kernel_gbs", bw.copy_kernel_gbs}};

  cuda::CudaModelOptions o;
  o.tp = N;
  o.cuda_graphs = !a.no_graphs;
  o.max_seq = a.max_seq;
  o.tp_score_buckets = a.score_buckets;
  o.tp_index_split_entries = a.index_split_entries;
  if (a.index_split_min_work >= 0) o.index_split_min_work = a.index_split_min_work;
  spdlog::info("bench: building the synthetic checkpoint and loading {} ranks", N);
  const auto t_load = Clock::now();
  auto be = std::make_unique<cuda::CudaBackend>(cfg, model::synthetic_checkpoint(cfg, a.seed),
                                                model::synthetic_engram_token_map(cfg), o);
  const double load_s = us_since(t_load) * 1e-6;
  json mem = json::array();
  std::string mem_line;
  for (int r = 0; r < N; ++r) {
    mem.push_back(device_used_gb(r));
    mem_line += fmt::format(" {:.1f}", mem.back().get<double>());
  }
  std::cout << fmt::format("loaded in {:.1f} s (shard, upload, graphs); GB in use per GPU:{}\n",
                           load_s, mem_line);
  out["load_seconds"] = load_s;
  out["memory_gb_after_load"] = mem;

  const int V = cfg.vocab_size;
  float* host_logits = nullptr;
  UF_CUDA_CHECK(cudaMallocHost(&host_logits, size_t(8) * size_t(V) * sizeof(float)));
  const std::unique_ptr<float, PinnedFree> logits_owner(host_logits);
  std::mt19937_64 rng(a.seed + 17);
  const int32_t anchor = int32_t(3 + rng() % uint64_t(V - 3));
  sampling::SamplingParams sp;
  sp.temperature = 1.0f;
  uint64_t step = 0;
  model::FloorOptions fo;
  fo.head_slices = N;
  const int t_max = *std::max_element(a.rows.begin(), a.rows.end());

  json jctx = json::array();
  // One context: the draft, the forwards and the served steps of every T.
  auto time_context = [&](int64_t ctx) {
    const int64_t cap = ctx + 64;
    spdlog::info("bench: context {}: fast-forwarding {} ranks", ctx, N);
    auto s = session_at(*be, ctx, cap, a.seed);
    // One draft round first: how many drafts the served step can verify.
    const size_t drafted = be->draft_on_device(*s, anchor, sp, a.seed, ++step).tokens.size();
    const Stats dr = time_calls(a.warmup, a.iters,
                                [&] { (void)be->draft_on_device(*s, anchor, sp, a.seed, ++step); });
    const double dfl = model::step_floor(slice, 1, ctx, fo).draft_bytes() / (bwg * 1e3);
    std::cout << fmt::format(
        "\ncontext {}: DSpark draft round on the device ({} tokens, temperature 1): {:.1f} us "
        "median, floor {:.1f} us\n{:>2} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9}\n",
        ctx, drafted, dr.median_us, dfl, "T", "forward", "min", "kept", "floor", "x floor",
        "served = draft + forward + verify (medians of each)");
    json jrows = json::array();
    for (int T : a.rows) {
      const auto toks = random_tokens(rng, T, V);
      const Stats fw = time_calls(a.warmup, a.iters, [&] {
        be->decode_rows(*s, toks, std::span<float>(host_logits, size_t(T) * size_t(V)));
      });
      const Stats kept =
          time_calls(a.warmup, a.iters, [&] { be->decode_rows(*s, toks, std::span<float>()); });
      const double fl = model::step_floor(slice, T, ctx, fo).verify_bytes() / (bwg * 1e3);
      json jr = {{"rows", T},
                 {"forward", stats_json(fw)},
                 {"kept", stats_json(kept)},
                 {"floor_us", fl},
                 {"x_floor", fw.median_us / fl}};
      std::string served_txt = "-";
      if (T >= 2 && size_t(T - 1) <= drafted) {
        std::vector<int32_t> step_rows(static_cast<size_t>(T));
        std::vector<double> parts[3];  // draft, forward, verification: where a step goes
        const Stats sv = time_calls(a.warmup, a.iters, [&] {
          ++step;
          const auto t0 = Clock::now();
          const auto b = be->draft_on_device(*s, anchor, sp, a.seed, step);
          UF_CHECK(b.tokens.size() >= size_t(T - 1), "bench: a draft round gave {} tokens, not {}",
                   b.tokens.size(), T - 1);
          step_rows[0] = anchor;
          std::copy_n(b.tokens.begin(), T - 1, step_rows.begin() + 1);
          const auto t1 = Clock::now();
          be->decode_rows(*s, step_rows, std::span<float>());
          const auto t2 = Clock::now();
          (void)be->verify_last_rows(*s, sampling::VerifyMode::kBlock, sp, {},
                                     std::span<const int32_t>(step_rows.data() + 1, size_t(T - 1)),
                                     a.seed, step);
          const auto us = [](auto d) {
            return std::chrono::duration<double, std::micro>(d).count();
          };
          parts[0].push_back(us(t1 - t0));
          parts[1].push_back(us(t2 - t1));
          parts[2].push_back(us(Clock::now() - t2));
        });
        for (auto& v : parts)  // the timed calls only, as sv
          v.erase(v.begin(), v.begin() + std::min<ptrdiff_t>(a.warmup, ptrdiff_t(v.size())));
        const Stats pd = stats_of(parts[0]), pf = stats_of(parts[1]), pv = stats_of(parts[2]);
        served_txt = fmt::format("{:.1f} = {:.0f} + {:.0f} + {:.0f}", sv.median_us, pd.median_us,
                                 pf.median_us, pv.median_us);
        jr["served"] = stats_json(sv);
        jr["served_parts_median_us"] = {
            {"draft", pd.median_us}, {"forward", pf.median_us}, {"verify", pv.median_us}};
      }
      std::cout << fmt::format("{:>2} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>7.2f} {:>9}\n", T,
                               fw.median_us, fw.min_us, kept.median_us, fl, fw.median_us / fl,
                               served_txt);
      jrows.push_back(jr);
    }
    json jc = {{"context", ctx},
               {"draft", {{"time", stats_json(dr)}, {"tokens", drafted}, {"floor_us", dfl}}},
               {"rows", jrows}};
    return jc;
  };
  for (int64_t ctx : a.contexts) {
    try {
      jctx.push_back(time_context(ctx));
    } catch (const std::exception& ex) {  // e.g. a 1M session that does not fit: go on
      std::cout << fmt::format("context {} FAILED: {}\n", ctx, ex.what());
      jctx.push_back({{"context", ctx}, {"error", ex.what()}});
    }
  }
  out["contexts"] = jctx;

  if (!a.prefill_contexts.empty()) {
    const int C = std::min(a.chunk, be->model(0).max_span_rows());
    const auto toks = random_tokens(rng, C, V);
    std::vector<float> logits(static_cast<size_t>(V));
    engine::PrefillOptions po;
    po.chunk = C;
    std::vector<model::PrefillPoint> pts;
    json jp = json::array();
    std::cout << fmt::format(
        "\nprefill, one {}-row chunk (forward + commit on every rank; median of {} after 1 "
        "warm-up):\n{:>9} {:>11} {:>12} {:>12}\n",
        C, a.prefill_iters, "context", "chunk ms", "us/token", "tokens/s");
    for (int64_t c : a.prefill_contexts) {
      try {
        std::vector<double> v;
        for (int i = 0; i < 1 + a.prefill_iters; ++i) {
          auto s = session_at(*be, c, c + C + 64, a.seed);
          const auto t0 = Clock::now();
          be->prefill(*s, toks, po, logits);
          if (i > 0) v.push_back(us_since(t0));
        }
        const auto st = stats_of(v);
        const double upt = st.median_us / C;
        std::cout << fmt::format("{:>9} {:>11.2f} {:>12.2f} {:>12.0f}\n", c, st.median_us * 1e-3,
                                 upt, 1e6 / upt);
        pts.push_back({c, upt});
        jp.push_back({{"context", c}, {"chunk", stats_json(st)}, {"us_per_token", upt}});
      } catch (const std::exception& ex) {
        std::cout << fmt::format("{:>9} FAILED: {}\n", c, ex.what());
        jp.push_back({{"context", c}, {"error", ex.what()}});
      }
    }
    json proj = json::array();
    if (!pts.empty())
      for (int64_t n : a.prefill_tokens) {
        const double sec = model::prefill_seconds(pts, n);
        std::cout << fmt::format(
            "prompt of {} tokens on {} GPUs (full path, projected): {:.1f} s "
            "= {:.0f} tokens/s\n",
            n, N, sec, double(n) / sec);
        proj.push_back({{"tokens", n}, {"seconds", sec}});
      }
    out["prefill"] = {{"chunk", C}, {"points", jp}, {"prompts", proj}};
  }
  // The traces last: CUPTI, once initialised, slows every launch of the process (~10% of a
  // decode step), so every figure above is untraced.
  // One traced forward of the largest T at a context: the collectives table into jc["trace"].
  auto trace_context = [&](int64_t ctx, json& jc) {
    const int64_t cap = ctx + 64;
    auto s = session_at(*be, ctx, cap, a.seed);
    const auto toks = random_tokens(rng, t_max, V);
    be->decode_rows(*s, toks, std::span<float>());  // warm, untraced
    cuda::KernelTrace trace;
    trace.start();
    be->decode_rows(*s, toks, std::span<float>());
    const auto recs = trace.stop();
    std::cout << fmt::format(
        "\ncontext {}: collectives in one traced {}-row forward (kept logits):\n", ctx, t_max);
    const model::TpIndexSplit split{o.tp_index_split_entries, o.index_split_min_work};
    const int expected =
        model::total_calls(model::tp_verify_collectives(cfg, N, t_max, cap, split));
    jc["trace"] = collective_table(recs, N, expected);
    jc["trace"]["rows"] = t_max;
    if (!a.trace_file.empty()) {
      const auto r0 = records_of(recs, 0);
      std::ofstream f(a.trace_file, std::ios::app);
      UF_CHECK(f.good(), "bench: cannot write the trace file {}", a.trace_file);
      f << fmt::format("== context {}, {} rows, rank 0\n{}", ctx, t_max,
                       cuda::summarize_trace(r0, 40))
        << cuda::trace_records_text(r0);
    }
  };
  json& jcs = out["contexts"];  // the timings, written above in case the prefill part throws
  for (size_t i = 0; i < a.contexts.size(); ++i) {
    if (jcs[i].contains("error")) continue;
    try {
      trace_context(a.contexts[i], jcs[i]);
    } catch (const std::exception& ex) {  // the timings stand; say what the trace hit
      std::cout << fmt::format("context {}: trace FAILED: {}\n", a.contexts[i], ex.what());
      jcs[i]["trace_error"] = ex.what();
    }
  }
  if (!a.trace_file.empty() && !a.prefill_contexts.empty()) {
    // One more chunk a context, traced: where a TP chunk's time goes.
    const int C = std::min(a.chunk, be->model(0).max_span_rows());
    const auto toks = random_tokens(rng, C, V);
    std::vector<float> logits(static_cast<size_t>(V));
    engine::PrefillOptions po;
    po.chunk = C;
    for (int64_t c : a.prefill_contexts) {
      try {
        auto s = session_at(*be, c, c + C + 64, a.seed);
        cuda::KernelTrace trace;
        trace.start();
        be->prefill(*s, toks, po, logits);
        const auto recs = trace.stop();
        std::ofstream f(a.trace_file, std::ios::app);
        for (int r = 0; r < N; ++r)
          f << fmt::format("== prefill chunk of {} rows at context {}, rank {}\n{}", C, c, r,
                           cuda::summarize_trace(records_of(recs, r), 30));
      } catch (const std::exception& ex) {
        std::cout << fmt::format("prefill trace at context {} FAILED: {}\n", c, ex.what());
      }
    }
  }
  be.reset();
}

#else

void run_tp_model_bench(const TpModelArgs&, nlohmann::json&) {
  core::fail("bench: this binary was built without CUDA (configure with -DUF_ENABLE_CUDA=ON)");
}

#endif  // UF_HAVE_CUDA

}  // namespace uf::cli::bench
