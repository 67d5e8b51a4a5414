// Synthetic rank-slice models (model/synthetic.h): the TP8 slice has one rank's shapes and bytes,
// the synthetic checkpoint satisfies the contract with sane values (no NaN anywhere, small host
// memory even for the released model), the CPU backend runs on it, and the decode-step floor
// grows with rows and with context.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "../cpu/tiny_a.h"
#include "core/dtypes.h"
#include "core/error.h"
#include "cpu/model.h"
#include "model/config.h"
#include "model/engram_hash.h"
#include "model/synthetic.h"
#include "model/tensor_contract.h"
#include "model/tp_plan.h"

namespace uf::model {
namespace {

namespace fs = std::filesystem;

using uf::testing::tiny_a_dir;

TpOptions backend_options() {
  // The CUDA backend's sharding (cuda/backend/cuda_model.h backend_tp_options()): only heads,
  // index heads and experts split.
  TpOptions o;
  o.split_head = false;
  o.split_wq_a = false;
  o.split_engram_tables = false;
  o.split_engram_wkv = false;
  return o;
}

uint64_t contract_bytes(const ModelConfig& c) {
  uint64_t n = 0;
  for (const auto& e : tensor_contract(c)) n += e.nbytes();
  return n;
}

TEST(RankSlice, Tp8OfTheReleasedModelHasOneRanksDims) {
  const auto full = ModelConfig::deepseek_v41_flash();
  const auto s = rank_slice_config(full, 8);
  EXPECT_EQ(s.n_heads, 8);
  EXPECT_EQ(s.o_groups, 1);
  EXPECT_EQ(s.index_n_heads, 4);
  EXPECT_EQ(s.moe_inter_dim, 288);
  // Replicated dimensions are unchanged.
  EXPECT_EQ(s.dim, full.dim);
  EXPECT_EQ(s.head_dim, full.head_dim);
  EXPECT_EQ(s.q_lora_rank, full.q_lora_rank);
  EXPECT_EQ(s.o_lora_rank, full.o_lora_rank);
  EXPECT_EQ(s.vocab_size, full.vocab_size);
  EXPECT_EQ(s.n_routed_experts, full.n_routed_experts);
  EXPECT_EQ(s.engram_num_embeddings, full.engram_num_embeddings);
  EXPECT_EQ(s.index_head_dim, full.index_head_dim);
  ASSERT_EQ(s.roles.size(), full.roles.size());
  for (size_t l = 0; l < s.roles.size(); ++l) EXPECT_EQ(s.roles[l].mode, full.roles[l].mode);
  // tp = 1 is the identity.
  EXPECT_EQ(rank_slice_config(full, 1).n_heads, full.n_heads);
}

// `bench --synthetic tp2 --slice-of 4` splits one TP4 rank's slice over 2 GPUs and calls each a
// TP8-shaped rank: every tensor of the slice of a slice must have a TP8 slice's name, dtype and
// shape (the same for 2 x 4 and 4 x 2, and for 2 x 2 against TP4).
TEST(RankSlice, SliceOfASliceHasTheFinerSlicesShapes) {
  const auto full = ModelConfig::deepseek_v41_flash();
  for (const auto& [outer, inner] : std::vector<std::pair<int, int>>{{4, 2}, {2, 4}, {2, 2}}) {
    SCOPED_TRACE(std::to_string(outer) + " x " + std::to_string(inner));
    const auto twice = tensor_contract(rank_slice_config(rank_slice_config(full, outer), inner));
    const auto once = tensor_contract(rank_slice_config(full, outer * inner));
    ASSERT_EQ(twice.size(), once.size());
    for (size_t i = 0; i < once.size(); ++i) {
      EXPECT_EQ(twice[i].name, once[i].name);
      EXPECT_EQ(twice[i].dtype, once[i].dtype) << once[i].name;
      EXPECT_EQ(twice[i].shape, once[i].shape) << once[i].name;
    }
  }
}

TEST(RankSlice, ConfigsThatDoNotSplitFailNamingTheField) {
  const auto full = ModelConfig::deepseek_v41_flash();
  try {
    rank_slice_config(full, 3);
    FAIL() << "tp = 3 should not divide 64 heads";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_heads"), std::string::npos) << e.what();
  }
  try {
    rank_slice_config(full, 16);  // 64 heads split, 8 output groups do not
    FAIL() << "tp = 16 should not divide 8 output groups";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("o_groups"), std::string::npos) << e.what();
  }
  EXPECT_THROW(rank_slice_config(full, 0), core::Error);
}

// The slice's whole-model contract must hold exactly the bytes one rank holds under the
// backend's plan: every split tensor divides evenly at TP8 (32-row/col blocks), and the
// replicated ones (Engram, head, embedding, vision, KV path) are whole on both sides. So the
// tolerance is zero; shrinking the Engram tables removes exactly their dropped rows.
TEST(RankSlice, ContractBytesEqualTheTp8PlanPerRank) {
  const auto full = ModelConfig::deepseek_v41_flash();
  const auto s = rank_slice_config(full, 8);
  const uint64_t slice = contract_bytes(s);
  for (int r : {0, 7}) {
    const auto plan = make_tp_plan(full, 8, r, backend_options());
    EXPECT_EQ(slice, plan.total_bytes()) << "rank " << r;
  }
  const auto small = with_engram_rows(s, int64_t(1) << 22);
  const int64_t row_bytes = s.engram_head_dim + s.engram_head_dim / 32;  // FP8 row + E8M0
  uint64_t dropped = 0;
  for (size_t i = 0; i < s.engram_num_embeddings.size(); ++i) {
    // About the rows asked for: 24 bucket primes just above 4M / 24 (within 1%).
    EXPECT_NEAR(double(small.engram_num_embeddings[i]), double(int64_t(1) << 22), 0.01 * (1 << 22));
    dropped += uint64_t(s.engram_num_embeddings[i] - small.engram_num_embeddings[i]) * row_bytes;
  }
  EXPECT_EQ(contract_bytes(small), slice - dropped);
  // The hasher accepts the shrunk tables (it checks that its bucket primes sum to the rows).
  EXPECT_NO_THROW(EngramHasher(small, 2));
  std::printf("TP8 rank slice: %.2f GB with the released Engram tables, %.2f GB with ~4M rows\n",
              slice * 1e-9, contract_bytes(small) * 1e-9);
  EXPECT_THROW(with_engram_rows(s, 1000), core::Error);
}

// Decodes `n` elements spread over the tensor and checks them against the pool's value range.
void check_values(const std::string& name, const core::TensorView& v, TensorKind kind) {
  SCOPED_TRACE(name);
  ASSERT_NE(v.data, nullptr);
  const size_t es = core::dtype_size(v.dtype);
  const size_t count = v.nbytes / es;
  ASSERT_GT(count, 0u);
  const size_t samples = std::min<size_t>(count, 16);
  int nan = 0, out_of_range = 0;
  float worst = 0;
  for (size_t k = 0; k < samples; ++k) {
    const size_t i = samples == 1 ? 0 : (count - 1) * k / (samples - 1);
    const uint8_t* p = v.data + i * es;
    std::vector<float> vals;
    float lo = -1, hi = 1;
    switch (v.dtype) {
      case core::DType::kF8E4M3:
        vals = {core::e4m3_to_float(*p)};
        break;
      case core::DType::kF8E8M0:
        vals = {core::e8m0_to_float(*p)};
        lo = std::ldexp(1.0f, -9);
        hi = std::ldexp(1.0f, -5);
        break;
      case core::DType::kI8:
        vals = {core::e2m1_to_float(core::e2m1_even(*p)), core::e2m1_to_float(core::e2m1_odd(*p))};
        lo = -6;
        hi = 6;
        break;
      case core::DType::kBF16: {
        uint16_t b;
        std::memcpy(&b, p, 2);
        vals = {core::bf16_to_float(b)};
        const bool norm = name.find("norm") != std::string::npos;
        lo = norm ? 0.89f : -0.051f;
        hi = norm ? 1.11f : 0.051f;
        break;
      }
      case core::DType::kF32: {
        float f;
        std::memcpy(&f, p, 4);
        vals = {f};
        lo = -0.051f;
        hi = 0.051f;
        break;
      }
      default:
        FAIL() << "unexpected dtype " << core::dtype_name(v.dtype) << " (kind " << int(kind) << ")";
    }
    for (float x : vals) {
      if (std::isnan(x)) ++nan;
      if (!(x >= lo && x <= hi)) {
        ++out_of_range;
        worst = x;
      }
    }
  }
  EXPECT_EQ(nan, 0);
  EXPECT_EQ(out_of_range, 0) << "e.g. " << worst;
}

void check_synthetic(const ModelConfig& c) {
  const auto ck = synthetic_checkpoint(c, 7);
  const auto rep = check_contract(c, ck);
  ASSERT_TRUE(rep.ok()) << (rep.lines().empty() ? "" : rep.lines().front());
  for (const auto& e : tensor_contract(c)) {
    const auto& v = ck.get(e.name);
    ASSERT_EQ(v.nbytes, e.nbytes()) << e.name;
    check_values(e.name, v, e.kind);
    if (::testing::Test::HasFailure()) return;  // one tensor's report is enough
  }
}

TEST(Synthetic, TinyFixtureConfigPassesTheContractWithSaneValues) {
  check_synthetic(ModelConfig::load(tiny_a_dir()));
}

TEST(Synthetic, ReleasedTp8SliceWithFullEngramTablesStaysSmallOnTheHost) {
  const auto s = rank_slice_config(ModelConfig::deepseek_v41_flash(), 8);
  check_synthetic(s);
  // Host memory behind the ~263 GB of views (two 98 GB Engram tables included): the pools.
  uint64_t physical = 0;
  for (const auto& p : synthetic_pools(s)) {
    std::printf("pool %-10s largest %-40s %8.1f MB span, %5.1f MB physical\n", p.kind.c_str(),
                p.largest.c_str(), p.span_bytes * 1e-6, p.physical_bytes * 1e-6);
    physical += p.physical_bytes;
    EXPECT_LE(p.physical_bytes, SyntheticOptions{}.pool_block_bytes);
  }
  EXPECT_LE(physical, uint64_t(6) * SyntheticOptions{}.pool_block_bytes);
  const auto pools = synthetic_pools(s);
  ASSERT_FALSE(pools.empty());
  EXPECT_EQ(pools[0].kind, "fp8-e4m3");
  EXPECT_NE(pools[0].largest.find("engram.embed.weight"), std::string::npos);
}

// Distinct seeds give distinct values; the same seed the same values.
TEST(Synthetic, ValuesFollowTheSeed) {
  const auto c = ModelConfig::load(tiny_a_dir());
  const auto a = synthetic_checkpoint(c, 1), b = synthetic_checkpoint(c, 1),
             d = synthetic_checkpoint(c, 2);
  const auto& va = a.get("layers.0.attn.wq_a.weight");
  EXPECT_EQ(0, std::memcmp(va.data, b.get("layers.0.attn.wq_a.weight").data, va.nbytes));
  EXPECT_NE(0, std::memcmp(va.data, d.get("layers.0.attn.wq_a.weight").data, va.nbytes));
}

bool all_finite(const std::vector<float>& v, size_t* bad) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i])) {
      *bad = i;
      return false;
    }
  return true;
}

