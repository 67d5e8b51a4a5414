// Request validation: every malformed or unsupported input is an ApiError naming the parameter.
#include <gtest/gtest.h>

#include "server/api_error.h"
#include "server/request_parser.h"

namespace uf::server {
namespace {

// The status, param and code of the error a body raises (status 0 = no error).
struct Outcome {
  int status = 0;
  std::string param, code;
};

Outcome chat(const std::string& body) {
  try {
    parse_request(body, Endpoint::kChat);
  } catch (const ApiError& e) {
    return {e.status(), e.param(), e.code()};
  }
  return {};
}

const char* kUser = R"("messages":[{"role":"user","content":"hi"}])";

std::string with(const std::string& extra) { return std::string("{") + kUser + "," + extra + "}"; }

TEST(ServerRequestParser, AcceptsMinimalChat) {
  auto r = parse_request(std::string("{") + kUser + "}", Endpoint::kChat);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.max_tokens.has_value());
  EXPECT_FALSE(r.has_assistant_turn);
  EXPECT_EQ(r.chat_body["messages"][0]["content"], "hi");
}

TEST(ServerRequestParser, ReadsSamplingAndLimits) {
  auto r = parse_request(with(R"("model":"m","max_tokens":7,"temperature":0.5,"top_p":0.9,)"
                              R"("seed":-3,"stop":["a","b"],"stream":true,)"
                              R"("stream_options":{"include_usage":true})"),
                         Endpoint::kChat);
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_DOUBLE_EQ(r.sampling.temperature, 0.5);
  EXPECT_DOUBLE_EQ(r.sampling.top_p, 0.9);
  ASSERT_TRUE(r.sampling.seed);
  EXPECT_EQ(*r.sampling.seed, uint64_t(-3));
  EXPECT_EQ(r.stop, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

TEST(ServerRequestParser, MaxCompletionTokensWins) {
  auto r = parse_request(with(R"("max_tokens":7,"max_completion_tokens":9)"), Endpoint::kChat);
  EXPECT_EQ(r.max_tokens, 9);
}

TEST(ServerRequestParser, NullMeansUnset) {
  auto r =
      parse_request(with(R"("max_tokens":null,"stop":null,"temperature":null)"), Endpoint::kChat);
  EXPECT_FALSE(r.max_tokens);
  EXPECT_TRUE(r.stop.empty());
}

// Parameters a request leaves out (or sends as null) take the server's defaults (the model's
// generation_config.json); those it sends win; the seed is never defaulted.
TEST(ServerRequestParser, OmittedSamplingTakesTheServerDefaults) {
  ParserOptions options;
  options.default_sampling.temperature = 0.6;
  options.default_sampling.top_p = 0.95;
  options.default_sampling.top_k = 20;
  options.default_sampling.seed = 99;
  auto d = parse_request(with(R"("temperature":null)"), Endpoint::kChat, options);
  EXPECT_DOUBLE_EQ(d.sampling.temperature, 0.6);
  EXPECT_DOUBLE_EQ(d.sampling.top_p, 0.95);
  EXPECT_EQ(d.sampling.top_k, 20);
  EXPECT_FALSE(d.sampling.seed);
  auto r = parse_request(with(R"("temperature":0,"top_p":1,"top_k":-1)"), Endpoint::kChat, options);
  EXPECT_DOUBLE_EQ(r.sampling.temperature, 0.0);
  EXPECT_DOUBLE_EQ(r.sampling.top_p, 1.0);
  EXPECT_EQ(r.sampling.top_k, 0);
  // Without server defaults: OpenAI's.
  auto o = parse_request(with(R"("stream":false)"), Endpoint::kChat);
  EXPECT_DOUBLE_EQ(o.sampling.temperature, 1.0);
  EXPECT_DOUBLE_EQ(o.sampling.top_p, 1.0);
  EXPECT_EQ(o.sampling.top_k, 0);
}

TEST(ServerRequestParser, RejectsMalformedJson) {
  auto o = chat("{\"messages\": [");
  EXPECT_EQ(o.status, 400);
  EXPECT_EQ(o.code, "invalid_json");
  EXPECT_EQ(chat("[1,2]").code, "invalid_type");
  EXPECT_EQ(chat("").code, "invalid_json");
}

TEST(ServerRequestParser, RejectsWrongTypes) {
  EXPECT_EQ(chat(with(R"("max_tokens":"10")")).param, "max_tokens");
  EXPECT_EQ(chat(with(R"("max_tokens":1.5)")).param, "max_tokens");
  EXPECT_EQ(chat(with(R"("stream":"yes")")).param, "stream");
  EXPECT_EQ(chat(with(R"("temperature":"hot")")).param, "temperature");
  EXPECT_EQ(chat(with(R"("stop":[1])")).param, "stop");
  EXPECT_EQ(chat(R"({"messages":"hi"})").param, "messages");
  EXPECT_EQ(chat(R"({"messages":[{"role":"user","content":5}]})").param, "messages[0].content");
  EXPECT_EQ(chat(R"({"messages":[{"role":"user"}]})").param, "messages[0].content");
  EXPECT_EQ(chat(R"({"messages":[{"content":"x"}]})").param, "messages[0].role");
  EXPECT_EQ(chat(R"({"messages":[{"role":"robot","content":"x"}]})").param, "messages[0].role");
  EXPECT_EQ(chat(with(R"("thinking":{"type":"maybe"})")).param, "thinking.type");
  EXPECT_EQ(chat(with(R"("tools":[{"type":"function"}])")).param, "tools[0].function");
}

TEST(ServerRequestParser, RejectsOutOfRange) {
  for (const char* extra : {R"("temperature":2.5)", R"("temperature":-0.1)", R"("top_p":0)",
                            R"("top_p":1.01)", R"("max_tokens":0)", R"("max_tokens":-5)"}) {
    auto o = chat(with(extra));
    EXPECT_EQ(o.status, 400) << extra;
    EXPECT_EQ(o.code, "invalid_value") << extra;
  }
}

TEST(ServerRequestParser, RejectsEmptyMessages) {
  EXPECT_EQ(chat(R"({"messages":[]})").code, "invalid_value");
  EXPECT_EQ(chat(R"({"model":"x"})").code, "missing_required_parameter");
}

TEST(ServerRequestParser, RejectsUnknownAndUnsupportedFields) {
  auto o = chat(with(R"("frobnicate":1)"));
  EXPECT_EQ(o.code, "unknown_parameter");
  EXPECT_EQ(o.param, "frobnicate");
  EXPECT_EQ(chat(with(R"("n":2)")).code, "unsupported_parameter");
  EXPECT_EQ(chat(with(R"("logprobs":true)")).code, "unsupported_parameter");
  EXPECT_EQ(chat(with(R"("presence_penalty":0.5)")).code, "unsupported_parameter");
  EXPECT_EQ(chat(with(R"("tool_choice":"required")")).code, "unsupported_parameter");
  EXPECT_EQ(
      chat(R"({"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]})")
          .param,
      "messages[0].content[0].type");
  // Neutral values and OpenAI bookkeeping fields are fine.
  EXPECT_EQ(
      chat(with(R"("n":1,"logprobs":false,"presence_penalty":0,"user":"u","store":false)")).status,
      0);
}

TEST(ServerRequestParser, StreamOptionsNeedStream) {
  EXPECT_EQ(chat(with(R"("stream_options":{"include_usage":true})")).param, "stream_options");
}

TEST(ServerRequestParser, DetectsAssistantTurnAndNormalisesRoles) {
  auto r = parse_request(R"({"messages":[{"role":"developer","content":"be brief"},
      {"role":"user","content":[{"type":"text","text":"hi"}]},
      {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
        "function":{"name":"f","arguments":"{}"}}]},
      {"role":"tool","tool_call_id":"c1","content":"42"}]})",
                         Endpoint::kChat);
  EXPECT_TRUE(r.has_assistant_turn);
  EXPECT_EQ(r.chat_body["messages"][0]["role"], "system");
}

