// engine::check_e2e / check_ced (engine/fixture_e2e.h), the end-to-end fixture check every backend
// runs, through the CPU backend on tiny-a: the lines scripts and docs grep, with their bounds
// passing; a backend whose decode is off fails exactly those lines; later variants start from the
// prefilled state; the observer sees the steps in order.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "engine/fixture_e2e.h"

namespace uf::engine {
namespace {

namespace fs = std::filesystem;
const fs::path kTiny = fs::path(UF_SHARED_DIR) / "fixtures" / "tiny-a";

std::unique_ptr<cpu::CpuBackend> tiny_backend(const GoldenFixture& fx) {
  return std::make_unique<cpu::CpuBackend>(kTiny, fx.ref.i64("engram_token_map"));
}

std::vector<std::string> names(const model::FixtureReport& rep) {
  std::vector<std::string> v;
  for (const auto& l : rep.lines) v.push_back(l.name);
  return v;
}

const model::CheckLine& find(const model::FixtureReport& rep, const std::string& name) {
  for (const auto& l : rep.lines)
    if (l.name == name) return l;
  throw std::runtime_error("no line " + name);
}

// A backend whose decode logits are off: `shift` added to token 0's logit of every decode row.
class ShiftedDecode final : public Backend {
 public:
  ShiftedDecode(Backend& inner, float shift) : b_(inner), shift_(shift) {}
  const model::ModelConfig& config() const override { return b_.config(); }
  std::string name() const override { return "shifted"; }
  int max_rows() const override { return b_.max_rows(); }
  std::unique_ptr<SessionState> new_session(int64_t n) override { return b_.new_session(n); }
  void prefill(SessionState& s, std::span<const int32_t> t, const PrefillOptions& o,
               std::span<float> l) override {
    b_.prefill(s, t, o, l);
  }
  void decode_rows(SessionState& s, std::span<const int32_t> t, std::span<float> l) override {
    b_.decode_rows(s, t, l);
    for (size_t r = 0; r < t.size(); ++r) l[r * size_t(config().vocab_size)] += shift_;
  }
  void commit(SessionState& s, int n) override { b_.commit(s, n); }
  DraftBlock draft(SessionState& s, int32_t a, const DraftSampler& f) override {
    return b_.draft(s, a, f);
  }
  std::vector<uint8_t> snapshot(const SessionState& s) const override { return b_.snapshot(s); }
  void restore(SessionState& s, std::span<const uint8_t> b) const override { b_.restore(s, b); }

 private:
  Backend& b_;
  float shift_;
};

TEST(FixtureE2e, CpuBackendPassesWithTheGreppedLineNames) {
  const GoldenFixture fx(kTiny);
  auto be = tiny_backend(fx);
  model::FixtureReport rep;
  const auto last = check_e2e(*be, fx, {}, rep);
  check_ced(*be, fx, last, /*against_reference=*/false, rep);
  EXPECT_TRUE(rep.ok()) << rep.format();
  const std::vector<std::string> want = {
      "e2e prefill logits maxabs",
      "e2e prefill logits rms-rel",
      "e2e prefill argmax agreement",
      "e2e [owner keys] decode logits maxabs",
      "e2e [owner keys] decode logits rms-rel",
      "e2e [owner keys] decode argmax agreement",
      "e2e [owner keys] dspark logits maxabs",
      "e2e [owner keys] dspark logits rms-rel",
      "e2e [owner keys] dspark head logits rms-rel",
      "e2e [owner keys] markov bias maxabs",
      "e2e [owner keys] confidence logits maxabs",
      "e2e [owner keys] draft token agreement",
      "ced shortcut vs full prefill, last logits",
  };
  EXPECT_EQ(names(rep), want) << rep.format();
  // The bounds come from the manifest (tiny-a has agreement figures), not the fallbacks.
  EXPECT_NE(find(rep, "e2e prefill logits maxabs").detail.find("noise floor"), std::string::npos);
  EXPECT_EQ(find(rep, "e2e [owner keys] markov bias maxabs").bound, 1e-4);
  EXPECT_EQ(find(rep, "e2e prefill argmax agreement").bound, 0.85);
  ASSERT_EQ(last.size(), size_t(be->config().vocab_size));
}

TEST(FixtureE2e, WrongDecodeFailsItsLinesOnly) {
  const GoldenFixture fx(kTiny);
  auto be = tiny_backend(fx);
  // 100 logits off on one token: far over tiny-a's decode maxabs bound (about 0.6).
  ShiftedDecode wrong(*be, 100.f);
  model::FixtureReport rep;
  check_e2e(wrong, fx, {}, rep);
  EXPECT_FALSE(rep.ok());
  EXPECT_FALSE(find(rep, "e2e [owner keys] decode logits maxabs").pass) << rep.format();
  EXPECT_TRUE(find(rep, "e2e prefill logits maxabs").pass) << rep.format();
  EXPECT_TRUE(find(rep, "e2e [owner keys] dspark logits maxabs").pass) << rep.format();
}

// Records the observer calls; switches the CPU model's index keys per variant name.
class Recorder final : public E2eObserver {
 public:
  explicit Recorder(cpu::CpuBackend& be) : be_(be) {}
  std::vector<std::string> events;
  void begin_prefill() override { events.push_back("prefill"); }
  void end_prefill(model::FixtureReport& rep) override {
    events.push_back("end prefill after " + rep.lines.back().name);
  }
  void begin_variant(const E2eVariant& v) override {
    events.push_back("variant " + v.name);
    be_.model().set_index_keys(v.name == "reference keys" ? cpu::IndexKeys::kReference
                                                          : cpu::IndexKeys::kOwner);
  }
  void begin_decode_step(int k) override { events.push_back("step " + std::to_string(k)); }
  void end_variant(const E2eVariant& v, model::FixtureReport& rep) override {
    events.push_back("end " + v.name + " after " + rep.lines.back().name);
  }

