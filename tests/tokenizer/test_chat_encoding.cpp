// Chat encoding: every case of model-arch.md §7 (DeepSeek-V4.1 encoding.py), with the expected
// prompt written out from the spec as special-token ids and plain-text pieces, plus the DSML
// tool-call parser and bad requests.
#include <gtest/gtest.h>

#include "core/error.h"
#include "test_util.h"
#include "tokenizer/chat_encoding.h"

using namespace uf::tokenizer;
using namespace uf::tokenizer::testing;
using ojson = nlohmann::ordered_json;
using Id = V41Ids;

namespace {

// An expected prompt: special tokens by id, text pieces tokenized on their own (added tokens are
// split off before BPE, so pieces between special tokens tokenize independently).
struct Expect {
  std::vector<int32_t> ids;
  std::string text;
  Expect& sp(int32_t id, const char* s) {
    ids.push_back(id);
    text += s;
    return *this;
  }
  Expect& bos() { return sp(Id::kBos, "<｜begin▁of▁sentence｜>"); }
  Expect& eos() { return sp(Id::kEos, "<｜end▁of▁sentence｜>"); }
  Expect& system() { return sp(Id::kSystem, "<｜System｜>"); }
  Expect& user() { return sp(Id::kUser, "<｜User｜>"); }
  Expect& assistant() { return sp(Id::kAssistant, "<｜Assistant｜>"); }
  Expect& think() { return sp(Id::kThink, "<think>"); }
  Expect& think_end() { return sp(Id::kThinkEnd, "</think>"); }
  Expect& dsml() { return sp(Id::kDsml, "｜DSML｜"); }
  Expect& t(const std::string& s) {
    auto e = v41().encode(s);
    ids.insert(ids.end(), e.begin(), e.end());
    text += s;
    return *this;
  }
  Expect& effort(int n) {
    return t("Reasoning Effort: " + std::to_string(n) +
             " (range 1-100, the higher the value, the more thorough the reasoning)\n\n");
  }
};

class ChatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_v3()) GTEST_SKIP() << "run scripts/setup.sh: missing " << v3_tokenizer_path();
    enc_ = std::make_unique<ChatEncoder>(v41());
  }
  void check(const ojson& request, const Expect& want, bool thinking) {
    ChatPrompt p = enc_->encode(request);
    EXPECT_EQ(p.text, want.text);
    EXPECT_EQ(p.ids, want.ids);
    EXPECT_EQ(p.thinking, thinking);
  }
  std::unique_ptr<ChatEncoder> enc_;
};

ojson msg(const char* role, const char* content) { return {{"role", role}, {"content", content}}; }

}  // namespace

TEST_F(ChatTest, NonThinkingExampleFromSpec) {
  // §7: BOS <｜System｜>You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi!<EOS>
  ojson r = {{"messages",
              {msg("system", "You are a helpful assistant."), msg("user", "Hello"),
               msg("assistant", "Hi!")}},
             {"thinking", {{"type", "disabled"}}}};
  Expect e;
  e.bos()
      .system()
      .t("You are a helpful assistant.")
      .user()
      .t("Hello")
      .assistant()
      .think_end()
      .t("Hi!")
      .eos();
  check(r, e, false);
}

TEST_F(ChatTest, GenerationHeaderThinkingOff) {
  ojson r = {{"messages", {msg("user", "Hello")}}, {"thinking", {{"type", "disabled"}}}};
  Expect e;
  e.bos().user().t("Hello").assistant().think_end();  // no <｜System｜> without system/effort
  check(r, e, false);
}

TEST_F(ChatTest, ThinkingIsTheDefaultWithEffortPrefix) {
  // Thinking: index 0 gets <｜System｜> + the effort prefix (default "high" = 75).
  ojson r = {{"messages", {msg("user", "Hello")}}};
  Expect e;
  e.bos().system().effort(75).user().t("Hello").assistant().think();
  check(r, e, true);
  ojson s = {{"messages", {msg("system", "Be brief."), msg("user", "Hello")}}};
  Expect f;
  f.bos().system().effort(75).t("Be brief.").user().t("Hello").assistant().think();
  check(s, f, true);
}

