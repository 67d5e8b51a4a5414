// ModelConfig: both fixture configs, the released configuration, the agreement check between
// the two files and the layer roles of model-arch.md §2.3.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "model/config.h"
#include "model/engram_primes.h"

namespace fs = std::filesystem;
using uf::model::AttnMode;
using uf::model::ModelConfig;

namespace {

const fs::path kFixtures = fs::path(UF_SHARED_DIR) / "fixtures";

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}
void write_json(const fs::path& p, const nlohmann::json& j) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << j.dump(2);
}

// A scratch copy of a fixture's two config files, removed on destruction.
struct TempConfigDir {
  fs::path dir;
  explicit TempConfigDir(const std::string& fixture) {
    dir = fs::temp_directory_path() /
          ("uf_cfg_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    fs::create_directories(dir / "inference");
    fs::copy_file(kFixtures / fixture / "config.json", dir / "config.json");
    fs::copy_file(kFixtures / fixture / "inference" / "config.json",
                  dir / "inference" / "config.json");
  }
  ~TempConfigDir() { fs::remove_all(dir); }
  static int& counter() {
    static int c = 0;
    return c;
  }
  fs::path hf() const { return dir / "config.json"; }
  fs::path flat() const { return dir / "inference" / "config.json"; }
};

std::string load_error(const fs::path& dir) {
  try {
    ModelConfig::load(dir);
  } catch (const uf::core::Error& e) {
    return e.what();
  }
  return "";
}

// Roles of the tiny-a / medium-a pattern (their README §1 table).
void expect_fixture_roles(const ModelConfig& c) {
  ASSERT_EQ(c.roles.size(), 11u);
  EXPECT_EQ(c.role(0).mode, AttnMode::kWindowOnly);
  EXPECT_EQ(c.role(1).mode, AttnMode::kWindowOnly);
  EXPECT_TRUE(c.role(1).engram);
  EXPECT_EQ(c.role(1).engram_index, 0);

  const auto& l2 = c.role(2);
  EXPECT_EQ(l2.mode, AttnMode::kFull);
  EXPECT_TRUE(l2.kv_source && l2.index_source);
  EXPECT_FALSE(l2.candidate_source || l2.candidate_restricted);
  EXPECT_EQ(l2.kv_from, 2);
  EXPECT_EQ(l2.index_keys_from, 2);
  EXPECT_EQ(l2.topk_from, 2);
  EXPECT_EQ(l2.compress_ratio, 2);
  EXPECT_FALSE(l2.decoder);

  const auto& l3 = c.role(3);
  EXPECT_EQ(l3.mode, AttnMode::kReuse);
  EXPECT_EQ(l3.kv_from, 2);
  EXPECT_EQ(l3.topk_from, 2);
  EXPECT_EQ(l3.index_keys_from, -1);

  const auto& l4 = c.role(4);
  EXPECT_EQ(l4.mode, AttnMode::kFull);
  EXPECT_TRUE(l4.candidate_source);
  EXPECT_FALSE(l4.candidate_restricted);
  EXPECT_TRUE(l4.decoder);
  EXPECT_EQ(l4.compress_ratio, 1);

  EXPECT_EQ(c.role(5).mode, AttnMode::kReuse);
  EXPECT_EQ(c.role(5).topk_from, 4);
  EXPECT_TRUE(c.role(5).dspark_tap);

  const auto& l6 = c.role(6);
  EXPECT_EQ(l6.mode, AttnMode::kReindex);
  EXPECT_TRUE(l6.index_source && !l6.kv_source);
  EXPECT_TRUE(l6.candidate_restricted);
  EXPECT_EQ(l6.kv_from, 4);
  EXPECT_EQ(l6.index_keys_from, 4);
  EXPECT_EQ(l6.topk_from, 6);

  EXPECT_EQ(c.role(7).mode, AttnMode::kReuse);
  EXPECT_EQ(c.role(7).kv_from, 4);
  EXPECT_EQ(c.role(7).topk_from, 6);

  for (int l = 0; l < 8; ++l) {
    EXPECT_FALSE(c.role(l).dspark);
    EXPECT_EQ(c.role(l).rope_theta, c.role(l).compress_ratio ? 160000.0 : 10000.0) << l;
    EXPECT_EQ(c.role(l).yarn, c.role(l).compress_ratio > 0) << l;
    EXPECT_EQ(c.role(l).n_routed_experts, c.n_routed_experts);
  }
  for (int l = 8; l < 11; ++l) {
    const auto& r = c.role(l);
    EXPECT_TRUE(r.dspark);
    EXPECT_FALSE(r.decoder || r.engram || r.dspark_tap || r.kv_source || r.index_source);
    EXPECT_EQ(r.mode, AttnMode::kWindowOnly);
    EXPECT_EQ(r.rope_theta, 10000.0);
    EXPECT_FALSE(r.yarn);
    EXPECT_EQ(r.n_routed_experts, c.dspark_n_routed_experts);
    EXPECT_EQ(r.n_activated_experts, c.dspark_n_activated_experts);
  }
}

}  // namespace

