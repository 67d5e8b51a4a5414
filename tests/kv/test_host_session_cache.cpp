// Host session cache: exact-prefix lookup, per-session limit, LRU eviction by bytes.
#include <gtest/gtest.h>

#include "kv/host_session_cache.h"

using namespace uf::kv;

namespace {
SessionSnapshot snap(std::vector<int32_t> tokens, size_t bytes) {
  return SessionSnapshot{std::move(tokens), std::vector<uint8_t>(bytes, 7)};
}
}  // namespace

TEST(HostSessionCache, FindsLongestProperPrefix) {
  HostSessionCache c(1 << 20);
  c.put("a", snap({1, 2, 3}, 100));
  c.put("a", snap({1, 2, 3, 4, 5}, 100));
  std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6};
  auto s = c.find_prefix("a", prompt);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->tokens.size(), 5u);
  // A snapshot as long as the prompt is not usable (no token left for the last logits).
  std::vector<int32_t> same = {1, 2, 3, 4, 5};
  EXPECT_EQ(c.find_prefix("a", same)->tokens.size(), 3u);
  // Divergence inside a snapshot disqualifies it.
  std::vector<int32_t> diverged = {1, 2, 9, 4, 5, 6};
  EXPECT_FALSE(c.find_prefix("a", diverged));
  EXPECT_FALSE(c.find_prefix("b", prompt));
  auto st = c.stats();
  EXPECT_EQ(st.hits, 2u);
  EXPECT_EQ(st.misses, 2u);
}

TEST(HostSessionCache, KeepsAtMostNPerSessionAndEvictsLruByBytes) {
  HostSessionCache c(1000, 2);
  c.put("a", snap({1}, 100));
  c.put("a", snap({1, 2}, 100));
  c.put("a", snap({1, 2, 3}, 100));  // drops {1}
  std::vector<int32_t> p = {1, 2, 3, 4};
  EXPECT_EQ(c.find_prefix("a", p)->tokens.size(), 3u);
  std::vector<int32_t> p2 = {1, 5};
  EXPECT_FALSE(c.find_prefix("a", p2));  // {1} is gone
  EXPECT_EQ(c.stats().snapshots, 2u);
  // Fill beyond capacity: the least recently used session goes first.
  c.put("b", snap({7, 8}, 450));
  std::vector<int32_t> pa = {1, 2, 3, 9};
  ASSERT_TRUE(c.find_prefix("a", pa));  // touch "a"
  c.put("c", snap({5, 6}, 450));  // over 1000: evicts a{1,2}, then b; never the touched a{1,2,3}
  std::vector<int32_t> pb = {7, 8, 9};
  EXPECT_FALSE(c.find_prefix("b", pb));
  EXPECT_TRUE(c.find_prefix("a", pa));
  EXPECT_LE(c.stats().bytes, 1000u);
  EXPECT_GE(c.stats().evictions, 1u);
  // Larger than the whole cache: not stored.
  c.put("d", snap({1, 2}, 5000));
  std::vector<int32_t> pd = {1, 2, 3};
  EXPECT_FALSE(c.find_prefix("d", pd));
  c.erase("a");
  EXPECT_FALSE(c.find_prefix("a", pa));
}
