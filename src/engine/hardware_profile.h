#pragma once
// Hardware profiles: how many draft slots a DSpark round uses and where the confidence schedule
// stops it, per backend, GPU architecture and GPU count. The profile trades draft length against
// verify cost: a longer block pays off only where an extra verify row is nearly free.

#include <string>
#include <vector>

namespace uf::engine {

// Verify rows are anchor + drafts; kernels are written and tested for at most 8 rows, beyond which
// the decode kernels' numerics would differ from plain decoding ("spec == plain").
inline constexpr int kMaxDraftTokens = 7;
inline constexpr int kMaxVerifyRows = kMaxDraftTokens + 1;

struct HardwareKey {
  std::string backend;  // "cpu" or "cuda"
  std::string arch;     // "sm90", "sm100", "sm103"; "" for the CPU
  int gpu_count = 0;    // 0 for the CPU
};

struct HardwareProfile {
  HardwareKey key;
  int draft_tokens = 0;               // slots per DSpark round (0 = the config's dspark_block_size)
  double confidence_threshold = 0.0;  // prefix-survival probability below which drafting stops
  std::string note;                   // why these values
};

// The table, most specific first.
const std::vector<HardwareProfile>& hardware_profiles();

// The best match for `key`: exact, then same backend/arch any count, then same backend, then the
// default. `config_block_size` resolves draft_tokens == 0. Throws uf::core::Error if the resolved
// value is outside 1..kMaxDraftTokens or the threshold outside [0, 1).
HardwareProfile resolve_hardware_profile(const HardwareKey& key, int config_block_size);

// Validates a user override (e.g. --draft-tokens); same bounds as above.
void validate_draft_tokens(int draft_tokens);

}  // namespace uf::engine
