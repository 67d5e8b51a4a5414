// Top-p / temperature sampling for up to 8 rows over V <= 131072 logits (V = 129280 here).
//
// Layout: one thread-block cluster of 8 blocks x 512 threads per row (sm_90+ clusters); each
// thread keeps 32 tokens (e and score) in registers for the whole kernel: tokens rank*16384 +
// j*2048 + 4*tid + w (j < 8, w < 4), so every load is a coalesced float4 and one Philox call
// serves 4 tokens.
// Reductions (max, uint64 sums, argmax) go warp -> block -> cluster: each block publishes its
// partial in shared memory, one cluster barrier, then every block reads the 8 partials through
// distributed shared memory. Integer sums are exact and argmax breaks ties by the smallest index,
// so the result does not depend on the reduction order: it is deterministic and identical for a
// row whatever the other rows are (spec == plain).
//
// Math (sampling.h): m = max l; e = expf((l - m) / T); q = floor(e * 2^40); Z = sum q;
// kept iff sum_{e_j > e_i} q_j < top_p * Z; token = argmax over kept of ((l - m) / T + gumbel).
// Rejection rounds: candidate c = argmax over {e > pivot}; one pass computes F(e_c) and the next
// candidate over {e > e_c}; accept c when F(e_c) < top_p * Z (compared in double).

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cfloat>

#include "cuda/cuda_check.h"
#include "cuda/sampling.h"
#include "cuda/sampling_math.h"

namespace uf::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kClusterBlocks = 8;
constexpr int kThreads = 512;
constexpr int kPerThread = 32;
constexpr int kBlockTokens = kThreads * kPerThread;

struct Red {
  unsigned long long sum;
  float maxv;
  float score;
  int idx;
  float e;
};

__device__ __forceinline__ Red combine(Red a, const Red& b) {
  a.sum += b.sum;
  a.maxv = fmaxf(a.maxv, b.maxv);
  if (b.score > a.score || (b.score == a.score && b.idx < a.idx)) {
    a.score = b.score;
    a.idx = b.idx;
    a.e = b.e;
  }
  return a;
}

__device__ __forceinline__ Red shfl_xor(const Red& r, int o) {
  Red x;
  x.sum = __shfl_xor_sync(0xffffffffu, r.sum, o);
  x.maxv = __shfl_xor_sync(0xffffffffu, r.maxv, o);
  x.score = __shfl_xor_sync(0xffffffffu, r.score, o);
  x.idx = __shfl_xor_sync(0xffffffffu, r.idx, o);
  x.e = __shfl_xor_sync(0xffffffffu, r.e, o);
  return x;
}

__device__ __forceinline__ Red red_identity() {
  return Red{0ull, -FLT_MAX, -INFINITY, INT_MAX, 0.f};
}

// Cluster-wide reduction. slot: this block's 2 publication slots (double-buffered by `phase`).
__device__ __forceinline__ Red cluster_reduce(Red v, Red* s_warp, Red* s_slot, Red* s_result,
                                              int phase) {
  cg::cluster_group cluster = cg::this_cluster();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = combine(v, shfl_xor(v, o));
  if (lane == 0) s_warp[warp] = v;
  __syncthreads();
  if (warp == 0) {
    Red w = lane < int(blockDim.x >> 5) ? s_warp[lane] : red_identity();
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) w = combine(w, shfl_xor(w, o));
    if (lane == 0) s_slot[phase] = w;
  }
  cluster.sync();
  if (warp == 0) {
    Red w = red_identity();
    if (lane < kClusterBlocks) w = cluster.map_shared_rank(s_slot, lane)[phase];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) w = combine(w, shfl_xor(w, o));
    if (lane == 0) *s_result = w;
  }
  __syncthreads();
  return *s_result;
}

