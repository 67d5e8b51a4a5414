// bench_cuda_verify: the device sampling transform (cuda/verify.h) at the real vocab (129280),
// temperature 1, top-p 0.95 / 0.5 / off, top-k 0 / 50, on three kinds of rows:
//   flat   logits = normal * 0.01 (random weights: the nucleus is ~95% of the vocab),
//   peaked logits = normal * 3,
//   zipf   logits = -1.1 log(rank + 1) + normal * 0.05 (real-looking; ranks shuffled),
// each with the cluster kernels (new: a row over the CTAs of a thread-block cluster) and the
// single-CTA ones (old: one 1024-thread block a row, the same top-p cut by mass;
// set_single_cta_transform_for_bench). Figures: median replay
// of a CUDA graph (events) of
//   row    logits_to_probs_on_device on one row (latency of a row),
//   rows15 logits_to_probs_on_device on 15 rows in one launch (a verify step with 7 drafts),
//   draft5 sample_slot_on_device x 5 (a DSpark draft round, the slots one after another),
//   verify verify_probs_on_device, block mode, 7 drafts on the 15 transformed rows (the
//          verification kernel alone; random draft tokens: early rejections, residual draws),
// in microseconds per call. The nucleus size printed is that of the first row.
//
//   bench_cuda_verify [--reps N] [--skip-old]

#include <cstdio>
#include <cstdlib>
#include <cstring>

#ifndef UF_HAVE_CUDA
int main() {
  std::printf("bench_cuda_verify: built without the CUDA backend\n");
  return 0;
}
#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/verify.h"
#include "cuda_bench_util.h"

using namespace uf::cuda;