TEST(ServerRequestParser, ToolChoiceNoneDropsTools) {
  auto r = parse_request(with(R"("tools":[{"type":"function","function":{"name":"f"}}],)"
                              R"("tool_choice":"none")"),
                         Endpoint::kChat);
  EXPECT_FALSE(r.has_tools);
  EXPECT_FALSE(r.chat_body.contains("tools"));
  auto t = parse_request(with(R"("tools":[{"type":"function","function":{"name":"f"}}])"),
                         Endpoint::kChat);
  EXPECT_TRUE(t.has_tools);
  EXPECT_TRUE(t.chat_body.contains("tools"));
}

TEST(ServerRequestParser, Completions) {
  auto r = parse_request(R"({"prompt":"abc","max_tokens":3})", Endpoint::kCompletion);
  EXPECT_EQ(r.prompt_text, "abc");
  EXPECT_EQ(r.max_tokens, 3);
  auto d = parse_request(R"({"prompt":["abc"]})", Endpoint::kCompletion);
  EXPECT_EQ(d.max_tokens, 16);
  auto ids = parse_request(R"({"prompt":[1,2,3]})", Endpoint::kCompletion);
  EXPECT_TRUE(ids.prompt_is_ids);
  EXPECT_EQ(ids.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  auto bad = [](const std::string& b) {
    try {
      parse_request(b, Endpoint::kCompletion);
    } catch (const ApiError& e) {
      return e.param();
    }
    return std::string("none");
  };
  EXPECT_EQ(bad(R"({"max_tokens":3})"), "prompt");
  EXPECT_EQ(bad(R"({"prompt":""})"), "prompt");
  EXPECT_EQ(bad(R"({"prompt":["a","b"]})"), "prompt");
  EXPECT_EQ(bad(R"({"prompt":"a","echo":true})"), "echo");
  EXPECT_EQ(bad(R"({"prompt":"a","messages":[]})"), "messages");
}

TEST(ServerApiError, Shape) {
  auto j = invalid_request("bad", "x", "c").to_json();
  EXPECT_EQ(j["error"]["message"], "bad");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["param"], "x");
  EXPECT_EQ(j["error"]["code"], "c");
  auto k = invalid_request("bad").to_json();
  EXPECT_TRUE(k["error"]["param"].is_null());
  EXPECT_TRUE(k["error"]["code"].is_null());
}

}  // namespace
}  // namespace uf::server

