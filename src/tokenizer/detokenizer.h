#pragma once
// Streaming detokenizer: token ids in, UTF-8 text chunks out.
// - Never splits a multi-byte character across chunks: bytes of an incomplete character are held
//   until it completes (or finish() flushes them as U+FFFD).
// - Separates reasoning from content: in thinking mode everything before the </think> token is
//   reasoning_content; after it, content. A leading <think> token is dropped.
// - Stop strings: matched across chunk boundaries; text that could still become a stop string is
//   held back; the stop string itself is never emitted. Stop strings apply to content only (and to
//   reasoning too when `stop_in_reasoning`).
// - Special tokens (BOS/EOS/…) are not emitted as text when `skip_special_tokens` (default);
//   ｜DSML｜ is always kept, since it is part of the tool-call text.
// - Tool calls (`detect_tool_calls`, default off): content ends where a DSML block begins
//   ("\n\n<｜DSML｜ calls"); that text and everything after it goes to tool_calls_text() instead
//   of the stream (chunk.tool_calls_started marks the moment). After finish(), parse it with
//   parse_assistant_output(tool_calls_text(), /*thinking=*/false) (chat_encoding.h).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace uf::tokenizer {

struct DetokenizerOptions {
  bool thinking = true;  // the prompt ended with <think>: output starts as reasoning
  std::vector<std::string> stop;
  bool stop_in_reasoning = false;
  bool skip_special_tokens = true;
  bool detect_tool_calls = false;  // opt-in (see the header comment)
};

struct DetokenizerChunk {
  std::string reasoning;  // new reasoning_content text (valid UTF-8)
  std::string content;    // new content text (valid UTF-8)
  bool stopped = false;   // a stop string matched; no further text will be produced
  std::string stop_string;
  bool tool_calls_started = false;  // the DSML tool-call block began in this chunk
  bool empty() const {
    return reasoning.empty() && content.empty() && !stopped && !tool_calls_started;
  }
};

class StreamingDetokenizer {
 public:
  StreamingDetokenizer(Tokenizer tokenizer, DetokenizerOptions options);

  // Feeds one generated token. After a stop string matched, further tokens are ignored.
  DetokenizerChunk push(int32_t id);
  // End of generation: flushes held text (an incomplete character becomes U+FFFD).
  DetokenizerChunk finish();

  bool stopped() const { return stopped_; }
  bool in_reasoning() const { return in_reasoning_; }
  // All text emitted so far.
  const std::string& reasoning_text() const { return all_reasoning_; }
  const std::string& content_text() const { return all_content_; }
  // The DSML tool-call text ("\n\n<｜DSML｜ calls>..."), empty if none began.
  const std::string& tool_calls_text() const { return tool_text_; }
  bool in_tool_calls() const { return in_tool_calls_; }

 private:
  void emit(std::string_view text, bool final, DetokenizerChunk& out);
  Tokenizer tok_;
  DetokenizerOptions opts_;
  int32_t think_start_ = -1, think_end_ = -1, dsml_ = -1;
  bool in_reasoning_ = true;
  bool stopped_ = false;
  bool in_tool_calls_ = false;
  bool any_text_token_ = false;  // for tokenizers whose decode joins tokens with spaces
  std::string pending_bytes_;    // bytes of an incomplete UTF-8 character
  std::string held_;             // complete text held back as a possible stop-string prefix
  std::string all_reasoning_, all_content_, tool_text_;
};

}  // namespace uf::tokenizer
