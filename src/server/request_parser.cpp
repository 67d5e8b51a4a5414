#include "server/request_parser.h"

#include <fmt/format.h>

#include <set>

#include "server/api_error.h"

namespace uf::server {
namespace {

using nlohmann::json;

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default:
      return "a number";
  }
}

[[noreturn]] void wrong_type(const std::string& param, const json& v, const char* expected) {
  throw invalid_request(fmt::format("'{}' must be {}, got {}.", param, expected, type_name(v)),
                        param, "invalid_type");
}

// Accessors return nullopt for absent or null fields (OpenAI clients send null for "unset").
const json* field(const json& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> get_bool(const json& body, const char* key) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(key, *v, "a boolean");
  return v->get<bool>();
}

std::optional<double> get_number(const json& body, const char* key, double lo, double hi,
                                 bool lo_open = false) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(key, *v, "a number");
  double x = v->get<double>();
  if (!(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
    throw invalid_request(
        fmt::format("'{}' must be in {}{}, {}], got {}.", key, lo_open ? "(" : "[", lo, hi, x), key,
        "invalid_value");
  }
  return x;
}

std::optional<int64_t> get_int(const json& body, const char* key, int64_t lo, int64_t hi) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  // Integral-valued floats (e.g. 100.0) are accepted as Python clients sometimes send them.
  int64_t x = 0;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX)) {
      throw invalid_request(fmt::format("'{}' is out of range.", key), key, "invalid_value");
    }
    x = v->get<int64_t>();
  } else if (v->is_number_float() &&
             v->get<double>() == static_cast<double>(static_cast<int64_t>(v->get<double>()))) {
    x = static_cast<int64_t>(v->get<double>());
  } else {
    wrong_type(key, *v, "an integer");
  }
  if (x < lo || x > hi) {
    throw invalid_request(fmt::format("'{}' must be between {} and {}, got {}.", key, lo, hi, x),
                          key, "invalid_value");
  }
  return x;
}

void reject_unsupported(const std::string& param, const std::string& why) {
  throw invalid_request(fmt::format("'{}' is not supported by this server: {}.", param, why), param,
                        "unsupported_parameter");
}

// Fields that are accepted but do not change generation (bookkeeping for OpenAI's own service).
const std::set<std::string> kIgnoredFields = {"user",
                                              "metadata",
                                              "store",
                                              "service_tier",
                                              "parallel_tool_calls",
                                              "prompt_cache_key",
                                              "safety_identifier"};

void check_known_fields(const json& body, const std::set<std::string>& known) {
  for (auto it = body.begin(); it != body.end(); ++it) {
    if (!known.count(it.key()) && !kIgnoredFields.count(it.key())) {
      throw invalid_request(fmt::format("Unrecognized request argument supplied: {}", it.key()),
                            it.key(), "unknown_parameter");
    }
  }
}

// Parameters every server supports somewhere but this one cannot honour; accepted only at their
// neutral values so that a client never gets silently different behaviour.
void check_neutral(const json& body) {
  if (auto n = get_int(body, "n", 1, 128); n && *n != 1) reject_unsupported("n", "only n=1");
  if (auto b = get_int(body, "best_of", 1, 128); b && *b != 1) {
    reject_unsupported("best_of", "only best_of=1");
  }
  if (const json* v = field(body, "logprobs")) {
    if (!(v->is_boolean() && !v->get<bool>()) && !(v->is_number_integer() && v->get<int>() == 0)) {
      reject_unsupported("logprobs", "log probabilities are not returned");
    }
  }
  if (auto t = get_int(body, "top_logprobs", 0, 20); t && *t != 0) {
    reject_unsupported("top_logprobs", "log probabilities are not returned");
  }
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    if (auto p = get_number(body, key, -2.0, 2.0); p && *p != 0.0) {
      reject_unsupported(key, "penalties are not implemented");
    }
  }
  if (const json* v = field(body, "logit_bias")) {
    if (!v->is_object()) wrong_type("logit_bias", *v, "an object");
    if (!v->empty()) reject_unsupported("logit_bias", "logit biases are not implemented");
  }
}