namespace uf::server {
namespace {

// Mutation fuzzing: every field of valid bodies replaced by values of every JSON type. The parser
// must answer with an ApiError or a result, never another exception.
TEST(ServerRequestParser, MutationsOnlyEverRaiseApiErrors) {
  using nlohmann::json;
  const std::vector<json> values = {nullptr,
                                    true,
                                    false,
                                    0,
                                    -1,
                                    1,
                                    3.5,
                                    -1e300,
                                    1e300,
                                    uint64_t(1) << 63,
                                    "",
                                    "x",
                                    "enabled",
                                    json::array(),
                                    json::array({1, "a"}),
                                    json::object(),
                                    json{{"type", "text"}},
                                    json{{"type", "function"}}};
  const std::vector<json> bases = {
      json::parse(R"({"model":"m","messages":[{"role":"user","content":"hi"},
        {"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function",
        "function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c",
        "content":[{"type":"text","text":"r"}]}],"max_tokens":5,"stop":["a"],"stream":true,
        "stream_options":{"include_usage":true},"temperature":1,"top_p":0.5,"seed":1,
        "thinking":{"type":"enabled"},"reasoning_effort":"high",
        "tools":[{"type":"function","function":{"name":"f","parameters":{}}}],
        "tool_choice":"auto","response_format":{"type":"text"}})"),
      json::parse(R"({"prompt":"abc","max_tokens":3,"stop":"x","echo":false,"n":1})")};
  int accepted = 0, rejected = 0;
  auto check = [&](const json& body, Endpoint ep) {
    try {
      parse_request(body.dump(), ep);
      ++accepted;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status(), 400);
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "non-API exception " << e.what() << " for " << body.dump();
    }
  };
  for (size_t b = 0; b < bases.size(); ++b) {
    const Endpoint ep = b == 0 ? Endpoint::kChat : Endpoint::kCompletion;
    const json flat = bases[b].flatten();
    for (auto it = flat.begin(); it != flat.end(); ++it) {
      for (const auto& v : values) {
        json m = bases[b];
        m[json::json_pointer(it.key())] = v;
        check(m, ep);
      }
    }
    // Also each top-level member replaced or removed.
    for (auto it = bases[b].begin(); it != bases[b].end(); ++it) {
      json r = bases[b];
      r.erase(it.key());
      check(r, ep);
      for (const auto& v : values) {
        json m = bases[b];
        m[it.key()] = v;
        check(m, ep);
      }
    }
  }
  EXPECT_GT(accepted, 10);
  EXPECT_GT(rejected, 100);
}

}  // namespace
}  // namespace uf::server
