#pragma once
// Directory behaviour shared by the in-process and the Redis tests.

#include <gtest/gtest.h>

#include <barrier>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "kv/session_directory.h"

namespace uf::kv::testing {

using namespace std::chrono_literals;

// Collects change notifications for a test to wait on.
class ChangeLog {
 public:
  ChangeCallback callback() {
    return [this](const OwnershipChange& c) {
      std::lock_guard lock(mu_);
      changes_.push_back(c);
      cv_.notify_all();
    };
  }
  // Waits for a notification matching pred; true if one arrived in time.
  template <typename Pred>
  bool wait_for(Pred pred, std::chrono::milliseconds timeout, OwnershipChange* out = nullptr) {
    std::unique_lock lock(mu_);
    bool found = cv_.wait_for(lock, timeout, [&] {
      for (const auto& c : changes_)
        if (pred(c)) {
          if (out) *out = c;
          return true;
        }
      return false;
    });
    return found;
  }
  bool wait_resyncs(size_t n, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] {
      size_t k = 0;
      for (const auto& c : changes_) k += c.resync;
      return k >= n;
    });
  }
  size_t resyncs() {
    std::lock_guard lock(mu_);
    size_t n = 0;
    for (const auto& c : changes_) n += c.resync;
    return n;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<OwnershipChange> changes_;
};

inline void expect_lookup_claim_check(SessionDirectory& dir) {
  DirectoryResult r = dir.lookup("session-unknown");
  EXPECT_EQ(r.status.code(), StatusCode::kNotFound) << r.status.to_string();
  EXPECT_FALSE(r.version.epoch.empty());
  EXPECT_EQ(r.version.seq, 0u);

  DirectoryResult first = dir.lookup("session-a");
  ASSERT_EQ(first.status.code(), StatusCode::kNotFound);
  DirectoryResult c = dir.claim("session-a", {first.version.epoch, 0, "srv-1", "10.0.0.1:7000"});
  ASSERT_TRUE(c.status.is_ok()) << c.status.to_string();
  EXPECT_EQ(c.version.seq, 1u);
  EXPECT_EQ(c.version.epoch, first.version.epoch);

  DirectoryResult l = dir.lookup("session-a");
  ASSERT_TRUE(l.status.is_ok()) << l.status.to_string();
  EXPECT_EQ(l.version.seq, 1u);
  EXPECT_EQ(l.version.owner, "srv-1");
  EXPECT_EQ(l.version.address, "10.0.0.1:7000");

  // A claim carrying what the first lookup read is stale now.
  DirectoryResult stale = dir.claim("session-a", {first.version.epoch, 0, "srv-2", "x"});
  EXPECT_EQ(stale.status.code(), StatusCode::kStale);
  EXPECT_EQ(stale.status.message(), kStaleMessage);
  // A wrong epoch is stale too.
  EXPECT_EQ(dir.claim("session-a", {"not-the-epoch", 1, "srv-2", "x"}).status.code(),
            StatusCode::kStale);

  EXPECT_TRUE(dir.check("session-a", l.version.epoch, 1).status.is_ok());
  EXPECT_EQ(dir.check("session-a", l.version.epoch, 0).status.code(), StatusCode::kStale);
  EXPECT_EQ(dir.check("session-a", "other", 1).status.code(), StatusCode::kStale);

  // The next owner claims with the version it read.
  DirectoryResult c2 = dir.claim("session-a", {l.version.epoch, 1, "srv-2", "10.0.0.2:7000"});
  ASSERT_TRUE(c2.status.is_ok()) << c2.status.to_string();
  EXPECT_EQ(c2.version.seq, 2u);
  EXPECT_EQ(dir.lookup("session-a").version.owner, "srv-2");
  EXPECT_EQ(dir.check("session-a", l.version.epoch, 1).status.code(), StatusCode::kStale);
}

// Two servers (two directory clients) race to claim the same version: exactly one wins.
inline void expect_one_winner(SessionDirectory& a, SessionDirectory& b, int rounds) {
  for (int i = 0; i < rounds; ++i) {
    std::string id = "race-" + std::to_string(i);
    DirectoryResult seen = a.lookup(id);
    ASSERT_NE(seen.status.code(), StatusCode::kUnavailable);
    std::barrier sync(2);
    DirectoryResult ra, rb;
    std::thread ta([&] {
      sync.arrive_and_wait();
      ra = a.claim(id, {seen.version.epoch, seen.version.seq, "A", "a:1"});
    });
    std::thread tb([&] {
      sync.arrive_and_wait();
      rb = b.claim(id, {seen.version.epoch, seen.version.seq, "B", "b:1"});
    });
    ta.join();
    tb.join();
    int wins = ra.status.is_ok() + rb.status.is_ok();
    EXPECT_EQ(wins, 1) << "round " << i;
    const DirectoryResult& loser = ra.status.is_ok() ? rb : ra;
    EXPECT_EQ(loser.status.code(), StatusCode::kStale);
    EXPECT_EQ(loser.status.message(), kStaleMessage);
    DirectoryResult now = b.lookup(id);
    EXPECT_EQ(now.version.owner, ra.status.is_ok() ? "A" : "B");
    EXPECT_EQ(now.version.seq, 1u);
  }
}

inline bool uuid_looks_valid(const std::string& u) {
  if (u.size() != 36 || u[14] != '4') return false;
  for (size_t i = 0; i < u.size(); ++i) {
    bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash != (u[i] == '-')) return false;
    if (!dash && !std::isxdigit(static_cast<unsigned char>(u[i]))) return false;
  }
  return true;
}

}  // namespace uf::kv::testing