void parse_common(const json& body, ParsedRequest& out, const ParserOptions& options) {
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) wrong_type("model", *m, "a string");
    out.model = m->get<std::string>();
  }
  out.stream = get_bool(body, "stream").value_or(false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", *so, "an object");
    if (!out.stream) {
      throw invalid_request("'stream_options' is only allowed when 'stream' is true.",
                            "stream_options", "invalid_value");
    }
    for (auto it = so->begin(); it != so->end(); ++it) {
      if (it.key() != "include_usage" && it.key() != "continuous_usage_stats") {
        throw invalid_request(
            fmt::format("Unrecognized argument supplied in stream_options: {}", it.key()),
            "stream_options." + it.key(), "unknown_parameter");
      }
    }
    out.include_usage = get_bool(*so, "include_usage").value_or(false);
  }
  if (const json* s = field(body, "stop")) {
    if (s->is_string()) {
      out.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (const auto& e : *s) {
        if (!e.is_string()) wrong_type("stop", e, "a string or an array of strings");
        out.stop.push_back(e.get<std::string>());
      }
    } else {
      wrong_type("stop", *s, "a string or an array of strings");
    }
    if (out.stop.size() > options.max_stop_strings) {
      throw invalid_request(
          fmt::format("'stop' may hold at most {} strings.", options.max_stop_strings), "stop",
          "invalid_value");
    }
    for (const auto& st : out.stop) {
      if (st.empty() || st.size() > options.max_stop_bytes) {
        throw invalid_request(
            fmt::format("Every 'stop' string must have 1 to {} bytes.", options.max_stop_bytes),
            "stop", "invalid_value");
      }
    }
  }
  out.sampling.temperature = options.default_sampling.temperature;
  out.sampling.top_p = options.default_sampling.top_p;
  out.sampling.top_k = options.default_sampling.top_k;
  if (auto t = get_number(body, "temperature", 0.0, 2.0)) out.sampling.temperature = *t;
  if (auto p = get_number(body, "top_p", 0.0, 1.0, /*lo_open=*/true)) out.sampling.top_p = *p;
  if (auto k = get_int(body, "top_k", -1, 1 << 20)) out.sampling.top_k = *k < 0 ? 0 : int(*k);
  if (auto s = get_int(body, "seed", INT64_MIN, INT64_MAX)) out.sampling.seed = uint64_t(*s);
  check_neutral(body);
}

std::optional<int> parse_max_tokens(const json& body, const ParserOptions& options) {
  auto mct = get_int(body, "max_completion_tokens", 1, options.max_tokens_limit);
  auto mt = get_int(body, "max_tokens", 1, options.max_tokens_limit);
  if (mct) return int(*mct);
  if (mt) return int(*mt);
  return std::nullopt;
}

void validate_text_content(const json& content, const std::string& param, bool allow_null) {
  if (content.is_null()) {
    if (!allow_null) wrong_type(param, content, "a string or an array of text parts");
    return;
  }
  if (content.is_string()) return;
  if (!content.is_array()) wrong_type(param, content, "a string or an array of text parts");
  for (size_t j = 0; j < content.size(); ++j) {
    const auto& part = content[j];
    std::string pp = fmt::format("{}[{}]", param, j);
    if (!part.is_object()) wrong_type(pp, part, "an object");
    const json* type = field(part, "type");
    if (!type || !type->is_string()) {
      throw invalid_request(fmt::format("'{}.type' is required and must be a string.", pp),
                            pp + ".type", "invalid_type");
    }
    if (type->get<std::string>() != "text") {
      throw invalid_request(fmt::format("'{}.type' is '{}'; only 'text' content parts are "
                                        "supported by this text-only model.",
                                        pp, type->get<std::string>()),
                            pp + ".type", "invalid_value");
    }
    const json* text = field(part, "text");
    if (!text || !text->is_string()) {
      throw invalid_request(fmt::format("'{}.text' is required and must be a string.", pp),
                            pp + ".text", "invalid_type");
    }
  }
}

void validate_tool_calls(const json& calls, const std::string& param) {
  if (!calls.is_array()) wrong_type(param, calls, "an array");
  for (size_t j = 0; j < calls.size(); ++j) {
    const auto& c = calls[j];
    std::string pp = fmt::format("{}[{}]", param, j);
    if (!c.is_object()) wrong_type(pp, c, "an object");
    const json* fn = field(c, "function");
    if (!fn || !fn->is_object()) {
      throw invalid_request(fmt::format("'{}.function' is required and must be an object.", pp),
                            pp + ".function", "invalid_type");
    }
    const json* name = field(*fn, "name");
    if (!name || !name->is_string() || name->get<std::string>().empty()) {
      throw invalid_request(fmt::format("'{}.function.name' must be a non-empty string.", pp),
                            pp + ".function.name", "invalid_type");
    }
    const json* args = field(*fn, "arguments");
    if (args && !args->is_string()) wrong_type(pp + ".function.arguments", *args, "a string");
  }
}

