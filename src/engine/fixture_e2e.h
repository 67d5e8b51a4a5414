#pragma once
// The end-to-end check of a backend against a golden fixture of the official reference
// (shared/fixtures/<set>/golden), through the engine::Backend interface only, so every backend
// runs the same check with the same bounds and line names: the CPU's full check
// (cpu/fixture_check.h) for its end-to-end lines, `ultrafast check-fixture --backend <kind>` for
// the others. It covers:
//  - prefill logits at the stored positions (the whole prompt as one span, as the reference);
//  - decode steps as decode_rows(1) + commit(1), per index-key variant;
//  - DSpark rounds fed the reference's anchors and drafts;
//  - the CED prefill shortcut's measured difference from the full prefill (check_ced).
// Golden readers, figures and bounds: model/golden.h.

#include <filesystem>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "model/golden.h"

namespace uf::engine {

// A fixture's golden files and the token streams every check feeds.
struct GoldenFixture {
  explicit GoldenFixture(const std::filesystem::path& fixture_dir);

  model::Golden ref;         // reference.safetensors: the official reference (stale index keys)
  model::Golden own;         // reference_ownerkeys.safetensors: its owner-keys variant
  nlohmann::json agreement;  // the manifest's "agreement" figures (empty object if none)
  std::vector<int32_t> prompt, decode_ids;
  std::vector<int64_t> stored_pos;  // prompt position of each stored prefill row
};

// One decode variant: its tag in the line names ("owner keys") and the golden file it is compared
// with. How the backend switches to it is the observer's business (begin_variant).
struct E2eVariant {
  std::string name;
  const model::Golden* golden = nullptr;
};

// Backend-specific additions around the generic steps (the CPU's taps on every sublayer, its
// index-key switch). Lines appended in end_* come right after the step's own lines.
class E2eObserver {
 public:
  virtual ~E2eObserver() = default;
  virtual void begin_prefill() {}
  virtual void end_prefill(model::FixtureReport&) {}
  virtual void begin_variant(const E2eVariant&) {}
  virtual void begin_decode_step(int /*k*/) {}
  virtual void end_variant(const E2eVariant&, model::FixtureReport&) {}
};

struct E2eOptions {
  double bound_margin = 1.5;         // bounds = margin x the manifest's worst faithful run
  std::vector<E2eVariant> variants;  // empty: owner keys against reference_ownerkeys
  E2eObserver* observer = nullptr;
};

// Appends the end-to-end lines to `rep`. Returns the full prefill's logits of the last prompt
// position (check_ced compares with them). Variants after the first continue from a snapshot of
// the prefilled session (Backend::snapshot / restore).
std::vector<float> check_e2e(Backend& be, const GoldenFixture& fx, const E2eOptions& opts,
                             model::FixtureReport& rep);

// The CED prefill shortcut against the full prefill's last logits (informational). With
// `against_reference` also against the reference's last prefill logits and, decoding on from the
// shortcut's state, against its owner-keys decode logits. Throws if the backend cannot run it;
// appends nothing then.
void check_ced(Backend& be, const GoldenFixture& fx, std::span<const float> full_last_logits,
               bool against_reference, model::FixtureReport& rep);

}  // namespace uf::engine