// The CPU backend runs on a synthetic checkpoint (of the tiny config and of its TP2 slice, which
// must be a runnable model too): prefill, a verify of 3 rows and a DSpark round give finite values.
void run_cpu(const ModelConfig& c) {
  const auto ck = synthetic_checkpoint(c, 3);
  cpu::CpuModel m(c, ck, synthetic_engram_token_map(c));
  auto s = m.new_session(64);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 20; ++i) prompt.push_back(int32_t((i * 37 + 5) % c.vocab_size));
  const size_t V = size_t(c.vocab_size);
  std::vector<float> logits(prompt.size() * V);
  std::vector<float> mh(prompt.size() * size_t(m.n_taps()) * size_t(c.dim));
  m.forward(*s, prompt, true, true, logits.data(), mh.data(), nullptr);
  size_t bad = 0;
  ASSERT_TRUE(all_finite(logits, &bad)) << "prefill logit " << bad << " = " << logits[bad];
  m.commit(*s, prompt, mh.data(), int(prompt.size()), -1);
  const std::vector<int32_t> rows = {11, 12, 13};
  std::vector<float> vl(rows.size() * V);
  m.forward(*s, rows, false, true, vl.data(), nullptr, nullptr);
  ASSERT_TRUE(all_finite(vl, &bad)) << "verify logit " << bad << " = " << vl[bad];
  const auto blk = m.draft(*s, 11, [&](int, std::span<const float> lg) {
    return int32_t(std::max_element(lg.begin(), lg.end()) - lg.begin());
  });
  ASSERT_EQ(int(blk.tokens.size()), c.dspark_block_size);
  for (int32_t t : blk.tokens) EXPECT_TRUE(t >= 0 && t < c.vocab_size);
  ASSERT_TRUE(all_finite(blk.confidence, &bad)) << "confidence " << bad;
  ASSERT_TRUE(all_finite(blk.logits, &bad)) << "draft logit " << bad;
}

