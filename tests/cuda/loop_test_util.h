#pragma once
// The generation loop on a CUDA backend for tests that compare decoding paths: the tokens and the
// per-step accepted / drafted counts of one request.
#include <cstdint>
#include <span>
#include <vector>

#include "cuda/backend/cuda_backend.h"
#include "engine/generation_loop.h"
#include "engine/hardware_profile.h"

namespace uf::cuda::test {

struct LoopRun {
  std::vector<int32_t> tokens;
  std::vector<int> accepted, drafted;  // per step
};

inline LoopRun generate(CudaBackend& be, const std::vector<int32_t>& prompt,
                        const engine::GenerationParams& p) {
  engine::GenerationLoop loop(
      be, engine::resolve_hardware_profile({"cpu", "", 0}, be.config().dspark_block_size));
  auto s = be.new_session(512);
  LoopRun out;
  const auto r =
      loop.run(*s, prompt, p, [&](std::span<const int32_t>, const engine::StepStats& st) {
        out.accepted.push_back(st.accepted);
        out.drafted.push_back(st.drafted);
        return true;
      });
  out.tokens = r.tokens;
  return out;
}

}  // namespace uf::cuda::test