namespace {

constexpr int kVocab = 129280;
constexpr int kRows = 15;  // 2 kMaxDraft + 1
constexpr int kSlots = 5;

std::vector<float> make_rows(const char* kind, int rows, std::mt19937& rng) {
  std::vector<float> l(size_t(rows) * kVocab);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<int> rank(kVocab);
  for (int r = 0; r < rows; ++r) {
    float* row = l.data() + size_t(r) * kVocab;
    if (std::strcmp(kind, "flat") == 0) {
      for (int x = 0; x < kVocab; ++x) row[x] = 0.01f * nd(rng);
    } else if (std::strcmp(kind, "peaked") == 0) {
      for (int x = 0; x < kVocab; ++x) row[x] = 3.0f * nd(rng);
    } else {
      for (int i = 0; i < kVocab; ++i) rank[size_t(i)] = i;
      std::shuffle(rank.begin(), rank.end(), rng);
      for (int x = 0; x < kVocab; ++x)
        row[x] = -1.1f * std::log(float(rank[size_t(x)]) + 1.0f) + 0.05f * nd(rng);
    }
  }
  return l;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  bool skip_old = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) reps = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--skip-old") == 0) skip_old = true;
  }
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  VerifyPlan plan(kVocab);
  float *d_logits = nullptr, *d_probs = nullptr, *d_u = nullptr;
  int32_t* d_tok = nullptr;
  DeviceSamplingParams* d_params = nullptr;
  UF_CUDA_CHECK(cudaMalloc(&d_logits, size_t(kRows) * kVocab * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&d_probs, size_t(kRows) * kVocab * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&d_u, kSlots * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&d_tok, 2 * kSlots * sizeof(int32_t)));
  UF_CUDA_CHECK(cudaMalloc(&d_params, sizeof(DeviceSamplingParams)));
  int32_t* d_drafts = nullptr;
  unsigned long long* d_seed_step = nullptr;
  uf::sampling::VerifyResult* d_result = nullptr;
  UF_CUDA_CHECK(cudaMalloc(&d_drafts, uf::sampling::kMaxDraft * sizeof(int32_t)));
  UF_CUDA_CHECK(cudaMalloc(&d_seed_step, 2 * sizeof(unsigned long long)));
  UF_CUDA_CHECK(cudaMalloc(&d_result, sizeof(uf::sampling::VerifyResult)));
  const int32_t drafts_host[uf::sampling::kMaxDraft] = {11, 2024, 70000, 5, 129000, 333, 64000};
  const unsigned long long seed_step_host[2] = {1234, 5};
  UF_CUDA_CHECK(cudaMemcpy(d_drafts, drafts_host, sizeof(drafts_host), cudaMemcpyHostToDevice));
  UF_CUDA_CHECK(
      cudaMemcpy(d_seed_step, seed_step_host, sizeof(seed_step_host), cudaMemcpyHostToDevice));
  const float us_host[kSlots] = {0.1f, 0.3f, 0.5f, 0.7f, 0.9f};
  UF_CUDA_CHECK(cudaMemcpy(d_u, us_host, sizeof(us_host), cudaMemcpyHostToDevice));

  struct Cfg {
    float top_p;
    int top_k;
  };
  const Cfg cfgs[] = {{1.0f, 0}, {0.95f, 0}, {0.5f, 0}, {0.95f, 50}, {0.5f, 50}};
  std::mt19937 rng(7);
  std::printf("%-7s %-6s %-5s %8s | %10s %10s | %10s %10s | %10s %10s | %8s\n", "rows", "top_p",
              "top_k", "nucleus", "row new", "row old", "rows15 new", "rows15 old", "draft5 new",
              "draft5 old", "verify");
  for (const char* kind : {"flat", "peaked", "zipf"}) {
    const std::vector<float> l = make_rows(kind, kRows, rng);
    for (const Cfg& c : cfgs) {
      uf::sampling::SamplingParams p;
      p.temperature = 1.0f;
      p.top_p = c.top_p;
      p.top_k = c.top_k;
      const DeviceSamplingParams dp = device_sampling_params(p);
      UF_CUDA_CHECK(cudaMemcpy(d_params, &dp, sizeof(dp), cudaMemcpyHostToDevice));
      float t[2][3] = {{0, 0, 0}, {0, 0, 0}};
      for (int old = 0; old < (skip_old ? 1 : 2); ++old) {
        set_single_cta_transform_for_bench(old != 0);
        // The draft slots add no bias and keep the logits, so every replay sees the same rows.
        UF_CUDA_CHECK(
            cudaMemcpy(d_logits, l.data(), l.size() * sizeof(float), cudaMemcpyHostToDevice));
        t[old][0] = uf::bench::time_graph_us(
            s, reps, [&] { logits_to_probs_on_device(plan, d_logits, 1, kVocab, p, d_probs, s); });
        t[old][1] = uf::bench::time_graph_us(s, reps, [&] {
          logits_to_probs_on_device(plan, d_logits, kRows, kVocab, p, d_probs, s);
        });
        t[old][2] = uf::bench::time_graph_us(s, reps, [&] {
          for (int i = 0; i < kSlots; ++i) {
            sample_slot_on_device(d_logits + size_t(i) * kVocab, nullptr, kVocab, d_params, d_u + i,
                                  d_probs + size_t(i) * kVocab, d_tok + i, d_tok + kSlots + i, s);
          }
        });
      }
      set_single_cta_transform_for_bench(false);
      // The verification kernel on the 15 rows transformed as a verify step does (8 target, 7
      // draft rows in the plan's buffers).
      UF_CUDA_CHECK(
          cudaMemcpy(d_logits, l.data(), l.size() * sizeof(float), cudaMemcpyHostToDevice));
      constexpr int g = uf::sampling::kMaxDraft;
      logits_to_probs_on_device(plan, d_logits, g + 1, kVocab, p, plan.target_probs(), s);
      logits_to_probs_on_device(plan, d_logits + size_t(g + 1) * kVocab, g, kVocab, p,
                                plan.draft_probs(), s);
      const double t_verify = uf::bench::time_graph_us(s, reps, [&] {
        verify_probs_on_device(plan, uf::sampling::VerifyMode::kBlock, plan.target_probs(),
                               plan.draft_probs(), d_drafts, g, kVocab, d_seed_step, nullptr,
                               d_result, nullptr, s);
      });
      logits_to_probs_on_device(plan, d_logits, 1, kVocab, p, d_probs, s);
      UF_CUDA_CHECK(cudaStreamSynchronize(s));
      std::vector<float> row(kVocab);
      UF_CUDA_CHECK(
          cudaMemcpy(row.data(), d_probs, kVocab * sizeof(float), cudaMemcpyDeviceToHost));
      const long nucleus = std::count_if(row.begin(), row.end(), [](float v) { return v > 0; });
      std::printf("%-7s %-6.2f %-5d %8ld | %10.1f %10.1f | %10.1f %10.1f | %10.1f %10.1f | %8.1f\n",
                  kind, double(c.top_p), c.top_k, nucleus, double(t[0][0]), double(t[1][0]),
                  double(t[0][1]), double(t[1][1]), double(t[0][2]), double(t[1][2]), t_verify);
    }
  }
  cudaFree(d_logits);
  cudaFree(d_probs);
  cudaFree(d_drafts);
  cudaFree(d_seed_step);
  cudaFree(d_result);
  cudaFree(d_u);
  cudaFree(d_tok);
  cudaFree(d_params);
  UF_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}
#endif
