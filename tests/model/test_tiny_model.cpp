// The tiny-model generator: a full-architecture checkpoint that loads, passes the tensor
// contract, is deterministic per seed and has the weight statistics it promises.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/dtypes.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/tensor_contract.h"
#include "model/tiny_model.h"
#include "model_test_util.h"

namespace fs = std::filesystem;
using uf::model::Checkpoint;
using uf::model::ModelConfig;

namespace {

using uf::model::testing::kBaseTokenizer;

// Each test's scratch folder.
struct TempDir : uf::model::testing::TempDir {
  TempDir() : uf::model::testing::TempDir("uf_tiny_") {}
};

// The generator's config with a 1024-token vocabulary: every tensor but the vocab-sized ones is
// the same, and it writes in well under a second.
ModelConfig small_vocab_config() {
  auto c = uf::model::tiny_model_config(273);
  c.vocab_size = 1024;
  c.dspark_noise_token_id = 1020;
  c.image_token_id = 1021;
  c.derive_roles();
  return c;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<float> dequant_fp8(const Checkpoint& ck, const std::string& prefix) {
  const auto& w = ck.get(prefix + ".weight");
  const auto& s = ck.get(prefix + ".scale");
  const int64_t rows = w.dim(0), cols = w.dim(1);
  std::vector<float> out(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[size_t(r * cols + c)] = uf::core::e4m3_to_float(w.data[r * cols + c]) *
                                  uf::core::e8m0_to_float(s.data[(r / 32) * s.dim(1) + c / 32]);
  return out;
}
std::vector<float> bf16_values(const Checkpoint& ck, const std::string& name) {
  const auto& v = ck.get(name);
  std::vector<float> out(size_t(v.numel()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = uf::core::bf16_to_float(uint16_t(v.data[2 * i] | (v.data[2 * i + 1] << 8)));
  return out;
}
double mean(const std::vector<float>& x) {
  double s = 0;
  for (float f : x) s += f;
  return s / double(x.size());
}
double rms(const std::vector<float>& x) {
  double s = 0;
  for (float f : x) s += double(f) * f;
  return std::sqrt(s / double(x.size()));
}

}  // namespace

TEST(TinyModel, ConfigHasTinyARolesAndRealVocab) {
  const auto c = uf::model::tiny_model_config(12345);
  const auto a = ModelConfig::load(fs::path(UF_SHARED_DIR) / "fixtures" / "tiny-a");
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.engram_compressed_vocab_size, 12345);
  EXPECT_EQ(c.engram_num_embeddings, a.engram_num_embeddings);  // same primes (vocab 500)
  EXPECT_EQ(c.dspark_noise_token_id, 128799);
  EXPECT_EQ(c.image_token_id, 129264);
  ASSERT_EQ(c.roles.size(), a.roles.size());
  for (size_t i = 0; i < c.roles.size(); ++i) {
    EXPECT_EQ(c.roles[i].mode, a.roles[i].mode) << i;
    EXPECT_EQ(c.roles[i].kv_from, a.roles[i].kv_from) << i;
    EXPECT_EQ(c.roles[i].topk_from, a.roles[i].topk_from) << i;
    EXPECT_EQ(c.roles[i].engram, a.roles[i].engram) << i;
    EXPECT_EQ(c.roles[i].n_routed_experts, a.roles[i].n_routed_experts) << i;
  }
  // Same dims as tiny-a except the vocabulary and token ids.
  auto fa = a.to_flat_json(), fc = c.to_flat_json();
  for (const char* k :
       {"vocab_size", "dspark_noise_token_id", "image_token_id", "engram_compressed_vocab_size"}) {
    fa.erase(k);
    fc.erase(k);
  }
  EXPECT_EQ(fa, fc);
}

TEST(TinyModel, DeterministicPerSeed) {
  const auto c = small_vocab_config();
  TempDir a, b, d;
  uf::model::write_random_checkpoint(a.path, c, 3);
  uf::model::write_random_checkpoint(b.path, c, 3);
  uf::model::write_random_checkpoint(d.path, c, 4);
  for (const char* f :
       {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors", "model.safetensors.index.json", "config.json"}) {
    EXPECT_EQ(file_bytes(a.path / f), file_bytes(b.path / f)) << f;
  }
  EXPECT_NE(file_bytes(a.path / "model-00001-of-00003.safetensors"),
            file_bytes(d.path / "model-00001-of-00003.safetensors"));
}

TEST(TinyModel, WeightFormatsAndStatistics) {
  const auto c = small_vocab_config();
  TempDir t;
  uf::model::write_random_checkpoint(t.path, c, 11);
  const auto cfg = ModelConfig::load(t.path);
  const auto ck = Checkpoint::open(t.path);
  const auto rep = uf::model::check_contract(cfg, ck);
  ASSERT_TRUE(rep.ok()) << rep.lines()[0];
  EXPECT_EQ(ck.size(), 826u);  // tiny-a's tensor count: the same architecture

  // Every E8M0 scale is a finite power of two (not the NaN code 255); no FP8 code is NaN.
  for (const auto& [name, e] : ck.tensors()) {
    if (e.view.dtype == uf::core::DType::kF8E8M0) {
      for (size_t i = 0; i < e.view.nbytes; ++i) ASSERT_NE(e.view.data[i], 255) << name;
    }
    if (e.view.dtype == uf::core::DType::kF8E4M3) {
      for (size_t i = 0; i < e.view.nbytes; ++i) ASSERT_NE(e.view.data[i] & 0x7f, 0x7f) << name;
    }
  }
  // The FP4 experts use the whole E2M1 range: some code in a 128x128 expert reaches |6|.
  bool saw_max = false;
  const auto& w1 = ck.get("layers.0.ffn.experts.0.w1.weight");
  for (size_t i = 0; i < w1.nbytes; ++i)
    saw_max |= (w1.data[i] & 7) == 7 || ((w1.data[i] >> 4) & 7) == 7;
  EXPECT_TRUE(saw_max);

  // Tolerances: sample statistics of >= 256 Gaussian values (1-D norms) are within a few % of
  // their targets; 5% (norms, 256 values, 10% spread: sd of the mean 0.6%) and 3% for gains of
  // matrices of >= 32K values, leaving room for FP8 rounding (~2% rms error).
  EXPECT_NEAR(rms(bf16_values(ck, "embed.weight")), 1.0, 0.01);
  EXPECT_NEAR(mean(bf16_values(ck, "layers.0.attn_norm.weight")), 0.025, 0.025 * 0.05);
  EXPECT_NEAR(mean(bf16_values(ck, "layers.5.ffn_norm.weight")), 0.2, 0.2 * 0.05);
  EXPECT_NEAR(mean(bf16_values(ck, "layers.3.ffn_norm.weight")), 6.0, 6.0 * 0.05);  // clamp
  EXPECT_NEAR(mean(bf16_values(ck, "mtp.1.ffn_norm.weight")), 6.0, 6.0 * 0.05);     // clamp
  EXPECT_NEAR(rms(dequant_fp8(ck, "layers.0.attn.wq_a")) * std::sqrt(256.0), 1.6, 1.6 * 0.03);
  EXPECT_NEAR(rms(dequant_fp8(ck, "layers.0.attn.wo_b")) * std::sqrt(128.0), 0.25, 0.25 * 0.03);
  EXPECT_NEAR(rms(dequant_fp8(ck, "layers.2.engram.wkv")) * std::sqrt(1536.0), 0.05, 0.05 * 0.03);
  EXPECT_LT(rms(dequant_fp8(ck, "layers.3.ffn.shared_experts.w2")), 0.001);
}

TEST(TinyModel, V41TokenizerIds) {
  if (!fs::exists(kBaseTokenizer)) GTEST_SKIP() << "no " << kBaseTokenizer << " (scripts/setup.sh)";
  std::ifstream in(kBaseTokenizer);
  const auto v3 = nlohmann::json::parse(in);
  const auto v41 = uf::model::make_v41_tokenizer_json(v3, 129280);
  std::map<std::string, int> ids;
  std::set<int> all;
  for (const auto& t : v41["added_tokens"]) {
    ids[t["content"].get<std::string>()] = t["id"].get<int>();
    EXPECT_TRUE(all.insert(t["id"].get<int>()).second);
  }
  // BOS/EOS/pad are both in the BPE vocabulary and added tokens (as in V3): same id, same text.
  for (const auto& [tok, id] : v41["model"]["vocab"].items())
    if (!all.insert(id.get<int>()).second) {
      EXPECT_EQ(ids[tok], id.get<int>()) << tok;
    }
  // Contiguous ids 0..129279: the tokenizer covers exactly the model's vocabulary.
  EXPECT_EQ(all.size(), 129280u);
  EXPECT_EQ(*all.rbegin(), 129279);
  EXPECT_EQ(ids["<｜begin▁of▁sentence｜>"], 0);
  EXPECT_EQ(ids["<｜end▁of▁sentence｜>"], 1);
  EXPECT_EQ(ids["<｜System｜>"], 128799);
  EXPECT_EQ(ids["<｜User｜>"], 128803);
  EXPECT_EQ(ids["<｜Assistant｜>"], 128804);
  EXPECT_EQ(ids["<think>"], 128821);
  EXPECT_EQ(ids["</think>"], 128822);
  EXPECT_EQ(ids["<｜deepseek_image｜>"], 129264);
  EXPECT_EQ(ids["｜DSML｜"], 128815);
  EXPECT_EQ(ids.count("<｜place▁holder▁no▁799｜>"), 0u);
}