__global__ void __cluster_dims__(kClusterBlocks, 1, 1) __launch_bounds__(kThreads, 1)
    sample_top_p_kernel(const float* logits, int vocab, float temperature, float top_p,
                        const unsigned long long* seed_step, int32_t* tokens,
                        SampleRowStats* stats) {
  __shared__ Red s_warp[32];
  __shared__ Red s_slot[2];
  __shared__ Red s_result;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int row = blockIdx.x / kClusterBlocks;
  const float* lrow = logits + size_t(row) * vocab;
  const int base = rank * kBlockTokens + threadIdx.x * 4;
  int phase = 0;

  // Logits are read twice (max, then e and scores) rather than kept in registers.
  auto load4 = [&](int j, float(&x)[4]) {
    const int v = base + j * 4 * kThreads;
    if (v + 3 < vocab && (vocab & 3) == 0) {
      const float4 t = __ldg(reinterpret_cast<const float4*>(lrow + v));
      x[0] = t.x, x[1] = t.y, x[2] = t.z, x[3] = t.w;
    } else {
#pragma unroll
      for (int w = 0; w < 4; ++w) x[w] = v + w < vocab ? __ldg(lrow + v + w) : -INFINITY;
    }
  };
  auto token_of = [&](int i) { return base + (i >> 2) * 4 * kThreads + (i & 3); };

  Red r = red_identity();
#pragma unroll
  for (int j = 0; j < kPerThread / 4; ++j) {
    float x[4];
    load4(j, x);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if (temperature <= 0.f) {
        r = combine(r, Red{0ull, x[w], x[w], token_of(4 * j + w), 0.f});
      } else {
        r.maxv = fmaxf(r.maxv, x[w]);
      }
    }
  }
  r = cluster_reduce(r, s_warp, s_slot, &s_result, phase);
  phase ^= 1;
  if (temperature <= 0.f) {  // greedy: argmax, smallest index on ties
    if (rank == 0 && threadIdx.x == 0) {
      tokens[row] = r.idx;
      if (stats) stats[row] = SampleRowStats{0ull, r.maxv, 0, r.idx, 0};
    }
    cluster.sync();  // keep shared memory alive until every block has read it
    return;
  }
  const float m = r.maxv;

  const unsigned long long seed = seed_step[0], step = seed_step[1];
  float e[kPerThread], s[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread / 4; ++j) {
    const int v = base + j * 4 * kThreads;
    float x[4];
    load4(j, x);
    const Philox4 rnd = sampling_philox(seed, step, uint32_t(row), uint32_t(v >> 2));
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int i = 4 * j + w;
      if (v + w < vocab) {
        const float z = (x[w] - m) / temperature;
        e[i] = expf(z);
        s[i] = z - logf(-logf(philox_uniform(rnd.v[w])));
      } else {
        e[i] = 0.f;
        s[i] = -INFINITY;
      }
    }
  }

  // Round 0: Z and the unrestricted candidate.
  r = red_identity();
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    r.sum += mass_q(e[i]);
    if (s[i] > r.score) r.score = s[i], r.idx = token_of(i), r.e = e[i];
  }
  r = cluster_reduce(r, s_warp, s_slot, &s_result, phase);
  phase ^= 1;
  const unsigned long long z_q = r.sum;
  const double target = double(top_p) * double(z_q);
  int cand = r.idx;
  float cand_e = r.e;
  int rounds = 0;
  if (top_p < 1.f) {
    // Each round raises the pivot to a strictly larger e, so at most vocab rounds; the bound only
    // guards against a hang should that invariant ever break.
    for (int it = 0; it < vocab; ++it) {
      // Tokens are visited in increasing index, so a strict > keeps the smallest on ties.
      Red q = red_identity();
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        // Opaque to the optimizer: stops it hoisting the 32 uint64 masses out of the loop
        // (64 more live registers, which spilled).
        asm volatile("" : "+f"(e[i]));
        if (e[i] > cand_e) {
          q.sum += mass_q(e[i]);
          if (s[i] > q.score) q.score = s[i], q.idx = token_of(i), q.e = e[i];
        }
      }
      q = cluster_reduce(q, s_warp, s_slot, &s_result, phase);
      phase ^= 1;
      if (double(q.sum) < target || q.idx == INT_MAX) break;  // kept (or nothing above it)
      cand = q.idx;
      cand_e = q.e;
      ++rounds;
    }
  }
  if (rank == 0 && threadIdx.x == 0) {
    tokens[row] = cand;
    if (stats) stats[row] = SampleRowStats{z_q, m, rounds, cand, 0};
  }
  cluster.sync();
}

}  // namespace

void sample_top_p(const float* logits, int rows, int vocab, float temperature, float top_p,
                  const unsigned long long* seed_step, int32_t* tokens, SampleRowStats* stats,
                  cudaStream_t stream) {
  require(rows >= 1 && rows <= 8 && vocab >= 1 && vocab <= kSamplingMaxVocab,
          "sample_top_p: rows = %d must be in 1..8 and vocab = %d in 1..%d", rows, vocab,
          kSamplingMaxVocab);
  require(top_p > 0.f && top_p <= 1.f, "sample_top_p: top_p = %g must be in (0, 1]", double(top_p));
  sample_top_p_kernel<<<rows * kClusterBlocks, kThreads, 0, stream>>>(
      logits, vocab, temperature, top_p, seed_step, tokens, stats);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