void parse_messages(json& body, ParsedRequest& out) {
  auto it = body.find("messages");
  if (it == body.end() || it->is_null()) {
    throw invalid_request("'messages' is required.", "messages", "missing_required_parameter");
  }
  if (!it->is_array()) wrong_type("messages", *it, "an array");
  if (it->empty()) {
    throw invalid_request("'messages' must contain at least one message.", "messages",
                          "invalid_value");
  }
  static const std::set<std::string> kRoles = {"system",    "developer", "user",
                                               "assistant", "tool",      "latest_reminder"};
  for (size_t i = 0; i < it->size(); ++i) {
    json& m = (*it)[i];
    std::string p = fmt::format("messages[{}]", i);
    if (!m.is_object()) wrong_type(p, m, "an object");
    const json* role = field(m, "role");
    if (!role || !role->is_string()) {
      throw invalid_request(fmt::format("'{}.role' is required and must be a string.", p),
                            p + ".role", "invalid_type");
    }
    std::string r = role->get<std::string>();
    if (!kRoles.count(r)) {
      throw invalid_request(fmt::format("'{}.role' is '{}'; expected one of system, developer, "
                                        "user, assistant, tool.",
                                        p, r),
                            p + ".role", "invalid_value");
    }
    if (r == "developer") m["role"] = r = "system";  // OpenAI's newer name for system
    const bool assistant = r == "assistant";
    if (assistant) out.has_assistant_turn = true;
    auto c = m.find("content");
    if (c == m.end()) {
      if (!assistant) {
        throw invalid_request(fmt::format("'{}.content' is required.", p), p + ".content",
                              "missing_required_parameter");
      }
    } else {
      validate_text_content(*c, p + ".content", assistant);
    }
    if (const json* rc = field(m, "reasoning_content"); rc && !rc->is_string()) {
      wrong_type(p + ".reasoning_content", *rc, "a string");
    }
    if (const json* tc = field(m, "tool_calls")) {
      if (!assistant) {
        throw invalid_request(fmt::format("'{}.tool_calls' is only allowed on assistant "
                                          "messages.",
                                          p),
                              p + ".tool_calls", "invalid_value");
      }
      validate_tool_calls(*tc, p + ".tool_calls");
    }
    if (r == "tool") {
      const json* id = field(m, "tool_call_id");
      if (id && !id->is_string()) wrong_type(p + ".tool_call_id", *id, "a string");
    }
  }
}

void parse_tools(json& body, ParsedRequest& out) {
  const json* tools = field(body, "tools");
  if (tools) {
    if (!tools->is_array()) wrong_type("tools", *tools, "an array");
    for (size_t i = 0; i < tools->size(); ++i) {
      const auto& t = (*tools)[i];
      std::string p = fmt::format("tools[{}]", i);
      if (!t.is_object()) wrong_type(p, t, "an object");
      const json* type = field(t, "type");
      if (!type || *type != "function") {
        throw invalid_request(fmt::format("'{}.type' must be 'function'.", p), p + ".type",
                              "invalid_value");
      }
      const json* fn = field(t, "function");
      if (!fn || !fn->is_object()) {
        throw invalid_request(fmt::format("'{}.function' is required and must be an object.", p),
                              p + ".function", "invalid_type");
      }
      const json* name = field(*fn, "name");
      if (!name || !name->is_string() || name->get<std::string>().empty()) {
        throw invalid_request(fmt::format("'{}.function.name' must be a non-empty string.", p),
                              p + ".function.name", "invalid_type");
      }
      if (const json* params = field(*fn, "parameters"); params && !params->is_object()) {
        wrong_type(p + ".function.parameters", *params, "an object");
      }
    }
  }
  bool none = false;
  if (const json* tc = field(body, "tool_choice")) {
    if (tc->is_string()) {
      std::string v = tc->get<std::string>();
      if (v == "none") {
        none = true;
      } else if (v == "required") {
        reject_unsupported("tool_choice", "'required' cannot be enforced; use 'auto'");
      } else if (v != "auto") {
        throw invalid_request("'tool_choice' must be 'none', 'auto' or 'required'.", "tool_choice",
                              "invalid_value");
      }
    } else if (tc->is_object()) {
      reject_unsupported("tool_choice", "naming a function cannot be enforced; use 'auto'");
    } else {
      wrong_type("tool_choice", *tc, "a string or an object");
    }
    body.erase("tool_choice");
  }
  if (none) body.erase("tools");
  out.has_tools = !none && tools && !tools->empty();
}

