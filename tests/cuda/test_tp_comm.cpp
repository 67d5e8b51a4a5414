// TpGroup (src/cuda/tp/nccl_comm.h): NCCL all-reduce and all-gather over every local GPU (1 GPU:
// the TP = 1 path, no NCCL), compared with the host. The NVLS guard and the missing-library
// message are checked without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/dtypes.h"
#include "core/error.h"
#include "cuda/tp/nccl_comm.h"
#include "cuda_test_util.h"

using uf::cuda::test::gpu_count;
using uf::cuda::tp::CommDType;
using uf::cuda::tp::TpGroup;

namespace {

// One buffer per rank, each on its rank's device.
struct RankBuffers {
  std::vector<void*> ptrs;
  std::vector<cudaStream_t> streams;
  explicit RankBuffers(const TpGroup& g, size_t bytes) {
    for (int r = 0; r < g.size(); ++r) {
      UF_CUDA_CHECK(cudaSetDevice(g.device(r)));
      void* p = nullptr;
      UF_CUDA_CHECK(cudaMalloc(&p, bytes));
      UF_CUDA_CHECK(cudaMemset(p, 0xFF, bytes));  // NaN poison for fp32 and bf16
      ptrs.push_back(p);
      cudaStream_t s = nullptr;
      UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams.push_back(s);
    }
  }
  ~RankBuffers() {
    for (size_t r = 0; r < ptrs.size(); ++r) {
      cudaFree(ptrs[r]);
      cudaStreamDestroy(streams[r]);
    }
  }
  void sync() {
    for (auto s : streams) UF_CUDA_CHECK(cudaStreamSynchronize(s));
  }
};

template <typename T>
void upload(void* dst, const std::vector<T>& v) {
  UF_CUDA_CHECK(cudaMemcpy(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}
template <typename T>
std::vector<T> download(const void* src, size_t n) {
  std::vector<T> v(n);
  UF_CUDA_CHECK(cudaMemcpy(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// A value with magnitude in [1/16, 1): sums of two such bf16/fp32 values are exact in fp32, so
// with 2 ranks the only rounding is the final one.
float random_value(std::mt19937& rng) {
  std::uniform_real_distribution<float> mag(0.0625f, 1.0f);
  return (rng() & 1 ? -1.0f : 1.0f) * mag(rng);
}

// Compares `got` with the host sum; `tol(i)` is the allowed |error| at i (0: bitwise equal).
struct Mismatch {
  size_t bad = 0, nan = 0, first = SIZE_MAX;
  double max_err = 0;
};
template <typename Tol>
Mismatch compare(const std::vector<float>& got, const std::vector<float>& want, Tol tol) {
  Mismatch m;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) ++m.nan;
    const double err = std::fabs(double(got[i]) - double(want[i]));
    m.max_err = std::max(m.max_err, std::isnan(err) ? INFINITY : err);
    const double t = tol(i);
    const bool ok = t == 0 ? uf::cuda::test::bits_equal(got[i], want[i]) : err <= t;
    if (!ok) {
      if (m.first == SIZE_MAX) m.first = i;
      ++m.bad;
    }
  }
  return m;
}

std::string describe(const Mismatch& m, const std::vector<float>& got,
                     const std::vector<float>& want) {
  std::string s = "bad " + std::to_string(m.bad) + ", NaN " + std::to_string(m.nan) +
                  ", max abs err " + std::to_string(m.max_err);
  if (m.first != SIZE_MAX)
    s += ", first bad index " + std::to_string(m.first) + " got " + std::to_string(got[m.first]) +
         " want " + std::to_string(want[m.first]);
  return s;
}

// Every local GPU (1 GPU: the no-NCCL TP = 1 path).
std::unique_ptr<TpGroup> all_devices() { return TpGroup::create(gpu_count()); }

class EnvRestore {
 public:
  explicit EnvRestore(const char* name) : name_(name) {
    const char* v = std::getenv(name);
    had_ = v != nullptr;
    if (had_) old_ = v;
  }
  ~EnvRestore() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

}  // namespace

TEST(TpComm, NvlsOnIsRefused) {
  EnvRestore restore("NCCL_NVLS_ENABLE");
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  try {
    TpGroup::create(2);
    FAIL() << "a group started with NCCL_NVLS_ENABLE=1";
  } catch (const uf::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("NCCL_NVLS_ENABLE"), std::string::npos) << e.what();
  }
  unsetenv("NCCL_NVLS_ENABLE");
  uf::cuda::tp::require_nvls_off();
  ASSERT_NE(std::getenv("NCCL_NVLS_ENABLE"), nullptr);
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
}

TEST(TpComm, MissingLibraryNamesTheFix) {
  try {
    uf::cuda::tp::load_nccl("/nonexistent/libnccl.so.2");
    FAIL() << "loaded a library that does not exist";
  } catch (const uf::core::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("NCCL not found"), std::string::npos) << m;
    EXPECT_NE(m.find("LD_LIBRARY_PATH"), std::string::npos) << m;
  }
}

// Where a libnccl.so.2 is on the loader path, every symbol resolves and the version is 2.x.
TEST(TpComm, LoadsNcclWhereInstalled) {
  std::shared_ptr<const uf::cuda::tp::NcclLib> lib;
  try {
    lib = uf::cuda::tp::load_nccl("libnccl.so.2");
  } catch (const uf::core::Error& e) {
    GTEST_SKIP() << e.what();
  }
  const std::string v = uf::cuda::tp::nccl_version_string(*lib);
  EXPECT_EQ(v.rfind("2.", 0), 0u) << v;
}

TEST(TpComm, RejectsBadRankCounts) {
  UF_REQUIRE_GPU();
  EXPECT_THROW(TpGroup::create(0), uf::core::Error);
  try {
    TpGroup::create(gpu_count() + 1);
    FAIL() << "a group with more ranks than devices started";
  } catch (const uf::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("device"), std::string::npos) << e.what();
  }
  if (gpu_count() >= 2) {
    EXPECT_THROW(TpGroup::create(2, {0, 0}), uf::core::Error);
  }
}

TEST(TpComm, AllReduceF32MatchesHostSum) {
  UF_REQUIRE_GPU();
  auto g = all_devices();
  const int n = g->size();
  for (size_t count : {size_t(5), size_t((1 << 20) + 3)}) {
    SCOPED_TRACE("ranks " + std::to_string(n) + ", count " + std::to_string(count));
    std::mt19937 rng(1234 + unsigned(count));
    std::vector<std::vector<float>> x(static_cast<size_t>(n), std::vector<float>(count));
    for (auto& v : x)
      for (auto& e : v) e = random_value(rng);
    RankBuffers b(*g, count * 4);
    for (int r = 0; r < n; ++r) upload(b.ptrs[size_t(r)], x[size_t(r)]);
    std::vector<float*> bufs;
    for (void* p : b.ptrs) bufs.push_back(static_cast<float*>(p));
    g->all_reduce_sum_f32(bufs, count, b.streams);
    b.sync();
    // Reference: fp32 sum in rank order; with 2 ranks a + b == b + a exactly (tolerance 0).
    // With more ranks NCCL's order differs: in NCCL's order and in the reference's, each of the
    // n-1 fp32 additions rounds by at most 2^-24 * sum|x|: allowed (n-1) * 2^-23 * sum|x|.
    std::vector<float> want(count), abs_sum(count);
    for (size_t i = 0; i < count; ++i) {
      float s = 0, a = 0;
      for (int r = 0; r < n; ++r) s += x[size_t(r)][i], a += std::fabs(x[size_t(r)][i]);
      want[i] = s;
      abs_sum[i] = a;
    }
    for (int r = 0; r < n; ++r) {
      const auto got = download<float>(b.ptrs[size_t(r)], count);
      const auto m = compare(got, want, [&](size_t i) {
        return n <= 2 ? 0.0 : (n - 1) * std::ldexp(1.0, -23) * abs_sum[i];
      });
      EXPECT_EQ(m.bad, 0u) << "rank " << r << ": " << describe(m, got, want);
    }
  }
}

TEST(TpComm, AllReduceBf16MatchesHostSum) {
  UF_REQUIRE_GPU();
  auto g = all_devices();
  const int n = g->size();
  const size_t count = (1 << 19) + 7;
  std::mt19937 rng(99);
  std::vector<std::vector<uint16_t>> x(static_cast<size_t>(n), std::vector<uint16_t>(count));
  for (auto& v : x)
    for (auto& e : v) e = uf::core::float_to_bf16(random_value(rng));
  RankBuffers b(*g, count * 2);
  for (int r = 0; r < n; ++r) upload(b.ptrs[size_t(r)], x[size_t(r)]);
  g->all_reduce_sum_bf16(b.ptrs, count, b.streams);
  b.sync();
  // Reference: exact sum (fp32; exact for 2 terms in [1/16, 1)) rounded once to bf16. With 2
  // ranks NCCL rounds the same single sum: tolerance 0. With more ranks each of NCCL's n-1 bf16
  // partial sums rounds by at most 2^-9 * sum|x|, the reference once more: allowed
  // n * 2^-9 <= (n-1) * 2^-8 times sum|x|.
  std::vector<float> want(count), abs_sum(count);
  for (size_t i = 0; i < count; ++i) {
    double s = 0, a = 0;
    for (int r = 0; r < n; ++r) {
      const double v = uf::core::bf16_to_float(x[size_t(r)][i]);
      s += v, a += std::fabs(v);
    }
    want[i] = n == 1 ? uf::core::bf16_to_float(x[0][i]) : uf::core::round_bf16(float(s));
    abs_sum[i] = float(a);
  }
  for (int r = 0; r < n; ++r) {
    const auto raw = download<uint16_t>(b.ptrs[size_t(r)], count);
    std::vector<float> got(count);
    for (size_t i = 0; i < count; ++i) got[i] = uf::core::bf16_to_float(raw[i]);
    const auto m = compare(got, want, [&](size_t i) {
      return n <= 2 ? 0.0 : (n - 1) * std::ldexp(1.0, -8) * abs_sum[i];
    });
    EXPECT_EQ(m.bad, 0u) << "rank " << r << " of " << n << ": " << describe(m, got, want);
  }
}

TEST(TpComm, AllGatherPlacesEachRanksSlice) {
  UF_REQUIRE_GPU();
  auto g = all_devices();
  const int n = g->size();
  const size_t count = 4099;
  std::mt19937 rng(7);
  std::vector<std::vector<float>> x(static_cast<size_t>(n), std::vector<float>(count));
  std::vector<float> want;
  for (auto& v : x) {
    for (auto& e : v) e = random_value(rng);
    want.insert(want.end(), v.begin(), v.end());
  }
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(std::string("ranks ") + std::to_string(n) + (in_place ? ", in place" : ""));
    RankBuffers recv(*g, count * n * 4);
    RankBuffers send(*g, count * 4);
    std::vector<const void*> src;
    for (int r = 0; r < n; ++r) {
      if (in_place) {
        float* slot = static_cast<float*>(recv.ptrs[size_t(r)]) + size_t(r) * count;
        upload(slot, x[size_t(r)]);
        src.push_back(slot);
      } else {
        upload(send.ptrs[size_t(r)], x[size_t(r)]);
        src.push_back(send.ptrs[size_t(r)]);
      }
    }
    g->all_gather(src, recv.ptrs, count, CommDType::kF32, recv.streams);
    recv.sync();
    for (int r = 0; r < n; ++r) {
      const auto got = download<float>(recv.ptrs[size_t(r)], count * n);
      const auto m = compare(got, want, [](size_t) { return 0.0; });
      EXPECT_EQ(m.bad, 0u) << "rank " << r << " (slice of the first bad index: "
                           << (m.first == SIZE_MAX ? -1 : long(m.first / count))
                           << "): " << describe(m, got, want);
    }
  }
}

