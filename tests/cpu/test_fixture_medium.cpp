// check-fixture on medium-a (real per-head dimensions, a 1301-token prompt). Label `slow`; with
// UF_SLOW_REDUCED=1 (CI) it skips the reference-key variant and the CED measurement.
#include <gtest/gtest.h>

#include <cstdlib>

#include "cpu/fixture_check.h"

namespace uf::cpu {
namespace {

TEST(CpuFixture, MediumAPassesEveryCheck) {
  FixtureCheckOptions o;
  if (std::getenv("UF_SLOW_REDUCED")) {
    o.run_ced = false;
    o.run_reference_keys = false;
  }
  const auto rep = check_fixture(std::filesystem::path(UF_SHARED_DIR) / "fixtures" / "medium-a", o);
  EXPECT_TRUE(rep.ok()) << rep.format();
}

}  // namespace
}  // namespace uf::cpu
