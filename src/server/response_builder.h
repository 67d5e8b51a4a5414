#pragma once
// Response bodies in OpenAI's exact shapes: chat.completion, chat.completion.chunk,
// text_completion (whole and streamed), usage, and the SSE framing ("data: ...\n\n", "[DONE]").

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "server/output_assembler.h"

namespace uf::server {

struct UsageCounts {
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int reasoning_tokens = 0;
  int cached_tokens = 0;  // prompt tokens whose KV state was reused
};

struct ResponseMeta {
  std::string id;  // chatcmpl-... / cmpl-...
  int64_t created = 0;
  std::string model;
  std::string system_fingerprint;
};

nlohmann::json usage_json(const UsageCounts& u);

// Non-streaming chat completion. `reasoning` is omitted from the message when absent.
nlohmann::json chat_completion(const ResponseMeta& m, const std::optional<std::string>& reasoning,
                               const std::string& content, const std::vector<ToolCallOut>& calls,
                               const std::string& finish_reason, const UsageCounts& usage);

// One chat.completion.chunk with a single choice. `finish_reason` empty = null. With
// `include_usage`, every chunk carries "usage": null, as OpenAI's stream does.
nlohmann::json chat_chunk(const ResponseMeta& m, nlohmann::json delta,
                          const std::string& finish_reason, bool include_usage);
// The final usage chunk: "choices": [] and "usage": {...}.
nlohmann::json chat_usage_chunk(const ResponseMeta& m, const UsageCounts& usage);
// The delta of a tool-call chunk (one call, complete arguments).
nlohmann::json tool_call_delta(const ToolCallOut& call, int index);

nlohmann::json text_completion(const ResponseMeta& m, const std::string& text,
                               const std::string& finish_reason, const UsageCounts& usage);
nlohmann::json text_completion_chunk(const ResponseMeta& m, const std::string& text,
                                     const std::string& finish_reason, bool include_usage);
nlohmann::json text_usage_chunk(const ResponseMeta& m, const UsageCounts& usage);

// "data: <json>\n\n"
std::string sse_event(const nlohmann::json& j);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

}  // namespace uf::server