 private:
  cpu::CpuBackend& be_;
};

TEST(FixtureE2e, VariantsStartFromThePrefilledStateInOrder) {
  const GoldenFixture fx(kTiny);
  auto be = tiny_backend(fx);
  Recorder obs(*be);
  E2eOptions o;
  o.observer = &obs;
  // The same variant twice: the second must start from the snapshot of the prefilled session, not
  // from where the first one's decode left it, so its figures must be bit-identical.
  o.variants = {
      {"owner keys", &fx.own}, {"owner keys again", &fx.own}, {"reference keys", &fx.ref}};
  model::FixtureReport rep;
  check_e2e(*be, fx, o, rep);
  EXPECT_TRUE(rep.ok()) << rep.format();
  for (const char* what : {"decode logits maxabs", "decode logits rms-rel", "dspark logits rms-rel",
                           "confidence logits maxabs"}) {
    const auto& a = find(rep, fmt::format("e2e [owner keys] {}", what));
    const auto& b = find(rep, fmt::format("e2e [owner keys again] {}", what));
    EXPECT_EQ(a.value, b.value) << what;
  }
  const int N = int(fx.decode_ids.size());
  std::vector<std::string> want = {"prefill", "end prefill after e2e prefill argmax agreement"};
  for (const std::string v : {"owner keys", "owner keys again", "reference keys"}) {
    want.push_back("variant " + v);
    for (int k = 0; k < N; ++k) want.push_back("step " + std::to_string(k));
    want.push_back("end " + v + " after e2e [" + v + "] draft token agreement");
  }
  EXPECT_EQ(obs.events, want);
}

TEST(FixtureE2e, CedAgainstReferenceAddsItsLines) {
  const GoldenFixture fx(kTiny);
  auto be = tiny_backend(fx);
  model::FixtureReport rep;
  const auto last = check_e2e(*be, fx, {}, rep);
  const size_t n0 = rep.lines.size();
  check_ced(*be, fx, last, /*against_reference=*/true, rep);
  ASSERT_EQ(rep.lines.size(), n0 + 3);
  EXPECT_EQ(rep.lines[n0].name, "ced shortcut vs full prefill, last logits");
  EXPECT_EQ(rep.lines[n0 + 1].name, "ced shortcut vs reference, last logits");
  EXPECT_EQ(rep.lines[n0 + 2].name, "ced shortcut then decode vs reference");
  for (size_t i = n0; i < rep.lines.size(); ++i) EXPECT_TRUE(rep.lines[i].informational);
  // The shortcut is an approximation, but on tiny-a's short prompt it stays close to the full
  // prefill (measured 0.007 rms-rel; 0.1 flags a broken shortcut, not noise).
  EXPECT_LT(rep.lines[n0].value, 0.1);
}

}  // namespace
}  // namespace uf::engine
