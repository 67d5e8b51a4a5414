#include "core/json_file.h"

#include <fstream>
#include <sstream>

#include "core/error.h"

namespace uf::core {

nlohmann::json read_json_file(const std::filesystem::path& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  UF_CHECK(in, "cannot read {} {}", what, path.string());
  std::stringstream text;
  text << in.rdbuf();
  try {
    return nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    fail("{} is not valid JSON: {}", path.string(), e.what());
  }
}

}  // namespace uf::core