void parse_thinking(const json& body) {
  if (const json* th = field(body, "thinking")) {
    if (!th->is_object()) wrong_type("thinking", *th, "an object");
    const json* type = field(*th, "type");
    if (!type || !type->is_string() || (*type != "enabled" && *type != "disabled")) {
      throw invalid_request("'thinking.type' must be 'enabled' or 'disabled'.", "thinking.type",
                            "invalid_value");
    }
  }
  if (const json* re = field(body, "reasoning_effort")) {
    static const std::set<std::string> kEfforts = {"none", "minimal", "low", "medium",
                                                   "high", "xhigh",   "max"};
    if (re->is_string()) {
      if (!kEfforts.count(re->get<std::string>())) {
        throw invalid_request("'reasoning_effort' must be one of none, low, medium, high, max.",
                              "reasoning_effort", "invalid_value");
      }
    } else if (!re->is_number_integer()) {
      wrong_type("reasoning_effort", *re, "a string");
    }
  }
  if (const json* k = field(body, "chat_template_kwargs"); k && !k->is_object()) {
    wrong_type("chat_template_kwargs", *k, "an object");
  }
}

}  // namespace

ParsedRequest parse_request(std::string_view text, Endpoint endpoint,
                            const ParserOptions& options) {
  json body = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    throw invalid_request(
        "The request body is not valid JSON. Send a JSON object with Content-Type: "
        "application/json.",
        "", "invalid_json");
  }
  if (!body.is_object()) {
    throw invalid_request(
        fmt::format("The request body must be a JSON object, got {}.", type_name(body)), "",
        "invalid_type");
  }
  ParsedRequest out;
  out.endpoint = endpoint;
  if (endpoint == Endpoint::kChat) {
    check_known_fields(body, {"model",
                              "messages",
                              "max_tokens",
                              "max_completion_tokens",
                              "stop",
                              "stream",
                              "stream_options",
                              "temperature",
                              "top_p",
                              "top_k",
                              "seed",
                              "thinking",
                              "reasoning_effort",
                              "tools",
                              "tool_choice",
                              "response_format",
                              "chat_template_kwargs",
                              "n",
                              "logprobs",
                              "top_logprobs",
                              "presence_penalty",
                              "frequency_penalty",
                              "logit_bias"});
    parse_common(body, out, options);
    out.max_tokens = parse_max_tokens(body, options);
    parse_messages(body, out);
    parse_tools(body, out);
    parse_thinking(body);
    if (const json* rf = field(body, "response_format")) {
      if (!rf->is_object()) wrong_type("response_format", *rf, "an object");
      if (*rf == json{{"type", "text"}}) body.erase("response_format");
    }
    // The encoder reads only the fields that shape the prompt.
    json enc = json::object();
    for (const char* key : {"messages", "thinking", "reasoning_effort", "tools", "response_format",
                            "chat_template_kwargs"}) {
      if (const json* v = field(body, key)) enc[key] = *v;
    }
    out.chat_body = std::move(enc);
  } else {
    check_known_fields(
        body, {"model", "prompt", "max_tokens", "stop", "stream", "stream_options", "temperature",
               "top_p", "top_k", "seed", "n", "best_of", "logprobs", "echo", "suffix",
               "presence_penalty", "frequency_penalty", "logit_bias"});
    parse_common(body, out, options);
    if (auto mt = get_int(body, "max_tokens", 1, options.max_tokens_limit)) {
      out.max_tokens = int(*mt);
    } else {
      out.max_tokens = 16;  // OpenAI's documented default for completions
    }
    if (get_bool(body, "echo").value_or(false))
      reject_unsupported("echo", "prompts are not echoed");
    if (const json* s = field(body, "suffix")) {
      if (!s->is_string()) wrong_type("suffix", *s, "a string");
      if (!s->get<std::string>().empty()) reject_unsupported("suffix", "no insertion mode");
    }
    const json* p = field(body, "prompt");
    if (!p) throw invalid_request("'prompt' is required.", "prompt", "missing_required_parameter");
    if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) p = &(*p)[0];
    if (p->is_string()) {
      out.prompt_text = p->get<std::string>();
      if (out.prompt_text.empty()) {
        throw invalid_request("'prompt' must not be empty.", "prompt", "invalid_value");
      }
    } else if (p->is_array() && !p->empty() && (*p)[0].is_number_integer()) {
      out.prompt_is_ids = true;
      for (const auto& e : *p) {
        if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX) {
          throw invalid_request("'prompt' token ids must be non-negative integers.", "prompt",
                                "invalid_value");
        }
        out.prompt_ids.push_back(e.get<int32_t>());
      }
    } else if (p->is_array()) {
      if (p->empty())
        throw invalid_request("'prompt' must not be empty.", "prompt", "invalid_value");
      reject_unsupported("prompt", "batched prompts; send one prompt per request");
    } else {
      wrong_type("prompt", *p, "a string or an array of token ids");
    }
  }
  return out;
}

}  // namespace uf::server
