// OutputAssembler with the real V4.1-style tokenizer: reasoning/content split, token counts, and
// tool calls whose DSML never leaks into content, whatever the token boundaries.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "server/output_assembler.h"
#include "server_test_support.h"

namespace uf::server::testing {
namespace {

struct Fed {
  std::string reasoning, content;
  std::vector<std::string> content_snapshots;  // content after every push
};

Fed feed(OutputAssembler& a, const std::vector<int32_t>& ids, size_t step = 1) {
  Fed f;
  for (size_t i = 0; i < ids.size(); i += step) {
    size_t n = std::min(step, ids.size() - i);
    auto d = a.push(std::span<const int32_t>(ids.data() + i, n));
    f.reasoning += d.reasoning;
    f.content += d.content;
    f.content_snapshots.push_back(f.content);
  }
  auto d = a.finish();
  f.reasoning += d.reasoning;
  f.content += d.content;
  return f;
}

std::vector<int32_t> ids_of(const std::string& reasoning, const std::string& content) {
  auto enc = v41_encoder();
  const auto& tok = enc->tokenizer();
  std::vector<int32_t> ids;
  if (!reasoning.empty()) {
    ids = tok.encode(reasoning);
    ids.push_back(enc->think_end_id());
  }
  auto c = tok.encode(content);
  ids.insert(ids.end(), c.begin(), c.end());
  ids.push_back(enc->eos_id());
  return ids;
}

TEST(ServerOutputAssembler, SplitsReasoningAndCountsTokens) {
  auto enc = v41_encoder();
  ASSERT_TRUE(enc);
  auto ids = ids_of("Think first.", "The answer is 4.");
  OutputAssembler a(enc->tokenizer(), true, {}, false, "call_");
  auto f = feed(a, ids);
  EXPECT_EQ(f.reasoning, "Think first.");
  EXPECT_EQ(f.content, "The answer is 4.");
  EXPECT_EQ(a.completion_tokens(), int(ids.size()));
  // Reasoning tokens: the reasoning text and its closing </think>.
  EXPECT_EQ(a.reasoning_tokens(), int(enc->tokenizer().encode("Think first.").size()) + 1);
  EXPECT_TRUE(a.tool_calls().empty());
}

TEST(ServerOutputAssembler, ToolCallsNeverLeakIntoContent) {
  auto enc = v41_encoder();
  ASSERT_TRUE(enc);
  const std::string block =
      "Checking.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
      "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n"
      "</｜DSML｜ invoke>\n<｜DSML｜ invoke name=\"add\">\n"
      "<｜DSML｜ parameter name=\"x\" string=\"false\">1.5</｜DSML｜ parameter>\n"
      "</｜DSML｜ invoke>\n</｜DSML｜ calls>";
  for (bool thinking : {true, false}) {
    for (size_t step : {1, 3, 1000}) {
      auto ids = ids_of(thinking ? "Plan." : "", block);
      OutputAssembler a(enc->tokenizer(), thinking, {}, true, "call_x_");
      auto f = feed(a, ids, step);
      for (const auto& snap : f.content_snapshots) {
        EXPECT_EQ(snap.find('<'), std::string::npos) << "step " << step << ": " << snap;
      }
      EXPECT_EQ(f.content, "Checking.");
      ASSERT_EQ(a.tool_calls().size(), 2u);
      EXPECT_EQ(a.tool_calls()[0].name, "get_weather");
      EXPECT_EQ(a.tool_calls()[0].id, "call_x_0");
      EXPECT_EQ(nlohmann::json::parse(a.tool_calls()[0].arguments),
                nlohmann::json({{"city", "Paris"}}));
      EXPECT_EQ(a.tool_calls()[1].name, "add");
      EXPECT_EQ(nlohmann::json::parse(a.tool_calls()[1].arguments), nlohmann::json({{"x", 1.5}}));
    }
  }
}

TEST(ServerOutputAssembler, LookalikesAndReasoningAreNotToolCalls) {
  auto enc = v41_encoder();
  ASSERT_TRUE(enc);
  // Text that starts like a block but is not one is held only until it diverges.
  auto ids =
      ids_of("I could write \n\n<｜DSML｜ calls> here but will not.", "Para.\n\n<b>bold</b>");
  OutputAssembler a(enc->tokenizer(), true, {}, true, "call_");
  auto f = feed(a, ids);
  EXPECT_EQ(f.content, "Para.\n\n<b>bold</b>");
  EXPECT_TRUE(a.tool_calls().empty());
  EXPECT_NE(f.reasoning.find("here but will not."), std::string::npos);
}

TEST(ServerOutputAssembler, StopStringEndsOutput) {
  auto enc = v41_encoder();
  ASSERT_TRUE(enc);
  auto ids = ids_of("", "one two STOP three four");
  OutputAssembler a(enc->tokenizer(), false, {"STOP"}, false, "call_");
  auto f = feed(a, ids);
  EXPECT_EQ(f.content, "one two ");
  EXPECT_TRUE(a.stopped());
  EXPECT_LT(a.completion_tokens(), int(ids.size()));
}

}  // namespace
}  // namespace uf::server::testing
