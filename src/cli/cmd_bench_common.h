#pragma once
// Shared pieces of the `ultrafast bench*` commands (cmd_bench_*.cpp): the synthetic model's
// config, wall-clock statistics, JSON output. Header-only (the CLI globs cmd_*.cpp only).
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/config.h"
#include "model/synthetic.h"

#ifdef UF_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#endif

namespace uf::cli::bench {

using Clock = std::chrono::steady_clock;

inline double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// Rank 0 of TP8 of the released config, Engram tables shrunk (the `bench --synthetic` model).
inline model::ModelConfig synthetic_config(const std::string& name, int64_t engram_rows) {
  UF_CHECK(name == "tp8-rank",
           "bench: --synthetic '{}' is not known (the only synthetic model is tp8-rank)", name);
  return model::with_engram_rows(
      model::rank_slice_config(model::ModelConfig::deepseek_v41_flash(), 8), engram_rows);
}

struct Stats {
  double median_us = 0, min_us = 0, mean_us = 0;
  std::vector<double> samples;
};

// n random token ids in [3, vocab): the synthetic benches' inputs (ids 0..2 are bos / eos / pad).
inline std::vector<int32_t> random_tokens(std::mt19937_64& rng, int n, int vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(3 + rng() % uint64_t(vocab - 3));
  return t;
}

inline Stats stats_of(std::vector<double> v) {
  Stats s;
  s.samples = v;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.median_us = v[v.size() / 2];
  s.min_us = v.front();
  for (double x : v) s.mean_us += x / double(v.size());
  return s;
}

// Wall time of f() (steady_clock), `warmup` untimed calls first.
template <typename F>
Stats time_calls(int warmup, int iters, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> v;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    f();
    v.push_back(us_since(t0));
  }
  return stats_of(std::move(v));
}

inline nlohmann::json stats_json(const Stats& s) {
  return {{"median_us", s.median_us},
          {"min_us", s.min_us},
          {"mean_us", s.mean_us},
          {"samples_us", s.samples}};
}

template <typename T>
std::vector<T> parse_list(const std::string& s, const char* what) {
  std::vector<T> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const double v = std::stod(item, &used);
      UF_CHECK(used == item.size(), "bench: {} entry '{}' is not a number", what, item);
      out.push_back(T(v));
    } catch (const std::logic_error&) {
      core::fail("bench: {} entry '{}' is not a number", what, item);
    }
  }
  UF_CHECK(!out.empty(), "bench: {} '{}' lists nothing", what, s);
  return out;
}

inline void write_json(const std::string& file, const nlohmann::json& out) {
  if (file.empty()) return;
  std::ofstream f(file);
  UF_CHECK(f.good(), "bench: cannot write --json file {}", file);
  f << out.dump(2) << "\n";
  spdlog::info("bench: wrote {}", file);
}

inline nlohmann::json read_json(const std::string& file, const char* what) {
  std::ifstream f(file);
  UF_CHECK(f.good(), "bench: cannot read {} {} (run the step bench with --json first)", what, file);
  try {
    return nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    core::fail("bench: {} {} is not JSON: {}", what, file, e.what());
  }
}

#ifdef UF_HAVE_CUDA

struct Bandwidth {
  double memcpy_gbs = 0, copy_kernel_gbs = 0;
  double best() const { return std::max(memcpy_gbs, copy_kernel_gbs); }
};

// Read + write bytes per second of a 2 GiB device-to-device copy (median of 10 after 2 warm-ups),
// by cudaMemcpyAsync and by the 16-byte vector copy kernel: the floors' bandwidth.
inline Bandwidth measure_bandwidth(int device) {
  UF_CUDA_CHECK(cudaSetDevice(device));
  const size_t n = size_t(2) << 30;
  void *src = nullptr, *dst = nullptr;
  UF_CUDA_CHECK(cudaMalloc(&src, n));
  UF_CUDA_CHECK(cudaMalloc(&dst, n));
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cuda::fill_random_bytes(static_cast<uint8_t*>(src), n, 99, 0, 255, s);
  cudaEvent_t a, b;
  UF_CUDA_CHECK(cudaEventCreate(&a));
  UF_CUDA_CHECK(cudaEventCreate(&b));
  auto gbs = [&](auto&& body) {
    std::vector<float> t;
    for (int i = 0; i < 12; ++i) {
      UF_CUDA_CHECK(cudaEventRecord(a, s));
      body();
      UF_CUDA_CHECK(cudaEventRecord(b, s));
      UF_CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      UF_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      if (i >= 2) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return 2.0 * double(n) / (double(t[t.size() / 2]) * 1e-3) / 1e9;
  };
  Bandwidth bw;
  bw.memcpy_gbs =
      gbs([&] { UF_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s)); });
  bw.copy_kernel_gbs = gbs([&] { cuda::device_copy(dst, src, n, s); });
  UF_CUDA_CHECK(cudaEventDestroy(a));
  UF_CUDA_CHECK(cudaEventDestroy(b));
  UF_CUDA_CHECK(cudaStreamDestroy(s));
  UF_CUDA_CHECK(cudaFree(src));
  UF_CUDA_CHECK(cudaFree(dst));
  return bw;
}

// Device memory in use (total - free), GB.
inline double device_used_gb(int device) {
  UF_CUDA_CHECK(cudaSetDevice(device));
  size_t free_b = 0, total_b = 0;
  UF_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return double(total_b - free_b) * 1e-9;
}

#endif  // UF_HAVE_CUDA

}  // namespace uf::cli::bench