TEST(Synthetic, CpuBackendRunsOnTheTinyConfig) { run_cpu(ModelConfig::load(tiny_a_dir())); }

TEST(Synthetic, CpuBackendRunsOnTheTinyTp2Slice) {
  const auto c = rank_slice_config(ModelConfig::load(tiny_a_dir()), 2);
  EXPECT_EQ(c.n_heads, 2);
  EXPECT_EQ(c.moe_inter_dim, 64);
  run_cpu(c);
}

// The config of the GPU test at every TP degree (tests/cuda/test_cuda_backend_tpn.cpp) runs on the
// CPU, whole and as a TP 8 rank's slice.
TEST(Synthetic, CpuBackendRunsOnTheTinyConfigDivisibleBy8) {
  const auto c = uf::testing::tiny_a_config_divisible_by_8();
  run_cpu(c);
  const auto s = rank_slice_config(c, 8);
  EXPECT_EQ(s.n_heads, 1);
  EXPECT_EQ(s.o_groups, 1);
  EXPECT_EQ(s.moe_inter_dim, 32);
  run_cpu(s);
}

TEST(StepFloor, ExpectedDistinctExperts) {
  EXPECT_DOUBLE_EQ(expected_distinct_experts(384, 6, 1), 6.0);
  // 384 * (1 - (378/384)^7) and 128 * (1 - (125/128)^5).
  EXPECT_NEAR(expected_distinct_experts(384, 6, 7), 40.0817, 1e-3);
  EXPECT_NEAR(expected_distinct_experts(384, 6, 10000), 384.0, 1e-6);
  EXPECT_NEAR(expected_distinct_experts(128, 3, 5), 14.3132, 1e-3);
}