TEST_F(ChatTest, ReasoningEffortValues) {
  for (auto [effort, n] : std::vector<std::pair<ojson, int>>{
           {"low", 50}, {"medium", 75}, {"high", 75}, {"max", 100}, {1, 1}, {100, 100}, {42, 42}}) {
    ojson r = {{"messages", {msg("user", "Q")}}, {"reasoning_effort", effort}};
    Expect e;
    e.bos().system().effort(n).user().t("Q").assistant().think();
    check(r, e, true);
  }
  // "none" turns thinking off (vLLM's convention); chat mode renders no effort prefix.
  ojson r = {{"messages", {msg("user", "Q")}}, {"reasoning_effort", "none"}};
  Expect e;
  e.bos().user().t("Q").assistant().think_end();
  check(r, e, false);
  for (ojson bad : {ojson(0), ojson(101), ojson("extreme"), ojson(1.5)}) {
    EXPECT_THROW(enc_->encode(ojson{{"messages", {msg("user", "Q")}}, {"reasoning_effort", bad}}),
                 uf::core::Error)
        << bad.dump();
  }
  // chat_template_kwargs.thinking = false is the same switch.
  ojson k = {{"messages", {msg("user", "Q")}}, {"chat_template_kwargs", {{"thinking", false}}}};
  check(k, e, false);
}

TEST_F(ChatTest, ReasoningOfEarlierTurnsIsDropped) {
  ojson a1 = {{"role", "assistant"}, {"content", "A1"}, {"reasoning_content", "R1"}};
  ojson r = {{"messages", {msg("user", "Q1"), a1, msg("user", "Q2")}}};
  Expect e;
  e.bos().system().effort(75).user().t("Q1").assistant().think_end().t("A1").eos();
  e.user().t("Q2").assistant().think();
  check(r, e, true);
}

TEST_F(ChatTest, AssistantTurnAfterLastUserKeepsReasoning) {
  ojson a = {{"role", "assistant"}, {"content", "A"}, {"reasoning_content", "R"}};
  ojson r = {{"messages", {msg("user", "Q"), a}}};
  Expect e;
  e.bos().system().effort(75).user().t("Q").assistant().think().t("R").think_end().t("A").eos();
  check(r, e, true);
}

TEST_F(ChatTest, MidConversationSystemAndLatestReminder) {
  ojson r = {{"messages",
              {msg("user", "Q"), msg("assistant", "A"), msg("system", "New rule."),
               msg("latest_reminder", "Remember.")}},
             {"thinking", {{"type", "disabled"}}}};
  // The mid system message is followed by latest_reminder, so it gets the header after it.
  Expect e;
  e.bos().user().t("Q").assistant().think_end().t("A").eos();
  e.system().t("New rule.").assistant().think_end();
  e.sp(Id::kLatestReminder, "<｜latest_reminder｜>").t("Remember.");
  check(r, e, false);
}

TEST_F(ChatTest, ConsecutiveUserMessagesMerge) {
  ojson parts =
      ojson::array({{{"type", "text"}, {"text", "B1"}}, {{"type", "text"}, {"text", "B2"}}});
  ojson r = {{"messages", {msg("user", "A"), {{"role", "user"}, {"content", parts}}}},
             {"thinking", {{"type", "disabled"}}}};
  Expect e;
  e.bos().user().t("A\n\nB1\n\nB2").assistant().think_end();
  check(r, e, false);
}

