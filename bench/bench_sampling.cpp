// CPU cost of the sampling path at the model's vocabulary (V = 129,280): the transform, one draw,
// and verification of a 7-draft block. Reference numbers for the CPU backend; the device kernel is
// measured in the CUDA benchmarks.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "sampling/rng.h"
#include "sampling/sampler.h"
#include "sampling/transform.h"
#include "sampling/verify.h"

namespace {

using namespace uf::sampling;
constexpr int64_t kVocab = 129280;

std::vector<float> random_logits(uint64_t seed, int64_t n) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> l(n);
  for (float& x : l) x = normal(rng);
  return l;
}

void BM_Transform(benchmark::State& state) {
  const SamplingParams params{1.0f, state.range(0) / 100.0f, int32_t(state.range(1))};
  const std::vector<float> logits = random_logits(1, kVocab);
  std::vector<float> probs(kVocab), scratch(kVocab);
  for (auto _ : state) {
    logits_to_probs(logits.data(), kVocab, params, probs.data(), scratch.data());
    benchmark::DoNotOptimize(probs.data());
  }
  state.SetBytesProcessed(state.iterations() * kVocab * 4);
}
BENCHMARK(BM_Transform)->Args({100, 0})->Args({90, 0})->Args({100, 50});

void BM_SampleFromProbs(benchmark::State& state) {
  std::vector<float> probs(kVocab), scratch(kVocab);
  logits_to_probs(random_logits(2, kVocab).data(), kVocab, {}, probs.data(), scratch.data());
  uint32_t i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        sample_from_probs(probs.data(), kVocab, stream_uniform(1, i++, RngPurpose::kPlain, 0)));
  }
}
BENCHMARK(BM_SampleFromProbs);

void BM_Verify(benchmark::State& state) {
  const int32_t g = kMaxDraft;
  std::vector<float> p((g + 1) * kVocab), q(g * kVocab), scratch(kVocab);
  std::vector<int32_t> x(g);
  for (int32_t i = 0; i <= g; ++i) {
    logits_to_probs(random_logits(10 + i, kVocab).data(), kVocab, {}, &p[i * kVocab],
                    scratch.data());
  }
  for (int32_t i = 0; i < g; ++i) {
    logits_to_probs(random_logits(30 + i, kVocab).data(), kVocab, {}, &q[i * kVocab],
                    scratch.data());
    x[i] = sample_from_probs(&q[i * kVocab], kVocab, 0.5f);
  }
  const VerifyRows rows{g, kVocab, p.data(), q.data(), x.data()};
  const VerifyMode mode = state.range(0) ? VerifyMode::kBlock : VerifyMode::kTokenWise;
  uint64_t step = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(verify(mode, rows, make_verify_draws(1, step++)).extra_token);
  }
}
BENCHMARK(BM_Verify)->Arg(0)->Arg(1);

}  // namespace

BENCHMARK_MAIN();
