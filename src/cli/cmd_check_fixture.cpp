// `ultrafast check-fixture <dir>`: the CPU reference backend against a golden fixture of the
// official reference. Prints one line per check (figure and bound) and exits non-zero on a failure.
#include <fmt/format.h>

#include <cstdio>
#include <string>

#include "cli/command_registry.h"
#include "cpu/fixture_check.h"

namespace {

void setup_check_fixture(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "check-fixture", "Check the CPU backend against a golden fixture (shared/fixtures/<set>)");
  auto dir = std::make_shared<std::string>();
  auto opts = std::make_shared<uf::cpu::FixtureCheckOptions>();
  cmd->add_option("fixture_dir", *dir, "Fixture folder (config, checkpoint, golden/)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_flag("!--no-reference-keys", opts->run_reference_keys,
                "Skip the reference's stale-index-key variant (checked by default)");
  cmd->add_flag("!--no-ced", opts->run_ced, "Skip measuring the CED prefill shortcut");
  cmd->add_option("--bound-margin", opts->bound_margin,
                  "End-to-end bounds = this margin x the manifest's worst faithful run")
      ->capture_default_str();
  cmd->callback([dir, opts, &exit_code] {
    const auto rep = uf::cpu::check_fixture(*dir, *opts);
    std::fputs(rep.format().c_str(), stdout);
    std::fputs(
        fmt::format("{} in {:.1f} s\n", rep.ok() ? "ALL PASS" : "FAILED", rep.seconds).c_str(),
        stdout);
    exit_code = rep.ok() ? 0 : 1;
  });
}

}  // namespace

UF_REGISTER_COMMAND("check-fixture", setup_check_fixture);
