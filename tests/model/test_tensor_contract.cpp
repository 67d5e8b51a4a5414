// The tensor contract against the published totals of the released checkpoint and against the
// two fixtures.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/tensor_contract.h"

namespace fs = std::filesystem;
using uf::core::DType;
using uf::model::ExpectedTensor;
using uf::model::ModelConfig;

namespace {

const fs::path kFixtures = fs::path(UF_SHARED_DIR) / "fixtures";

struct Totals {
  size_t count = 0;
  uint64_t bytes = 0;
  std::map<DType, uint64_t> by_dtype;
};
Totals totals(const std::vector<ExpectedTensor>& ts) {
  Totals t;
  for (const auto& e : ts) {
    ++t.count;
    t.bytes += e.nbytes();
    t.by_dtype[e.dtype] += e.nbytes();
  }
  return t;
}
const ExpectedTensor& find(const std::vector<ExpectedTensor>& ts, const std::string& name) {
  for (const auto& e : ts)
    if (e.name == name) return e;
  throw std::runtime_error("not in contract: " + name);
}

}  // namespace

// model-arch.md §3/§6 (from the KIO-ATLAS header census): 96,085 tensors, 510,286,023,000 bytes.
// The spec's §6.2 tables reproduce the text part exactly (95,819 tensors, 509,315,486,040 bytes).
// The spec only names the vision part ("32-block ViT", aligner w1/w2), so its tensors follow the
// reference inference/vision.py (patch_embed.proj weight+bias; per block norm1, attn.wqkv
// weight+bias, attn.wo weight+bias, norm2, mlp.w1, mlp.w2; final norm; aligner w1/w2 weight+bias;
// image_start/end/newline). With every vision tensor BF16 that is 266 tensors and 970,536,960
// bytes, exactly what the published totals leave for it (F32 is already exhausted by the text
// part). Vision tensor *names* are taken from the reference module tree and are not confirmed
// by a header read.
TEST(TensorContract, ReleasedModelMatchesPublishedTotals) {
  const auto c = ModelConfig::deepseek_v41_flash();
  const auto ts = uf::model::tensor_contract(c);
  auto t = totals(ts);
  EXPECT_EQ(t.count, 96085u);
  EXPECT_EQ(t.bytes, 510286023000ull);
  EXPECT_EQ(t.by_dtype[DType::kI8], 278585671680ull);
  EXPECT_EQ(t.by_dtype[DType::kF8E4M3], 204015223296ull);
  EXPECT_EQ(t.by_dtype[DType::kF8E8M0], 23563015184ull);
  EXPECT_EQ(t.by_dtype[DType::kBF16], 3952883712ull);
  EXPECT_EQ(t.by_dtype[DType::kF32], 169229128ull);
  EXPECT_EQ(t.by_dtype.size(), 5u);

  // Text only.
  auto text = c;
  text.vision_n_layers = 0;
  const auto tt = totals(uf::model::tensor_contract(text));
  EXPECT_EQ(tt.count, 95819u);
  EXPECT_EQ(tt.bytes, 509315486040ull);
  EXPECT_EQ(t.count - tt.count, 266u);
  EXPECT_EQ(t.bytes - tt.bytes, 970536960ull);

  // Owner counts of model-arch.md §6.2 (engram tensors counted apart).
  size_t enc = 0, dec = 0, mtp = 0, engram = 0, top = 0;
  for (const auto& e : ts) {
    if (e.name.find(".engram.") != std::string::npos) {
      ++engram;
    } else if (e.name.rfind("layers.", 0) == 0) {
      const int l = std::stoi(e.name.substr(7));
      (l < 20 ? enc : dec)++;
    } else if (e.name.rfind("mtp.", 0) == 0) {
      ++mtp;
    } else if (e.name == "embed.weight" || e.name == "head.weight" || e.name == "norm.weight") {
      ++top;
    }
  }
  EXPECT_EQ(enc, 46704u);
  EXPECT_EQ(dec, 46699u);
  EXPECT_EQ(mtp, 2401u);
  EXPECT_EQ(engram, 12u);  // 8 resident + 4 table tensors
  EXPECT_EQ(top, 3u);

  // Header spot checks quoted in model-arch.md §6.2.
  auto shape = [&](const std::string& n) { return find(ts, n).shape; };
  using S = std::vector<int64_t>;
  EXPECT_EQ(shape("layers.3.attn.wq_b.weight"), (S{32768, 1280}));
  EXPECT_EQ(shape("layers.3.attn.wq_b.scale"), (S{1024, 40}));
  EXPECT_EQ(shape("layers.3.ffn.experts.7.w1.weight"), (S{2304, 2560}));
  EXPECT_EQ(shape("layers.3.ffn.experts.7.w1.scale"), (S{2304, 160}));
  EXPECT_EQ(shape("layers.3.ffn.experts.7.w2.scale"), (S{5120, 72}));
  EXPECT_EQ(shape("layers.1.engram.embed.weight"), (S{384006168, 256}));
  EXPECT_EQ(shape("layers.14.engram.embed.scale"), (S{384016682, 8}));
  EXPECT_EQ(shape("layers.14.engram.wkv.scale"), (S{800, 192}));
  EXPECT_EQ(shape("layers.20.attn.wo_a.scale"), (S{256, 128}));
  EXPECT_EQ(shape("mtp.0.main_proj.scale"), (S{160, 480}));
  EXPECT_EQ(shape("mtp.2.confidence_head.proj.weight"), (S{1, 5376}));
  EXPECT_EQ(shape("mtp.1.ffn.gate.weight"), (S{128, 5120}));
  EXPECT_EQ(find(ts, "layers.8.attn.compressor.wgate.weight").dtype, DType::kBF16);
  EXPECT_THROW(find(ts, "layers.20.attn.compressor.wgate.weight"), std::runtime_error);
  EXPECT_THROW(find(ts, "layers.24.attn.indexer.wk.weight"), std::runtime_error);
  EXPECT_EQ(find(ts, "layers.24.attn.indexer.wq_b.weight").dtype, DType::kF8E4M3);
  EXPECT_THROW(find(ts, "mtp.1.main_proj.weight"), std::runtime_error);
}