TEST_F(ChatTest, ToolsToolCallsAndToolResults) {
  ojson fn = {
      {"name", "get_weather"},
      {"description", "Weather für eine Stadt"},
      {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}};
  ojson call1 = {
      {"id", "c1"},
      {"type", "function"},
      {"function", {{"name", "get_weather"}, {"arguments", R"({"city": "Paris", "days": 3})"}}}};
  ojson call2 = {{"id", "c2"},
                 {"type", "function"},
                 {"function", {{"name", "get_weather"}, {"arguments", R"({"city": "Oslo"})"}}}};
  ojson asst = {{"role", "assistant"},
                {"content", ""},
                {"reasoning_content", "Need weather."},
                {"tool_calls", {call1, call2}}};
  // Results arrive out of order; they are sorted by call order and merged into one user turn.
  ojson t2 = {{"role", "tool"}, {"tool_call_id", "c2"}, {"content", "cold"}};
  ojson t1 = {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "warm"}};
  ojson r = {{"messages", {msg("user", "Weather?"), asst, t2, t1}},
             {"tools", {{{"type", "function"}, {"function", fn}}}}};

  const std::string tools_text =
      "\n\n## Tools\n\nYou have access to a set of tools to help answer the user's question. You "
      "can invoke tools by writing a \"<｜DSML｜ calls>\" block like the following:\n\n"
      "<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"$TOOL_NAME\">\n<｜DSML｜ parameter "
      "name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜ parameter>\n...\n"
      "</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜ invoke>\n"
      "</｜DSML｜ calls>\n\nString parameters should be specified as is and set `string=\"true\"`. "
      "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format "
      "and set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST "
      "output your complete reasoning inside <think>...</think> BEFORE any tool calls or final "
      "response.\n\nOtherwise, output directly after </think> with tool calls or final "
      "response.\n\n### Available Tool Schemas\n\n"
      "{\"name\": \"get_weather\", \"description\": \"Weather für eine Stadt\", \"parameters\": "
      "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}\n\n"
      "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
      "calls.\n";
  ChatPrompt p = enc_->encode(r);
  // Tools present: no reasoning is dropped, and every header opens <think>.
  std::string want =
      "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, "
      "the more thorough the reasoning)\n\n" +
      tools_text + "<｜User｜>Weather?<｜Assistant｜><think>Need weather.</think>" +
      "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
      "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n"
      "<｜DSML｜ parameter name=\"days\" string=\"false\">3</｜DSML｜ parameter>\n"
      "</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"get_weather\">\n"
      "<｜DSML｜ parameter name=\"city\" string=\"true\">Oslo</｜DSML｜ parameter>\n"
      "</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>"
      "<｜User｜><tool_result>warm</tool_result>\n\n<tool_result>cold</tool_result>"
      "<｜Assistant｜><think>";
  EXPECT_EQ(p.text, want);
  EXPECT_EQ(p.ids, v41().encode(want));
  // The DSML marker is one token wherever it appears.
  size_t dsml = 0;
  for (int32_t id : p.ids) dsml += id == Id::kDsml;
  EXPECT_EQ(dsml, 9u + 12u);  // 9 in the tools template, 12 in the two calls
}

TEST_F(ChatTest, ToolArgumentsThatAreNotAnObject) {
  ojson call = {
      {"id", "c"}, {"type", "function"}, {"function", {{"name", "f"}, {"arguments", "not json"}}}};
  ojson r = {
      {"messages",
       {msg("user", "Q"), {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {call}}}}},
      {"thinking", {{"type", "disabled"}}}};
  // Non-object arguments become one string parameter named "arguments".
  EXPECT_NE(
      enc_->encode(r).text.find(
          "<｜DSML｜ parameter name=\"arguments\" string=\"true\">not json</｜DSML｜ parameter>"),
      std::string::npos);
}

TEST_F(ChatTest, PythonJsonDumps) {
  auto j = ojson::parse(R"({"b": [1, 2.5, true, null], "a": "é\n\"\u0001"})");
  EXPECT_EQ(python_json_dumps(j), "{\"b\": [1, 2.5, true, null], \"a\": \"é\\n\\\"\\u0001\"}");
}