const FloorItem* item(const std::vector<FloorItem>& v, const std::string& name) {
  for (const auto& i : v)
    if (i.name == name) return &i;
  return nullptr;
}

void print_floor(const StepFloor& f) {
  std::printf("T = %d, context %lld: verify %.1f MB, draft %.1f MB\n", f.rows, (long long)f.context,
              f.verify_bytes() * 1e-6, f.draft_bytes() * 1e-6);
  for (const auto& i : f.verify)
    std::printf("  verify %-24s %10.3f MB\n", i.name.c_str(), i.bytes * 1e-6);
  for (const auto& i : f.draft)
    std::printf("  draft  %-24s %10.3f MB\n", i.name.c_str(), i.bytes * 1e-6);
  for (const auto& i : f.commit)
    std::printf("  commit %-24s %10.3f MB\n", i.name.c_str(), i.bytes * 1e-6);
}

TEST(StepFloor, GrowsWithRowsAndContext) {
  const auto s = rank_slice_config(ModelConfig::deepseek_v41_flash(), 8);
  double prev = 0;
  for (int t = 1; t <= 8; ++t) {
    const auto f = step_floor(s, t, 8192);
    EXPECT_GT(f.verify_bytes(), prev) << "T = " << t;
    prev = f.verify_bytes();
    if (t == 1 || t == 7) print_floor(f);
  }
  EXPECT_GT(step_floor(s, 1, 65536).verify_bytes(), step_floor(s, 1, 8192).verify_bytes());
  EXPECT_GT(step_floor(s, 1, 8192).draft_bytes(), step_floor(s, 1, 16).draft_bytes());
}

// Hand-computed components of the TP8 slice (model-arch.md dims).
TEST(StepFloor, ComponentsOfTheTp8Slice) {
  const auto s = rank_slice_config(ModelConfig::deepseek_v41_flash(), 8);
  const auto f = step_floor(s, 1, 8192);
  // One expert slice: w1, w3 [288, 5120] and w2 [5120, 288], MXFP4 + per-32 scales.
  const double expert = 2 * (288.0 * 2560 + 288.0 * 160) + (5120.0 * 144 + 5120.0 * 9);
  ASSERT_NE(item(f.verify, "routed experts"), nullptr);
  EXPECT_DOUBLE_EQ(item(f.verify, "routed experts")->bytes, 40 * 6 * expert);
  ASSERT_NE(item(f.verify, "head"), nullptr);
  EXPECT_DOUBLE_EQ(item(f.verify, "head")->bytes, 129280.0 * 5120 * 2 + 5120 * 2);
  // Window: 128 entries of 528 B on 40 layers at T = 1.
  EXPECT_DOUBLE_EQ(item(f.verify, "window KV")->bytes, 40 * 128 * 528.0);
  // Top-k: 512 entries of 288 B on the 38 compressed layers.
  EXPECT_DOUBLE_EQ(item(f.verify, "compressed KV (top-k)")->bytes, 38 * 512 * 288.0);
  // Engram: 24 rows of 264 B on 2 layers.
  EXPECT_DOUBLE_EQ(item(f.verify, "Engram rows")->bytes, 2 * 24 * 264.0);
  // Draft: 3 stages with 128 experts top-3 over 5 rows; the Markov head read per slot.
  ASSERT_NE(item(f.draft, "Markov head"), nullptr);
  EXPECT_GT(item(f.draft, "Markov head")->bytes, 5 * 129280.0 * 256 * 2);
  EXPECT_NEAR(item(f.draft, "routed experts")->bytes, 3 * 14.3132 * expert, 3 * 1e-3 * expert);
  EXPECT_THROW(step_floor(s, 0, 8192), core::Error);
}

}  // namespace
}  // namespace uf::model
