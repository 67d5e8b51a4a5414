// The sharing flow between two servers (each: a Redis directory client + a UCX node) against a
// real redis-server: new session, hand-over by fetch + claim, the old owner dropping its copy on
// the notification, and a failed fetch falling back to a plain claim.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

#include "kv/session_sharing.h"
#include "test_support.h"

namespace uf::kv {
namespace {

using namespace std::chrono_literals;
using namespace uf::kv::testing;

struct Server {
  std::unique_ptr<SessionDirectory> dir;
  std::unique_ptr<UcxNode> node;
  std::unique_ptr<SessionSharing> sharing;
  std::mutex mu;
  std::vector<std::string> dropped;
};

class SessionSharingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_program("redis-server")) GTEST_SKIP() << "redis-server is not installed";
    ASSERT_TRUE(redis_.start());
    try {
      make(a_, "srv-a");
      make(b_, "srv-b");
    } catch (const std::exception& e) {
      GTEST_SKIP() << "UCX cannot start in this environment: " << e.what();
    }
    // Subscribers connect asynchronously: probe until each server hears the other's claims.
    ASSERT_TRUE(hears(b_, a_)) << "srv-a never received notifications";
    ASSERT_TRUE(hears(a_, b_)) << "srv-b never received notifications";
  }

  // Claims probe sessions through `from` until `to` is notified; then forgets the probes.
  static bool hears(Server& from, Server& to) {
    for (int i = 0; i < 100; ++i) {
      std::string id = "probe-" + std::to_string(i);
      DirectoryResult r = from.dir->lookup(id);
      from.dir->claim(id, {r.version.epoch, r.version.seq, "prober", ""});
      std::this_thread::sleep_for(20ms);
      std::lock_guard lock(to.mu);
      if (!to.dropped.empty()) {
        to.dropped.clear();
        return true;
      }
    }
    return false;
  }

  void make(Server& s, const std::string& id) {
    RedisDirectoryConfig rc;
    rc.port = redis_.port();
    s.dir = make_redis_directory(rc);
    s.node = std::make_unique<UcxNode>();
    SessionSharingConfig sc;
    sc.server_id = id;
    sc.fingerprint = "fp-1";
    sc.fetch.timeout = 5s;
    s.sharing = std::make_unique<SessionSharing>(*s.dir, *s.node, sc);
    s.sharing->set_drop_local([&s](const std::string& key) {
      std::lock_guard lock(s.mu);
      s.dropped.push_back(key);
    });
  }

  static bool wait_dropped(Server& s, const std::string& key) {
    for (int i = 0; i < 250; ++i) {
      {
        std::lock_guard lock(s.mu);
        if (std::find(s.dropped.begin(), s.dropped.end(), key) != s.dropped.end()) return true;
      }
      std::this_thread::sleep_for(20ms);
    }
    return false;
  }

  RedisServer redis_;
  Server a_, b_;
};

TEST_F(SessionSharingTest, HandOverBetweenServers) {
  std::vector<int32_t> turn1 = {1, 2, 3, 4, 5, 6};
  Acquired first = a_.sharing->acquire("conv-1", turn1);
  ASSERT_TRUE(first.status.is_ok()) << first.status.to_string();
  EXPECT_EQ(first.source, Acquired::Source::kNone);
  EXPECT_EQ(first.version.seq, 1u);
  EXPECT_EQ(first.version.owner, "srv-a");

  std::vector<uint8_t> kv(300000);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<uint8_t>(i * 31);
  ASSERT_TRUE(a_.sharing->publish("conv-1", first.version, turn1, kv).is_ok());

  // Same server, next turn, its copy is current: nothing to do.
  Acquired again = a_.sharing->acquire("conv-1", turn1, first.version.epoch, 1);
  EXPECT_TRUE(again.status.is_ok());
  EXPECT_EQ(again.source, Acquired::Source::kLocal);

  // The next turn lands on server B: it fetches A's snapshot and takes the session over.
  std::vector<int32_t> turn2 = turn1;
  turn2.insert(turn2.end(), {7, 8, 9});
  Acquired moved = b_.sharing->acquire("conv-1", turn2);
  ASSERT_TRUE(moved.status.is_ok()) << moved.status.to_string();
  ASSERT_EQ(moved.source, Acquired::Source::kFetched) << moved.fetch_error;
  EXPECT_EQ(moved.reuse_tokens, turn1.size());
  EXPECT_EQ(moved.version.seq, 2u);
  EXPECT_EQ(moved.version.owner, "srv-b");
  ASSERT_EQ(moved.manifest.byte_size, kv.size());
  EXPECT_EQ(std::memcmp(moved.bytes->data(), kv.data(), kv.size()), 0);

  // A hears about it and drops its copy; its published snapshot is gone too.
  ASSERT_TRUE(wait_dropped(a_, session_key("conv-1")));
  EXPECT_FALSE(a_.node->has(session_key("conv-1")));
  // A's old local copy is no longer current.
  EXPECT_EQ(a_.dir->check("conv-1", first.version.epoch, 1).status.code(), StatusCode::kStale);

  // Back to A before B published anything: the fetch fails cleanly, A still claims.
  Acquired back = a_.sharing->acquire("conv-1", turn2, first.version.epoch, 1);
  ASSERT_TRUE(back.status.is_ok()) << back.status.to_string();
  EXPECT_EQ(back.source, Acquired::Source::kNone);
  EXPECT_NE(back.fetch_error.find("NOT_FOUND"), std::string::npos) << back.fetch_error;
  EXPECT_EQ(back.version.seq, 3u);
}

TEST_F(SessionSharingTest, IncompatibleServerDoesNotReuse) {
  std::vector<int32_t> toks = {5, 6, 7};
  Acquired first = a_.sharing->acquire("conv-2", toks);
  ASSERT_TRUE(first.status.is_ok());
  std::vector<uint8_t> kv(1000, 3);
  ASSERT_TRUE(a_.sharing->publish("conv-2", first.version, toks, kv).is_ok());

  // Server C runs another configuration (fingerprint).
  Server c;
  RedisDirectoryConfig rc;
  rc.port = redis_.port();
  c.dir = make_redis_directory(rc);
  c.node = std::make_unique<UcxNode>();
  SessionSharingConfig sc;
  sc.server_id = "srv-c";
  sc.fingerprint = "fp-2";
  c.sharing = std::make_unique<SessionSharing>(*c.dir, *c.node, sc);
  Acquired got = c.sharing->acquire("conv-2", toks);
  ASSERT_TRUE(got.status.is_ok()) << got.status.to_string();
  EXPECT_EQ(got.source, Acquired::Source::kNone);
  EXPECT_NE(got.fetch_error.find("MISMATCH"), std::string::npos) << got.fetch_error;
  EXPECT_EQ(got.version.owner, "srv-c");
}

}  // namespace
}  // namespace uf::kv