TEST_F(ChatTest, BadRequestsAreClearErrors) {
  auto expect_error = [&](const ojson& r, const char* needle) {
    try {
      enc_->encode(r);
      ADD_FAILURE() << "accepted " << r.dump();
    } catch (const uf::core::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(ojson::array(), "JSON object");
  expect_error(ojson{{"messages", ojson::array()}}, "empty");
  expect_error(ojson{{"model", "x"}}, "messages");
  expect_error(ojson{{"messages", {msg("wizard", "hi")}}}, "unknown role 'wizard'");
  expect_error(ojson{{"messages", {{{"content", "hi"}}}}}, "no role");
  expect_error(ojson{{"messages", {{{"role", "user"}, {"content", 5}}}}}, "content");
  expect_error(ojson{{"messages", {msg("user", "<｜deepseek_image｜>")}}}, "image");
  expect_error(ojson{{"messages", {msg("user", "hi")}}, {"thinking", {{"type", "maybe"}}}},
               "thinking");
  ojson img = {{"role", "user"},
               {"content", {{{"type", "image_url"}, {"image_url", {{"url", "x"}}}}}}};
  expect_error(ojson{{"messages", {img}}}, "image");
  ojson bad_utf8 = {{"messages", {msg("user", "ok")}}};
  bad_utf8["messages"][0]["content"] = std::string("a\xC3(");
  expect_error(bad_utf8, "UTF-8");
  EXPECT_THROW(enc_->encode_body("{\"messages\": [}"), uf::core::Error);
  ChatEncoder small(v41(), ChatLimits{2, 1 << 20});
  EXPECT_THROW(
      small.encode(ojson{{"messages", {msg("user", "a"), msg("user", "b"), msg("user", "c")}}}),
      uf::core::Error);
}

TEST_F(ChatTest, MissingSpecialTokenIsAClearError) {
  try {
    ChatEncoder enc(v3());  // V3's file has no <｜System｜>
    FAIL();
  } catch (const uf::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("<｜System｜>"), std::string::npos) << e.what();
  }
}

TEST(ChatParse, ThinkingContentAndToolCalls) {
  std::string text =
      "Let me check.</think>Checking.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
      "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris \"FR\"</｜DSML｜ parameter>\n"
      "<｜DSML｜ parameter name=\"days\" string=\"false\">3</｜DSML｜ parameter>\n"
      "</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"now\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"
      "<｜end▁of▁sentence｜>";
  auto m = parse_assistant_output(text, true);
  EXPECT_EQ(m.reasoning_content, "Let me check.");
  EXPECT_EQ(m.content, "Checking.");
  ASSERT_EQ(m.tool_calls.size(), 2u);
  EXPECT_EQ(m.tool_calls[0].name, "get_weather");
  EXPECT_EQ(m.tool_calls[0].arguments, "{\"city\": \"Paris \\\"FR\\\"\", \"days\": 3}");
  EXPECT_EQ(m.tool_calls[1].name, "now");
  EXPECT_EQ(m.tool_calls[1].arguments, "{}");
  EXPECT_EQ(find_tool_calls_start(text), text.find("\n\n<｜DSML｜"));

  auto plain = parse_assistant_output("Hi!<｜end▁of▁sentence｜>", false);
  EXPECT_EQ(plain.content, "Hi!");
  EXPECT_TRUE(plain.tool_calls.empty());
  auto cut = parse_assistant_output("still thinking", true);  // stopped before </think>
  EXPECT_EQ(cut.reasoning_content, "still thinking");
  EXPECT_EQ(cut.content, "");

  EXPECT_THROW(parse_assistant_output("x\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke "
                                      "nam=\"f\">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
                                      false),
               uf::core::Error);
  EXPECT_THROW(
      parse_assistant_output(
          "x\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n<｜DSML｜ parameter name=\"a\" "
          "string=\"true\">1</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"a\" "
          "string=\"true\">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
          false),
      uf::core::Error);  // duplicate parameter
  EXPECT_THROW(parse_assistant_output("x\n\n<｜DSML｜ calls>\n</｜DSML｜ calls>trailing", false),
               uf::core::Error);
}

TEST(ChatFixture, TinyFixtureTokenizerEncodesPlainChats) {
  // The tiny fixture's WordLevel tokenizer has the V4.1 specials but no DSML token: plain chats
  // work, a request with tools is a clear error naming the token.
  auto tok = Tokenizer::from_file(std::string(UF_SHARED_DIR) + "/fixtures/tiny-a/tokenizer.json");
  ChatEncoder enc(tok);
  auto p =
      enc.encode(ojson{{"messages", {msg("user", "café")}}, {"thinking", {{"type", "disabled"}}}});
  EXPECT_EQ(p.ids, (std::vector<int32_t>{0, 1016, 8, 1017, 1019}));
  ojson fn = {{"name", "f"}};
  try {
    enc.encode(ojson{{"messages", {msg("user", "café")}},
                     {"tools", {{{"type", "function"}, {"function", fn}}}}});
    FAIL();
  } catch (const uf::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("｜DSML｜"), std::string::npos) << e.what();
  }
}
