// Tokenizer unit tests: loading, added tokens, pre-tokenizer edge cases, BPE paths, UTF-8 rules.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "core/error.h"
#include "test_util.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

using namespace uf::tokenizer;
using namespace uf::tokenizer::testing;

namespace {

std::vector<std::string> pieces(SplitPattern p, std::string_view text) {
  std::vector<std::string> out;
  split_isolated(p, text, [&](std::string_view s) { out.emplace_back(s); });
  return out;
}

using V = std::vector<std::string>;

}  // namespace

TEST(PreTokenizer, DigitsInGroupsOfThree) {
  EXPECT_EQ(pieces(SplitPattern::kDigits1To3, "a1234567b"), (V{"a", "123", "456", "7", "b"}));
  EXPECT_EQ(pieces(SplitPattern::kDigits1To3, "٣٤٥٦½"), (V{"٣٤٥", "٦½"}));  // \p{N} includes No
}

TEST(PreTokenizer, CjkRuns) {
  EXPECT_EQ(pieces(SplitPattern::kCjkRun, "ab日本語のカナ,x"), (V{"ab", "日本語のカナ", ",x"}));
}

TEST(PreTokenizer, WordsAlternation) {
  auto w = [](std::string_view t) { return pieces(SplitPattern::kDeepSeekWords, t); };
  EXPECT_EQ(w("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(w("it's (x)"), (V{"it", "'s", " (", "x", ")"}));      // A1 punct+letters, A3 " ("
  EXPECT_EQ(w("a  b"), (V{"a", " ", " b"}));                      // \s+(?!\S) leaves one space
  EXPECT_EQ(w("a \n\n b"), (V{"a", " \n\n", " b"}));              // \s*[\r\n]+
  EXPECT_EQ(w("x   "), (V{"x", "   "}));                          // trailing run at end
  EXPECT_EQ(w("!!\n\nx"), (V{"!!\n\n", "x"}));                    // P/S run swallows CR/LF
  EXPECT_EQ(w("e\xCC\x81t\xC3\xA9"), (V{"e\xCC\x81t\xC3\xA9"}));  // marks join letters
}

TEST(PreTokenizer, OnigurumaWhitespaceClass) {
  auto w = [](std::string_view t) { return pieces(SplitPattern::kDeepSeekWords, t); };
  // U+0085 (NEL) is White_Space in Oniguruma (HF tokenizers): "a", then " \u0085" as a run.
  EXPECT_EQ(w("a \xC2\x85 b"), (V{"a", " \xC2\x85", " b"}));
  // U+FEFF is not: it is a Cf gap character that nothing matches.
  EXPECT_EQ(w("a \xEF\xBB\xBF"), (V{"a", " ", "\xEF\xBB\xBF"}));
}

class V3Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_v3()) GTEST_SKIP() << "run scripts/setup.sh: missing " << v3_tokenizer_path();
  }
};

TEST_F(V3Test, KnownIds) {
  // Ids cross-checked with the @lenml/tokenizers reference (test_tokenizer_compare).
  EXPECT_EQ(v3().encode("Hello, world! 12345 日本語のテキスト  \n\n  end"),
            (std::vector<int32_t>{19923, 14, 2058, 3, 223, 6895, 1883, 223, 88768, 1576, 17383,
                                  20367, 24552, 6776, 223, 1522}));
  EXPECT_EQ(v3().vocab_size(), 128815);
  EXPECT_EQ(v3().token_to_id("<｜begin▁of▁sentence｜>"), 0);
  EXPECT_FALSE(v3().token_to_id("<｜System｜>").has_value());
  EXPECT_TRUE(v3().is_special(0));
  EXPECT_FALSE(v3().is_special(128803));
  EXPECT_TRUE(v3().is_added(128803));
}

TEST_F(V3Test, AddedTokensMatchedBeforeBpeLongestFirst) {
  auto ids = v3().encode("a<｜User｜>b<｜end▁of▁sentence｜><｜User");
  ASSERT_GE(ids.size(), 5u);
  EXPECT_EQ(ids[1], 128803);
  EXPECT_EQ(ids[3], 1);
  EXPECT_EQ(v3().decode(ids), "a<｜User｜>b<｜end▁of▁sentence｜><｜User");
  EXPECT_EQ(v3().decode(ids, /*skip_special_tokens=*/true), "a<｜User｜>b<｜User");
}

TEST_F(V3Test, RoundTripAndLongWords) {
  // Words over 48 bytes take the heap path of BPE (the comparison corpus checks its ids on long
  // CJK and whitespace runs); here: huge single pre-tokens round-trip.
  std::string cjk;
  for (int i = 0; i < 5000; ++i) cjk += std::string("中文字符").substr(size_t(3 * (i % 4)), 3);
  auto ids = v3().encode(cjk);
  EXPECT_EQ(v3().decode(ids), cjk);
  std::string spaces(3000, ' ');
  EXPECT_EQ(v3().decode(v3().encode("x" + spaces + "y")), "x" + spaces + "y");
}

