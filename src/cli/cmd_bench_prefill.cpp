// `ultrafast bench-prefill --synthetic tp8-rank`: benchmark 3 of the performance issue, prefill
// throughput of the TP8 rank slice on one GPU (no collectives run), with the CED shortcut and the
// full path.
//
// Full path: a prompt is prefilled in chunks of --chunk rows as CudaBackend does (prefill_rank:
// the first chunk of a fresh session in the prefill layout, later chunks in the ring layout; each
// chunk = forward with the last row's logits to the host, then commit). A 1M-token prefill does
// not fit the run's time, so the chunk time is measured at a few contexts (--contexts; 0 = the
// first chunk of a fresh session) on a session fast-forwarded there (CudaModel::fast_forward:
// ring tags and entry counts of a real prefill, random state), and a prompt of N tokens is
// projected by integrating the per-token time over the context (model::prefill_seconds:
// piecewise linear between the measured contexts, exact trapezoids, constant beyond the last).
// The forward is timed --iters times, each on a freshly fast-forwarded session (a chunk longer
// than the window ring overwrites ring rows); the commit once after the last.
//
// CED shortcut: measured for a --ced token prompt as one span (a second model with max_chunk =
// --ced), against the full path's single-span prefill of the same prompt (forward in the prefill
// layout). CudaModel::prefill_ced runs longer prompts too (the encoder in chunks), but a 128k or
// 1M prompt does not fit the run's time: the CED figure there is MODELLED as the full path's time
// x the CED / single-span ratio measured at --ced.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cli/cmd_bench_common.h"
#include "cli/command_registry.h"
#include "core/error.h"
#include "model/config.h"
#include "model/synthetic.h"

#ifdef UF_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/backend/cuda_model.h"
#include "cuda/cuda_check.h"
#include "cuda/gemv.h"
#include "cuda/trace/kernel_trace.h"
#endif

