#pragma once
// FP8 block-scaled GEMV / small-M GEMM for decode rows (M = 1..8), the FP8 activation
// quantizer that feeds it, and the prefill GEMM (any M) with the same numerics (DeviceLinear's
// PrefillGemm::kFp8Bitwise; its default prefill path is cuda/prefill_gemm.h's bf16 GEMM). Kernels:
// src/cuda/kernels/fp8_gemv.cu and fp8_gemm.cu (shapes, tiles and the reduction order are stated
// there).
//
//   out[m][n] = sum over K blocks kb, in K order, of
//               (sum_{i<32} a[m][32kb+i] * w[n][32kb+i]) * a_scale[m][kb] * w_scale[n/32][kb]
//
// Weights are the checkpoint's F8_E4M3 [N, K] with F8_E8M0 scales [ceil(N/32), K/32];
// activations are quantized to E4M3 per 32 along K with a power-of-two scale (core/quant.h).
// The reduction order of a row never depends on M, so rows 1..8 give bitwise identical outputs
// for the same input row (spec == plain).

#include <cuda_runtime.h>

#include <cstdint>

namespace uf::cuda {

inline constexpr int kMaxDecodeRows = 8;

// Row-major F8_E4M3 weight [n, k] and its UE8M0 32x32 block scales [ceil(n/32), k/32].
struct Fp8WeightView {
  const uint8_t* data = nullptr;
  const uint8_t* scale = nullptr;
  int n = 0;
  int k = 0;
};

// Quantized activations: codes [m, k] E4M3, scales [m, k/32] fp32 powers of two.
struct QuantActView {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
  int m = 0;
  int k = 0;
};

// x [m, k] (bf16 bits or fp32) -> codes/scales. k % 32 == 0, m <= 8.
void act_quant_fp8_bf16(const uint16_t* x, int m, int k, uint8_t* codes, float* scales,
                        cudaStream_t stream);
void act_quant_fp8_f32(const float* x, int m, int k, uint8_t* codes, float* scales,
                       cudaStream_t stream);

class Fp8Gemv;

// At most this many weights share one grouped launch (Fp8Gemv::run_fused_group).
inline constexpr int kMaxGemvGroup = 8;

// One weight of a fused launch: its plan, its data, where its outputs go (out_f32 [m, n] fp32,
// bf16-rounded when round_f32; out_bf16 [m, n] bf16 bits; either may be null).
struct Fp8GemvCall {
  const Fp8Gemv* gemv = nullptr;
  Fp8WeightView w;
  float* out_f32 = nullptr;
  bool round_f32 = false;
  uint16_t* out_bf16 = nullptr;
};

// Which kernel a plan runs. kAuto: the resident kernel (every CTA holds all its weight bytes in
// shared memory, K split over the warps of a thread-block cluster) where the weight fits one wave
// of such CTAs, else the pipelined split-K kernel. kPipelined forces the latter (benchmarks: the
// kernel every plan ran before the resident one).
enum class Fp8GemvPath { kAuto, kPipelined };

// One GEMV shape (n, k) with its split-K plan and workspace. Constraints: n % 16 == 0,
// k % 32 == 0, 1 <= m <= 8. The split plan (kb_per_split, splits) depends on (n, k, SM count,
// path) only, never on m: every output is the in-order sum over the splits of the K-order sum of
// its split's K blocks (the grouping fp8_gemm_prefill reproduces from kb_per_split).
// Construction allocates; run*() do not (they may be captured in a CUDA graph). Every run is ONE
// kernel launch per path (split-K finish and roundings included); one run at a time per plan (a
// pipelined plan's split counters and partials are the plan's).
class Fp8Gemv {
 public:
  Fp8Gemv(int n, int k, int sm_count, Fp8GemvPath path = Fp8GemvPath::kAuto);
  ~Fp8Gemv();
  Fp8Gemv(const Fp8Gemv&) = delete;
  Fp8Gemv& operator=(const Fp8Gemv&) = delete;

  // Pre-quantised activations (act_quant_fp8_*). out_f32 [m, n] and/or out_bf16 [m, n] (either
  // may be null). Launched with PDL: the kernel prefetches weights before waiting on the previous
  // kernel in the stream.
  void run(const Fp8WeightView& w, const QuantActView& a, float* out_f32, uint16_t* out_bf16,
           cudaStream_t stream) const;
  // The same from fp32 x [m, k] (row stride x_stride), quantised inside the kernel: bitwise equal
  // to act_quant_fp8_f32 + run. round_f32: out_f32 holds bf16-rounded values (RNE).
  // x must satisfy fused_input_ok.
  void run_fused(const Fp8WeightView& w, const float* x, long long x_stride, int m, float* out_f32,
                 bool round_f32, uint16_t* out_bf16, cudaStream_t stream) const;
  // Several weights with the same k reading the same x, in ONE launch per path (their blocks
  // concatenated); each output is bitwise what run_fused of its own plan gives. 1..kMaxGemvGroup
  // calls, distinct plans.
  static void run_fused_group(const Fp8GemvCall* calls, int n_calls, const float* x,
                              long long x_stride, int m, cudaStream_t stream);
  // The fused kernel loads x with 16-byte loads.
  static bool fused_input_ok(const float* x, long long x_stride);

  int n() const { return n_; }
  int k() const { return k_; }
  int splits() const { return splits_; }
  int kb_per_split() const { return kb_per_split_; }
  int stages() const { return stages_; }  // weight pipeline depth (1..3; 1 for resident plans)
  bool resident() const { return resident_; }
  // Thread-block cluster size of a resident plan (CTAs sharing one output tile's K), else 1.
  int cluster() const { return cluster_; }
  // Resident blocks per SM of the kernel this plan launches alone (diagnostics, tests).
  int blocks_per_sm(bool fused) const;

 private:
  int n_, k_, sms_, splits_, kb_per_split_, n_blocks_, stages_;
  bool resident_ = false;
  int cluster_ = 1;
  float* partials_ = nullptr;  // pipelined: [splits][n_blocks][8 warps][16 x 8]
  int* counters_ = nullptr;    // pipelined: [n_blocks], self-resetting
};

// ---- Prefill (M > 8): src/cuda/kernels/fp8_gemm.cu ----

// act_quant_fp8_f32 for any m >= 1 and a row stride (x [m, x_stride], codes [m, k], scales
// [m, k/32]): the same kernel arithmetic, bitwise the same codes and scales.
void act_quant_fp8_rows(const float* x, long long x_stride, int m, int k, uint8_t* codes,
                        float* scales, cudaStream_t stream);

// out[m, n] (row stride n) for pre-quantised activations of any m >= 1, tensor cores, each weight
// tile read once per 64 rows. kb_per_split: the decode plan's (Fp8Gemv::kb_per_split() of the
// same shape, either path): the K sum is grouped at those split boundaries and the splits added
// in order, so every output is bitwise what Fp8Gemv::run gives for that row (round: bf16-rounded
// fp32 as run_fused's round_f32). One launch, no workspace; graph-capturable (no allocation).
void fp8_gemm_prefill(const Fp8WeightView& w, const QuantActView& a, int kb_per_split, float* out,
                      bool round, cudaStream_t stream);
// true: fp8_gemm_prefill runs the e4m3 mma.sync kernel (ptxas emulates it with 12 F2FP + 2 HMMA
// per mma) instead of the default f16 HMMA kernel that converts each fragment once; both give
// bitwise the same outputs. Process-wide, read at each launch (tests, benchmarks).
void fp8_gemm_set_legacy(bool on);

int device_sm_count();

}  // namespace uf::cuda
