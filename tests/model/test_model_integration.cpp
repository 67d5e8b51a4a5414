// Damaged copies of tiny-a: a tensor removed from a shard, a shard truncated by one byte. The
// loader (and `ultrafast inspect`) must refuse them with a message naming the tensor / file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/inspect.h"
#include "model/tensor_contract.h"
#include "model/tiny_model.h"
#ifdef UF_HAVE_TOKENIZER
#include "tokenizer/engram_token_map.h"
#include "tokenizer/tokenizer.h"
#endif

#include "model_test_util.h"

namespace fs = std::filesystem;
using uf::model::Checkpoint;

namespace {

const fs::path kTinyA = fs::path(UF_SHARED_DIR) / "fixtures" / "tiny-a";
const std::string kShard1 = "model-00001-of-00003.safetensors";
const std::string kShard3 = "model-00003-of-00003.safetensors";
using uf::model::testing::kBaseTokenizer;

// Each test's scratch folder.
struct TempDir : uf::model::testing::TempDir {
  TempDir() : uf::model::testing::TempDir("uf_tinyfull_") {}
};

struct TinyCopy {
  fs::path dir;
  TinyCopy() {
    static int n = 0;
    dir = fs::temp_directory_path() /
          ("uf_tiny_copy_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::create_directories(dir / "inference");
    for (const auto& e : fs::directory_iterator(kTinyA)) {
      const auto name = e.path().filename().string();
      if (name.find(".safetensors") != std::string::npos || name == "config.json")
        fs::copy_file(e.path(), dir / name);
    }
    fs::copy_file(kTinyA / "inference" / "config.json", dir / "inference" / "config.json");
    for (const auto& e : fs::directory_iterator(dir))
      fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
  }
  ~TinyCopy() { fs::remove_all(dir); }
};

std::string open_error(const fs::path& p) {
  try {
    Checkpoint::open(p);
  } catch (const uf::core::Error& e) {
    return e.what();
  }
  return "";
}

// Rewrites `shard` without `victim`; optionally drops it from the index too.
void remove_tensor(const fs::path& dir, const std::string& shard, const std::string& victim,
                   bool update_index) {
  std::vector<uf::model::TensorData> keep;
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  {
    const auto ck = Checkpoint::open(dir);
    for (const auto& [name, e] : ck.tensors()) {
      if (name == victim) continue;
      weight_map[name] = e.file;
      total += e.view.nbytes;
      if (e.file != shard) continue;
      keep.push_back({name, e.view.dtype, e.view.shape,
                      std::vector<uint8_t>(e.view.data, e.view.data + e.view.nbytes)});
    }
  }  // unmapped before the file is rewritten
  uf::model::write_safetensors(dir / shard, keep);
  if (update_index) uf::model::write_safetensors_index(dir, weight_map, total);
}

// The tensor stored last in a shard (highest end offset).
std::string last_tensor_of(const fs::path& dir, const std::string& shard) {
  const auto ck = Checkpoint::open(dir);
  std::string best;
  uint64_t end = 0;
  for (const auto& [name, e] : ck.tensors())
    if (e.file == shard && e.end >= end) end = e.end, best = name;
  return best;
}

// Runs the built CLI (if this build has it) and returns {exit status, stdout+stderr}.
std::pair<int, std::string> run_cli(const std::string& args) {
  const fs::path exe = fs::path(UF_BINARY_DIR) / "ultrafast";
  std::string out;
  FILE* p = ::popen((exe.string() + " " + args + " 2>&1").c_str(), "r");
  if (!p) return {-1, ""};
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}
bool have_cli() { return fs::exists(fs::path(UF_BINARY_DIR) / "ultrafast"); }

}  // namespace

TEST(ModelIntegration, RemovedTensorIsNamed) {
  TinyCopy t;
  const std::string victim = "layers.2.attn.indexer.wq_b.scale";
  remove_tensor(t.dir, kShard1, victim, /*update_index=*/false);
  // The index still lists it: the loader refuses the folder.
  const auto err = open_error(t.dir);
  EXPECT_NE(err.find("tensor '" + victim + "' is listed for shard " + kShard1), std::string::npos)
      << err;
  if (have_cli()) {
    const auto [rc, out] = run_cli("inspect " + t.dir.string());
    EXPECT_NE(rc, 0);
    EXPECT_NE(out.find(victim), std::string::npos) << out;
  }
}

TEST(ModelIntegration, RemovedTensorAndIndexEntryFailsContract) {
  TinyCopy t;
  const std::string victim = "layers.3.ffn.experts.5.w2.weight";
  remove_tensor(t.dir, kShard1, victim, /*update_index=*/true);
  const auto ck = Checkpoint::open(t.dir);  // structurally fine now
  const auto cfg = uf::model::ModelConfig::load(t.dir);
  const auto rep = uf::model::check_contract(cfg, ck);
  ASSERT_EQ(rep.missing.size(), 1u);
  EXPECT_TRUE(rep.extra.empty() && rep.mismatched.empty());
  EXPECT_NE(rep.missing[0].find(victim), std::string::npos) << rep.missing[0];
  std::ostringstream out;
  EXPECT_EQ(uf::model::inspect_model(t.dir, out), 1);
  EXPECT_NE(out.str().find("missing: " + victim + " (I8 [256, 64])"), std::string::npos)
      << out.str();
  if (have_cli()) {
    const auto [rc, text] = run_cli("inspect " + t.dir.string());
    EXPECT_EQ(rc, 1);
    EXPECT_NE(text.find("contract: FAILED"), std::string::npos) << text;
    EXPECT_NE(text.find(victim), std::string::npos) << text;
  }
}

TEST(ModelIntegration, ShardTruncatedByOneByte) {
  TinyCopy t;
  const std::string last = last_tensor_of(t.dir, kShard3);
  fs::resize_file(t.dir / kShard3, fs::file_size(t.dir / kShard3) - 1);
  const auto err = open_error(t.dir);
  EXPECT_NE(err.find(kShard3), std::string::npos) << err;
  EXPECT_NE(err.find("tensor '" + last + "'"), std::string::npos) << err;
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;
  if (have_cli()) {
    const auto [rc, out] = run_cli("inspect " + t.dir.string());
    EXPECT_NE(rc, 0);
    EXPECT_NE(out.find(last), std::string::npos) << out;
  }
}

TEST(ModelIntegration, InspectPrintsRolesAndPasses) {
  std::ostringstream out;
  EXPECT_EQ(uf::model::inspect_model(kTinyA, out), 0);
  const auto s = out.str();
  EXPECT_NE(s.find("contract: OK (826 tensors, 17660020 bytes"), std::string::npos) << s;
  EXPECT_NE(s.find("Reindex"), std::string::npos);
  EXPECT_NE(s.find("restricted"), std::string::npos);
  EXPECT_NE(s.find("F8_E8M0"), std::string::npos);
}

// The whole generator as `ultrafast make-tiny-model` runs it (real tokenizer, real vocabulary).
TEST(ModelIntegration, TinyModelFullGenerationLoadsAndPassesContract) {
  int classes = 1000;
  TempDir t;
#ifdef UF_HAVE_TOKENIZER
  if (!fs::exists(kBaseTokenizer)) GTEST_SKIP() << "no " << kBaseTokenizer << " (scripts/setup.sh)";
  uf::model::write_v41_tokenizer(kBaseTokenizer, t.path / "tokenizer.json", 129280);
  const auto tok = uf::tokenizer::Tokenizer::from_file(t.path / "tokenizer.json");
  EXPECT_EQ(tok.vocab_size(), 129280);
  EXPECT_EQ(tok.token_to_id("<｜System｜>"), 128799);
  EXPECT_EQ(tok.token_to_id("</think>"), 128822);
  classes = uf::tokenizer::build_engram_token_map(tok).num_classes;
#endif
  const auto t0 = std::chrono::steady_clock::now();
  uf::model::write_random_checkpoint(t.path, uf::model::tiny_model_config(classes), 1);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "generated in " << secs << " s\n";
  const auto cfg = uf::model::ModelConfig::load(t.path);
  EXPECT_EQ(cfg.engram_compressed_vocab_size, classes);
  const auto ck = Checkpoint::open(t.path);
  EXPECT_NO_THROW(uf::model::require_contract(cfg, ck));
  EXPECT_EQ(ck.get("embed.weight").shape, (std::vector<int64_t>{129280, 256}));
  EXPECT_EQ(ck.get("mtp.2.markov_head.head.weight").shape, (std::vector<int64_t>{129280, 64}));
  EXPECT_EQ(ck.entry("layers.1.engram.embed.weight").file, "model-00003-of-00003.safetensors");
}

// `ultrafast make-tiny-model` end to end, then `ultrafast inspect` on its output.
TEST(ModelIntegration, MakeTinyModelCli) {
  if (!have_cli()) GTEST_SKIP() << "ultrafast is not built in this build folder";
  if (!fs::exists(kBaseTokenizer)) GTEST_SKIP() << "no " << kBaseTokenizer << " (scripts/setup.sh)";
  TempDir t;
  const auto [rc, out] = run_cli("make-tiny-model " + t.path.string() +
                                 " --seed 5 --base-tokenizer " + kBaseTokenizer.string());
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("826 tensors"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(t.path / "tokenizer.json"));
  const auto [rc2, text] = run_cli("inspect " + t.path.string());
  EXPECT_EQ(rc2, 0) << text;
  EXPECT_NE(text.find("contract: OK (826 tensors"), std::string::npos) << text;
  EXPECT_NE(text.find("noise token 128799"), std::string::npos) << text;
  // A base tokenizer that does not exist is a clear error, not a crash.
  const auto [rc3, err] = run_cli("make-tiny-model " + (t.path / "x").string() +
                                  " --base-tokenizer /nonexistent/tokenizer.json");
  EXPECT_EQ(rc3, 1);
  EXPECT_NE(err.find("cannot read the base tokenizer /nonexistent/tokenizer.json"),
            std::string::npos)
      << err;
}