namespace {

using nlohmann::json;
namespace bench = uf::cli::bench;

struct PrefillArgs {
  std::string synthetic;
  std::string contexts = "0,8192,131072,1000000";
  std::string tokens = "8192,131072,1000000";
  int chunk = 512;
  int ced = 8192;
  int iters = 2, warmup = 1;
  int64_t engram_rows = int64_t(1) << 22;
  double target_s = 10;
  int tp = 8;
  double comm_gbs = -1;
  std::string json_file;
  std::string trace_file;
  uint64_t seed = 1;
  int device = 0;
  std::string prefill_gemm = "bf16";  // DeviceLinear's prefill GEMM (ops/linear.h): or "fp8"
  std::string fp8_gemm = "default";   // the fp8 GEMM's kernel (cuda/gemv.h): or "legacy"
  std::string attention = "mma";      // prefill attention: mma (tensor cores) or split
};

#ifdef UF_HAVE_CUDA

std::unique_ptr<uf::cuda::CudaModel> load(const uf::model::ModelConfig& cfg,
                                          const uf::model::Checkpoint& ck, int max_chunk,
                                          const PrefillArgs& a) {
  uf::cuda::CudaModelOptions o;
  o.device = a.device;
  o.prefill_attention_mma = a.attention == "mma";
  o.prefill_gemm_bf16 = a.prefill_gemm == "bf16";
  o.max_chunk = max_chunk;
  const auto t0 = bench::Clock::now();
  auto m =
      std::make_unique<uf::cuda::CudaModel>(cfg, ck, uf::model::synthetic_engram_token_map(cfg), o);
  std::cout << fmt::format("model with max_chunk {} loaded in {:.1f} s (span capacity {})\n",
                           max_chunk, bench::us_since(t0) * 1e-6, m->max_span_rows());
  return m;
}

// CED and the single-span full prefill of a --ced token prompt.
void run_ced(const PrefillArgs& a, const uf::model::ModelConfig& cfg,
             const uf::model::Checkpoint& ck, json& out, double& ratio, double& ced_s) {
  auto m = load(cfg, ck, a.ced, a);
  std::mt19937_64 rng(a.seed + 5);
  const auto toks = bench::random_tokens(rng, a.ced, cfg.vocab_size);
  std::vector<float> logits(static_cast<size_t>(cfg.vocab_size));
  std::vector<int> pub(toks.size());
  auto s = m->new_session(a.ced + 64);
  const auto full = bench::time_calls(a.warmup, a.iters, [&] {
    m->forward(*s, toks, /*prefill_layout=*/true, false, logits.data(), nullptr, pub.data());
  });
  s.reset();
  std::vector<double> v;
  for (int i = 0; i < a.warmup + a.iters; ++i) {
    auto cs = m->new_session(a.ced + 64);
    const auto t0 = bench::Clock::now();
    m->prefill_ced(*cs, toks, /*replay=*/0, logits.data());
    if (i >= a.warmup) v.push_back(bench::us_since(t0));
  }
  const auto ced = bench::stats_of(v);
  ratio = ced.median_us / full.median_us;
  ced_s = ced.median_us * 1e-6;
  std::cout << fmt::format(
      "\n{}-token prompt as one span: full path (prefill layout) {:.1f} ms = {:.0f} tokens/s; CED "
      "shortcut {:.1f} ms = {:.0f} tokens/s (CED / full = {:.3f})\n",
      a.ced, full.median_us * 1e-3, a.ced / (full.median_us * 1e-6), ced.median_us * 1e-3,
      a.ced / (ced.median_us * 1e-6), ratio);
  out["single_span"] = {{"tokens", a.ced},
                        {"full", bench::stats_json(full)},
                        {"ced", bench::stats_json(ced)},
                        {"ced_over_full", ratio}};
}

// Chunk time at each context.
std::vector<uf::model::PrefillPoint> run_chunks(const PrefillArgs& a,
                                                const uf::model::ModelConfig& cfg,
                                                const uf::model::Checkpoint& ck, json& out) {
  auto m = load(cfg, ck, a.chunk, a);
  const int C = std::min(a.chunk, m->max_span_rows());
  std::mt19937_64 rng(a.seed + 9);
  const auto toks = bench::random_tokens(rng, C, cfg.vocab_size);
  std::vector<float> logits(static_cast<size_t>(cfg.vocab_size));
  std::vector<int> pub(toks.size());
  const int MH = m->n_taps() * cfg.dim;
  std::vector<uf::model::PrefillPoint> pts;
  json jp = json::array();
  std::cout << fmt::format(
      "\nfull path, chunks of {} rows (forward median of {} after {} warm-up, then one commit):\n"
      "{:>9} {:>11} {:>10} {:>12} {:>12}\n",
      C, a.iters, a.warmup, "context", "forward ms", "commit ms", "us/token", "tokens/s");
  for (int64_t c : bench::parse_list<int64_t>(a.contexts, "--contexts")) {
    try {
      // A fresh session per call: a chunk longer than the window ring overwrites the ring rows
      // the next (uncommitted) call at the same position would need.
      std::unique_ptr<uf::cuda::CudaSession> s;
      auto fresh_session = [&] {
        s.reset();
        s = m->new_session(c + C + 64);
        if (c > 0) m->fast_forward(*s, c, a.seed);
      };
      const bool first = c == 0;
      std::vector<double> v;
      for (int i = 0; i < a.warmup + a.iters; ++i) {
        fresh_session();
        const auto t0 = bench::Clock::now();
        m->forward(*s, toks, first, false, logits.data(), nullptr, pub.data());
        if (i >= a.warmup) v.push_back(bench::us_since(t0));
      }
      if (!a.trace_file.empty()) {  // two more calls, the second traced (kernel_trace.h)
        // The first eager launch of each kernel after tracing starts pays CUPTI's set-up (~ms
        // of idle device in all): a traced call first, discarded.
        uf::cuda::KernelTrace trace;
        std::vector<uf::cuda::KernelRecord> recs;
        for (int pass = 0; pass < 2; ++pass) {
          fresh_session();
          trace.start();
          m->forward(*s, toks, first, false, logits.data(), nullptr, pub.data());
          recs = trace.stop();
        }
        const std::string table = uf::cuda::summarize_trace(recs, 40);
        std::cout << fmt::format("trace of one {}-row chunk at context {}:\n{}", C, c, table);
        std::ofstream f(a.trace_file, std::ios::app);
        f << fmt::format("== context {}, {} rows\n{}", c, C, table)
          << uf::cuda::trace_records_text(recs);
      }
      const auto st = bench::stats_of(v);
      // The last timed forward left its main hidden rows and publishers: commit them.
      const auto t0 = bench::Clock::now();
      m->commit(*s, toks, MH ? m->scratch_main_hidden() : nullptr, C, pub.back());
      m->synchronize();
      const double commit_us = bench::us_since(t0);
      const double upt = (st.median_us + commit_us) / C;
      std::cout << fmt::format("{:>9} {:>11.2f} {:>10.2f} {:>12.2f} {:>12.0f}\n", c,
                               st.median_us * 1e-3, commit_us * 1e-3, upt, 1e6 / upt);
      pts.push_back({c, upt});
      jp.push_back({{"context", c},
                    {"forward", bench::stats_json(st)},
                    {"commit_us", commit_us},
                    {"us_per_token", upt}});
    } catch (const std::exception& e) {
      std::cout << fmt::format("{:>9} FAILED: {}\n", c, e.what());
      jp.push_back({{"context", c}, {"error", e.what()}});
    }
  }
  out["chunks"] = jp;
  out["chunk"] = C;
  return pts;
}

#endif  // UF_HAVE_CUDA

int run_prefill(const PrefillArgs& a) {
  std::cout << std::unitbuf;
  const auto cfg = bench::synthetic_config(a.synthetic, a.engram_rows);
  UF_CHECK(a.chunk >= 1 && a.iters >= 1 && a.warmup >= 0,
           "bench-prefill: --chunk {} / --iters {} must be >= 1", a.chunk, a.iters);
  json out = {{"model", "synthetic tp8-rank"}, {"seed", a.seed}};
#ifdef UF_HAVE_CUDA
  int n_dev = 0;
  const cudaError_t e = cudaGetDeviceCount(&n_dev);
  UF_CHECK(e == cudaSuccess && n_dev > a.device, "bench-prefill: no CUDA device {} ({})", a.device,
           e == cudaSuccess ? fmt::format("{} visible", n_dev) : cudaGetErrorString(e));
  UF_CHECK(a.fp8_gemm == "default" || a.fp8_gemm == "legacy",
           "bench-prefill: --fp8-gemm {} (default or legacy)", a.fp8_gemm);
  uf::cuda::fp8_gemm_set_legacy(a.fp8_gemm == "legacy");
  out["fp8_gemm"] = a.fp8_gemm;
  UF_CHECK(a.prefill_gemm == "bf16" || a.prefill_gemm == "fp8",
           "bench-prefill: --prefill-gemm {} (bf16 or fp8)", a.prefill_gemm);
  out["prefill_gemm"] = a.prefill_gemm;
  UF_CHECK(a.attention == "mma" || a.attention == "split",
           "bench-prefill: --attention {} (mma or split)", a.attention);
  out["attention"] = a.attention;
  spdlog::info("bench-prefill: building the synthetic checkpoint");
  const auto ck = uf::model::synthetic_checkpoint(cfg, a.seed);
  double ratio = -1, ced_measured_s = -1;
  if (a.ced > 0) {
    try {
      run_ced(a, cfg, ck, out, ratio, ced_measured_s);
    } catch (const std::exception& ex) {
      std::cout << "CED / single-span measurement FAILED: " << ex.what() << "\n";
      out["single_span_error"] = ex.what();
    }
  }
  const auto pts = run_chunks(a, cfg, ck, out);
  if (pts.empty()) {
    bench::write_json(a.json_file, out);
    uf::core::fail("bench-prefill: no chunk measurement succeeded (see FAILED lines above)");
  }
  int64_t last = 0;
  for (const auto& p : pts) last = std::max(last, p.context);
  std::cout << fmt::format(
      "\nprompts, one GPU (rank slice, no collectives): per-token time integrated over the "
      "context, piecewise linear between the measured contexts{}\n{:>9} {:>10} {:>12} {:>14} "
      "{:>12}\n",
      "", "tokens", "full s", "tokens/s", "CED s", "CED tokens/s");
  json jt = json::array();
  for (int64_t n : bench::parse_list<int64_t>(a.tokens, "--tokens")) {
    const double full_s = uf::model::prefill_seconds(pts, n);
    std::string ced_s = "n/a", ced_t = "n/a";
    json row = {{"tokens", n}, {"full_s", full_s}, {"full_tokens_per_s", double(n) / full_s}};
    if (ratio > 0) {
      // Measured for a prompt of exactly --ced tokens, else modelled.
      const bool measured = n == a.ced;
      const double cs = measured ? ced_measured_s : full_s * ratio;
      ced_s = fmt::format("{:.3f}{}", cs, measured ? "" : " (m)");
      ced_t = fmt::format("{:.0f}", double(n) / cs);
      row["ced_s"] = cs;
      row["ced_modelled"] = !measured;
    }
    std::cout << fmt::format("{:>9} {:>10.3f} {:>12.0f} {:>14} {:>12}{}\n", n, full_s,
                             double(n) / full_s, ced_s, ced_t,
                             n > last ? "  (beyond the last measured context: constant)" : "");
    // The TP8 projection: the rank's compute + the collectives' bytes (capacity = the prompt).
    double bytes = 0;
    for (int64_t b = 0; b < n; b += a.chunk) {
      const int rows = int(std::min<int64_t>(a.chunk, n - b));
      for (const auto& c : uf::model::tp_verify_collectives(cfg, a.tp, rows, n))
        bytes += c.calls * c.bytes() * (a.tp - 1);  // received per rank (all-gather)
    }
    row["tp_received_bytes_per_rank"] = bytes;
    if (a.comm_gbs > 0) {
      const double tp_s = full_s + bytes / (a.comm_gbs * 1e9);
      row["tp_projected_s"] = tp_s;
      std::cout << fmt::format(
          "          TP{} projected (modelled: {:.3g} GB received per rank at --comm-gbs {}): "
          "{:.2f} s{}\n",
          a.tp, bytes * 1e-9, a.comm_gbs, tp_s,
          n >= 1000000 ? fmt::format("; target for 1M < {} s: {}", a.target_s,
                                     tp_s < a.target_s ? "MET" : "NOT MET")
                       : "");
    } else {
      std::cout << fmt::format(
          "          TP{}: the collectives move {:.3g} GB per rank (all-gather; not timed: pass "
          "--comm-gbs){}\n",
          a.tp, bytes * 1e-9,
          n >= 1000000 ? fmt::format("; 1M target < {} s, compute alone {:.2f} s: {}", a.target_s,
                                     full_s, full_s < a.target_s ? "met so far" : "NOT MET")
                       : "");
    }
    jt.push_back(row);
  }
  if (ratio > 0)
    std::cout << fmt::format(
        "(m) = modelled (a 128k / 1M CED prefill does not fit the run): the full path's time x "
        "the CED / single-span ratio {:.3f} measured at {} tokens\n",
        ratio, a.ced);
  out["prompts"] = jt;
#else
  uf::core::fail("bench-prefill: this binary was built without CUDA");
#endif
  bench::write_json(a.json_file, out);
  return 0;
}

void setup_bench_prefill(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("bench-prefill",
                                 "Prefill throughput of the TP8 rank slice (CED and full path)");
  auto a = std::make_shared<PrefillArgs>();
  cmd->add_option("--synthetic", a->synthetic, "Synthetic model: tp8-rank")->required();
  cmd->add_option("--contexts", a->contexts,
                  "Contexts at which a chunk is timed, comma-separated (0 = first chunk)");
  cmd->add_option("--tokens", a->tokens, "Prompt lengths to project, comma-separated");
  cmd->add_option("--chunk", a->chunk, "Rows per prefill chunk (CudaModelOptions::max_chunk)");
  cmd->add_option("--ced", a->ced, "Prompt length of the CED / single-span measurement (0: skip)");
  cmd->add_option("--iters", a->iters, "Timed calls per measurement");
  cmd->add_option("--warmup", a->warmup, "Untimed calls first");
  cmd->add_option("--engram-rows", a->engram_rows, "Rows per Engram table");
  cmd->add_option("--tp", a->tp, "Ranks of the TP projection");
  cmd->add_option("--comm-gbs", a->comm_gbs,
                  "GB/s at which a rank receives the collectives' bytes (TP projection)");
  cmd->add_option("--target-s", a->target_s, "Target for a 1M-token prefill on 8 GPUs");
  cmd->add_option("--json", a->json_file, "Write every figure to this JSON file");
  cmd->add_option(
      "--trace", a->trace_file,
      "Trace one more chunk per context (CUPTI kernel timeline), appended to this file");
  cmd->add_option("--seed", a->seed, "Seed of the synthetic weights and tokens");
  cmd->add_option("--device", a->device, "CUDA device ordinal");
  cmd->add_option("--prefill-gemm", a->prefill_gemm,
                  "Prefill linear layers and mHC mixes: bf16 (exact bf16 operands, default) or "
                  "fp8 (bitwise the decode kernels)");
  cmd->add_option(
      "--fp8-gemm", a->fp8_gemm,
      "The fp8 prefill GEMM's kernel: default (f16 HMMA) or legacy (emulated e4m3 mma)");
  cmd->add_option("--attention", a->attention,
                  "Prefill attention: mma (tensor cores, default) or split (the decode kernels)");
  cmd->callback([a, &exit_code] { exit_code = run_prefill(*a); });
}

UF_REGISTER_COMMAND("bench-prefill", setup_bench_prefill);

}  // namespace
