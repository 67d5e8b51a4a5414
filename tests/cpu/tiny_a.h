#pragma once
// The tiny-a fixture for tests that run the CPU backend: its folder and its golden integer arrays
// (prompt ids, decode ids, the reference's Engram token map).

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "model/config.h"

namespace uf::testing {

// UF_SHARED_DIR in the environment overrides the build's shared folder: the GPU machine runs
// binaries built elsewhere, with the fixtures unpacked beside them (scripts/gpu-check).
inline const std::filesystem::path& tiny_a_dir() {
  static const std::filesystem::path dir = [] {
    const char* env = std::getenv("UF_SHARED_DIR");
    return std::filesystem::path(env && *env ? env : UF_SHARED_DIR) / "fixtures" / "tiny-a";
  }();
  return dir;
}

inline std::vector<int64_t> tiny_a_golden_i64(const std::string& name) {
  auto g = model::Checkpoint::open(tiny_a_dir() / "golden" / "reference.safetensors");
  auto s = g.get(name).as<int64_t>();
  return {s.begin(), s.end()};
}

// tiny-a's config with every tensor-parallel split divisible by 8 (8 heads, 8 output groups, 8
// index heads, an expert width of 8 x 32): tiny-a's own 2 output groups stop at TP 2. For
// synthetic weights (model/synthetic.h): the fixture's checkpoint has tiny-a's shapes.
inline model::ModelConfig tiny_a_config_divisible_by_8() {
  auto c = model::ModelConfig::load(tiny_a_dir());
  c.n_heads = 8;
  c.o_groups = 8;
  c.index_n_heads = 8;
  c.moe_inter_dim = 8 * 32;
  return c;
}

}  // namespace uf::testing
