// Session reuse is exact on the CPU backend: restoring a snapshot of a prompt prefix and
// prefilling the rest gives bitwise the logits of a full prefill of the same tokens, and decoding
// continues identically. Prefix lengths cover the window ring's wrap (window 8), odd and even
// ratio-2 compressor groups and candidate blocks (tiny-a fixture).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "../cpu/tiny_a.h"
#include "cpu/cpu_backend.h"
#include "model/checkpoint.h"

namespace {

using uf::testing::tiny_a_dir;
using uf::testing::tiny_a_golden_i64;

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST(CpuSessionReuse, RestoredPrefixPlusPrefillEqualsFullPrefillBitwise) {
  uf::cpu::CpuBackend be(tiny_a_dir(), tiny_a_golden_i64("engram_token_map"));
  const auto p = tiny_a_golden_i64("prompt_ids");
  const std::vector<int32_t> prompt(p.begin(), p.end());
  const auto d = tiny_a_golden_i64("decode_ids");
  const std::vector<int32_t> next(d.begin(), d.begin() + 4);
  const size_t V = size_t(be.config().vocab_size);

  // Reference: one prefill of the whole prompt, then 4 plain decode steps.
  auto full = be.new_session(128);
  std::vector<float> want(V);
  be.prefill(*full, prompt, {}, want);
  std::vector<std::vector<float>> want_steps;
  for (int32_t t : next) {
    std::vector<float> lg(V);
    be.decode_rows(*full, std::span<const int32_t>(&t, 1), lg);
    be.commit(*full, 1);
    want_steps.push_back(lg);
  }

  for (size_t k :
       {size_t(1), size_t(7), size_t(8), size_t(9), size_t(16), size_t(21), prompt.size() - 1}) {
    SCOPED_TRACE(testing::Message() << "prefix " << k);
    auto first = be.new_session(128);
    std::vector<float> scratch(V);
    be.prefill(*first, std::span<const int32_t>(prompt.data(), k), {}, scratch);
    const auto snap = be.snapshot(*first);

    auto reused = be.new_session(128);
    be.restore(*reused, snap);
    ASSERT_EQ(reused->length(), int64_t(k));
    std::vector<float> got(V);
    be.prefill(*reused, std::span<const int32_t>(prompt.data() + k, prompt.size() - k), {}, got);
    EXPECT_TRUE(bitwise_equal(got, want)) << "last prompt logits differ";
    for (size_t i = 0; i < next.size(); ++i) {
      std::vector<float> lg(V);
      be.decode_rows(*reused, std::span<const int32_t>(&next[i], 1), lg);
      be.commit(*reused, 1);
      EXPECT_TRUE(bitwise_equal(lg, want_steps[i])) << "decode step " << i << " differs";
    }
  }
}
