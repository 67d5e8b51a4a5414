// WeightUploader (cuda/weight_uploader.h): bulk pinned-staging uploads must be bitwise copies,
// whatever the sizes (0, 1, odd, larger than one staging buffer, many small ones sharing a
// buffer), with progress that only grows and ends at the total. Exact equality: a copy has no
// tolerance.

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "cuda/device_memory.h"
#include "cuda/device_weights.h"
#include "cuda/ops/linear.h"
#include "cuda/weight_uploader.h"
#include "cuda_test_util.h"
#include "ops_test_weights.h"

namespace uf::cuda {
namespace {

std::vector<uint8_t> random_bytes(size_t n, std::mt19937& rng) {
  std::vector<uint8_t> v(n);
  std::uniform_int_distribution<int> d(0, 255);
  for (auto& b : v) b = uint8_t(d(rng));
  return v;
}

// First index where two byte arrays differ, or -1.
int64_t first_mismatch(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return int64_t(i);
  return -1;
}

UploaderOptions options(size_t buffer_bytes, int threads) {
  UploaderOptions o;
  o.buffer_bytes = buffer_bytes;
  o.threads = threads;
  return o;
}

struct Case {
  std::vector<uint8_t> host;
  uint8_t* dev = nullptr;
};

// Uploads every size through one uploader (one finish at the end) and compares each download.
void check_sizes(const std::vector<size_t>& sizes, UploaderOptions opts, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Case> cases(sizes.size());
  std::vector<UploadProgress> seen;
  opts.progress_interval_s = 0;  // report on every call
  opts.on_progress = [&](const UploadProgress& p) { seen.push_back(p); };
  uint64_t total = 0;
  DeviceArena arena;
  {
    WeightUploader up(0, opts);
    for (size_t i = 0; i < sizes.size(); ++i) {
      cases[i].host = random_bytes(sizes[i], rng);
      cases[i].dev = static_cast<uint8_t*>(arena.alloc_bytes(sizes[i]));
      // Poison: a byte never written stays 0xFF where the host has something else.
      if (sizes[i]) UF_CUDA_CHECK(cudaMemset(cases[i].dev, 0xFF, sizes[i]));
      total += sizes[i];
    }
    // No synchronisation here on purpose: the uploader must order its copies after the poison
    // (and the arena's zero fill) issued on the legacy stream before enqueue().
    for (Case& c : cases) up.enqueue(c.dev, c.host.data(), c.host.size());
    const UploadStats st = up.finish();
    EXPECT_EQ(st.bytes, total);
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto back = download(cases[i].dev, cases[i].host.size());
    const int64_t bad = first_mismatch(cases[i].host, back);
    EXPECT_EQ(bad, -1) << "copy " << i << " of " << sizes[i] << " bytes differs first at byte "
                       << bad << " (host " << int(cases[i].host[size_t(bad < 0 ? 0 : bad)])
                       << ", device " << int(back[size_t(bad < 0 ? 0 : bad)]) << ")";
  }
  if (total == 0) return;
  ASSERT_FALSE(seen.empty()) << "progress callback never called";
  for (size_t i = 1; i < seen.size(); ++i) {
    EXPECT_GE(seen[i].bytes_done, seen[i - 1].bytes_done) << "progress went back at report " << i;
    EXPECT_GE(seen[i].bytes_enqueued, seen[i - 1].bytes_enqueued) << "report " << i;
  }
  for (const auto& p : seen) EXPECT_LE(p.bytes_done, p.bytes_enqueued);
  EXPECT_EQ(seen.back().bytes_done, total);
  EXPECT_EQ(seen.back().bytes_enqueued, total);
}

TEST(WeightUploader, OddSizesBitwiseEqual) {
  UF_REQUIRE_GPU();
  UploaderOptions o;
  o.buffer_bytes = 1 << 20;  // 1 MiB buffers so a few MiB spans many of them
  o.threads = 3;
  o.buffers_per_thread = 2;
  check_sizes({0, 1, 15, 17, 255, 257, 4097, (1 << 20) - 1, 1 << 20, (1 << 20) + 1,
               3 * (1 << 20) + 12345, 0, 7, 65537, 9 * (1 << 20) + 3},
              o, 1);
}

TEST(WeightUploader, ManySmallCopiesShareBuffers) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(2);
  std::uniform_int_distribution<size_t> d(0, 5000);
  std::vector<size_t> sizes(3000);
  for (auto& s : sizes) s = d(rng);
  UploaderOptions o;
  o.buffer_bytes = 256 << 10;
  o.threads = 4;
  check_sizes(sizes, o, 3);
}

TEST(WeightUploader, OneThreadOneBuffer) {
  UF_REQUIRE_GPU();
  UploaderOptions o;
  o.buffer_bytes = 64 << 10;
  o.threads = 1;
  o.buffers_per_thread = 1;  // every refill waits for the previous DMA
  check_sizes({100, 70000, 1, 200000, 64 << 10, 3}, o, 4);
}

TEST(WeightUploader, ReusableAfterFinishAndEmptyFinish) {
  UF_REQUIRE_GPU();
  WeightUploader up(0, options(1 << 16, 2));
  EXPECT_EQ(up.finish().bytes, 0u);  // nothing enqueued: returns at once
  std::mt19937 rng(5);
  for (int round = 0; round < 3; ++round) {
    const auto host = random_bytes(200000 + size_t(round) * 777, rng);
    test::DeviceBuffer<uint8_t> dev(host.size());
    up.enqueue(dev.get(), host.data(), host.size());
    EXPECT_EQ(up.finish().bytes, host.size());
    EXPECT_EQ(first_mismatch(host, dev.download()), -1) << "round " << round;
  }
}

TEST(WeightUploader, UploadWeightThroughUploaderMatchesSync) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(6);
  // An FP8 weight [70, 100] with 32x32 block scales [3, 4]: odd, unaligned sizes.
  const auto data = random_bytes(70 * 100, rng);
  const auto scale = random_bytes(3 * 4, rng);
  model::Weight w;
  w.format = model::WFormat::kFP8;
  w.rows = 70;
  w.cols = 100;
  w.data = data.data();
  w.scale = scale.data();
  DeviceArena arena;
  WeightUploader up(0, options(4096, 2));
  const DeviceWeight a = upload_weight(w, arena, &up);
  const DeviceWeight b = upload_weight(w, arena);  // the synchronous path
  const DeviceWeight empty = upload_weight(model::Weight{}, arena, &up);
  up.finish();
  EXPECT_TRUE(empty.empty());
  EXPECT_EQ(first_mismatch(download(a.data, data.size()), data), -1);
  EXPECT_EQ(first_mismatch(download(a.scale, scale.size()), scale), -1);
  EXPECT_EQ(first_mismatch(download(b.data, data.size()), data), -1);
  EXPECT_EQ(a.rows, 70);
  EXPECT_EQ(a.cols, 100);
}