TEST_F(V3Test, InvalidUtf8IsRejectedWithOffset) {
  for (std::string bad : {std::string("ab\xFF"), std::string("ab\xC3"), std::string("\xED\xA0\x80"),
                          std::string("x\xE0\x80\x80"), std::string("\xF4\x90\x80\x80")}) {
    try {
      v3().encode(bad);
      ADD_FAILURE() << "accepted invalid UTF-8";
    } catch (const uf::core::Error& e) {
      EXPECT_NE(std::string(e.what()).find("byte offset"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(v3().encode("\xF0\x9F\x8E\x89 \xEF\xBF\xBD"));
}

TEST_F(V3Test, DecodeReplacesInvalidBytes) {
  // "🎉" is several byte tokens; a prefix of them decodes to U+FFFD (one per maximal subpart).
  auto ids = v3().encode("\xF0\x9F\x8E\x89");
  std::string raw = v3().decode_bytes(ids);
  EXPECT_EQ(raw, "\xF0\x9F\x8E\x89");
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x8E"), "\xEF\xBF\xBD");
  EXPECT_EQ(utf8_lossy("a\xFF\xE1\x80Z"), "a\xEF\xBF\xBD\xEF\xBF\xBDZ");
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_THROW(v3().decode(std::vector<int32_t>{v3().vocab_size()}), uf::core::Error);
  EXPECT_THROW(v3().decode(std::vector<int32_t>{-1}), uf::core::Error);
}

TEST(Tokenizer, GiganticInputIsAClearError) {
  if (!have_v3()) GTEST_SKIP();
  std::string big(Tokenizer::max_input_bytes() + 1, 'a');
  EXPECT_THROW(v3().encode(big), uf::core::Error);
}

TEST(Tokenizer, WordLevelFixture) {
  auto tok = Tokenizer::from_file(std::string(UF_SHARED_DIR) + "/fixtures/tiny-a/tokenizer.json");
  EXPECT_EQ(tok.vocab_size(), 1024);
  EXPECT_EQ(tok.encode("café"), (std::vector<int32_t>{8}));
  EXPECT_EQ(tok.encode("<｜User｜>café<｜Assistant｜>"), (std::vector<int32_t>{1016, 8, 1017}));
  EXPECT_EQ(tok.encode("no such word"), (std::vector<int32_t>{2}));  // unk = pad
  EXPECT_EQ(tok.decode(std::vector<int32_t>{8, 9}), "café cafe");    // no decoder: joined by spaces
}

TEST(Tokenizer, BadFilesAreClearErrors) {
  EXPECT_THROW(Tokenizer::from_file("/nonexistent/tokenizer.json"), uf::core::Error);
  EXPECT_THROW(Tokenizer::from_json("{", "x"), uf::core::Error);
  EXPECT_THROW(Tokenizer::from_json(
                   R"({"added_tokens": [], "model": {"type": "Unigram", "vocab": {}}})", "x"),
               uf::core::Error);
  try {
    Tokenizer::from_json(R"({"added_tokens": [], "normalizer": null,
      "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\d+"}, "behavior": "Isolated", "invert": false},
      "model": {"type": "WordLevel", "vocab": {}}})",
                         "x.json");
    FAIL();
  } catch (const uf::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("\\d+"), std::string::npos) << e.what();
  }
}

TEST_F(V3Test, ConcurrentEncodeMatchesSerial) {
  // Each thread has its own merge cache; results must not depend on interleaving.
  std::vector<std::string> texts = {"Hello world, this is a test.", "日本語のテキストと English",
                                    "  spaces\n\n\tand tabs  ", "1234567890 numbers 3.14159"};
  std::vector<std::vector<int32_t>> want;
  for (const auto& t : texts) want.push_back(v3().encode(t));
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int rep = 0; rep < 200; ++rep) {
        size_t i = size_t(rep + k) % texts.size();
        if (v3().encode(texts[i]) != want[i]) ++bad;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST_F(V3Test, RandomTextRoundTrips) {
  // decode(encode(x)) == x for random valid UTF-8 drawn from many blocks (2000 strings).
  std::mt19937 rng(7);
  const uint32_t ranges[][2] = {{0x09, 0x0D},    {0x20, 0x7E},     {0x80, 0x7FF},
                                {0x800, 0xD7FF}, {0xE000, 0xFFFD}, {0x10000, 0x10FFFF}};
  for (int n = 0; n < 2000; ++n) {
    std::string s;
    int len = 1 + int(rng() % 24);
    for (int k = 0; k < len; ++k) {
      const auto& r = ranges[rng() % 6];
      append_utf8(s, r[0] + rng() % (r[1] - r[0] + 1));
    }
    ASSERT_EQ(v3().decode(v3().encode(s)), s);
  }
}

TEST(Tokenizer, NormalizersAndNormalizedAddedTokens) {
  const char* json = R"({
    "added_tokens": [
      {"id": 3, "content": "<x>", "normalized": true, "special": false},
      {"id": 4, "content": "<Y>", "normalized": false, "special": true}],
    "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]},
    "pre_tokenizer": null, "decoder": null,
    "model": {"type": "WordLevel", "unk_token": "[UNK]",
              "vocab": {"[UNK]": 0, "café": 1, "the": 2, "<y>": 5}}})";
  auto tok = Tokenizer::from_json(json, "inline");
  EXPECT_EQ(tok.encode("ＴＨＥ"), (std::vector<int32_t>{2}));  // NFKC then lowercase
  EXPECT_EQ(tok.encode("CAFÉ"), (std::vector<int32_t>{1}));
  EXPECT_EQ(tok.encode("<X>"), (std::vector<int32_t>{3}));  // matched after normalization
  EXPECT_EQ(tok.encode("<Y>"), (std::vector<int32_t>{4}));  // matched on the raw text
  EXPECT_EQ(tok.encode("<y>"), (std::vector<int32_t>{5}));  // not the added token: a word
  EXPECT_THROW(Tokenizer::from_json(R"({"added_tokens": [], "normalizer": {"type": "Strip"},
      "model": {"type": "WordLevel", "vocab": {}}})"),
               uf::core::Error);
}
