// The in-process session directory (single server, no Redis): same semantics as the Redis one.

#include <gtest/gtest.h>

#include "directory_checks.h"
#include "kv/session_directory.h"

namespace uf::kv {
namespace {

using namespace std::chrono_literals;
using namespace uf::kv::testing;

TEST(InProcessDirectory, LookupClaimCheck) {
  auto dir = make_in_process_directory();
  expect_lookup_claim_check(*dir);
  EXPECT_NE(session_key("session-a"), session_key("session-b"));
  EXPECT_EQ(session_key("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");  // FIPS 180-2
}

TEST(InProcessDirectory, ConcurrentClaimersOneWins) {
  auto dir = make_in_process_directory();
  expect_one_winner(*dir, *dir, 50);
}

TEST(InProcessDirectory, TtlExpiryAndCallbacks) {
  auto dir = make_in_process_directory({std::chrono::milliseconds(400)});
  ChangeLog log;
  dir->set_change_callback(log.callback());
  DirectoryResult r = dir->lookup("s");
  ASSERT_TRUE(dir->claim("s", {r.version.epoch, 0, "me", "here"}).status.is_ok());
  OwnershipChange got;
  EXPECT_TRUE(log.wait_for([](const auto& c) { return c.version.seq == 1; }, 10ms, &got));
  EXPECT_EQ(got.key, session_key("s"));
  for (int i = 0; i < 3; ++i) {  // accesses keep it alive past one TTL
    std::this_thread::sleep_for(150ms);
    EXPECT_TRUE(dir->lookup("s").status.is_ok()) << "access " << i;
  }
  std::this_thread::sleep_for(800ms);
  EXPECT_EQ(dir->lookup("s").status.code(), StatusCode::kNotFound);
  EXPECT_EQ(dir->claim("s", {r.version.epoch, 1, "me", "here"}).status.code(), StatusCode::kStale);
  EXPECT_TRUE(uuid_looks_valid(random_uuid())) << random_uuid();
  EXPECT_NE(random_uuid(), random_uuid());
}

}  // namespace
}  // namespace uf::kv
