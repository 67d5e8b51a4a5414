#include "server/response_builder.h"

namespace uf::server {

using nlohmann::json;

namespace {

json finish_json(const std::string& finish_reason) {
  return finish_reason.empty() ? json(nullptr) : json(finish_reason);
}

json envelope(const ResponseMeta& m, const char* object) {
  json j;
  j["id"] = m.id;
  j["object"] = object;
  j["created"] = m.created;
  j["model"] = m.model;
  j["system_fingerprint"] = m.system_fingerprint;
  return j;
}

}  // namespace

json usage_json(const UsageCounts& u) {
  return json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}},
              {"completion_tokens_details", {{"reasoning_tokens", u.reasoning_tokens}}}};
}

json tool_call_delta(const ToolCallOut& call, int index) {
  return json{{"index", index},
              {"id", call.id},
              {"type", "function"},
              {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
}

json chat_completion(const ResponseMeta& m, const std::optional<std::string>& reasoning,
                     const std::string& content, const std::vector<ToolCallOut>& calls,
                     const std::string& finish_reason, const UsageCounts& usage) {
  json msg;
  msg["role"] = "assistant";
  // OpenAI sends content null when the answer is only tool calls.
  msg["content"] = (content.empty() && !calls.empty()) ? json(nullptr) : json(content);
  if (reasoning) msg["reasoning_content"] = *reasoning;
  msg["refusal"] = nullptr;
  if (!calls.empty()) {
    json arr = json::array();
    for (const auto& c : calls) {
      arr.push_back(json{{"id", c.id},
                         {"type", "function"},
                         {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    }
    msg["tool_calls"] = std::move(arr);
  }
  json j = envelope(m, "chat.completion");
  j["choices"] = json::array({json{{"index", 0},
                                   {"message", std::move(msg)},
                                   {"logprobs", nullptr},
                                   {"finish_reason", finish_json(finish_reason)}}});
  j["usage"] = usage_json(usage);
  return j;
}

json chat_chunk(const ResponseMeta& m, json delta, const std::string& finish_reason,
                bool include_usage) {
  json j = envelope(m, "chat.completion.chunk");
  j["choices"] = json::array({json{{"index", 0},
                                   {"delta", std::move(delta)},
                                   {"logprobs", nullptr},
                                   {"finish_reason", finish_json(finish_reason)}}});
  if (include_usage) j["usage"] = nullptr;
  return j;
}

json chat_usage_chunk(const ResponseMeta& m, const UsageCounts& usage) {
  json j = envelope(m, "chat.completion.chunk");
  j["choices"] = json::array();
  j["usage"] = usage_json(usage);
  return j;
}

json text_completion(const ResponseMeta& m, const std::string& text,
                     const std::string& finish_reason, const UsageCounts& usage) {
  json j = envelope(m, "text_completion");
  j["choices"] = json::array({json{{"text", text},
                                   {"index", 0},
                                   {"logprobs", nullptr},
                                   {"finish_reason", finish_json(finish_reason)}}});
  j["usage"] = usage_json(usage);
  return j;
}

json text_completion_chunk(const ResponseMeta& m, const std::string& text,
                           const std::string& finish_reason, bool include_usage) {
  json j = envelope(m, "text_completion");
  j["choices"] = json::array({json{{"text", text},
                                   {"index", 0},
                                   {"logprobs", nullptr},
                                   {"finish_reason", finish_json(finish_reason)}}});
  if (include_usage) j["usage"] = nullptr;
  return j;
}

json text_usage_chunk(const ResponseMeta& m, const UsageCounts& usage) {
  json j = envelope(m, "text_completion");
  j["choices"] = json::array();
  j["usage"] = usage_json(usage);
  return j;
}

std::string sse_event(const json& j) {
  std::string s = "data: ";
  // Invalid UTF-8 cannot reach here (the detokenizer emits valid text), but never throw mid-stream.
  s += j.dump(-1, ' ', false, json::error_handler_t::replace);
  s += "\n\n";
  return s;
}

}  // namespace uf::server
