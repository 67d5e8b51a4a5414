// UCX snapshot transfer between two nodes (owner and fetcher) in one process over loopback:
// 1 KB / 10 MB / 200 MB fetches verified byte for byte, corruption caught by BLAKE3, manifest
// checks before reading, and every failure (owner gone, owner hung, unknown id) ending in a
// clean error within the timeout.

#include <gtest/gtest.h>

#include <future>
#include <random>
#include <thread>

#include "kv/ucx_transfer.h"

namespace uf::kv {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const char* kFingerprint = "test-model;maxseq=4096;gpus=1;kv=fp8";

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

std::vector<int32_t> tokens(size_t n) {
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((i * 2654435761u) % 129280);
  return t;
}

// Parameter: UCX peer-failure detection on (TCP between same-host peers in UCX 1.13) or off
// (shared memory).
class UcxTransferTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    try {
      UcxNodeConfig cfg;
      cfg.remove_grace = 100ms;
      cfg.peer_failure_detection = GetParam();
      owner_ = std::make_unique<UcxNode>(cfg);
      fetcher_ = std::make_unique<UcxNode>(cfg);
    } catch (const std::exception& e) {
      GTEST_SKIP() << "UCX cannot start in this environment: " << e.what();
    }
  }

  // Publishes n random bytes with a manifest for `toks`; returns the bytes.
  std::vector<uint8_t> publish(const std::string& id, size_t n, const std::vector<int32_t>& toks,
                               uint64_t seq = 0) {
    std::vector<uint8_t> bytes = random_bytes(n, n + 17);
    Manifest m = make_manifest(kFingerprint, toks, bytes, "epoch-1", seq);
    Status s = owner_->publish_copy(id, m, bytes);
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    return bytes;
  }

  ReceiverExpectations expect(const std::vector<int32_t>& request) {
    ReceiverExpectations ex;
    ex.fingerprint = kFingerprint;
    ex.request_tokens = request;
    return ex;
  }

  void fetch_and_verify(size_t n) {
    std::vector<int32_t> toks = tokens(1000);
    std::vector<uint8_t> bytes = publish("s", n, toks);
    std::vector<int32_t> request(toks.begin(), toks.begin() + 700);
    request.push_back(1);
    FetchOptions opt;
    opt.timeout = 20s;
    FetchResult r = fetcher_->fetch(owner_->address(), "s", expect(request), opt);
    ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
    ASSERT_TRUE(r.bytes);
    ASSERT_EQ(r.bytes->size(), n);
    EXPECT_EQ(std::memcmp(r.bytes->data(), bytes.data(), n), 0);
    EXPECT_EQ(r.common_prefix, 700u);
    EXPECT_EQ(r.manifest.token_ids, toks);
    EXPECT_EQ(r.manifest.epoch, "epoch-1");
    EXPECT_EQ(fetcher_->stats().fetches_ok, 1u);
    EXPECT_EQ(owner_->stats().requests_served, 1u);
    std::printf("fetched %zu bytes: manifest %.2f ms, read %.2f ms (%.2f GB/s), verify %.2f ms\n",
                n, r.manifest_seconds * 1e3, r.read_seconds * 1e3,
                r.read_seconds > 0 ? n / r.read_seconds / 1e9 : 0.0, r.verify_seconds * 1e3);
  }

  std::unique_ptr<UcxNode> owner_, fetcher_;
};

TEST_P(UcxTransferTest, Fetch1KB) { fetch_and_verify(1024); }
TEST_P(UcxTransferTest, Fetch10MB) { fetch_and_verify(10u << 20); }
TEST_P(UcxTransferTest, Fetch200MB) { fetch_and_verify(200u << 20); }

TEST_P(UcxTransferTest, EmptySnapshotAndRepeatedFetches) {
  std::vector<int32_t> toks = tokens(10);
  publish("empty", 0, toks);
  FetchResult r = fetcher_->fetch(owner_->address(), "empty", expect(toks));
  ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
  EXPECT_EQ(r.bytes->size(), 0u);
  publish("small", 4097, toks);
  for (int i = 0; i < 5; ++i) {
    FetchResult again = fetcher_->fetch(owner_->address(), "small", expect(toks));
    EXPECT_TRUE(again.status.is_ok()) << again.status.to_string();
  }
}

