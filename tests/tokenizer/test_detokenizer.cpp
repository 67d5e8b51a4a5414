// Streaming detokenizer: byte-by-byte splits of multi-byte text, reasoning/content separation,
// stop strings across chunk boundaries.
#include <gtest/gtest.h>

#include "test_util.h"
#include "tokenizer/chat_encoding.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/unicode.h"

using namespace uf::tokenizer;
using namespace uf::tokenizer::testing;

namespace {

const char* kFffd = "\xEF\xBF\xBD";

// The single-byte tokens spelling `text` (every split point of every character).
std::vector<int32_t> byte_tokens(const Tokenizer& tok, std::string_view text) {
  std::vector<int32_t> ids;
  for (unsigned char b : text) {
    // The GPT-2 alphabet character of byte b is a one-byte token in the byte-level vocabulary.
    uint32_t cp = b;
    if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174))) {
      int extra = 0;
      for (int x = 0; x < b; ++x) {
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174))) ++extra;
      }
      cp = 256 + uint32_t(extra);
    }
    std::string piece;
    append_utf8(piece, cp);
    ids.push_back(*tok.token_to_id(piece));
  }
  return ids;
}

struct Stream {
  std::vector<DetokenizerChunk> chunks;
  std::string reasoning, content;
  bool stopped = false;
};

Stream run(const Tokenizer& tok, const std::vector<int32_t>& ids, DetokenizerOptions opts) {
  StreamingDetokenizer d(tok, std::move(opts));
  Stream r;
  auto take = [&](DetokenizerChunk c) {
    EXPECT_FALSE(find_invalid_utf8(c.reasoning)) << "chunk is not valid UTF-8";
    EXPECT_FALSE(find_invalid_utf8(c.content)) << "chunk is not valid UTF-8";
    r.reasoning += c.reasoning;
    r.content += c.content;
    r.stopped = r.stopped || c.stopped;
    r.chunks.push_back(std::move(c));
  };
  for (int32_t id : ids) take(d.push(id));
  take(d.finish());
  EXPECT_EQ(r.reasoning, d.reasoning_text());
  EXPECT_EQ(r.content, d.content_text());
  return r;
}

class DetokTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_v3()) GTEST_SKIP() << "run scripts/setup.sh: missing " << v3_tokenizer_path();
  }
};

DetokenizerOptions opts(bool thinking, std::vector<std::string> stop = {},
                        bool stop_in_reasoning = false) {
  DetokenizerOptions o;
  o.thinking = thinking;
  o.stop = std::move(stop);
  o.stop_in_reasoning = stop_in_reasoning;
  return o;
}

const std::string kMixed =
    "Grüße, 日本語! 🎉👨‍👩‍👧 ∑ x² ﷽ 𝔘𝔫𝔦 café";

}  // namespace

TEST_F(DetokTest, ByteByByteNeverSplitsACharacter) {
  auto ids = byte_tokens(v41(), kMixed);
  ASSERT_EQ(ids.size(), kMixed.size());
  Stream r = run(v41(), ids, opts(false));
  EXPECT_EQ(r.content, kMixed);
  EXPECT_EQ(r.content.find(kFffd), std::string::npos);
  // A chunk is emitted exactly when a character completes: count the non-empty chunks.
  size_t chars = 0;
  for (size_t i = 0; i < kMixed.size();
       i += size_t(utf8_len(static_cast<unsigned char>(kMixed[i]))))
    ++chars;
  size_t nonempty = 0;
  for (auto& c : r.chunks) nonempty += !c.content.empty();
  EXPECT_EQ(nonempty, chars);
}

TEST_F(DetokTest, RealTokensOfMultiByteText) {
  // BPE splits rare characters over several tokens; the stream must still be whole characters.
  auto ids = v41().encode(kMixed);
  Stream r = run(v41(), ids, opts(false));
  EXPECT_EQ(r.content, kMixed);
}

TEST_F(DetokTest, InvalidAndTruncatedBytesBecomeReplacementCharacters) {
  auto ids = byte_tokens(v41(),
                         "a\xFF"
                         "b\xE6\x97");  // 0xFF never valid; E6 97 truncated
  Stream r = run(v41(), ids, opts(false));
  EXPECT_EQ(r.content, std::string("a") + kFffd + "b" + kFffd);
  // The 0xFF is replaced as soon as it arrives (it can never complete).
  StreamingDetokenizer d(v41(), opts(false));
  d.push(ids[0]);
  EXPECT_EQ(d.push(ids[1]).content, kFffd);
}

TEST_F(DetokTest, ReasoningThenContent) {
  std::vector<int32_t> ids = {V41Ids::kThink};
  auto r1 = v41().encode("Let me think: 日本");
  ids.insert(ids.end(), r1.begin(), r1.end());
  ids.push_back(V41Ids::kThinkEnd);
  auto c1 = v41().encode("Answer.");
  ids.insert(ids.end(), c1.begin(), c1.end());
  ids.push_back(V41Ids::kEos);
  Stream r = run(v41(), ids, opts(true));
  EXPECT_EQ(r.reasoning, "Let me think: 日本");
  EXPECT_EQ(r.content, "Answer.");  // EOS is special: not text
  // Thinking off: everything is content; a stray </think> is not text.
  Stream off = run(v41(), ids, opts(false));
  EXPECT_EQ(off.reasoning, "");
  EXPECT_EQ(off.content, "Let me think: 日本Answer.");
}

