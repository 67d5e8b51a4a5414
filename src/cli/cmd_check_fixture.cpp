// `ultrafast check-fixture [--backend cpu|cuda] <dir>`: a backend against a golden fixture of the
// official reference. Prints one line per check (figure and bound) and exits non-zero on a failure.
//  - cpu (default): the CPU reference backend's full check (cpu/fixture_check.h: teacher-forced
//    sublayers, end to end, both index-key semantics, CED);
//  - any other kind: the end-to-end checks through the engine::Backend interface only (prefill
//    logits at the stored positions, decode steps as decode_rows(1) + commit(1) against the
//    owner-keys reference, DSpark rounds fed the reference's anchors and drafts), with the same
//    bounds and line names as the CPU's end-to-end lines (model/golden.h).
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "cli/backend_factory.h"
#include "cli/command_registry.h"
#include "core/error.h"
#include "cpu/fixture_check.h"
#include "model/golden.h"

namespace {

namespace fs = std::filesystem;
using uf::model::Diff;
using uf::model::FixtureReport;
using uf::model::Golden;
using uf::model::LogitStats;

FixtureReport check_backend_e2e(const fs::path& dir, const std::string& kind, double margin,
                                int tp) {
  const auto t0 = std::chrono::steady_clock::now();
  FixtureReport rep;
  auto line = [&](std::string name, double v, double bound, bool pass, std::string detail = "") {
    rep.lines.push_back({std::move(name), v, bound, pass, false, std::move(detail)});
  };
  auto info = [&](std::string name, double v, std::string detail = "") {
    rep.lines.push_back({std::move(name), v, 0, true, true, std::move(detail)});
  };
  const fs::path gd = dir / "golden";
  Golden ref(gd / "reference.safetensors");
  Golden own(gd / "reference_ownerkeys.safetensors");
  const auto bounds = uf::model::e2e_bounds(uf::model::golden_agreement(gd), margin);

  const auto& prompt64 = ref.i64("prompt_ids");
  const auto& dec64 = ref.i64("decode_ids");
  const std::vector<int32_t> prompt(prompt64.begin(), prompt64.end());
  const std::vector<int32_t> dec_ids(dec64.begin(), dec64.end());
  const int S = int(prompt.size()), N = int(dec_ids.size());
  std::vector<int64_t> stored_pos;
  if (ref.has("prefill_positions"))
    stored_pos = ref.i64("prefill_positions");
  else
    for (int i = 0; i < S; ++i) stored_pos.push_back(i);
  const auto& ref_prefill_logits = ref.f32("prefill_logits");

  // The whole prompt as one span, as the reference (and the CPU check) prefill it.
  uf::cli::BackendChoice choice;
  choice.kind = kind;
  choice.max_chunk = S;
  choice.tp = tp;
  auto loaded = uf::cli::load_backend(dir, choice);
  auto& be = *loaded.backend;
  const auto& cfg = be.config();
  const int V = cfg.vocab_size;
  info(fmt::format("backend {}{}", be.name(), tp > 1 ? fmt::format(" tp {}", tp) : ""),
       double(be.max_rows()),
       fmt::format("max verify rows; profile {} draft tokens", loaded.profile.draft_tokens));

  auto s = be.new_session(S + N + 8);
  uf::engine::PrefillOptions po;
  po.all_logits = true;
  po.chunk = S;
  std::vector<float> logits(size_t(S) * size_t(V));
  be.prefill(*s, prompt, po, logits);
  LogitStats pl;
  for (size_t j = 0; j < stored_pos.size(); ++j)
    pl.add(logits.data() + stored_pos[j] * V, ref_prefill_logits.data() + int64_t(j) * V, V);
  const auto& pre_b = bounds.prefill;
  line("e2e prefill logits maxabs", pl.d.maxabs, pre_b.maxabs, pl.d.maxabs < pre_b.maxabs,
       pre_b.from);
  line("e2e prefill logits rms-rel", pl.d.rms_rel(), pre_b.rms, pl.d.rms_rel() < pre_b.rms,
       fmt::format("{} rows", pl.rows));
  line("e2e prefill argmax agreement", pl.argmax(), 0.85, pl.argmax() >= 0.85);

  // Owner keys (the default of every backend) against reference_ownerkeys.safetensors.
  const std::string vn = "owner keys";
  const auto& dec_bv = bounds.decode;
  const auto& ds_b = bounds.dspark;
  LogitStats dl, dsl, dsh;
  Diff bias, conf;
  size_t draft_agree = 0, draft_n = 0;
  const auto& rl = own.f32("decode_logits");
  const auto& anchors = own.i64("dspark_anchor");
  const auto& drafts = own.i64("dspark_draft_tokens");
  const auto& d_logits = own.f32("dspark_logits");
  const auto& d_head = own.f32("dspark_head_logits");
  const auto& d_bias = own.f32("dspark_markov_bias");
  const auto& d_conf = own.f32("dspark_confidence");
  const int R = int(anchors.size()), B = cfg.dspark_block_size;
  std::vector<float> lg(static_cast<size_t>(V));
  for (int r = 0; r < R; ++r) {
    if (r > 0) {
      const int k = r - 1;
      be.decode_rows(*s, std::span<const int32_t>(&dec_ids[size_t(k)], 1), lg);
      be.commit(*s, 1);
      dl.add(lg.data(), rl.data() + int64_t(k) * V, V);
    }
    if (B == 0 || cfg.n_mtp_layers == 0) continue;
    // Teacher-forced tokens: the reference's anchor, and its drafts feed the Markov chain.
    auto blk = be.draft(*s, int32_t(anchors[size_t(r)]), [&](int slot, std::span<const float> l) {
      const int32_t mine = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
      const int32_t theirs = int32_t(drafts[size_t(r * B + slot)]);
      ++draft_n;
      draft_agree += mine == theirs;
      return theirs;
    });
    for (int i = 0; i < B; ++i) {
      const int64_t off = (int64_t(r) * B + i) * V;
      std::vector<float> head(static_cast<size_t>(V));
      for (int v = 0; v < V; ++v)
        head[size_t(v)] = blk.logits[size_t(i) * V + v] - blk.markov_bias[size_t(i) * V + v];
      dsl.add(blk.logits.data() + int64_t(i) * V, d_logits.data() + off, V);
      dsh.add(head.data(), d_head.data() + off, V);
      bias.add(blk.markov_bias.data() + int64_t(i) * V, d_bias.data() + off, size_t(V));
    }
    conf.add(blk.confidence.data(), d_conf.data() + int64_t(r) * B, size_t(B));
  }
  line(fmt::format("e2e [{}] decode logits maxabs", vn), dl.d.maxabs, dec_bv.maxabs,
       dl.d.maxabs < dec_bv.maxabs, dec_bv.from);
  line(fmt::format("e2e [{}] decode logits rms-rel", vn), dl.d.rms_rel(), dec_bv.rms,
       dl.d.rms_rel() < dec_bv.rms, fmt::format("{} steps", dl.rows));
  info(fmt::format("e2e [{}] decode argmax agreement", vn), dl.argmax());
  if (dsl.rows) {
    line(fmt::format("e2e [{}] dspark logits maxabs", vn), dsl.d.maxabs, ds_b.maxabs,
         dsl.d.maxabs < ds_b.maxabs, ds_b.from);
    line(fmt::format("e2e [{}] dspark logits rms-rel", vn), dsl.d.rms_rel(), ds_b.rms,
         dsl.d.rms_rel() < ds_b.rms, fmt::format("{} slots", dsl.rows));
    line(fmt::format("e2e [{}] dspark head logits rms-rel", vn), dsh.d.rms_rel(), ds_b.rms,
         dsh.d.rms_rel() < ds_b.rms);
    // The Markov bias is a pure fp32 lookup-and-GEMV of the same token: only summation order
    // separates it from the reference.
    line(fmt::format("e2e [{}] markov bias maxabs", vn), bias.maxabs, 1e-4, bias.maxabs < 1e-4);
    line(fmt::format("e2e [{}] confidence logits maxabs", vn), conf.maxabs, ds_b.maxabs,
         conf.maxabs < ds_b.maxabs, fmt::format("rms-rel {:.3g}", conf.rms_rel()));
    info(fmt::format("e2e [{}] draft token agreement", vn),
         double(draft_agree) / double(std::max<size_t>(draft_n, 1)),
         fmt::format("{}/{} slots", draft_agree, draft_n));
  }
  // The CED prefill shortcut's measured difference (reported, as on the CPU).
  try {
    auto cs = be.new_session(S + N + 8);
    uf::engine::PrefillOptions co;
    co.ced_shortcut = true;
    std::vector<float> cl(static_cast<size_t>(V));
    be.prefill(*cs, prompt, co, cl);
    LogitStats c;
    c.add(cl.data(), logits.data() + int64_t(S - 1) * V, V);
    info("ced shortcut vs full prefill, last logits", c.d.rms_rel(),
         fmt::format("rms-rel; maxabs {:.3g}, argmax {}", c.d.maxabs,
                     c.agree ? "same" : "different"));
  } catch (const std::exception& e) {
    info("ced shortcut vs full prefill, last logits", 0, fmt::format("not run: {}", e.what()));
  }
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

void setup_check_fixture(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "check-fixture", "Check a backend against a golden fixture (shared/fixtures/<set>)");
  auto dir = std::make_shared<std::string>();
  auto backend = std::make_shared<std::string>("cpu");
  auto opts = std::make_shared<uf::cpu::FixtureCheckOptions>();
  cmd->add_option("fixture_dir", *dir, "Fixture folder (config, checkpoint, golden/)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--backend", *backend,
                  "cpu: the full CPU check; cuda: the end-to-end checks through the backend")
      ->capture_default_str();
  auto e2e_only = std::make_shared<bool>(false);
  cmd->add_flag("--e2e-only", *e2e_only,
                "Only the end-to-end checks through the Backend interface (what every non-CPU "
                "backend runs), also for the CPU");
  cmd->add_flag("!--no-reference-keys", opts->run_reference_keys,
                "Skip the reference's stale-index-key variant (checked by default; CPU only)");
  cmd->add_flag("!--no-ced", opts->run_ced, "Skip measuring the CED prefill shortcut (CPU only)");
  auto tp = std::make_shared<int>(1);
  cmd->add_option("--tp", *tp, "Tensor-parallel GPUs for --backend cuda (devices 0..N-1)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--bound-margin", opts->bound_margin,
                  "End-to-end bounds = this margin x the manifest's worst faithful run")
      ->capture_default_str();
  cmd->callback([dir, backend, opts, e2e_only, tp, &exit_code] {
    UF_CHECK(*tp == 1 || *backend == "cuda", "--tp {} needs --backend cuda", *tp);
    const auto rep = *backend == "cpu" && !*e2e_only
                         ? uf::cpu::check_fixture(*dir, *opts)
                         : check_backend_e2e(*dir, *backend, opts->bound_margin, *tp);
    std::fputs(rep.format().c_str(), stdout);
    std::fputs(
        fmt::format("{} in {:.1f} s\n", rep.ok() ? "ALL PASS" : "FAILED", rep.seconds).c_str(),
        stdout);
    exit_code = rep.ok() ? 0 : 1;
  });
}

}  // namespace

UF_REGISTER_COMMAND("check-fixture", setup_check_fixture);
