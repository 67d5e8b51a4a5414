// The Engram token map against the reference's own map (golden/reference.safetensors), and the
// normalizer on hand-written cases.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/engram_token_map.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using namespace uf::tokenizer;

namespace {

// A minimal safetensors reader for one I64 array (8-byte LE header length, JSON header, data).
std::vector<int64_t> read_i64(const fs::path& file, const std::string& name) {
  std::ifstream in(file, std::ios::binary);
  EXPECT_TRUE(in.good()) << file;
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  in.read(header.data(), std::streamsize(n));
  auto h = nlohmann::json::parse(header);
  const auto& e = h.at(name);
  EXPECT_EQ(e.at("dtype"), "I64");
  uint64_t begin = e.at("data_offsets")[0], end = e.at("data_offsets")[1];
  std::vector<int64_t> out((end - begin) / 8);
  in.seekg(std::streamoff(8 + n + begin));
  in.read(reinterpret_cast<char*>(out.data()), std::streamsize(end - begin));
  return out;
}

int64_t compressed_vocab(const fs::path& fixture) {
  std::ifstream in(fixture / "inference/config.json");
  return nlohmann::json::parse(in).at("engram_compressed_vocab_size").get<int64_t>();
}

void check_fixture(const std::string& name) {
  fs::path dir = fs::path(UF_SHARED_DIR) / "fixtures" / name;
  Tokenizer tok = Tokenizer::from_file(dir / "tokenizer.json");
  auto want = read_i64(dir / "golden/reference.safetensors", "engram_token_map");
  auto got = build_engram_token_map(tok, compressed_vocab(dir));
  ASSERT_EQ(got.map.size(), want.size());
  int shown = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got.map[i] != want[i] && shown++ < 10) {
      ADD_FAILURE() << name << " token " << i << " '" << tok.id_to_piece(int32_t(i)) << "': ours "
                    << got.map[i] << ", reference " << want[i];
    }
  }
  EXPECT_EQ(shown, 0);
}

}  // namespace

TEST(EngramTokenMap, MatchesReferenceTinyA) { check_fixture("tiny-a"); }
TEST(EngramTokenMap, MatchesReferenceMediumA) { check_fixture("medium-a"); }

TEST(EngramTokenMap, WrongClassCountIsAClearError) {
  fs::path dir = fs::path(UF_SHARED_DIR) / "fixtures/tiny-a";
  Tokenizer tok = Tokenizer::from_file(dir / "tokenizer.json");
  try {
    build_engram_token_map(tok, 274);
    FAIL() << "expected an error";
  } catch (const uf::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("273"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("274"), std::string::npos) << e.what();
  }
}

TEST(EngramTokenMap, Normalizer) {
  EXPECT_EQ(engram_normalize(" Café"), "cafe");  // accents, case, outer space
  EXPECT_EQ(engram_normalize("ＴＨＥ"), "the");  // NFKC fullwidth
  EXPECT_EQ(engram_normalize("ﬁ"), "fi");        // NFKC ligature
  EXPECT_EQ(engram_normalize("Ⅳ"), "iv");        // NFKC roman numeral, lowercased
  EXPECT_EQ(engram_normalize(" "), " ");         // the single-space sentinel
  EXPECT_EQ(engram_normalize("  "), " ");        // a run collapses to one space first
  EXPECT_EQ(engram_normalize(" \n "), " ");
  EXPECT_EQ(engram_normalize("a \t\r\n b"), "a b");   // collapse inside
  EXPECT_EQ(engram_normalize("\xE3\x80\x80x"), "x");  // U+3000 -> NFKC space -> stripped
  EXPECT_EQ(engram_normalize("x "), "x");             // strip only after the sentinel check
  EXPECT_EQ(engram_normalize("İ"), "i");              // NFD splits off U+0307, the strip drops it
  EXPECT_EQ(engram_normalize("ΣΑΣ"), "σασ");  // per-character lowercase: no final-sigma rule
}