TEST_F(DetokTest, StopStringAcrossByteChunks) {
  const std::string text = "hello 世界STOP world";
  auto ids = byte_tokens(v41(), text);
  Stream r = run(v41(), ids, opts(false, {"STOP"}));
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.content, "hello 世界");
  // While "ST" could still become "STOP" it is held back.
  StreamingDetokenizer d(v41(), opts(false, {"STOP"}));
  std::string seen;
  for (char ch : std::string("ab ST"))
    seen += d.push(byte_tokens(v41(), std::string(1, ch))[0]).content;
  EXPECT_EQ(seen, "ab ");
  seen += d.push(byte_tokens(v41(), "x")[0]).content;  // "STx" can no longer match
  EXPECT_EQ(seen, "ab STx");
  EXPECT_FALSE(d.stopped());
}

TEST_F(DetokTest, MultiByteStopStringAndEarliestMatch) {
  const std::string text = "答案是：四十二。结束";
  auto ids = byte_tokens(v41(), text);
  Stream r = run(v41(), ids, opts(false, {"结束", "。"}));
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.content, "答案是：四十二");
  size_t stops = 0;
  for (const auto& c : r.chunks) {
    if (c.stopped) {
      ++stops;
      EXPECT_EQ(c.stop_string, "。");  // the earliest match wins
    }
  }
  EXPECT_EQ(stops, 1u);
  // Held-back text that never completes a stop string is flushed by finish().
  Stream tail = run(v41(), byte_tokens(v41(), "abc结"), opts(false, {"结束"}));
  EXPECT_FALSE(tail.stopped);
  EXPECT_EQ(tail.content, "abc结");
}

TEST_F(DetokTest, StopStringsIgnoreReasoningByDefault) {
  std::vector<int32_t> ids = byte_tokens(v41(), "I might say STOP here");
  ids.push_back(V41Ids::kThinkEnd);
  auto c = byte_tokens(v41(), "Result STOP tail");
  ids.insert(ids.end(), c.begin(), c.end());
  Stream r = run(v41(), ids, opts(true, {"STOP"}));
  EXPECT_EQ(r.reasoning, "I might say STOP here");
  EXPECT_EQ(r.content, "Result ");
  Stream in_r = run(v41(), ids, opts(true, {"STOP"}, true));
  EXPECT_EQ(in_r.reasoning, "I might say ");
  EXPECT_EQ(in_r.content, "");
  // After the stop, further tokens produce nothing.
  StreamingDetokenizer d(v41(), opts(false, {"S"}));
  EXPECT_TRUE(d.push(byte_tokens(v41(), "S")[0]).stopped);
  EXPECT_TRUE(d.push(byte_tokens(v41(), "x")[0]).empty());
}

TEST_F(DetokTest, ToolCallBlockLeavesTheContentStream) {
  const std::string calls =
      "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter "
      "name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ "
      "calls>";
  std::vector<int32_t> ids = {V41Ids::kThink};
  auto r = v41().encode("Need weather.");
  ids.insert(ids.end(), r.begin(), r.end());
  ids.push_back(V41Ids::kThinkEnd);
  auto c = v41().encode("Checking." + calls);
  ids.insert(ids.end(), c.begin(), c.end());
  ids.push_back(V41Ids::kEos);
  DetokenizerOptions o = opts(true, {"STOP"});
  o.detect_tool_calls = true;
  StreamingDetokenizer d(v41(), o);
  std::string content;
  int started = 0;
  for (int32_t id : ids) {
    auto ch = d.push(id);
    content += ch.content;
    started += ch.tool_calls_started;
  }
  content += d.finish().content;
  EXPECT_EQ(d.reasoning_text(), "Need weather.");
  EXPECT_EQ(content, "Checking.");
  EXPECT_EQ(started, 1);
  EXPECT_EQ(d.tool_calls_text(), calls);  // ｜DSML｜ is special but kept; EOS is dropped
  auto parsed = parse_assistant_output(d.tool_calls_text(), false);
  ASSERT_EQ(parsed.tool_calls.size(), 1u);
  EXPECT_EQ(parsed.tool_calls[0].name, "get_weather");
  EXPECT_EQ(parsed.tool_calls[0].arguments, "{\"city\": \"Paris\"}");
  // A "\n\n" that does not start a tool call is only held until it is clear.
  DetokenizerOptions p = opts(false);
  p.detect_tool_calls = true;
  Stream plain = run(v41(), v41().encode("a\n\nb"), p);
  EXPECT_EQ(plain.content, "a\n\nb");
  // Off (the default): the DSML text is ordinary content.
  Stream off = run(v41(), c, opts(false));
  EXPECT_EQ(off.content, "Checking." + calls);
}

TEST(Detokenizer, WordLevelStreamMatchesDecode) {
  // Without a decoder HF joins tokens with spaces; the stream must say the same as decode().
  auto tok = Tokenizer::from_file(std::string(UF_SHARED_DIR) + "/fixtures/tiny-a/tokenizer.json");
  std::vector<int32_t> ids = {8, 9, 1, 17};  // café cafe <EOS> the
  StreamingDetokenizer d(tok, opts(false));
  std::string text;
  for (int32_t id : ids) text += d.push(id).content;
  text += d.finish().content;
  EXPECT_EQ(text, tok.decode(ids, /*skip_special_tokens=*/true));
  EXPECT_EQ(text, "café cafe the");
}
