// "spec == plain": verify rows forwarded together equal plain single-row decoding bit for bit, for
// every row count 1..8, and rejected rows leave committed state intact. Runs on the tiny-a
// fixture model (window 8, so the rings wrap many times over the 41-token prompt).
#include <gtest/gtest.h>

#include <cstring>

#include "cpu/cpu_backend.h"
#include "model/checkpoint.h"
#include "tiny_a.h"

namespace uf::cpu {
namespace {

using uf::testing::tiny_a_dir;
using uf::testing::tiny_a_golden_i64;

class SpecPlain : public ::testing::TestWithParam<IndexKeys> {
 protected:
  void SetUp() override {
    ModelOptions o;
    o.index_keys = GetParam();
    be_ = std::make_unique<CpuBackend>(tiny_a_dir(), tiny_a_golden_i64("engram_token_map"), o);
    const auto p = tiny_a_golden_i64("prompt_ids");
    prompt_.assign(p.begin(), p.end());
    const auto d = tiny_a_golden_i64("decode_ids");
    next_.assign(d.begin(), d.begin() + 8);
    V_ = be_->config().vocab_size;
    auto s = be_->new_session(128);
    std::vector<float> lg(static_cast<size_t>(V_));
    be_->prefill(*s, prompt_, {}, lg);
    snap_ = be_->snapshot(*s);
  }
  std::unique_ptr<engine::SessionState> fresh() {
    auto s = be_->new_session(128);
    be_->restore(*s, snap_);
    return s;
  }
  std::unique_ptr<CpuBackend> be_;
  std::vector<int32_t> prompt_, next_;
  std::vector<uint8_t> snap_;
  int V_ = 0;
};

TEST_P(SpecPlain, VerifyRowsEqualPlainDecodeBitwise) {
  // Plain decoding, one committed row at a time.
  std::vector<float> plain(size_t(8 * V_));
  auto sp = fresh();
  for (int i = 0; i < 8; ++i) {
    be_->decode_rows(*sp, std::span<const int32_t>(&next_[size_t(i)], 1),
                     std::span<float>(plain.data() + int64_t(i) * V_, size_t(V_)));
    be_->commit(*sp, 1);
  }
  for (int k = 1; k <= 8; ++k) {
    auto sv = fresh();
    std::vector<float> rows(size_t(k * V_));
    be_->decode_rows(*sv, std::span<const int32_t>(next_.data(), size_t(k)), rows);
    for (int i = 0; i < k; ++i)
      EXPECT_EQ(0, std::memcmp(rows.data() + int64_t(i) * V_, plain.data() + int64_t(i) * V_,
                               size_t(V_) * 4))
          << "k=" << k << " row " << i;
    // Accept j rows, reject the rest, then continue plainly: still identical.
    const int j = k / 2;
    be_->commit(*sv, j);
    EXPECT_EQ(sv->length(), int64_t(prompt_.size()) + j);
    std::vector<float> row(static_cast<size_t>(V_));
    for (int i = j; i < 8; ++i) {
      be_->decode_rows(*sv, std::span<const int32_t>(&next_[size_t(i)], 1), row);
      be_->commit(*sv, 1);
      EXPECT_EQ(0, std::memcmp(row.data(), plain.data() + int64_t(i) * V_, size_t(V_) * 4))
          << "after k=" << k << " accepting " << j << ", row " << i;
    }
  }
}

TEST_P(SpecPlain, RejectedRowsDoNotChangeTheDraftOrSnapshotRestore) {
  auto greedy = [](int, std::span<const float> l) {
    return int32_t(std::max_element(l.begin(), l.end()) - l.begin());
  };
  auto a = fresh();
  auto b = fresh();
  std::vector<float> rows(size_t(8 * V_));
  // a: 8 verify rows, only 3 accepted. b: 3 plain steps.
  be_->decode_rows(*a, std::span<const int32_t>(next_.data(), 8), rows);
  be_->commit(*a, 3);
  for (int i = 0; i < 3; ++i) {
    be_->decode_rows(*b, std::span<const int32_t>(&next_[size_t(i)], 1),
                     std::span<float>(rows.data(), size_t(V_)));
    be_->commit(*b, 1);
  }
  const auto da = be_->draft(*a, next_[3], greedy);
  const auto db = be_->draft(*b, next_[3], greedy);
  EXPECT_EQ(da.tokens, db.tokens);
  EXPECT_EQ(0, std::memcmp(da.logits.data(), db.logits.data(), da.logits.size() * 4));
  EXPECT_EQ(0, std::memcmp(da.confidence.data(), db.confidence.data(), da.confidence.size() * 4));
  // A restored snapshot continues exactly like the original.
  auto c = be_->new_session(128);
  be_->restore(*c, be_->snapshot(*a));
  std::vector<float> ra(static_cast<size_t>(V_)), rc(static_cast<size_t>(V_));
  be_->decode_rows(*a, std::span<const int32_t>(&next_[3], 1), ra);
  be_->decode_rows(*c, std::span<const int32_t>(&next_[3], 1), rc);
  EXPECT_EQ(0, std::memcmp(ra.data(), rc.data(), size_t(V_) * 4));
}

INSTANTIATE_TEST_SUITE_P(IndexKeys, SpecPlain,
                         ::testing::Values(IndexKeys::kOwner, IndexKeys::kReference),
                         [](const auto& info) {
                           return std::string(info.param == IndexKeys::kOwner ? "OwnerKeys"
                                                                              : "ReferenceKeys");
                         });

}  // namespace
}  // namespace uf::cpu
