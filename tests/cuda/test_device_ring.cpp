// DeviceRing's host bookkeeping (cuda/backend/cuda_session.h): first_missing must agree with get()
// position by position, across the wrap-around, for full, partial and overwritten rings. Host only
// (no device memory: the tags alone are exercised).
#include <gtest/gtest.h>

#include <cstdint>

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

}  // namespace
}  // namespace uf::cuda