TEST_P(UcxTransferTest, CorruptionInFlightIsDetected) {
  std::vector<int32_t> toks = tokens(100);
  publish("s", 1u << 20, toks);
  FetchOptions opt;
  opt.test_corrupt_in_flight = [](std::span<uint8_t> b) { b[b.size() / 3] ^= 0x10; };
  FetchResult r = fetcher_->fetch(owner_->address(), "s", expect(toks), opt);
  EXPECT_EQ(r.status.code(), StatusCode::kCorrupt) << r.status.to_string();
  EXPECT_NE(r.status.message().find("BLAKE3"), std::string::npos);
  EXPECT_FALSE(r.bytes) << "corrupt bytes must not be handed out";
  EXPECT_EQ(fetcher_->stats().fetches_failed, 1u);
}

TEST_P(UcxTransferTest, ManifestChecksHappenBeforeTheRead) {
  std::vector<int32_t> toks = tokens(100);
  publish("s", 4096, toks, /*seq=*/3);
  ReceiverExpectations ex = expect(toks);
  ex.fingerprint = "another-model";
  FetchResult r = fetcher_->fetch(owner_->address(), "s", ex);
  EXPECT_EQ(r.status.code(), StatusCode::kMismatch) << r.status.to_string();

  std::vector<int32_t> unrelated = {5, 5, 5};
  r = fetcher_->fetch(owner_->address(), "s", expect(unrelated));
  EXPECT_EQ(r.status.code(), StatusCode::kMismatch) << r.status.to_string();

  FetchOptions opt;
  opt.expect_seq = 4;
  r = fetcher_->fetch(owner_->address(), "s", expect(toks), opt);
  EXPECT_EQ(r.status.code(), StatusCode::kStale) << r.status.to_string();
  opt.expect_seq = 3;
  r = fetcher_->fetch(owner_->address(), "s", expect(toks), opt);
  EXPECT_TRUE(r.status.is_ok()) << r.status.to_string();
}

TEST_P(UcxTransferTest, UnknownAndRemovedSnapshots) {
  std::vector<int32_t> toks = tokens(10);
  FetchResult r = fetcher_->fetch(owner_->address(), "nope", expect(toks));
  EXPECT_EQ(r.status.code(), StatusCode::kNotFound) << r.status.to_string();
  publish("s", 100, toks);
  EXPECT_TRUE(owner_->has("s"));
  EXPECT_TRUE(owner_->remove("s"));
  EXPECT_FALSE(owner_->remove("s"));
  r = fetcher_->fetch(owner_->address(), "s", expect(toks));
  EXPECT_EQ(r.status.code(), StatusCode::kNotFound) << r.status.to_string();
}

TEST(UcxTransferLru, PublishingBeyondTheCapEvictsLeastRecentlyUsed) {
  std::unique_ptr<UcxNode> owner, fetcher;
  try {
    UcxNodeConfig cfg;
    cfg.max_published_bytes = 3000;
    owner = std::make_unique<UcxNode>(cfg);
    fetcher = std::make_unique<UcxNode>();
  } catch (const std::exception& e) {
    GTEST_SKIP() << "UCX cannot start in this environment: " << e.what();
  }
  std::vector<int32_t> toks = tokens(4);
  std::vector<uint8_t> kb(1000, 7);
  for (const char* id : {"a", "b", "c"})
    ASSERT_TRUE(owner->publish_copy(id, make_manifest(kFingerprint, toks, kb), kb).is_ok());
  ReceiverExpectations ex;
  ex.fingerprint = kFingerprint;
  ex.request_tokens = toks;
  ASSERT_TRUE(fetcher->fetch(owner->address(), "a", ex).status.is_ok());  // "a" is now recent
  ASSERT_TRUE(owner->publish_copy("d", make_manifest(kFingerprint, toks, kb), kb).is_ok());
  EXPECT_TRUE(owner->has("a"));
  EXPECT_FALSE(owner->has("b"));
  EXPECT_TRUE(owner->has("c"));
  EXPECT_TRUE(owner->has("d"));
  EXPECT_EQ(owner->stats().evicted, 1u);
  EXPECT_EQ(owner->stats().published_bytes, 3000u);
}

