// `ultrafast tp-plan --tp N <model-dir>|--released`: a dry run of the tensor-parallel sharding
// plan (model/tp_plan.h). Prints each rank's bytes by tensor kind, split vs replicated, and the
// largest shards of rank 0. An N the config does not divide fails with the reason (main()
// prints the uf::core::Error).
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include "cli/command_registry.h"
#include "core/error.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/tp_plan.h"

namespace {

struct TpPlanArgs {
  std::string dir;
  bool released = false;
  int tp = 0;
  int top = 12;
  bool split_wq_a = false;
  bool replicate_head = false;
  bool replicate_engram_tables = false;
  bool replicate_engram_wkv = false;
  bool replicate_index_heads = false;
};

// Bytes in the largest binary unit that keeps the number at least 1.
std::string gib(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  double v = double(b);
  int u = 0;
  while (u < 3 && v >= 1024) v /= 1024, ++u;
  return fmt::format("{:.3f} {}", v, units[u]);
}

int run_tp_plan(const TpPlanArgs& a) {
  UF_CHECK(a.released != !a.dir.empty(),
           "tp-plan: give either a model folder or --released (not both, not neither)");
  const auto cfg = a.released ? uf::model::ModelConfig::deepseek_v41_flash()
                              : uf::model::ModelConfig::load(a.dir);
  uf::model::TpOptions o;
  o.split_wq_a = a.split_wq_a;
  o.split_head = !a.replicate_head;
  o.split_engram_tables = !a.replicate_engram_tables;
  o.split_engram_wkv = !a.replicate_engram_wkv;
  o.split_index_heads = !a.replicate_index_heads;
  uf::model::validate_tp(cfg, a.tp, o);

  auto& out = std::cout;
  out << fmt::format("tp-plan: {} over {} rank(s)\n", a.released ? "released config" : a.dir, a.tp);
  out << fmt::format("options: head {}, wq_a {}, engram tables {}, engram.wkv {}, indexer {}\n",
                     o.split_head ? "split (vocab rows)" : "replicated",
                     o.split_wq_a ? "split" : "replicated",
                     o.split_engram_tables ? "split (rows)" : "replicated",
                     o.split_engram_wkv ? "split (rows)" : "replicated",
                     o.split_index_heads ? "split (index heads)" : "replicated (entries split)");
  uint64_t max_total = 0;
  for (int r = 0; r < a.tp; ++r) {
    const auto p = uf::model::make_tp_plan(cfg, a.tp, r, o);
    std::map<std::string, uint64_t> by_kind;
    uint64_t split = 0, repl = 0, strided = 0;
    size_t n_split = 0;
    for (const auto& s : p.shards) {
      by_kind[uf::model::tensor_kind_name(s.kind)] += s.nbytes;
      if (s.mode == uf::model::ShardMode::kSplit) {
        split += s.nbytes;
        ++n_split;
        if (!uf::model::shard_contiguous(s)) strided += s.nbytes;
      } else {
        repl += s.nbytes;
      }
    }
    max_total = std::max(max_total, p.total_bytes());
    out << fmt::format("rank {}: {} ({} bytes) = split {} ({} tensors) + replicated {} ({})\n", r,
                       gib(p.total_bytes()), p.total_bytes(), gib(split), n_split, gib(repl),
                       p.shards.size() - n_split);
    // How a rank places them at load (the CUDA backend's shard_model_weights): row ranges are
    // read in place from the checkpoint, column slices copied on the host first.
    out << fmt::format("  split: {} row ranges (read in place), {} column slices (host copies)\n",
                       gib(split - strided), gib(strided));
    for (const auto& [k, b] : by_kind) out << fmt::format("  {:<13} {}\n", k, gib(b));
    if (r == 0 && a.top > 0) {
      std::vector<const uf::model::TensorShard*> order;
      for (const auto& s : p.shards) order.push_back(&s);
      std::stable_sort(order.begin(), order.end(),
                       [](auto* x, auto* y) { return x->nbytes > y->nbytes; });
      order.resize(std::min<size_t>(order.size(), size_t(a.top)));
      out << fmt::format("  largest shards of rank 0:\n");
      for (const auto* s : order) {
        std::string how = uf::model::shard_mode_name(s->mode);
        if (s->mode == uf::model::ShardMode::kSplit)
          how = fmt::format("split dim {} [{}, {}), then {}", s->dim, s->begin, s->end,
                            uf::model::tp_collective_name(s->collective));
        out << fmt::format("    {:<44} {:>14} {} of {} ({})\n", s->name, gib(s->nbytes),
                           uf::core::shape_string(s->shape), uf::core::shape_string(s->full_shape),
                           how);
      }
    }
  }
  out << fmt::format("largest rank holds {}\n", gib(max_total));
  return 0;
}

void setup_tp_plan(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "tp-plan", "Dry run of the tensor-parallel sharding plan: per-rank bytes and largest shards");
  auto a = std::make_shared<TpPlanArgs>();
  cmd->add_option("model-dir", a->dir, "Checkpoint folder (its config files are read)");
  cmd->add_flag("--released", a->released, "Use the released DeepSeek-V4.1-Flash config");
  cmd->add_option("--tp", a->tp, "Tensor-parallel degree (1, 2, 4, 8)")->required();
  cmd->add_option("--top", a->top, "How many of rank 0's largest shards to list");
  cmd->add_flag("--split-wq-a", a->split_wq_a, "Split attn.wq_a by rows (all-gather after)");
  cmd->add_flag("--replicate-head", a->replicate_head, "Replicate head.weight");
  cmd->add_flag("--replicate-engram-tables", a->replicate_engram_tables,
                "Replicate the Engram tables (they are ~98 GB each in the released model)");
  cmd->add_flag("--replicate-engram-wkv", a->replicate_engram_wkv, "Replicate engram.wkv");
  cmd->add_flag("--replicate-index-heads", a->replicate_index_heads,
                "Replicate attn.indexer.wq_b / weights_proj (the CUDA backend's default: it "
                "splits the entries a rank scores instead)");
  cmd->callback([a, &exit_code] { exit_code = run_tp_plan(*a); });
}

UF_REGISTER_COMMAND("tp-plan", setup_tp_plan);

}  // namespace