// Column slices of a row-major host tensor gathered on upload: rows of 1, 17 and 5000 bytes, and
// rows longer than a staging buffer (copied one by one).
TEST(WeightUploader, RowGatherMatchesHostSlices) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(7);
  struct Slice {
    size_t rows, row_bytes, pitch, col;
  };
  const std::vector<Slice> slices = {
      {1000, 1, 3, 2},      {333, 17, 40, 5}, {257, 5000, 6001, 1000}, {3, 9000, 9100, 50},
      {50, 144, 1152, 144}, {1, 10, 100, 0},  {0, 10, 100, 0},         {20, 64, 64, 0}};
  WeightUploader up(0, options(8192, 3));
  std::vector<std::vector<uint8_t>> hosts, expect;
  std::vector<std::unique_ptr<test::DeviceBuffer<uint8_t>>> devs;
  for (const Slice& sl : slices) {
    hosts.push_back(random_bytes(sl.rows * sl.pitch, rng));
    std::vector<uint8_t> e;
    for (size_t r = 0; r < sl.rows; ++r)
      e.insert(e.end(), hosts.back().begin() + long(r * sl.pitch + sl.col),
               hosts.back().begin() + long(r * sl.pitch + sl.col + sl.row_bytes));
    expect.push_back(std::move(e));
    devs.push_back(std::make_unique<test::DeviceBuffer<uint8_t>>(sl.rows * sl.row_bytes));
    if (sl.rows) devs.back()->poison();
  }
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  uint64_t total = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& sl = slices[i];
    up.enqueue_rows(devs[i]->get(), hosts[i].data() + sl.col, sl.rows, sl.row_bytes, sl.pitch);
    total += sl.rows * sl.row_bytes;
  }
  EXPECT_EQ(up.finish().bytes, total);
  for (size_t i = 0; i < slices.size(); ++i) {
    if (slices[i].rows == 0) continue;
    const int64_t bad = first_mismatch(expect[i], devs[i]->download());
    EXPECT_EQ(bad, -1) << "slice " << i << " (" << slices[i].rows << " rows of "
                       << slices[i].row_bytes << " bytes, pitch " << slices[i].pitch
                       << ") differs first at byte " << bad;
  }
}

