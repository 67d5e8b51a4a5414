#include "server/sampling_defaults.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/error.h"
#include "core/json_file.h"

namespace uf::server {

namespace {

using nlohmann::json;

// The number at key, if present and not null; throws when it is not a number or not in
// [lo, hi] ((lo, hi] with lo_open).
std::optional<double> number_at(const json& cfg, const char* key, double lo, double hi,
                                bool lo_open, const std::string& path) {
  const auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return std::nullopt;
  UF_CHECK(it->is_number(), "{}: '{}' must be a number, got {}", path, key, it->dump());
  const double v = it->get<double>();
  UF_CHECK(std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi,
           "{}: '{}' = {} is out of range: it must lie in {}{}, {}]", path, key, v,
           lo_open ? "(" : "[", lo, hi);
  return v;
}

}  // namespace

SamplingParams load_sampling_defaults(const std::string& path) {
  const json cfg = core::read_json_file(path, "the generation config");
  UF_CHECK(cfg.is_object(), "{}: expected a JSON object, got {}", path, cfg.type_name());
  SamplingParams p;
  if (auto t = number_at(cfg, "temperature", 0.0, 2.0, false, path)) p.temperature = *t;
  if (auto t = number_at(cfg, "top_p", 0.0, 1.0, true, path)) p.top_p = *t;
  const auto k = cfg.find("top_k");
  if (k != cfg.end() && !k->is_null()) {
    UF_CHECK(k->is_number_integer() && k->get<int64_t>() >= -1 && k->get<int64_t>() <= (1 << 20),
             "{}: 'top_k' must be an integer in -1..{} (-1 and 0: off), got {}", path, 1 << 20,
             k->dump());
    p.top_k = int(std::max<int64_t>(0, k->get<int64_t>()));
  }
  return p;
}

std::string describe_sampling(const SamplingParams& p) {
  return fmt::format("temperature {}, top_p {}, top_k {}", p.temperature, p.top_p,
                     p.top_k > 0 ? std::to_string(p.top_k) : std::string("off"));
}

}  // namespace uf::server
