#pragma once
// Parsing and validation of /v1/chat/completions and /v1/completions bodies. Everything that can
// be checked without the tokenizer is checked here and reported as an ApiError naming the
// parameter (OpenAI's `param`), so a bad request never reaches the queue.

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/generation_engine.h"

namespace uf::server {

enum class Endpoint { kChat, kCompletion };

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kChat;
  std::string model;
  // Chat: the body handed to the V4.1 chat encoder (roles normalised, tool_choice "none" applied).
  nlohmann::json chat_body;
  // Completions: the raw prompt, as text or as token ids.
  std::string prompt_text;
  std::vector<int32_t> prompt_ids;
  bool prompt_is_ids = false;

  std::optional<int> max_tokens;  // absent: up to --max-seq (chat) or 16 (completions, as OpenAI)
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
  SamplingParams sampling;
  bool has_tools = false;           // tools offered (and tool_choice is not "none")
  bool has_assistant_turn = false;  // multi-turn: needs X-Session-ID
};

struct ParserOptions {
  size_t max_stop_strings = 16;
  size_t max_stop_bytes = 256;
  int max_tokens_limit = 1 << 24;
  // What a request gets for the sampling parameters it leaves out (sampling_defaults.h: the
  // model's generation_config.json, else OpenAI's); its seed is never used.
  SamplingParams default_sampling;
};

// Parses the request body text. Throws ApiError (400) on malformed JSON, wrong types, out-of-range
// values, empty messages and unsupported or unknown parameters.
ParsedRequest parse_request(std::string_view body, Endpoint endpoint,
                            const ParserOptions& options = {});

}  // namespace uf::server
