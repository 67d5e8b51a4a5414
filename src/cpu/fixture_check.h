#pragma once
// `ultrafast check-fixture`: the CPU backend against a golden fixture of the official reference
// (shared/fixtures/<set>/golden). Three kinds of checks, one line each with its figure and bound:
//  1. teacher-forced sublayers: every Engram, attention, indexer, MoE and mHC step is fed the
//     reference's recorded inputs and its output compared with the recorded output;
//  2. end to end: the generic check every backend runs (engine/fixture_e2e.h: prefill logits at
//     every stored position, every decode step, every DSpark round), here with the CPU's taps
//     reporting how its free-running top-k and hash selections match the recorded ones;
//  3. both index-key semantics at decode, teacher-forced and end to end (owner's keys, the
//     default, against reference_ownerkeys.safetensors; the reference's stale keys against
//     reference.safetensors);
// plus the top-k rule on the stored scores and the CED prefill shortcut's measured difference
// from the full prefill and from the reference (reported).

#include <filesystem>
#include <string>
#include <vector>

#include "model/golden.h"

namespace uf::cpu {

using model::CheckLine;      // model/golden.h
using model::FixtureReport;  // model/golden.h

struct FixtureCheckOptions {
  bool run_reference_keys = true;  // also the stale-key variant against reference.safetensors
  bool run_ced = true;             // measure the CED prefill shortcut
  double bound_margin = 1.5;       // e2e bounds = margin x the manifest's noise floor
};

FixtureReport check_fixture(const std::filesystem::path& fixture_dir,
                            const FixtureCheckOptions& opts = {});

}  // namespace uf::cpu
