#pragma once
// The tiny-a fixture for tests that run the CPU backend: its folder and its golden integer arrays
// (prompt ids, decode ids, the reference's Engram token map).

#include <filesystem>
#include <string>
#include <vector>

#include "model/checkpoint.h"

namespace uf::testing {

inline const std::filesystem::path& tiny_a_dir() {
  static const std::filesystem::path dir =
      std::filesystem::path(UF_SHARED_DIR) / "fixtures" / "tiny-a";
  return dir;
}

inline std::vector<int64_t> tiny_a_golden_i64(const std::string& name) {
  auto g = model::Checkpoint::open(tiny_a_dir() / "golden" / "reference.safetensors");
  auto s = g.get(name).as<int64_t>();
  return {s.begin(), s.end()};
}

}  // namespace uf::testing
