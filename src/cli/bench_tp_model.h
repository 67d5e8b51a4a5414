#pragma once
// `ultrafast bench --synthetic tpN` (cmd_bench_tp_model.cpp): the released model sharded over N
// GPUs of this machine, every collective run for real. cmd_bench.cpp parses the options and calls
// run_tp_model_bench; the one-GPU rank slice (`--synthetic tp8-rank`) stays in cmd_bench.cpp.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace uf::cli::bench {

// "tp2" / "tp4" / "tp8" -> 2 / 4 / 8; 0 for any other name.
int tp_model_ranks(const std::string& synthetic);

struct TpModelArgs {
  int tp = 8;
  // 1: the released model over tp GPUs. K > 1: the model is one TP K rank's slice
  // (model::rank_slice_config), split over tp GPUs, so that each GPU holds the shapes of a
  // TP (K x tp) rank: `--synthetic tp2 --slice-of 4` runs two TP8-shaped ranks on 2 GPUs (the
  // released model at TP 2 does not fit an H200), collectives included, at 2 ranks' latency.
  int slice_of = 1;
  std::vector<int> rows;          // verify rows per step (1..8)
  std::vector<int64_t> contexts;  // committed tokens before the step
  int iters = 20, warmup = 3;     // per step measurement
  int64_t engram_rows = int64_t(1) << 22;
  std::vector<int64_t> prefill_contexts;  // empty: no prefill measurement
  std::vector<int64_t> prefill_tokens;    // prompt lengths to project
  int chunk = 512;                        // prefill rows per chunk
  int prefill_iters = 2;                  // after one warm-up, per context
  std::string trace_file;                 // also write the traced step's records here
  uint64_t seed = 1;
  bool no_graphs = false;
  // As a server with --max-seq: the index scratch sized for it at load (CudaModelOptions::max_seq;
  // 0: grown by the sessions the bench creates), and the graph steps' score width buckets.
  int64_t max_seq = 0;
  bool score_buckets = true;
  bool index_split_entries = true;  // CudaModelOptions::tp_index_split_entries
  // CudaModelOptions::index_split_min_work (-1: its default).
  int64_t index_split_min_work = -1;
};

// Builds, loads and times; every figure goes into `out` as well as to stdout. Throws
// uf::core::Error when fewer than tp GPUs are visible or a rank does not fit its device.
void run_tp_model_bench(const TpModelArgs& a, nlohmann::json& out);

}  // namespace uf::cli::bench