TEST(WeightUploader, UploadScopeRoutesUploadWeightAndCopies) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(8);
  const auto data = random_bytes(64 * 96, rng);
  model::Weight w;
  w.format = model::WFormat::kBF16;
  w.rows = 64;
  w.cols = 48;  // 64 * 48 * 2 bytes
  w.data = data.data();
  const auto raw = random_bytes(100003, rng);
  DeviceArena arena;
  EXPECT_EQ(UploadScope::current(), nullptr);
  DeviceWeight d;
  uint8_t* copy = static_cast<uint8_t*>(arena.alloc_bytes(raw.size()));
  {
    UploadScope scope(0, options(1 << 16, 2));
    ASSERT_EQ(UploadScope::current(), &scope.uploader());
    d = upload_weight(w, arena);  // the two-argument call, routed through the scope
    copy_to_device(copy, raw.data(), raw.size());
    EXPECT_EQ(scope.uploader().progress().bytes_enqueued, data.size() + raw.size());
    EXPECT_EQ(scope.finish().bytes, data.size() + raw.size());
  }
  EXPECT_EQ(UploadScope::current(), nullptr);
  EXPECT_EQ(first_mismatch(download(d.data, data.size()), data), -1);
  EXPECT_EQ(first_mismatch(download(copy, raw.size()), raw), -1);
}

// UploadScope::after_upload: without a scope the work runs at once; with one it runs after
// finish() (the copies are on the device by then), in registration order, on the innermost scope;
// a scope destroyed without finish() runs it after draining its copies.
TEST(WeightUploader, AfterUploadRunsOnceTheCopiesLanded) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(9);
  int ran = 0;
  UploadScope::after_upload([&] { ++ran; });
  EXPECT_EQ(ran, 1) << "no scope: at once";
  const auto raw = random_bytes(size_t(6) << 20, rng);
  DeviceArena arena;
  uint8_t* dst = static_cast<uint8_t*>(arena.alloc_bytes(raw.size()));
  std::vector<int> order;
  {
    UploadScope outer(0, options(1 << 20, 2));
    copy_to_device(dst, raw.data(), raw.size());
    int64_t seen = -2;
    UploadScope::after_upload([&] {
      order.push_back(1);
      seen = first_mismatch(download(dst, raw.size()), raw);
    });
    UploadScope::after_upload([&] { order.push_back(2); });
    {
      UploadScope inner(0, options(1 << 16, 1));
      UploadScope::after_upload([&] { order.push_back(0); });
      inner.finish();
      EXPECT_EQ(order, std::vector<int>{0}) << "the inner scope runs its own work only";
    }
    EXPECT_EQ(order, std::vector<int>{0}) << "nothing of the outer scope before its finish()";
    outer.finish();
    EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(seen, -1) << "the work saw the copy on the device";
    outer.finish();  // nothing left to run
    EXPECT_EQ(order.size(), 3u);
  }
  {
    UploadScope scope(0, options(1 << 20, 2));
    copy_to_device(dst, raw.data(), raw.size());
    UploadScope::after_upload([&] { order.push_back(3); });
  }  // no finish(): the destructor drains the copies and runs the work
  EXPECT_EQ(order.back(), 3);
}

// A DeviceLinear built under a scope (its bf16 weight copy for the prefill GEMM is made after the
// uploads) gives the bits of one built without.
TEST(WeightUploader, PrefillWeightCopyAfterTheUpload) {
  UF_REQUIRE_GPU();
  using test::bits_equal;
  using test::DeviceBuffer;
  using test::make_weight;
  using test::random_acts;
  using test::sync_and_check;
  std::mt19937 rng(10);
  auto hw = make_weight(model::WFormat::kFP8, 256, 1024, rng);
  DeviceArena arena;
  const DeviceLinear plain(hw->w, LinearKind::kQuant, arena);
  std::unique_ptr<DeviceLinear> scoped;
  {
    UploadScope scope(0, options(1 << 16, 2));
    scoped = std::make_unique<DeviceLinear>(hw->w, LinearKind::kQuant, arena);
    scope.finish();
  }
  const int T = 40;
  const DeviceBuffer<float> dx(random_acts(T, 1024, rng));
  DeviceBuffer<float> y0(size_t(T) * 256), y1(size_t(T) * 256);
  y0.poison();
  y1.poison();
  plain.apply(dx.get(), T, y0.get(), nullptr);
  scoped->apply(dx.get(), T, y1.get(), nullptr);
  sync_and_check();
  const auto a = y0.download(), b = y1.download();
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_TRUE(bits_equal(a[i], b[i]) && std::isfinite(a[i]))
        << i << ": " << a[i] << " vs " << b[i];
}

TEST(WeightUploader, BadPointerIsAnError) {
  UF_REQUIRE_GPU();
  WeightUploader up(0, options(4096, 1));
  uint8_t x = 0;
  EXPECT_ANY_THROW(up.enqueue(nullptr, &x, 1));
  up.enqueue(nullptr, nullptr, 0);  // an empty copy needs no pointers
  EXPECT_EQ(up.finish().bytes, 0u);
}

}  // namespace
}  // namespace uf::cuda
