#pragma once
// DeepSeek-V4.1 chat encoding (model-arch.md §7; the official encoding/encoding.py) and the parser
// of its DSML tool calls. Special-token ids are looked up by string in the tokenizer; a missing
// one is an error at construction.
//
// Accepted request (OpenAI chat-completions style JSON object):
//   "messages": [{"role": "system"|"user"|"assistant"|"tool"|"latest_reminder",
//                 "content": string | [{"type":"text","text":...}, ...] | null,
//                 "reasoning_content": string (assistant), "tool_calls": [...] (assistant),
//                 "tool_call_id": string (tool)}]
//   "thinking": {"type": "enabled"|"disabled"}          (default enabled)
//   "chat_template_kwargs": {"thinking": bool}           (vLLM style, same effect)
//   "reasoning_effort": "low"|"medium"|"high"|"max"|"none"|int 1..100  (default "high" = 75;
//                        low 50, medium 75, max 100 as the encoder maps them; "none" disables
//                        thinking as vLLM does)
//   "tools": [{"type":"function","function":{...}}]   (rendered into the first system message;
//                        an empty system message is inserted first when there is none, since the
//                        format renders tools only there)
//   "response_format": {...}                          (same; {"type":"text"} is ignored)
// JSON inside the prompt (tool schemas, non-string tool arguments) is written as Python's
// json.dumps(ensure_ascii=False) writes it, keys in request order: use the ordered_json overload
// (or encode_body) to keep that order; the nlohmann::json overload sorts keys.
// User text is tokenized like the rest of the prompt, so special-token strings inside it become
// special tokens, as with the reference (encoding.py + tokenizer.encode of the whole prompt).
// Errors (uf::core::Error, the server maps them to HTTP 400): not an object, no/empty messages,
// unknown role, wrong field types, invalid UTF-8, too many messages / too large a prompt.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace uf::tokenizer {

struct ChatPrompt {
  std::string text;          // the rendered prompt (starts with BOS)
  std::vector<int32_t> ids;  // tokenizer.encode(text)
  bool thinking = true;      // the generation header ends with <think> (true) or </think>
};

struct ChatLimits {
  size_t max_messages = 100000;
  size_t max_prompt_bytes = size_t(32) << 20;
};

class ChatEncoder {
 public:
  // Looks up the special tokens every prompt needs (BOS, EOS, <｜System｜>, <｜User｜>,
  // <｜Assistant｜>, <think>, </think>); throws naming the missing one and the file. Requests with
  // a latest_reminder message or tools/tool calls also need <｜latest_reminder｜> / ｜DSML｜.
  explicit ChatEncoder(Tokenizer tokenizer, ChatLimits limits = {});

  // Renders and tokenizes a request (see the header comment for the accepted fields).
  ChatPrompt encode(const nlohmann::ordered_json& request) const;
  ChatPrompt encode(const nlohmann::json& request) const;
  // Parses the request body (JSON text) keeping key order, then encodes it.
  ChatPrompt encode_body(std::string_view json_text) const;
  // Only renders the prompt text.
  std::string render(const nlohmann::ordered_json& request, bool* thinking_out = nullptr) const;

  const Tokenizer& tokenizer() const { return tok_; }
  int32_t bos_id() const { return bos_; }
  int32_t eos_id() const { return eos_; }
  int32_t think_start_id() const { return think_start_; }
  int32_t think_end_id() const { return think_end_; }

 private:
  Tokenizer tok_;
  ChatLimits limits_;
  int32_t bos_ = -1, eos_ = -1, think_start_ = -1, think_end_ = -1;
};

// A tool call recovered from generated text (OpenAI format: arguments is a JSON object as text).
struct ParsedToolCall {
  std::string name;
  std::string arguments;
};

struct ParsedAssistantMessage {
  std::string reasoning_content;
  std::string content;
  std::vector<ParsedToolCall> tool_calls;
};

// Parses the text generated after the prompt (special tokens included, i.e. decoded with
// skip_special_tokens=false), as encoding.py's parse_message_from_completion_text does:
// thinking mode: "{reasoning}</think>{content}[\n\n<｜DSML｜ calls>...</｜DSML｜ calls>]<EOS>".
// Unlike the reference, a missing final EOS (generation stopped by length or a stop string) is
// accepted. Malformed DSML throws uf::core::Error.
ParsedAssistantMessage parse_assistant_output(std::string_view text, bool thinking);

// Python's json.dumps(value, ensure_ascii=False) formatting (", " and ": " separators).
std::string python_json_dumps(const nlohmann::ordered_json& value);

// Finds the start of a DSML tool-call block ("\n\n<｜DSML｜ calls") in `text`, or npos. The server
// can use it to stop streaming content once a tool call begins.
size_t find_tool_calls_start(std::string_view text);

}  // namespace uf::tokenizer