TEST(Config, LoadsTinyA) {
  const auto c = ModelConfig::load(kFixtures / "tiny-a");
  EXPECT_EQ(c.vocab_size, 1024);
  EXPECT_EQ(c.dim, 256);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.window_size, 8);
  EXPECT_EQ(c.n_mtp_layers, 3);
  EXPECT_EQ(c.original_seq_len, 65536);
  EXPECT_EQ(c.rope_factor, 16);
  EXPECT_EQ(c.norm_eps, 1e-20);
  EXPECT_EQ(c.image_token_id, 1021);
  EXPECT_EQ(c.dspark_noise_token_id, 1020);
  EXPECT_EQ(c.engram_layer_ids, (std::vector<int>{1, 2}));
  EXPECT_EQ(c.engram_compressed_vocab_size, 273);
  EXPECT_EQ(c.dspark_n_routed_experts, 4);
  EXPECT_EQ(c.dspark_n_activated_experts, 2);
  expect_fixture_roles(c);
  EXPECT_TRUE(c.role(2).engram);  // tiny-a puts its second Engram on the KV-source layer
  EXPECT_EQ(c.role(2).engram_index, 1);
}

TEST(Config, LoadsMediumA) {
  const auto c = ModelConfig::load(kFixtures / "medium-a");
  EXPECT_EQ(c.head_dim, 512);
  EXPECT_EQ(c.index_topk, 512);
  EXPECT_EQ(c.candidate_topk_blocks, 96);
  EXPECT_EQ(c.engram_num_embeddings, (std::vector<int64_t>{2946}));
  expect_fixture_roles(c);
  EXPECT_FALSE(c.role(2).engram);
}

TEST(Config, EngramPrimesMatchFixtures) {
  // The prime rule reproduces the fixture table sizes (computed by the reference).
  for (const char* f : {"tiny-a", "medium-a"}) {
    const auto c = ModelConfig::load(kFixtures / f);
    EXPECT_EQ(uf::model::engram_prime_sums(c), c.engram_num_embeddings) << f;
  }
  const auto p = uf::model::engram_primes(2, 4, 8, 500);
  EXPECT_EQ(p[0][0], 503);  // smallest prime above 499
  // The 3-gram heads restart from the same base but skip taken primes.
  EXPECT_GT(p[0][8], p[0][7]);
  // Never reused: the 2-gram and 3-gram ranges of one layer start from the same base.
  std::set<int64_t> all;
  for (const auto& l : p)
    for (int64_t x : l) EXPECT_TRUE(all.insert(x).second) << x;
}

TEST(Config, ReleasedModelRoles) {
  const auto c = ModelConfig::deepseek_v41_flash();
  ASSERT_EQ(c.roles.size(), 43u);
  int swa = 0, full = 0, reindex = 0, reuse = 0;
  for (int l = 0; l < 40; ++l) {
    switch (c.role(l).mode) {
      case AttnMode::kWindowOnly:
        ++swa;
        break;
      case AttnMode::kFull:
        ++full;
        break;
      case AttnMode::kReindex:
        ++reindex;
        break;
      case AttnMode::kReuse:
        ++reuse;
        break;
    }
  }
  // model-arch.md §2.3 totals.
  EXPECT_EQ(swa, 2);
  EXPECT_EQ(full, 4);
  EXPECT_EQ(reindex, 4);
  EXPECT_EQ(reuse, 30);
  for (int l : {3, 7}) EXPECT_EQ(c.role(l).kv_from, 2);
  for (int l : {9, 13}) EXPECT_EQ(c.role(l).topk_from, 8);
  EXPECT_TRUE(c.role(14).engram && c.role(14).kv_source);
  EXPECT_TRUE(c.role(20).candidate_source && c.role(20).decoder);
  EXPECT_FALSE(c.role(19).decoder);
  for (int l : {24, 28, 32, 36}) {
    EXPECT_EQ(c.role(l).mode, AttnMode::kReindex) << l;
    EXPECT_TRUE(c.role(l).candidate_restricted);
    EXPECT_EQ(c.role(l).index_keys_from, 20);
    EXPECT_EQ(c.role(l).kv_from, 20);
  }
  EXPECT_EQ(c.role(21).topk_from, 20);
  EXPECT_EQ(c.role(27).topk_from, 24);
  EXPECT_EQ(c.role(39).topk_from, 36);
  EXPECT_EQ(c.role(25).index_keys_from, -1);
  for (int l : {37, 38, 39}) EXPECT_TRUE(c.role(l).dspark_tap);
  EXPECT_FALSE(c.role(36).dspark_tap);
  for (int l : {40, 41, 42}) {
    EXPECT_TRUE(c.role(l).dspark);
    EXPECT_EQ(c.role(l).n_routed_experts, 128);
    EXPECT_EQ(c.role(l).n_activated_experts, 3);
  }
  EXPECT_EQ(c.role(5).n_routed_experts, 384);
  EXPECT_EQ(c.role(0).rope_theta, 10000.0);
  EXPECT_EQ(c.role(2).rope_theta, 160000.0);
  EXPECT_TRUE(c.role(2).yarn);
  // The released engram_num_embeddings are the sums of the primes above 16e6 (validate checks
  // this, but say it here too).
  EXPECT_EQ(uf::model::engram_prime_sums(c), c.engram_num_embeddings);
}

