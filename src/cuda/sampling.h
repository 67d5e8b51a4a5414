#pragma once
// On-device sampling for decode rows: softmax with temperature, top-p, Gumbel-max over a
// counter-based RNG. Kernel: src/cuda/kernels/sampling.cu; the RNG and the per-token math are in
// src/cuda/sampling_math.h so that a CPU reference (tests) and a future on-device block
// verification (port of src/sampling/verify.h) compute exactly the same numbers.
//
// Per row r (logits l[V]), with T = temperature, p = top_p:
//   T <= 0: greedy argmax (smallest index on ties).
//   m = max l;  e_i = expf((l_i - m) / T) in fp32;  q_i = floor(e_i * 2^40) (uint64, exact sums)
//   Z = sum q_i;  token i is kept iff F(e_i) = sum_{j : e_j > e_i} q_j < p * Z   (ties kept alike)
//   g_i = -log(-log(u_i)), u_i = philox_uniform(seed, step, r, i)
//   token = argmax over kept i of ((l_i - m) / T + g_i)   (smallest index on ties)
// The kernel finds it by rejection: candidate = argmax over {e > pivot}; accept when kept, else
// pivot = e_candidate. Each round is one pass over registers (the argmax of the next round and
// F of the current candidate are computed together); it terminates because the top token is
// always kept. The result equals the direct definition above.

#include <cuda_runtime.h>

#include <cstdint>

namespace uf::cuda {

inline constexpr int kSamplingMaxVocab = 131072;  // 8 blocks x 1024 threads x 16 tokens

// Softmax statistics of one row, for verification kernels and tests.
struct SampleRowStats {
  unsigned long long z_q;  // sum of q_i (fixed point 2^-40); 0 for greedy rows
  float max_logit;
  int rounds;  // rejection rounds taken (0 when the first candidate was kept)
  int token;
  int pad;
};

// logits [rows, vocab] fp32 on the device, rows <= 8, vocab <= kSamplingMaxVocab.
// seed_step: device pointer to {seed, step} (uint64 each), read at run time so that a captured
// graph can be replayed for new steps. tokens [rows] int32 out; stats [rows] optional.
void sample_top_p(const float* logits, int rows, int vocab, float temperature, float top_p,
                  const unsigned long long* seed_step, int32_t* tokens, SampleRowStats* stats,
                  cudaStream_t stream);

}  // namespace uf::cuda
