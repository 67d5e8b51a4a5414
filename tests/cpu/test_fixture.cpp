// check-fixture on tiny-a: every check must pass (medium-a: test_fixture_medium.cpp, label slow).
#include <gtest/gtest.h>

#include "cpu/fixture_check.h"

namespace uf::cpu {
namespace {

const std::filesystem::path kFixtures = std::filesystem::path(UF_SHARED_DIR) / "fixtures";

TEST(CpuFixture, TinyAPassesEveryCheck) {
  const auto rep = check_fixture(kFixtures / "tiny-a");
  EXPECT_TRUE(rep.ok()) << rep.format();
  EXPECT_GT(rep.lines.size(), 40u);
}

}  // namespace
}  // namespace uf::cpu
