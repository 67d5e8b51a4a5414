#include "engine/hardware_profile.h"

#include "core/error.h"

namespace uf::engine {

const std::vector<HardwareProfile>& hardware_profiles() {
  // Thresholds of the original engine on 4 and 8 GPUs (0.3 / 0.2); block sizes follow its
  // profiles (6 on sm_103a, 7 on 8 x B200, 5 on 4 x B200). On Hopper a verify row costs more than
  // on Blackwell (no FP4 tensor cores), so the 8-GPU profile keeps the trained block of 5.
  static const std::vector<HardwareProfile> table = {
      {{"cuda", "sm103", 8}, 6, 0.2, "8 x B300: long blocks, cheap rows"},
      {{"cuda", "sm103", 4}, 6, 0.3, "4 x B300 / GB300"},
      {{"cuda", "sm100", 8}, 7, 0.2, "8 x B200"},
      {{"cuda", "sm100", 4}, 5, 0.3, "4 x B200"},
      {{"cuda", "sm90", 8}, 5, 0.2, "8 x H100/H200: trained block size"},
      {{"cuda", "sm90", 4}, 5, 0.3, "4 x H100/H200"},
      {{"cuda", "sm90", 0}, 5, 0.3, "Hopper, other GPU counts"},
      {{"cuda", "", 0}, 0, 0.3, "other GPUs: the config's block size"},
      {{"cpu", "", 0},
       0,
       0.1,
       "CPU reference: a verify row costs little next to reading the weights once"},
  };
  return table;
}

void validate_draft_tokens(int draft_tokens) {
  UF_CHECK(draft_tokens >= 1 && draft_tokens <= kMaxDraftTokens,
           "draft block of {} tokens is not supported: it must be 1..{} (at most {} verify rows, "
           "where the decode kernels keep the numerics of plain decoding)",
           draft_tokens, kMaxDraftTokens, kMaxVerifyRows);
}

HardwareProfile resolve_hardware_profile(const HardwareKey& key, int config_block_size) {
  const auto& table = hardware_profiles();
  const HardwareProfile* best = nullptr;
  auto try_match = [&](auto pred) {
    if (best) return;
    for (const auto& p : table) {
      if (pred(p.key)) {
        best = &p;
        return;
      }
    }
  };
  try_match([&](const HardwareKey& k) {
    return k.backend == key.backend && k.arch == key.arch && k.gpu_count == key.gpu_count;
  });
  try_match([&](const HardwareKey& k) {
    return k.backend == key.backend && k.arch == key.arch && k.gpu_count == 0;
  });
  try_match([&](const HardwareKey& k) {
    return k.backend == key.backend && k.arch.empty() && k.gpu_count == 0;
  });
  UF_CHECK(best != nullptr, "no hardware profile for backend '{}'", key.backend);
  HardwareProfile p = *best;
  if (p.draft_tokens == 0) p.draft_tokens = config_block_size;
  validate_draft_tokens(p.draft_tokens);
  UF_CHECK(p.confidence_threshold >= 0.0 && p.confidence_threshold < 1.0,
           "hardware profile '{}': confidence threshold {} is outside [0, 1)", p.note,
           p.confidence_threshold);
  return p;
}

}  // namespace uf::engine