TEST(TensorContract, FixturesPass) {
  for (const char* f : {"tiny-a", "medium-a"}) {
    const auto c = ModelConfig::load(kFixtures / f);
    const auto ck = uf::model::Checkpoint::open(kFixtures / f);
    const auto rep = uf::model::check_contract(c, ck);
    EXPECT_TRUE(rep.ok()) << f << ": " << (rep.lines().empty() ? "" : rep.lines()[0]);
    EXPECT_EQ(rep.expected, ck.size()) << f;
    EXPECT_EQ(rep.expected_bytes, ck.total_bytes()) << f;
    EXPECT_NO_THROW(uf::model::require_contract(c, ck));
  }
}

TEST(TensorContract, ReportsEveryDifference) {
  // tiny-a's checkpoint against a config with one more expert, no Engram on layer 2 and a
  // different DSpark Markov rank: every difference gets its own line.
  auto c = ModelConfig::load(kFixtures / "tiny-a");
  const auto ck = uf::model::Checkpoint::open(kFixtures / "tiny-a");
  c.dspark_markov_rank = 32;
  c.derive_roles();
  auto rep = uf::model::check_contract(c, ck);
  EXPECT_FALSE(rep.ok());
  EXPECT_TRUE(rep.missing.empty());
  EXPECT_TRUE(rep.extra.empty());
  ASSERT_EQ(rep.mismatched.size(), 3u);  // markov embed, markov head, confidence proj
  EXPECT_NE(rep.mismatched[0].find("mtp.2.markov_head.embed.weight is BF16 [1024, 64]"),
            std::string::npos)
      << rep.mismatched[0];
  EXPECT_NE(rep.mismatched[0].find("expected BF16 [1024, 32]"), std::string::npos);

  c = ModelConfig::load(kFixtures / "tiny-a");
  c.n_routed_experts = 9;
  c.derive_roles();
  rep = uf::model::check_contract(c, ck);
  EXPECT_EQ(rep.missing.size(), 8u * 6u);     // w1/w2/w3 weight+scale of expert 8, 8 layers
  EXPECT_EQ(rep.mismatched.size(), 8u * 3u);  // gate weight, bias, bias_vl
  EXPECT_TRUE(rep.extra.empty());
  EXPECT_NE(rep.missing[0].find("missing: layers.0.ffn.experts.8.w1.weight (I8 [128, 128])"),
            std::string::npos)
      << rep.missing[0];

  c = ModelConfig::load(kFixtures / "tiny-a");
  c.engram_layer_ids = {1};
  c.engram_num_embeddings = {14032};
  c.derive_roles();
  rep = uf::model::check_contract(c, ck);
  EXPECT_EQ(rep.extra.size(), 6u);  // embed weight+scale, wkv weight+scale, q_weight, k_weight
  EXPECT_TRUE(rep.missing.empty());
  EXPECT_NE(rep.extra[0].find("extra: layers.2.engram."), std::string::npos) << rep.extra[0];
  try {
    uf::model::require_contract(c, ck);
    ADD_FAILURE();
  } catch (const uf::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("6 extra"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("layers.2.engram.embed.scale"), std::string::npos);
  }
}
