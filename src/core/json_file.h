#pragma once
// Reading a JSON file with errors a user can act on: which file, and why.

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>

namespace uf::core {

// The parsed contents of `path`. Throws core::Error "cannot read <what> <path>" when the file
// cannot be opened, "<path> is not valid JSON: <parser message>" when it does not parse.
// what: the file's role, e.g. "the config file".
nlohmann::json read_json_file(const std::filesystem::path& path, std::string_view what);

}  // namespace uf::core