// The per-rank entry from one thread per rank (the CUDA backend's TP workers): every rank sums
// its own buffer in place; the result is the host's fp32 sum (2 ranks: bitwise, see above).
TEST(TpComm, AllReduceF32PerRankThreads) {
  UF_REQUIRE_GPU();
  auto g = all_devices();
  const int n = g->size();
  const size_t count = (1 << 16) + 7;
  std::mt19937 rng(99);
  std::vector<std::vector<float>> x(static_cast<size_t>(n), std::vector<float>(count));
  for (auto& v : x)
    for (auto& e : v) e = random_value(rng);
  RankBuffers b(*g, count * 4);
  for (int r = 0; r < n; ++r) upload(b.ptrs[size_t(r)], x[size_t(r)]);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        UF_CUDA_CHECK(cudaSetDevice(g->device(r)));
        // Twice, so that a second collective on the same communicators follows the first.
        for (int it = 0; it < 2; ++it)
          g->all_reduce_sum_rank(r, b.ptrs[size_t(r)], count, CommDType::kF32,
                                 b.streams[size_t(r)]);
        UF_CUDA_CHECK(cudaStreamSynchronize(b.streams[size_t(r)]));
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) ASSERT_TRUE(errors[size_t(r)].empty()) << errors[size_t(r)];
  // After two in-place sums every element is n * (sum over ranks): with 2 ranks, 2 * (a + b),
  // exact (the doubling is exact in fp32). More ranks: the tolerance of the test above, doubled.
  std::vector<float> want(count), abs_sum(count);
  for (size_t i = 0; i < count; ++i) {
    float s = 0, a = 0;
    for (int r = 0; r < n; ++r) s += x[size_t(r)][i], a += std::fabs(x[size_t(r)][i]);
    want[i] = n == 1 ? s : float(n) * s;
    abs_sum[i] = float(n) * a;
  }
  for (int r = 0; r < n; ++r) {
    const auto got = download<float>(b.ptrs[size_t(r)], count);
    const auto m = compare(got, want, [&](size_t i) {
      return n <= 2 ? 0.0 : 2.0 * (n - 1) * std::ldexp(1.0, -23) * abs_sum[i];
    });
    EXPECT_EQ(m.bad, 0u) << "rank " << r << ": " << describe(m, got, want);
  }
}

