// The Redis session directory against a real redis-server child process on a free loopback port
// (no persistence, temp dir): claims, races, TTL, FLUSHALL, crash and restart, pub/sub.

#include <gtest/gtest.h>

#include "directory_checks.h"
#include "kv/session_directory.h"
#include "test_support.h"

namespace uf::kv {
namespace {

using namespace std::chrono_literals;
using namespace uf::kv::testing;

class RedisDirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_program("redis-server"))
      GTEST_SKIP() << "redis-server is not installed (Debian package redis-server)";
    ASSERT_GT(server_.port(), 0);
    ASSERT_TRUE(server_.start()) << "redis-server did not start on port " << server_.port();
  }

  RedisDirectoryConfig config(bool subscribe = false) {
    RedisDirectoryConfig c;
    c.port = server_.port();
    c.subscribe = subscribe;
    c.backoff_initial = 20ms;
    c.backoff_max = 200ms;
    return c;
  }

  RedisServer server_;
};

TEST_F(RedisDirectoryTest, LookupClaimCheck) {
  auto dir = make_redis_directory(config());
  expect_lookup_claim_check(*dir);
  EXPECT_EQ(dir->stats().failures, 0u);
  EXPECT_GE(dir->stats().script_loads, 3u);  // each script loaded once after NOSCRIPT
}

TEST_F(RedisDirectoryTest, ConcurrentClaimersOneWins) {
  auto a = make_redis_directory(config());
  auto b = make_redis_directory(config());
  expect_one_winner(*a, *b, 50);
}

TEST_F(RedisDirectoryTest, TtlExpiry) {
  auto cfg = config();
  cfg.ttl = 600ms;  // margins generous enough for a loaded CI machine
  auto dir = make_redis_directory(cfg);
  DirectoryResult r = dir->lookup("s");
  ASSERT_TRUE(dir->claim("s", {r.version.epoch, 0, "me", "here"}).status.is_ok());
  for (int i = 0; i < 4; ++i) {  // 4 x 250 ms > TTL: only the refreshes keep it alive
    std::this_thread::sleep_for(250ms);
    EXPECT_TRUE(dir->check("s", r.version.epoch, 1).status.is_ok()) << "access " << i;
  }
  std::this_thread::sleep_for(1200ms);
  DirectoryResult gone = dir->lookup("s");
  EXPECT_EQ(gone.status.code(), StatusCode::kNotFound);
  EXPECT_EQ(gone.version.epoch, r.version.epoch);  // expiry is not a restart
  EXPECT_EQ(dir->claim("s", {r.version.epoch, 1, "me", "here"}).status.code(), StatusCode::kStale);
}

TEST_F(RedisDirectoryTest, FlushallStartsANewEpoch) {
  auto dir = make_redis_directory(config());
  DirectoryResult r = dir->lookup("s");
  ASSERT_TRUE(dir->claim("s", {r.version.epoch, 0, "me", "here"}).status.is_ok());
  ASSERT_EQ(server_.cli("FLUSHALL"), 0);
  DirectoryResult after = dir->lookup("s");
  EXPECT_EQ(after.status.code(), StatusCode::kNotFound);
  EXPECT_NE(after.version.epoch, r.version.epoch);
  EXPECT_FALSE(after.version.epoch.empty());
  EXPECT_EQ(dir->check("s", r.version.epoch, 1).status.code(), StatusCode::kStale);
  EXPECT_EQ(dir->claim("s", {r.version.epoch, 1, "me", "here"}).status.message(), kStaleMessage);
  // The new epoch works as usual.
  EXPECT_TRUE(dir->claim("s", {after.version.epoch, 0, "me", "here"}).status.is_ok());
  // A stale hash left from an old epoch (epoch key lost alone) is void as well.
  ASSERT_EQ(server_.cli("DEL uf:kv:epoch"), 0);
  DirectoryResult third = dir->lookup("s");
  EXPECT_EQ(third.status.code(), StatusCode::kNotFound);
  EXPECT_NE(third.version.epoch, after.version.epoch);
}

TEST_F(RedisDirectoryTest, RedisKilledFailsFastThenReconnects) {
  auto cfg = config(/*subscribe=*/true);
  auto dir = make_redis_directory(cfg);
  ChangeLog log;
  dir->set_change_callback(log.callback());
  ASSERT_TRUE(log.wait_for([](const auto& c) { return c.resync; }, 5s));
  DirectoryResult r = dir->lookup("s");
  ASSERT_TRUE(dir->claim("s", {r.version.epoch, 0, "me", "here"}).status.is_ok());

  server_.stop();  // SIGKILL: a crash
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) {
    DirectoryResult f = dir->lookup("s");
    EXPECT_EQ(f.status.code(), StatusCode::kUnavailable);
    EXPECT_NE(f.status.message().find("Redis at 127.0.0.1:"), std::string::npos)
        << f.status.message();
  }
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, 1s) << "20 calls against a dead Redis must fail fast";
  EXPECT_GE(dir->stats().failures, 20u);

  ASSERT_TRUE(server_.start());
  DirectoryResult back;
  auto deadline = std::chrono::steady_clock::now() + 5s;
  do {
    back = dir->lookup("s");
    if (back.status.code() != StatusCode::kUnavailable) break;
    std::this_thread::sleep_for(20ms);
  } while (std::chrono::steady_clock::now() < deadline);
  ASSERT_NE(back.status.code(), StatusCode::kUnavailable) << back.status.to_string();
  EXPECT_EQ(back.status.code(), StatusCode::kNotFound);  // no persistence: all is gone
  EXPECT_NE(back.version.epoch, r.version.epoch);        // and the old version is void
  EXPECT_EQ(dir->check("s", r.version.epoch, 1).status.code(), StatusCode::kStale);
  EXPECT_GE(dir->stats().reconnects, 1u);
  // The subscriber re-subscribed as well.
  EXPECT_TRUE(log.wait_resyncs(2, 5s));
}

TEST_F(RedisDirectoryTest, ClaimsArePublishedToOtherServers) {
  auto watcher = make_redis_directory(config(/*subscribe=*/true));
  ChangeLog log;
  watcher->set_change_callback(log.callback());
  ASSERT_TRUE(log.wait_for([](const auto& c) { return c.resync; }, 5s)) << "never subscribed";

  auto claimer = make_redis_directory(config());
  DirectoryResult r = claimer->lookup("shared-session");
  ASSERT_TRUE(claimer->claim("shared-session", {r.version.epoch, 0, "srv-9", "10.1.1.1:9000"})
                  .status.is_ok());
  OwnershipChange got;
  ASSERT_TRUE(log.wait_for([](const auto& c) { return !c.resync; }, 5s, &got));
  EXPECT_EQ(got.key, session_key("shared-session"));
  EXPECT_EQ(got.version.epoch, r.version.epoch);
  EXPECT_EQ(got.version.seq, 1u);
  EXPECT_EQ(got.version.owner, "srv-9");
  EXPECT_EQ(got.version.address, "10.1.1.1:9000");
  EXPECT_EQ(watcher->stats().notifications, 1u);
  // A stale claim publishes nothing.
  EXPECT_EQ(claimer->claim("shared-session", {r.version.epoch, 0, "x", "y"}).status.code(),
            StatusCode::kStale);
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(watcher->stats().notifications, 1u);
}

}  // namespace
}  // namespace uf::kv