TEST_P(UcxTransferTest, OwnerStoppedGivesACleanErrorWithinTheTimeout) {
  std::vector<int32_t> toks = tokens(10);
  publish("s", 1u << 20, toks);
  std::string addr = owner_->address();
  owner_.reset();
  FetchOptions opt;
  opt.timeout = 3s;
  auto t0 = Clock::now();
  FetchResult r = fetcher_->fetch(addr, "s", expect(toks), opt);
  auto took = Clock::now() - t0;
  EXPECT_FALSE(r.status.is_ok());
  EXPECT_TRUE(r.status.code() == StatusCode::kUnavailable ||
              r.status.code() == StatusCode::kTimeout)
      << r.status.to_string();
  EXPECT_LT(took, opt.timeout + 1s);
  std::printf("owner gone: %s after %.0f ms\n", r.status.to_string().c_str(),
              std::chrono::duration<double, std::milli>(took).count());
}

// The fetcher keeps its connection to an owner (keep_connections, the default). When that owner
// stops, the kept connection must not turn a clean error into a hang, and it is dropped: the
// next fetch from that address fails at once (connection refused), not after a wait on a dead
// connection.
TEST_P(UcxTransferTest, KeptConnectionToAStoppedOwnerIsDropped) {
  std::vector<int32_t> toks = tokens(10);
  publish("s", 1u << 20, toks);
  const std::string addr = owner_->address();
  ASSERT_TRUE(fetcher_->fetch(addr, "s", expect(toks)).status.is_ok());
  ASSERT_TRUE(fetcher_->fetch(addr, "s", expect(toks)).status.is_ok());  // on the kept one
  owner_.reset();
  FetchOptions opt;
  opt.timeout = 3s;
  auto t0 = Clock::now();
  FetchResult r = fetcher_->fetch(addr, "s", expect(toks), opt);
  EXPECT_FALSE(r.status.is_ok());
  EXPECT_LT(Clock::now() - t0, opt.timeout + 1s);
  t0 = Clock::now();
  r = fetcher_->fetch(addr, "s", expect(toks), opt);
  EXPECT_FALSE(r.status.is_ok());
  // Connection refused on loopback is immediate; the kept-connection wait alone is 2 s.
  EXPECT_LT(Clock::now() - t0, 1500ms) << r.status.to_string();
}

// Snapshots carved out of the owner's arena: several live at once at distinct places, all fetch
// byte for byte over one kept connection (the arena's rkey is reused), and a removed snapshot's
// block is handed out again (first fit) once its grace period is over.
TEST_P(UcxTransferTest, ArenaSnapshotsFetchAndTheirBlocksAreReused) {
  UcxNodeConfig cfg;
  cfg.remove_grace = 0ms;
  cfg.peer_failure_detection = GetParam();
  cfg.arena_bytes = 32u << 20;
  owner_ = std::make_unique<UcxNode>(cfg);
  std::vector<int32_t> toks = tokens(50);
  std::vector<std::vector<uint8_t>> want;
  std::vector<const uint8_t*> where;
  for (int i = 0; i < 3; ++i) {
    const size_t n = (5u << 20) + 1000u * i;
    want.push_back(random_bytes(n, 100 + i));
    auto buf = owner_->allocate(n);
    ASSERT_TRUE(buf);
    std::memcpy(buf->data(), want.back().data(), n);
    where.push_back(buf->data());
    Manifest m = make_manifest(kFingerprint, toks, want.back(), "epoch-1", 0);
    ASSERT_TRUE(owner_->publish("s" + std::to_string(i), m, buf).is_ok());
  }
  EXPECT_EQ(where[1] - where[0], 5 << 20) << "page-aligned first fit, one after the other";
  for (int round = 0; round < 2; ++round)
    for (int i = 0; i < 3; ++i) {
      FetchResult r = fetcher_->fetch(owner_->address(), "s" + std::to_string(i), expect(toks));
      ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
      ASSERT_EQ(r.manifest.byte_size, want[i].size());
      EXPECT_EQ(std::memcmp(r.bytes->data(), want[i].data(), want[i].size()), 0) << i;
    }
  ASSERT_TRUE(owner_->remove("s1"));
  // The owner thread sweeps the graveyard every ~20 ms; then the block is free again.
  std::shared_ptr<RegisteredBuffer> again;
  for (int i = 0; i < 100 && (!again || again->data() != where[1]); ++i) {
    again.reset();
    std::this_thread::sleep_for(10ms);
    again = owner_->allocate(5u << 20);
  }
  ASSERT_TRUE(again);
  EXPECT_EQ(again->data(), where[1]);
  // Larger than what is left in the arena: a mapping of its own, still usable.
  auto big = owner_->allocate(40u << 20);
  ASSERT_TRUE(big);
  std::memset(big->data(), 7, big->size());
}

