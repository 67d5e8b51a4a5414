// check-fixture on tiny-a: every check must pass (medium-a: test_fixture_medium.cpp, label slow),
// and the end-to-end figures must stay at the level the CPU backend reaches since it sums the
// mHC mixes and the RMS statistics in the reference's orders (cpu/mhc.cpp, cpu/norm.h).
#include <gtest/gtest.h>

#include <string>

#include "cpu/fixture_check.h"

namespace uf::cpu {
namespace {

const std::filesystem::path kFixtures = std::filesystem::path(UF_SHARED_DIR) / "fixtures";

const CheckLine* find_line(const FixtureReport& rep, const std::string& name) {
  for (const auto& l : rep.lines)
    if (l.name == name) return &l;
  return nullptr;
}

TEST(CpuFixture, TinyAPassesEveryCheck) {
  const auto rep = check_fixture(kFixtures / "tiny-a");
  EXPECT_TRUE(rep.ok()) << rep.format();
  EXPECT_GT(rep.lines.size(), 40u);

  // About 3x the figures measured when the mixes / norm orders were matched (2026-11-30; before,
  // rms-rel: prefill 0.0249, decode 0.0354, DSpark 0.0134; 6/9 decode argmaxes). The CPU backend is
  // deterministic, so these only move when some rounding stops following the reference: with
  // the reference's FP8 re-quantisation, one flipped bf16 rounding anywhere puts the logits at
  // the ~1e-2 noise floor (fixture README section 5), far above every bound here.
  // Prefill, owner-key decode and owner-key DSpark are bitwise the reference but for the head's
  // fp32 sums; with the reference's stale keys, decode (and the DSpark rounds after it) keep a
  // few 1-ulp flips (the reference's one-row F.linear order for the decode mixes is not
  // reproduced, see cpu/mhc.cpp).
  const struct {
    const char* name;
    double bound;  // measured value in the comment
  } kBounds[] = {
      {"e2e prefill logits rms-rel", 4e-7},                    // 1.2e-7
      {"e2e prefill logits maxabs", 4e-6},                     // 1.2e-6
      {"e2e [owner keys] decode logits rms-rel", 2.5e-7},      // 7.9e-8
      {"e2e [owner keys] decode logits maxabs", 1.5e-6},       // 4.8e-7
      {"e2e [owner keys] dspark logits rms-rel", 2.5e-7},      // 7.7e-8
      {"e2e [owner keys] dspark logits maxabs", 1.5e-6},       // 4.8e-7
      {"e2e [reference keys] decode logits rms-rel", 0.0051},  // 0.0017
      {"e2e [reference keys] decode logits maxabs", 0.04},     // 0.0135
      {"e2e [reference keys] dspark logits rms-rel", 0.011},   // 0.0036
      {"e2e [reference keys] dspark logits maxabs", 0.1},      // 0.033
  };
  for (const auto& b : kBounds) {
    const CheckLine* l = find_line(rep, b.name);
    ASSERT_NE(l, nullptr) << "check-fixture has no line '" << b.name << "'\n" << rep.format();
    EXPECT_LE(l->value, b.bound) << b.name;
  }
  // Every argmax and draft token agrees with the golden.
  for (const char* name :
       {"e2e prefill argmax agreement", "e2e [owner keys] decode argmax agreement",
        "e2e [owner keys] draft token agreement", "e2e [reference keys] decode argmax agreement",
        "e2e [reference keys] draft token agreement"}) {
    const CheckLine* l = find_line(rep, name);
    ASSERT_NE(l, nullptr) << "check-fixture has no line '" << name << "'\n" << rep.format();
    EXPECT_EQ(l->value, 1.0) << name;
  }
}

}  // namespace
}  // namespace uf::cpu
