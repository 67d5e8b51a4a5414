// Device verification in the generation loop (CudaBackend::verify_last_rows, cuda/verify.h): on
// the tiny-a fixture model, engine::GenerationLoop with the verify step's logits kept on the
// device emits exactly the tokens (and accepts exactly the drafts) of the same loop verifying on
// the host, for sampled decoding with top-p / top-k in both verification modes and several seeds.
// The transform and the verification are ported in the host's operation order (exp in double on
// both sides), so equality is exact, not statistical.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "../cpu/tiny_a.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda_test_util.h"
#include "engine/generation_loop.h"
#include "engine/hardware_profile.h"
#include "loop_test_util.h"

namespace uf::cuda {
namespace {

using uf::testing::tiny_a_dir;
using uf::testing::tiny_a_golden_i64;

using test::generate;
using test::LoopRun;

TEST(CudaDeviceVerify, LoopEqualsHostVerification) {
  UF_REQUIRE_GPU();
  const auto map = tiny_a_golden_i64("engram_token_map");
  CudaModelOptions on, off;
  off.device_verify = false;
  CudaBackend dev(tiny_a_dir(), map, on), host(tiny_a_dir(), map, off);
  ASSERT_TRUE(dev.device_verify());
  ASSERT_FALSE(host.device_verify());
  const auto pi = tiny_a_golden_i64("prompt_ids");
  const std::vector<int32_t> prompt(pi.begin(), pi.end());
  int steps = 0, accepted = 0;
  for (auto mode : {sampling::VerifyMode::kBlock, sampling::VerifyMode::kTokenWise})
    for (uint64_t seed : {1u, 7u, 42u})
      for (float top_p : {1.0f, 0.9f}) {
        engine::GenerationParams p;
        p.sampling.temperature = 0.8f;
        p.sampling.top_p = top_p;
        p.sampling.top_k = top_p < 1.0f ? 50 : 0;
        p.seed = seed;
        p.verify = mode;
        p.max_new_tokens = 24;
        const LoopRun a = generate(dev, prompt, p), b = generate(host, prompt, p);
        EXPECT_EQ(a.tokens, b.tokens)
            << "mode " << int(mode) << " seed " << seed << " top_p " << top_p;
        EXPECT_EQ(a.accepted, b.accepted) << "mode " << int(mode) << " seed " << seed;
        steps += int(a.accepted.size());
        for (int n : a.accepted) accepted += n;
      }
  std::printf("[device_verify] %d steps, %d drafts accepted, identical to host verification\n",
              steps, accepted);
  EXPECT_GT(accepted, 0) << "no draft was ever accepted: the comparison would not cover tau > 0";
}

// Under TP rank 0 holds the whole logits rows and verifies on its device while every rank runs
// the forward: the same tokens as TP 2 verifying on the host. Both draft on the host here, so the
// comparison is about verification alone (device drafting at TP: test_device_draft.cpp).
TEST(CudaDeviceVerify, TensorParallelLoopEqualsHostVerification) {
  UF_REQUIRE_GPU();
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2)
    GTEST_SKIP() << "TP = 2 needs 2 GPUs, " << gpus << " visible";
  const auto map = tiny_a_golden_i64("engram_token_map");
  CudaModelOptions on, off;
  on.tp = off.tp = 2;
  on.device_draft = false;
  off.device_verify = false;
  CudaBackend dev(tiny_a_dir(), map, on), host(tiny_a_dir(), map, off);
  ASSERT_TRUE(dev.device_verify());
  ASSERT_FALSE(dev.device_draft());
  const auto pi = tiny_a_golden_i64("prompt_ids");
  const std::vector<int32_t> prompt(pi.begin(), pi.end());
  int accepted = 0;
  for (auto mode : {sampling::VerifyMode::kBlock, sampling::VerifyMode::kTokenWise}) {
    engine::GenerationParams p;
    p.sampling.temperature = 0.8f;
    p.sampling.top_p = 0.9f;
    p.seed = 7;
    p.verify = mode;
    p.max_new_tokens = 24;
    const LoopRun a = generate(dev, prompt, p), b = generate(host, prompt, p);
    EXPECT_EQ(a.tokens, b.tokens) << "mode " << int(mode);
    EXPECT_EQ(a.accepted, b.accepted) << "mode " << int(mode);
    for (int n : a.accepted) accepted += n;
  }
  EXPECT_GT(accepted, 0) << "no draft was ever accepted: the comparison would not cover tau > 0";
}

}  // namespace
}  // namespace uf::cuda
