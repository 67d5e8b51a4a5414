// DeviceRing's host bookkeeping (cuda/backend/cuda_session.h): first_missing must agree with get()
// position by position, across the wrap-around, for full, partial and overwritten rings. Host only
// (no device memory: the tags alone are exercised).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda/backend/cuda_session.h"

namespace uf::cuda {
namespace {

// get() position by position: the reference first_missing replaces in the span plan.
int64_t first_missing_by_get(const DeviceRing& r, int64_t begin, int64_t end) {
  for (int64_t q = begin; q < end; ++q)
    if (!r.get(q)) return q;
  return -1;
}

TEST(DeviceRing, FirstMissingAgreesWithGet) {
  DeviceRing r;
  r.slots = 7;
  r.width = 1;
  r.pos.assign(7, -1);
  r.data = reinterpret_cast<float*>(uintptr_t(0x1000));  // never dereferenced
  EXPECT_EQ(r.first_missing(0, 0), -1);
  EXPECT_EQ(r.first_missing(0, 3), 0);
  int checked = 0;
  for (int64_t len = 1; len <= 40; ++len) {
    r.put(len - 1);
    if (len % 9 == 0) r.put(len + 6);  // an uncommitted row past the end overwrites a slot
    for (int64_t b = 0; b <= len; ++b)
      for (int64_t e = b; e <= len + 1; ++e) {
        ASSERT_EQ(r.first_missing(b, e), first_missing_by_get(r, b, e))
            << "len " << len << " range [" << b << ", " << e << ")";
        ++checked;
      }
  }
  EXPECT_GT(checked, 1000);
  DeviceRing empty;
  EXPECT_EQ(empty.first_missing(3, 5), 3);  // no slots: nothing held
}

// The run shortcut (run_end / run_len) under the span plan's put patterns and worse: verify rows
// put past the commit point and put again after a partial commit, gaps, positions older than the
// run, rings restored from snapshot tags. first_missing must still agree with get() everywhere.
TEST(DeviceRing, RunShortcutAgreesWithGetUnderRandomPuts) {
  std::mt19937_64 rng(77);
  int checked = 0, fast = 0;
  for (int slots : {1, 2, 7, 135}) {
    DeviceRing r;
    r.slots = slots;
    r.width = 1;
    r.set_tags(std::vector<int64_t>(size_t(slots), -1));
    r.data = reinterpret_cast<float*>(uintptr_t(0x1000));  // never dereferenced
    int64_t len = 0;
    for (int step = 0; step < 600; ++step) {
      const int kind = int(rng() % 20);
      if (kind < 14) {  // a verify step: 1..8 rows from len, 0..rows committed
        const int rows = 1 + int(rng() % 8);
        for (int t = 0; t < rows; ++t) r.put(len + t);
        len += int64_t(rng() % uint64_t(rows + 1));
      } else if (kind < 16) {  // a gap
        len += 1 + int64_t(rng() % uint64_t(2 * slots + 1));
        r.put(len++);
      } else if (kind < 18 && len > 0) {  // an older position
        r.put(int64_t(rng() % uint64_t(len)));
      } else if (kind == 18) {  // restored tags (a snapshot)
        std::vector<int64_t> tags(r.pos);
        r.set_tags(tags);
      } else {  // tags of some other history
        std::vector<int64_t> tags(static_cast<size_t>(slots));
        for (auto& t : tags) t = int64_t(rng() % uint64_t(len + 1)) - 1;
        r.set_tags(tags);
      }
      for (int q = 0; q < 20; ++q) {
        // Half the queries are the span plan's: the window before the next span.
        const int64_t hi = len + 2;
        int64_t b = int64_t(rng() % uint64_t(hi + 1));
        int64_t e = b + int64_t(rng() % uint64_t(slots + 3));
        if (q % 2 == 0) {
          b = std::max<int64_t>(0, len - int64_t(rng() % uint64_t(slots)));
          e = len;
        }
        const int64_t want = first_missing_by_get(r, b, e);
        ASSERT_EQ(r.first_missing(b, e), want)
            << "slots " << slots << " step " << step << " range [" << b << ", " << e << ")";
        ++checked;
        fast += want < 0 && r.run_len > 0 && b > r.run_end - r.run_len && e - 1 <= r.run_end;
      }
    }
  }
  EXPECT_GT(checked, 40000);
  EXPECT_GT(fast, checked / 10);  // the shortcut does serve
}

}  // namespace
}  // namespace uf::cuda
