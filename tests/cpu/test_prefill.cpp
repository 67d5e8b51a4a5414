// Chunked prefill and the CED shortcut on the tiny-a fixture model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "cpu/cpu_backend.h"
#include "model/checkpoint.h"
#include "tiny_a.h"

namespace uf::cpu {
namespace {

using uf::testing::tiny_a_dir;
using uf::testing::tiny_a_golden_i64;

double rms_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    r += double(b[i]) * b[i];
  }
  return std::sqrt(d / r);
}

class Prefill : public ::testing::Test {
 protected:
  void SetUp() override {
    be_ = std::make_unique<CpuBackend>(tiny_a_dir(), tiny_a_golden_i64("engram_token_map"));
    const auto p = tiny_a_golden_i64("prompt_ids");
    prompt_.assign(p.begin(), p.end());
    V_ = be_->config().vocab_size;
  }
  std::vector<float> run(const engine::PrefillOptions& o) {
    auto s = be_->new_session(128);
    std::vector<float> lg(static_cast<size_t>(V_));
    be_->prefill(*s, prompt_, o, lg);
    EXPECT_EQ(s->length(), int64_t(prompt_.size()));
    return lg;
  }
  std::unique_ptr<CpuBackend> be_;
  std::vector<int32_t> prompt_;
  int V_ = 0;
};

TEST_F(Prefill, ChunkOfOneIsExactlyTokenByTokenDecoding) {
  engine::PrefillOptions o;
  o.chunk = 1;
  const auto chunked = run(o);
  auto s = be_->new_session(128);
  std::vector<float> lg(static_cast<size_t>(V_));
  be_->prefill(*s, std::span<const int32_t>(prompt_.data(), 1), {}, lg);
  for (size_t i = 1; i < prompt_.size(); ++i) {
    be_->decode_rows(*s, std::span<const int32_t>(&prompt_[i], 1), lg);
    be_->commit(*s, 1);
  }
  EXPECT_EQ(0, std::memcmp(chunked.data(), lg.data(), lg.size() * 4));
}

TEST_F(Prefill, ChunkedPrefillStaysWithinTheNoiseFloor) {
  const auto full = run({});
  engine::PrefillOptions o;
  o.chunk = 16;
  const auto chunked = run(o);
  // Later chunks list window slots in the decode order, which regroups the online softmax's bf16
  // probabilities; that is rounding-level, far below tiny-a's 4% prefill noise floor.
  EXPECT_LT(rms_rel(chunked, full), 0.04);
  EXPECT_EQ(std::max_element(chunked.begin(), chunked.end()) - chunked.begin(),
            std::max_element(full.begin(), full.end()) - full.begin());
}

TEST_F(Prefill, CedWithFullReplayEqualsFullPrefillBitwise) {
  const auto full = run({});
  engine::PrefillOptions o;
  o.ced_shortcut = true;
  o.replay = int(prompt_.size());
  const auto ced = run(o);
  EXPECT_EQ(0, std::memcmp(ced.data(), full.data(), full.size() * 4));
  // Bounded replay over the window: an approximation, but a close one.
  o.replay = 0;
  const auto bounded = run(o);
  EXPECT_GT(rms_rel(bounded, full), 0.0);
  EXPECT_LT(rms_rel(bounded, full), 0.06);
}

TEST_F(Prefill, ReferenceKeysLongSpanFallsBackToRowsExactly) {
  // With the reference's stale index keys a row may read a later layer's keys; a span longer than
  // the committed prefix is then run row by row, which must equal token-by-token decoding.
  ModelOptions mo;
  mo.index_keys = IndexKeys::kReference;
  CpuBackend be(tiny_a_dir(), tiny_a_golden_i64("engram_token_map"), mo);
  std::vector<float> a(static_cast<size_t>(V_)), b(static_cast<size_t>(V_));
  auto s1 = be.new_session(128);
  be.prefill(*s1, std::span<const int32_t>(prompt_.data(), 1), {}, a);
  be.prefill(*s1, std::span<const int32_t>(prompt_.data() + 1, prompt_.size() - 1), {}, a);
  engine::PrefillOptions o;
  o.chunk = 1;
  auto s2 = be.new_session(128);
  be.prefill(*s2, prompt_, o, b);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
}

}  // namespace
}  // namespace uf::cpu