// The per-rank all-gather from one thread per rank: rank q's slice lands at q * count on every
// rank, bit for bit.
TEST(TpComm, AllGatherPerRankThreads) {
  UF_REQUIRE_GPU();
  auto g = all_devices();
  const int n = g->size();
  const size_t count = 1000;
  std::mt19937 rng(7);
  std::vector<std::vector<float>> x(static_cast<size_t>(n), std::vector<float>(count));
  for (auto& v : x)
    for (auto& e : v) e = random_value(rng);
  RankBuffers send(*g, count * 4), recv(*g, size_t(n) * count * 4);
  for (int r = 0; r < n; ++r) upload(send.ptrs[size_t(r)], x[size_t(r)]);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        UF_CUDA_CHECK(cudaSetDevice(g->device(r)));
        g->all_gather_rank(r, send.ptrs[size_t(r)], recv.ptrs[size_t(r)], count, CommDType::kF32,
                           send.streams[size_t(r)]);
        UF_CUDA_CHECK(cudaStreamSynchronize(send.streams[size_t(r)]));
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) ASSERT_TRUE(errors[size_t(r)].empty()) << errors[size_t(r)];
  std::vector<float> want;
  for (const auto& v : x) want.insert(want.end(), v.begin(), v.end());
  for (int r = 0; r < n; ++r) {
    const auto got = download<float>(recv.ptrs[size_t(r)], want.size());
    const auto m = compare(got, want, [](size_t) { return 0.0; });
    EXPECT_EQ(m.bad, 0u) << "rank " << r << ": " << describe(m, got, want);
  }
}
