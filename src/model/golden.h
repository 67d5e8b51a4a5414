#pragma once
// Golden fixtures of the official reference (shared/fixtures/<set>/golden), shared by every
// fixture check (the CPU backend's sublayer check in cpu/fixture_check.cpp, the Backend-level
// end-to-end check of `ultrafast check-fixture --backend <kind>`): the golden-array reader, the
// comparison figures, the end-to-end bounds from the manifest and the report lines. Header-only
// so that no library gains a dependency.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/checkpoint.h"

namespace uf::model {

// ---- report ----
struct CheckLine {
  std::string name;
  double value = 0;
  double bound = 0;
  bool pass = true;
  bool informational = false;  // reported, never fails
  std::string detail;
};

struct FixtureReport {
  std::vector<CheckLine> lines;
  double seconds = 0;
  bool ok() const {
    for (const auto& l : lines)
      if (!l.informational && !l.pass) return false;
    return true;
  }
  std::string format() const {  // one line per check
    std::string out;
    for (const auto& l : lines) {
      const char* tag = l.informational ? "INFO" : (l.pass ? "PASS" : "FAIL");
      if (l.informational)
        out += fmt::format("{} {:<44} {:>12.6g}  {}\n", tag, l.name, l.value, l.detail);
      else
        out += fmt::format("{} {:<44} {:>12.6g}  bound {:<10.4g} {}\n", tag, l.name, l.value,
                           l.bound, l.detail);
    }
    return out;
  }
};

// ---- golden arrays ----
class Golden {
 public:
  explicit Golden(const std::filesystem::path& file) : ck_(Checkpoint::open(file)) {}
  bool has(const std::string& n) const { return ck_.has(n); }
  bool has_containing(const std::string& part) const {
    for (const auto& n : ck_.names())
      if (n.find(part) != std::string::npos) return true;
    return false;
  }
  std::vector<int64_t> shape(const std::string& n) const { return ck_.get(n).shape; }
  // Arrays are converted once and cached: the hooks look rows up many times.
  const std::vector<float>& f32(const std::string& n) const {
    auto it = f32_.find(n);
    if (it != f32_.end()) return it->second;
    const auto& v = ck_.get(n);
    UF_CHECK(v.dtype == core::DType::kF32, "golden array '{}' is not F32", n);
    auto s = v.as<float>();
    return f32_.emplace(n, std::vector<float>(s.begin(), s.end())).first->second;
  }
  const std::vector<int64_t>& i64(const std::string& n) const {
    auto it = i64_.find(n);
    if (it != i64_.end()) return it->second;
    const auto& v = ck_.get(n);
    std::vector<int64_t> out;
    if (v.dtype == core::DType::kI64) {
      auto s = v.as<int64_t>();
      out.assign(s.begin(), s.end());
    } else {
      UF_CHECK(v.dtype == core::DType::kI32, "golden array '{}' is not an integer array", n);
      auto s = v.as<int32_t>();
      out.assign(s.begin(), s.end());
    }
    return i64_.emplace(n, std::move(out)).first->second;
  }

 private:
  Checkpoint ck_;
  mutable std::map<std::string, std::vector<float>> f32_;
  mutable std::map<std::string, std::vector<int64_t>> i64_;
};

// The manifest's "agreement" object (empty if the fixture has none).
inline nlohmann::json golden_agreement(const std::filesystem::path& golden_dir) {
  nlohmann::json manifest;
  std::ifstream f(golden_dir / "manifest.json");
  if (f) manifest = nlohmann::json::parse(f, nullptr, false);
  return manifest.is_object() && manifest.contains("agreement") ? manifest["agreement"]
                                                                : nlohmann::json::object();
}

// ---- comparison figures ----
struct Diff {
  double sq = 0, ref = 0, maxabs = 0;
  size_t n = 0, finite_mismatch = 0;
  void add(const float* a, const float* r, size_t cnt) {
    for (size_t i = 0; i < cnt; ++i) {
      const bool fa = std::isfinite(a[i]), fr = std::isfinite(r[i]);
      if (fa != fr) {
        ++finite_mismatch;
        continue;
      }
      if (!fa) continue;
      const double d = double(a[i]) - double(r[i]);
      sq += d * d;
      ref += double(r[i]) * double(r[i]);
      maxabs = std::max(maxabs, std::fabs(d));
      ++n;
    }
  }
  double rms_rel() const { return ref > 0 ? std::sqrt(sq / ref) : std::sqrt(sq); }
};

struct LogitStats {
  Diff d;
  size_t rows = 0, agree = 0;
  void add(const float* a, const float* r, int V) {
    d.add(a, r, size_t(V));
    ++rows;
    agree += std::max_element(a, a + V) - a == std::max_element(r, r + V) - r;
  }
  double argmax() const { return rows ? double(agree) / double(rows) : 1.0; }
};

struct Bounds {
  double maxabs = 0, rms = 0;
  std::string from;
};

// End-to-end bounds: margin x the noise floor F the manifest measured between the reference and
// other faithful runs of the same model on the same inputs (the 1-ulp sensitivity probe, the GPU
// vs CPU port of the reference, transformers vs the reference's owner-keys variant): anything
// not bit-identical to the reference in every bf16 rounding lands on F (fixture READMEs §5).
// transformers runs against the official decode are left out: they differ by the stale-key quirk
// too, not by rounding alone.
inline Bounds manifest_bounds(const nlohmann::json& agreement, const std::string& phase,
                              double margin, Bounds fallback) {
  Bounds b;
  int n = 0;
  for (auto it = agreement.begin(); it != agreement.end(); ++it) {
    const std::string k = it.key();
    if (!it->is_object() || !it->contains("max_abs") || !it->contains("rms_rel")) continue;
    auto ends = [&](const std::string& suf) {
      return k.size() >= suf.size() && k.compare(k.size() - suf.size(), suf.size(), suf) == 0;
    };
    const bool same_model =
        k.rfind("sensitivity_probe", 0) == 0 || k.rfind("gpu_port_vs_cpu_port", 0) == 0;
    bool use = false;
    if (phase == "prefill")
      use =
          ends("_prefill") && (same_model || k.find("_vs_reference_prefill") != std::string::npos);
    if (phase == "decode")
      use = ends("_decode") && (same_model || ends("_vs_reference_ownerkeys_decode"));
    if (phase == "dspark") use = ends("_dspark_logits_matched") && same_model;
    if (!use) continue;
    b.maxabs = std::max(b.maxabs, (*it)["max_abs"].get<double>());
    b.rms = std::max(b.rms, (*it)["rms_rel"].get<double>());
    ++n;
  }
  if (n == 0) return fallback;
  b.maxabs *= margin;
  b.rms *= margin;
  b.from = fmt::format("{}x noise floor of {} faithful runs (manifest)", margin, n);
  return b;
}

// The end-to-end bounds every fixture check uses. Fallbacks when a manifest has no agreement
// figures: tiny-a README §5's suggested bounds.
struct E2eBounds {
  Bounds prefill, decode, dspark;
};
inline E2eBounds e2e_bounds(const nlohmann::json& agreement, double margin) {
  E2eBounds e;
  e.prefill = manifest_bounds(agreement, "prefill", margin, {0.5, 0.06, "default bounds"});
  e.decode = manifest_bounds(agreement, "decode", margin, {0.6, 0.10, "default bounds"});
  e.dspark = manifest_bounds(agreement, "dspark", margin, e.decode);
  return e;
}

}  // namespace uf::model