TEST(Config, JsonRoundTrips) {
  const auto c = ModelConfig::deepseek_v41_flash();
  const auto a = ModelConfig::from_hf_json(c.to_hf_json());
  const auto b = ModelConfig::from_flat_json(c.to_flat_json());
  EXPECT_EQ(a.to_flat_json(), c.to_flat_json());
  EXPECT_EQ(b.to_flat_json(), c.to_flat_json());
  EXPECT_EQ(a.to_hf_json(), c.to_hf_json());
  // The tiny-a files map onto the same values field by field.
  const auto t = ModelConfig::load(kFixtures / "tiny-a");
  const auto hf = read_json(kFixtures / "tiny-a" / "config.json");
  EXPECT_EQ(ModelConfig::from_hf_json(hf).to_flat_json(), t.to_flat_json());
  EXPECT_EQ(t.to_hf_json()["text_config"], hf["text_config"]);
}

TEST(Config, LoadsEitherFileAlone) {
  TempConfigDir d("tiny-a");
  fs::remove(d.flat());
  EXPECT_EQ(ModelConfig::load(d.dir).dim, 256);
  TempConfigDir e("tiny-a");
  fs::remove(e.hf());
  EXPECT_EQ(ModelConfig::load(e.dir).dim, 256);
  fs::remove(e.flat());
  EXPECT_NE(load_error(e.dir).find("neither config.json nor inference/config.json"),
            std::string::npos);
}

TEST(Config, DisagreementNamesFieldAndBothValues) {
  TempConfigDir d("tiny-a");
  auto flat = read_json(d.flat());
  flat["dim"] = 512;
  write_json(d.flat(), flat);
  const auto err = load_error(d.dir);
  EXPECT_NE(err.find("'dim'"), std::string::npos) << err;
  EXPECT_NE(err.find("hidden_size = 256"), std::string::npos) << err;
  EXPECT_NE(err.find("dim = 512"), std::string::npos) << err;

  TempConfigDir e("tiny-a");
  auto hf = read_json(e.hf());
  hf["text_config"]["compress_ratios"][3] = 1;
  write_json(e.hf(), hf);
  const auto err2 = load_error(e.dir);
  EXPECT_NE(err2.find("compress_ratios"), std::string::npos) << err2;
}

TEST(Config, ValidationErrors) {
  const auto base = ModelConfig::load(kFixtures / "tiny-a").to_flat_json();
  auto expect_error = [&](auto mutate, const std::string& needle) {
    auto j = base;
    mutate(j);
    try {
      ModelConfig::from_flat_json(j);
      ADD_FAILURE() << "no error, expected: " << needle;
    } catch (const uf::core::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([](auto& j) { j.erase("dim"); }, "missing required field 'dim'");
  expect_error([](auto& j) { j["dim"] = "256"; }, "'dim' must be an integer");
  expect_error([](auto& j) { j["compress_ratios"].erase(0); }, "'compress_ratios' has 10 entries");
  expect_error(
      [](auto& j) {
        j["index_source_layers"] = {4, 6};
      },
      "kv source layer 2 is not an index source");
  expect_error([](auto& j) { j["kv_source_layers"] = {4}; },
               "layer 2 has compress ratio 2 but no kv source");
  expect_error([](auto& j) { j["compress_ratios"][5] = 2; }, "layer 5 has compress ratio 2");
  expect_error([](auto& j) { j["compress_ratios"][9] = 1; }, "DSpark stages are sliding-window");
  expect_error([](auto& j) { j["candidate_source_layer"] = 5; }, "not an index source");
  expect_error([](auto& j) { j["engram_num_embeddings"][1] = 17775; },
               "engram_num_embeddings[1] = 17775");
  expect_error([](auto& j) { j["n_activated_experts"] = 9; }, "exceeds n_routed_experts");
  expect_error([](auto& j) { j["dspark_noise_token_id"] = 5000; }, "dspark_noise_token_id");
  expect_error([](auto& j) { j["expert_dtype"] = "fp8"; }, "expert_dtype");
  expect_error([](auto& j) { j["kv_source_layers"] = {4, 2}; }, "ascending");
}
