// `ultrafast check-fixture [--backend cpu|cuda] <dir>`: a backend against a golden fixture of the
// official reference. Prints one line per check (figure and bound) and exits non-zero on a failure.
//  - cpu (default): the CPU reference backend's full check (cpu/fixture_check.h: teacher-forced
//    sublayers, end to end, both index-key semantics, CED);
//  - any other kind, or --e2e-only: the end-to-end check through the engine::Backend interface
//    that the CPU's end-to-end lines come from too (engine/fixture_e2e.h: prefill logits at the
//    stored positions, decode steps as decode_rows(1) + commit(1) against the owner-keys
//    reference, DSpark rounds fed the reference's anchors and drafts), same bounds and names.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "cli/backend_factory.h"
#include "cli/command_registry.h"
#include "core/error.h"
#include "cpu/fixture_check.h"
#include "engine/fixture_e2e.h"
#include "model/golden.h"

namespace {

namespace fs = std::filesystem;
using uf::model::FixtureReport;

FixtureReport check_backend_e2e(const fs::path& dir, const std::string& kind, double margin,
                                int tp) {
  const auto t0 = std::chrono::steady_clock::now();
  FixtureReport rep;
  auto info = [&](std::string name, double v, std::string detail) {
    rep.lines.push_back({std::move(name), v, 0, true, true, std::move(detail)});
  };
  const uf::engine::GoldenFixture fx(dir);

  // The whole prompt as one span, as the reference (and the CPU check) prefill it.
  uf::cli::BackendChoice choice;
  choice.kind = kind;
  choice.max_chunk = int(fx.prompt.size());
  choice.tp = tp;
  auto loaded = uf::cli::load_backend(dir, choice);
  auto& be = *loaded.backend;
  info(fmt::format("backend {}{}", be.name(), tp > 1 ? fmt::format(" tp {}", tp) : ""),
       double(be.max_rows()),
       fmt::format("max verify rows; profile {} draft tokens", loaded.profile.draft_tokens));

  uf::engine::E2eOptions opts;
  opts.bound_margin = margin;
  const auto last_logits = uf::engine::check_e2e(be, fx, opts, rep);
  // The CED prefill shortcut's measured difference (reported, as on the CPU); a backend without
  // it says why.
  try {
    uf::engine::check_ced(be, fx, last_logits, /*against_reference=*/false, rep);
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