TEST_P(UcxTransferTest, HungOwnerTimesOut) {
  std::vector<int32_t> toks = tokens(10);
  publish("s", 1000, toks);
  owner_->test_stall_requests(true);
  FetchOptions opt;
  opt.timeout = 500ms;
  auto t0 = Clock::now();
  FetchResult r = fetcher_->fetch(owner_->address(), "s", expect(toks), opt);
  auto took = Clock::now() - t0;
  EXPECT_EQ(r.status.code(), StatusCode::kTimeout) << r.status.to_string();
  EXPECT_GE(took, 500ms);
  EXPECT_LT(took, 2500ms);  // the timeout plus endpoint teardown, with room for a loaded CI box
  // The node recovers: the next fetch works (the late reply of the first is ignored).
  owner_->test_stall_requests(false);
  r = fetcher_->fetch(owner_->address(), "s", expect(toks));
  EXPECT_TRUE(r.status.is_ok()) << r.status.to_string();
}

TEST_P(UcxTransferTest, OwnerStoppedMidFetchNeverHangs) {
  std::vector<int32_t> toks = tokens(10);
  publish("s", 1000, toks);
  owner_->test_stall_requests(true);
  FetchOptions opt;
  opt.timeout = 4s;
  std::string addr = owner_->address();
  auto t0 = Clock::now();
  auto fut =
      std::async(std::launch::async, [&] { return fetcher_->fetch(addr, "s", expect(toks), opt); });
  std::this_thread::sleep_for(200ms);
  owner_.reset();  // the owner goes away while the fetcher waits for its answer
  ASSERT_EQ(fut.wait_for(opt.timeout + 2s), std::future_status::ready) << "fetch hangs";
  FetchResult r = fut.get();
  auto took = Clock::now() - t0;
  EXPECT_TRUE(r.status.code() == StatusCode::kUnavailable ||
              r.status.code() == StatusCode::kTimeout)
      << r.status.to_string();
  std::printf("owner stopped mid-fetch: %s after %.0f ms\n", r.status.to_string().c_str(),
              std::chrono::duration<double, std::milli>(took).count());
}

TEST_P(UcxTransferTest, OwnerStoppedBetweenManifestAndReadFailsCleanly) {
  std::vector<int32_t> toks = tokens(10);
  publish("s", 8u << 20, toks);
  std::string addr = owner_->address();
  FetchOptions opt;
  opt.timeout = 4s;
  opt.test_before_read = [&] { owner_.reset(); };  // registered memory is gone with it
  auto t0 = Clock::now();
  FetchResult r = fetcher_->fetch(addr, "s", expect(toks), opt);
  auto took = Clock::now() - t0;
  // Either the read fails, or (shared memory kept mapped by the reader) it completes and the
  // bytes must still verify; never a hang or wrong bytes.
  if (r.status.is_ok()) {
    EXPECT_TRUE(verify_snapshot_bytes(r.manifest, r.data()).is_ok());
  } else {
    EXPECT_TRUE(r.status.code() == StatusCode::kUnavailable ||
                r.status.code() == StatusCode::kTimeout || r.status.code() == StatusCode::kCorrupt)
        << r.status.to_string();
  }
  EXPECT_LT(took, opt.timeout + 1s);
  std::printf("owner stopped before the read: %s after %.0f ms\n", r.status.to_string().c_str(),
              std::chrono::duration<double, std::milli>(took).count());
}

INSTANTIATE_TEST_SUITE_P(PeerDetection, UcxTransferTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "PeerOn" : "PeerOff"; });

}  // namespace
}  // namespace uf::kv
