// Manifest: round trip, strict parsing (every truncation, bad magic/version, oversized fields,
// trailing bytes), receiver-side checks and BLAKE3 verification of the bytes.

#include <gtest/gtest.h>

#include <random>

#include "kv/manifest.h"

namespace uf::kv {
namespace {

Manifest sample(size_t n_tokens = 100, size_t n_bytes = 5000) {
  std::vector<int32_t> tokens(n_tokens);
  for (size_t i = 0; i < n_tokens; ++i) tokens[i] = static_cast<int32_t>(i * 7 + 3);
  std::vector<uint8_t> bytes(n_bytes);
  for (size_t i = 0; i < n_bytes; ++i) bytes[i] = static_cast<uint8_t>(i * 13);
  return make_manifest("model=v4.1-flash;maxseq=65536;gpus=8;kv=fp4", tokens, bytes,
                       "3f2c0b8e-1c1d-4a55-9c1e-0f6a4a9f1e01", 42);
}

TEST(Manifest, RoundTrip) {
  Manifest m = sample();
  std::vector<uint8_t> wire = serialize_manifest(m);
  Manifest back;
  ASSERT_TRUE(parse_manifest(wire, back).is_ok());
  EXPECT_EQ(back.format_version, kManifestVersion);
  EXPECT_EQ(back.fingerprint, m.fingerprint);
  EXPECT_EQ(back.epoch, m.epoch);
  EXPECT_EQ(back.seq, 42u);
  EXPECT_EQ(back.byte_size, 5000u);
  EXPECT_EQ(back.blake3, m.blake3);
  EXPECT_EQ(back.token_ids, m.token_ids);
  EXPECT_EQ(manifest_summary(back)["tokens"], 100);
}

TEST(Manifest, EveryTruncationIsRejected) {
  std::vector<uint8_t> wire = serialize_manifest(sample(10, 10));
  for (size_t n = 0; n < wire.size(); ++n) {
    Manifest back;
    Status s = parse_manifest(std::span<const uint8_t>(wire.data(), n), back);
    EXPECT_EQ(s.code(), StatusCode::kCorrupt) << "prefix of " << n << " bytes: " << s.to_string();
  }
}

TEST(Manifest, RejectsBadMagicVersionTrailingAndOversized) {
  std::vector<uint8_t> wire = serialize_manifest(sample());
  Manifest back;
  auto bad = wire;
  bad[0] = 'X';
  EXPECT_EQ(parse_manifest(bad, back).code(), StatusCode::kCorrupt);

  bad = wire;
  bad[8] = 2;  // version 2
  Status s = parse_manifest(bad, back);
  EXPECT_EQ(s.code(), StatusCode::kMismatch);
  EXPECT_NE(s.message().find("version 2"), std::string::npos) << s.message();

  bad = wire;
  bad.push_back(0);
  s = parse_manifest(bad, back);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("unexpected bytes"), std::string::npos) << s.message();

  ManifestLimits tight;
  tight.max_tokens = 99;
  s = parse_manifest(wire, back, tight);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("token_count"), std::string::npos) << s.message();

  tight = {};
  tight.max_fingerprint_bytes = 8;
  s = parse_manifest(wire, back, tight);
  EXPECT_NE(s.message().find("fingerprint"), std::string::npos) << s.message();

  tight = {};
  tight.max_byte_size = 4999;
  s = parse_manifest(wire, back, tight);
  EXPECT_NE(s.message().find("byte_size"), std::string::npos) << s.message();

  // A huge token count with few bytes behind it must not allocate or read past the end.
  bad = wire;
  size_t count_at = wire.size() - 4 * 100 - 8;
  uint64_t huge = (uint64_t{1} << 22);
  std::memcpy(bad.data() + count_at, &huge, 8);
  s = parse_manifest(bad, back);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.message();
}

TEST(Manifest, RandomGarbageNeverParsesAsValidByAccident) {
  std::mt19937 rng(7);
  std::vector<uint8_t> wire = serialize_manifest(sample(20, 100));
  for (int i = 0; i < 2000; ++i) {
    auto bad = wire;
    size_t at = rng() % bad.size();
    bad[at] ^= static_cast<uint8_t>(1 + rng() % 255);
    Manifest back;
    Status s = parse_manifest(bad, back);
    // Flips inside free-form fields can still parse; then some field must differ.
    if (s.is_ok()) {
      Manifest orig = sample(20, 100);
      bool differs = back.fingerprint != orig.fingerprint || back.epoch != orig.epoch ||
                     back.seq != orig.seq || back.byte_size != orig.byte_size ||
                     back.blake3 != orig.blake3 || back.token_ids != orig.token_ids;
      EXPECT_TRUE(differs) << "flip at byte " << at;
    }
  }
}

TEST(Manifest, ReceiverChecks) {
  Manifest m = sample(100);
  std::vector<int32_t> req(m.token_ids.begin(), m.token_ids.begin() + 60);
  req.push_back(-1);
  req.push_back(5);
  ReceiverExpectations ex;
  ex.fingerprint = m.fingerprint;
  ex.request_tokens = req;
  ManifestCheck c = check_manifest(m, ex);
  EXPECT_TRUE(c.status.is_ok()) << c.status.to_string();
  EXPECT_EQ(c.common_prefix, 60u);

  // Request extends the snapshot: the whole snapshot is reusable.
  std::vector<int32_t> longer = m.token_ids;
  longer.push_back(9);
  ex.request_tokens = longer;
  EXPECT_EQ(check_manifest(m, ex).common_prefix, 100u);

  ex.request_tokens = req;
  ex.fingerprint = "model=v4.1-flash;maxseq=65536;gpus=8;kv=fp8";
  c = check_manifest(m, ex);
  EXPECT_EQ(c.status.code(), StatusCode::kMismatch);
  EXPECT_NE(c.status.message().find("fingerprint"), std::string::npos);

  ex.fingerprint = m.fingerprint;
  std::vector<int32_t> other = {999};
  ex.request_tokens = other;
  EXPECT_EQ(check_manifest(m, ex).status.code(), StatusCode::kMismatch);

  ex.request_tokens = req;
  ex.min_common_prefix = 61;
  EXPECT_EQ(check_manifest(m, ex).status.code(), StatusCode::kMismatch);

  ex.min_common_prefix = 1;
  ex.limits.max_byte_size = 100;
  EXPECT_EQ(check_manifest(m, ex).status.code(), StatusCode::kMismatch);

  Manifest v2 = m;
  v2.format_version = 2;
  ex.limits = {};
  EXPECT_EQ(check_manifest(v2, ex).status.code(), StatusCode::kMismatch);
}

TEST(Manifest, VerifyBytesCatchesEveryChangedByte) {
  std::vector<uint8_t> bytes(3000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i ^ (i >> 3));
  std::vector<int32_t> tokens = {1, 2, 3};
  Manifest m = make_manifest("fp", tokens, bytes);
  EXPECT_TRUE(verify_snapshot_bytes(m, bytes).is_ok());
  for (size_t at : {size_t{0}, size_t{1023}, size_t{1024}, size_t{2999}}) {
    auto bad = bytes;
    bad[at] ^= 0x01;
    Status s = verify_snapshot_bytes(m, bad);
    EXPECT_EQ(s.code(), StatusCode::kCorrupt) << "flip at " << at;
  }
  auto shorter = bytes;
  shorter.pop_back();
  EXPECT_EQ(verify_snapshot_bytes(m, shorter).code(), StatusCode::kCorrupt);
}

}  // namespace
}  // namespace uf::kv
