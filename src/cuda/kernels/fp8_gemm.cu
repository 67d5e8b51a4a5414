// FP8 block-scaled GEMM for prefill rows (M > 8), bitwise equal to the decode GEMV (fp8_gemv.cu).
//
// Shapes and dtypes: as Fp8Gemv (W [N, K] E4M3 with E8M0 32x32 block scales, A [M, K] E4M3 codes
// with fp32 power-of-two scales [M, K/32], out [M, N] fp32, optionally bf16-rounded). Any M >= 1,
// N % 16 == 0, K % 32 == 0.
//
// Tiling
//   A block (CTA, 8 warps) computes 128 weight rows x BM token rows (BM = 64; 32 when the 64-row
//   grid would not give every SM a block), walking all of K in chunks of 4 K blocks (128 bytes a
//   row) through a 3-stage cp.async pipeline that holds, per stage, the weight tile (128 rows),
//   the activation codes (BM rows) and the activation scales (BM x 4): 95 KB (BM 64) or 79 KB,
//   2 blocks an SM. Each weight byte is read once per BM token rows (the GEMV: once per 8).
//   Warp w owns weight rows 32 (w % 4) .. +31 and tokens BM/2 (w / 4) .. +BM/2-1: 2 x BM/16
//   mma.sync m16n8k32 (e4m3, fp32 accumulate) per K block, weights as the A operand and 8 tokens
//   as the B operand exactly as the GEMV, with the GEMV's K mapping (block byte 8t+j -> fragment
//   K position 4t+j for j < 4 and 16+4t+(j-4) for j >= 4, t = lane % 4) and the same fragment
//   registers, so each mma output element is the GEMV's. Shared rows are padded to 160 B: the
//   8-byte fragment reads of 8 rows x 4 lanes hit distinct banks. Rows beyond N or M are
//   zero-filled (cp.async src-size 0) and never stored.
//
// Reduction order (the GEMV's, so a prefill row is bitwise the decode row)
//   For each output (m, n) the K walk is split at the boundaries of the decode plan's splits
//   (kb_per_split, from the same Fp8Gemv plan; the resident and the pipelined GEMV kernels both
//   reduce in this form, only their kb_per_split differ): within split s, acc = 0; for kb in K
//   order: acc = fmaf(mma_partial(kb) * a_scale[m][kb], w_scale[n/32][kb], acc) (the GEMV's
//   expression); at the end of split s: total = acc (s = 0) or total = total + acc (s > 0), the
//   GEMV's in-order split sum; then the bf16 rounding where asked. Nothing depends on M or on the
//   other rows of the call.
//
// Kernels: fp8_gemm_kernel (above tiling, the e4m3 mma.sync that ptxas emulates with 12 F2FP +
// 2 HMMA + 4 FADD per mma; fp8_gemm_set_legacy(true)) and fp8_gemm_f16_kernel (the default: the
// same fragments and arithmetic with each fragment converted to f16 once per K block per warp and
// only the HMMAs per pair; see its comment). Bitwise the same outputs.
//
// Activation quantisation: act_quant_fp8_rows (below) is act_quant_kernel for any number of rows
// and a row stride: the same warp_quant_fp8_block on the same 32 values, so the codes and scales
// are bitwise those of act_quant_fp8_f32 (and of the GEMV's fused quantiser).

#include <cuda_runtime.h>

#include <atomic>

#include "cuda/cuda_check.h"
#include "cuda/gemv.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/mma_f16.cuh"

namespace uf::cuda {
namespace {

using namespace detail;

constexpr int kBN = 128;  // weight rows a block
constexpr int kKc = 4;    // K blocks a stage
constexpr int kStages = 3;
constexpr int kThreads = 256;
constexpr int kRow = kKc * 32 + 32;  // padded shared row (bytes)
constexpr int kWBytes = kBN * kRow;
// Per M tile (token rows a block, 64 or 32): activation codes, scales, stage and total bytes.
template <int kBM>
struct Tile {
  static constexpr int kNi = kBM / 16;  // 8-token mma columns a warp (2 warps along M)
  static constexpr int kABytes = kBM * kRow;
  static constexpr int kSBytes = kBM * kKc * 4;
  static constexpr int kStageBytes = kWBytes + kABytes + kSBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
};
constexpr int kMaxDevices = 64;
static_assert(Tile<64>::kStageBytes % 16 == 0 && Tile<32>::kStageBytes % 16 == 0,
              "stages keep 16-byte alignment");

struct GemmParams {
  const uint8_t* w;
  const uint8_t* w_scale;
  const uint8_t* a;
  const float* a_scale;
  float* out;
  int n, m, k, kbps, round;
};

// cp.async with zero fill: ok == false copies nothing and writes zeros.
__device__ __forceinline__ void cp16(void* dst, const void* src, bool ok) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  const int n = ok ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(n)
               : "memory");
}
__device__ __forceinline__ void cp4(void* dst, const void* src, bool ok) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
  const int n = ok ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(n)
               : "memory");
}

template <int kBM>
__global__ void __launch_bounds__(kThreads, 2) fp8_gemm_kernel(const GemmParams p) {
  using Tl = Tile<kBM>;
  constexpr int kNi = Tl::kNi, kABytes = Tl::kABytes, kStageBytes = Tl::kStageBytes;
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp & 3, wm = warp >> 2;
  const int n0 = int(blockIdx.x) * kBN, m0 = int(blockIdx.y) * kBM;
  const int nkb = p.k / 32;
  const int nchunks = (nkb + kKc - 1) / kKc;

  auto load = [&](int c) {
    if (c < nchunks) {
      uint8_t* st = smem + (c % kStages) * kStageBytes;
      const int kb0 = c * kKc, nk = min(kKc, nkb - kb0);
#pragma unroll
      for (int i = 0; i < kBN * kKc * 2 / kThreads; ++i) {  // weights: 8 pieces a row
        const int q = tid + kThreads * i, row = q >> 3, col = q & 7;
        if (col < 2 * nk) {
          const bool ok = n0 + row < p.n;
          const uint8_t* src = ok ? p.w + size_t(n0 + row) * p.k + kb0 * 32 + col * 16 : p.w;
          cp16(st + row * kRow + col * 16, src, ok);
        }
      }
#pragma unroll
      for (int i = 0; i < (kBM * kKc * 2 + kThreads - 1) / kThreads; ++i) {  // activation codes
        const int q = tid + kThreads * i, row = q >> 3, col = q & 7;
        if (q < kBM * kKc * 2 && col < 2 * nk) {
          const bool ok = m0 + row < p.m;
          const uint8_t* src = ok ? p.a + size_t(m0 + row) * p.k + kb0 * 32 + col * 16 : p.a;
          cp16(st + kWBytes + row * kRow + col * 16, src, ok);
        }
      }
      {  // activation scales: [kBM rows][kKc]
        const int row = tid / kKc, u = tid % kKc;
        if (row < kBM && u < nk) {
          const bool ok = m0 + row < p.m;
          const float* src = ok ? p.a_scale + size_t(m0 + row) * nkb + kb0 + u : p.a_scale;
          cp4(st + kWBytes + kABytes + (row * kKc + u) * 4, src, ok);
        }
      }
    }
    cp_async_commit();  // empty groups keep the group count uniform
  };

  // The warp's 32 weight rows share one scale row (n0 and 32 wn are multiples of 32); a warp
  // wholly beyond N reads the last scale row (its outputs are not stored).
  const int srow = min((n0 + 32 * wn) / 32, (p.n + 31) / 32 - 1);
  const uint8_t* wsc = p.w_scale + size_t(srow) * nkb;

  float acc[2][kNi][4], tot[2][kNi][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < kNi; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = tot[i][j][e] = 0.f;
  int split = 0;
  int split_end = min(nkb, p.kbps);

#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) load(c);

  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait<kStages - 2>();  // chunk c has landed (this thread's pieces)
    __syncthreads();               // ... everyone's; and chunk c - 1's buffer is free
    load(c + kStages - 1);
    const uint8_t* st = smem + (c % kStages) * kStageBytes;
    const uint8_t* ws = st + (32 * wn + g) * kRow + t * 8;
    const uint8_t* as = st + kWBytes + ((kBM / 2) * wm + g) * kRow + t * 8;
    const float* ss = reinterpret_cast<const float*>(st + kWBytes + kABytes);
    const int kb0 = c * kKc, nk = min(kKc, nkb - kb0);
#pragma unroll
    for (int u = 0; u < kKc; ++u) {
      if (u < nk) {  // block-uniform
        const int kb = kb0 + u;
        uint32_t af[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const uint2 wa = *reinterpret_cast<const uint2*>(ws + (16 * mi) * kRow + u * 32);
          const uint2 wb = *reinterpret_cast<const uint2*>(ws + (16 * mi + 8) * kRow + u * 32);
          af[mi][0] = wa.x, af[mi][1] = wb.x, af[mi][2] = wa.y, af[mi][3] = wb.y;
        }
        const float sw = e8m0_to_f32(__ldg(wsc + kb));
#pragma unroll
        for (int ni = 0; ni < kNi; ++ni) {
          const uint2 b = *reinterpret_cast<const uint2*>(as + (8 * ni) * kRow + u * 32);
          const int tok0 = (kBM / 2) * wm + 8 * ni + 2 * t;
          const float sa0 = ss[tok0 * kKc + u], sa1 = ss[(tok0 + 1) * kKc + u];
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            float d[4];
            mma_e4m3_16x8x32(d, af[mi], b.x, b.y);
            float* a = acc[mi][ni];
            a[0] = fmaf(d[0] * sa0, sw, a[0]);
            a[1] = fmaf(d[1] * sa1, sw, a[1]);
            a[2] = fmaf(d[2] * sa0, sw, a[2]);
            a[3] = fmaf(d[3] * sa1, sw, a[3]);
          }
        }
        if (kb + 1 == split_end) {  // block-uniform: the decode plan's split ends here
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < kNi; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                tot[i][j][e] = split == 0 ? acc[i][j][e] : tot[i][j][e] + acc[i][j][e];
                acc[i][j][e] = 0.f;
              }
          ++split;
          split_end = min(nkb, split_end + p.kbps);
        }
      }
    }
  }
  cp_async_wait<0>();

  // d[0]: (row g, token 2t), d[1]: (g, 2t+1), d[2]: (g+8, 2t), d[3]: (g+8, 2t+1).
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNi; ++ni) {
      const int r0 = n0 + 32 * wn + 16 * mi + g, r1 = r0 + 8;
      const int t0 = m0 + (kBM / 2) * wm + 8 * ni + 2 * t, t1 = t0 + 1;
      const float* v = tot[mi][ni];
      auto put = [&](int tok, int row, float x) {
        if (tok < p.m && row < p.n) p.out[size_t(tok) * p.n + row] = p.round ? round_bf16(x) : x;
      };
      put(t0, r0, v[0]);
      put(t1, r0, v[1]);
      put(t0, r1, v[2]);
      put(t1, r1, v[3]);
    }
}

// ---- The f16 kernel (the default; fp8_gemm_set_legacy(true) picks the kernel above) ----
// sm_90a has no e4m3 mma.sync: ptxas expands each mma_e4m3_16x8x32 into 12 F2FP (e4m3x2 ->
// f16x2, exact) + 2 HMMA.16816.F32 + 4 FADD of +0 (moe_fp4.cu, "The m16n8k32 e4m3 mma on f16
// HMMA", read from the SASS): t = HMMA({lo(a0), lo(a1), lo(a2), lo(a3)}, {lo(b0), lo(b1)}, 0),
// d = HMMA({hi(a0), hi(a1), hi(a2), hi(a3)}, {hi(b0), hi(b1)}, t), lo / hi = the f16x2 of the
// register's low / high two bytes. The kernel above re-converts both operands for every (A, B)
// pair; this one converts each A fragment (weights: 8 F2FP) once per K block per warp and each B
// fragment (8 tokens: 4 F2FP) once per K block per warp and issues the same two HMMAs on the same
// f16 registers per pair, so every d is the emulation's (it would differ only where t = -0, which
// an IEEE sum onto the first HMMA's +0 C does not give; test_fp8_gemm_f16 checks the bits). The
// fragments, the K mapping, the scales, acc = fmaf(d * sa, sw, acc), the split sums and the
// epilogue are the kernel above's, so the outputs are bitwise equal (and bitwise the GEMV's).
// (ldmatrix does not fit: a lane's fragment bytes are 8t..8t+7 of a row's K block, ldmatrix hands
// lane t bytes 4t..4t+3 of a 16-byte row; the K mapping is part of the bits.)
//   Tiles: 4 warps along N x kWm along M; a warp owns 32 weight rows (2 x m16) x 8 kNi tokens,
//   so a converted A fragment feeds kNi pair products and a converted B fragment 2.
//   F2FP a pair: 8 / kNi + 4 / 2 (the kernel above: 12). Same stages and shared layout.
template <int kNi, int kWm>
struct F16Tile {
  static constexpr int kThreads = 128 * kWm;  // 4 warps along N x kWm along M
  static constexpr int kWT = 8 * kNi;         // tokens a warp
  static constexpr int kBM = kWT * kWm;       // tokens a block
  static constexpr int kABytes = kBM * kRow;
  static constexpr int kSBytes = kBM * kKc * 4;
  static constexpr int kStageBytes = kWBytes + kABytes + kSBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static_assert(kStageBytes % 16 == 0, "stages keep 16-byte alignment");
};

template <int kNi, int kWm, int kMinBlocks>
__global__ void __launch_bounds__(128 * kWm, kMinBlocks) fp8_gemm_f16_kernel(const GemmParams p) {
  using Tl = F16Tile<kNi, kWm>;
  constexpr int kThr = Tl::kThreads, kWT = Tl::kWT, kBM = Tl::kBM;
  constexpr int kABytes = Tl::kABytes, kStageBytes = Tl::kStageBytes;
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp & 3, wm = warp >> 2;
  // Token tiles run fastest through the grid: the blocks in flight share few weight tiles, so
  // a weight larger than L2 (Engram's) is read from memory about once.
  const int n0 = int(blockIdx.y) * kBN, m0 = int(blockIdx.x) * kBM;
  const int nkb = p.k / 32;
  const int nchunks = (nkb + kKc - 1) / kKc;

  // The kernel above's loads for kThr threads and kBM token rows.
  auto load = [&](int c) {
    if (c < nchunks) {
      uint8_t* st = smem + (c % kStages) * kStageBytes;
      const int kb0 = c * kKc, nk = min(kKc, nkb - kb0);
#pragma unroll
      for (int i = 0; i < kBN * kKc * 2 / kThr; ++i) {  // weights: 8 pieces a row
        const int q = tid + kThr * i, row = q >> 3, col = q & 7;
        if (col < 2 * nk) {
          const bool ok = n0 + row < p.n;
          const uint8_t* src = ok ? p.w + size_t(n0 + row) * p.k + kb0 * 32 + col * 16 : p.w;
          cp16(st + row * kRow + col * 16, src, ok);
        }
      }
#pragma unroll
      for (int i = 0; i < (kBM * kKc * 2 + kThr - 1) / kThr; ++i) {  // activation codes
        const int q = tid + kThr * i, row = q >> 3, col = q & 7;
        if (q < kBM * kKc * 2 && col < 2 * nk) {
          const bool ok = m0 + row < p.m;
          const uint8_t* src = ok ? p.a + size_t(m0 + row) * p.k + kb0 * 32 + col * 16 : p.a;
          cp16(st + kWBytes + row * kRow + col * 16, src, ok);
        }
      }
#pragma unroll
      for (int i = 0; i < (kBM * kKc + kThr - 1) / kThr; ++i) {  // activation scales
        const int q = tid + kThr * i, row = q / kKc, u = q % kKc;
        if (row < kBM && u < nk) {
          const bool ok = m0 + row < p.m;
          const float* src = ok ? p.a_scale + size_t(m0 + row) * nkb + kb0 + u : p.a_scale;
          cp4(st + kWBytes + kABytes + (row * kKc + u) * 4, src, ok);
        }
      }
    }
    cp_async_commit();  // empty groups keep the group count uniform
  };

  const int srow = min((n0 + 32 * wn) / 32, (p.n + 31) / 32 - 1);
  const uint8_t* wsc = p.w_scale + size_t(srow) * nkb;

  float acc[2][kNi][4], tot[2][kNi][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < kNi; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = tot[i][j][e] = 0.f;
  int split = 0;
  int split_end = min(nkb, p.kbps);
  const float zero[4] = {0.f, 0.f, 0.f, 0.f};

#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) load(c);

  for (int c = 0; c < nchunks; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    load(c + kStages - 1);
    const uint8_t* st = smem + (c % kStages) * kStageBytes;
    const uint8_t* ws = st + (32 * wn + g) * kRow + t * 8;
    const uint8_t* as = st + kWBytes + (kWT * wm + g) * kRow + t * 8;
    const float* ss = reinterpret_cast<const float*>(st + kWBytes + kABytes);
    const int kb0 = c * kKc, nk = min(kKc, nkb - kb0);
#pragma unroll
    for (int u = 0; u < kKc; ++u) {
      if (u < nk) {  // block-uniform
        const int kb = kb0 + u;
        const float sw = e8m0_to_f32(__ldg(wsc + kb));
        // The two A fragments {row g: bytes 8t..8t+3, row g+8: same, row g: 8t+4..8t+7, row g+8:
        // same} (the kernel above's af[mi]) as the two HMMAs' f16 operands: once per K block.
        uint32_t al[2][4], ah[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const uint2 wa = *reinterpret_cast<const uint2*>(ws + (16 * mi) * kRow + u * 32);
          const uint2 wb = *reinterpret_cast<const uint2*>(ws + (16 * mi + 8) * kRow + u * 32);
          al[mi][0] = f16_lo_of_e4m3x4(wa.x), al[mi][1] = f16_lo_of_e4m3x4(wb.x);
          al[mi][2] = f16_lo_of_e4m3x4(wa.y), al[mi][3] = f16_lo_of_e4m3x4(wb.y);
          ah[mi][0] = f16_hi_of_e4m3x4(wa.x), ah[mi][1] = f16_hi_of_e4m3x4(wb.x);
          ah[mi][2] = f16_hi_of_e4m3x4(wa.y), ah[mi][3] = f16_hi_of_e4m3x4(wb.y);
        }
#pragma unroll
        for (int ni = 0; ni < kNi; ++ni) {
          // The B fragment (token g of the group) as the HMMAs' f16 operands, once per K block,
          // and the activation scales of tokens 2t, 2t + 1.
          const uint2 b = *reinterpret_cast<const uint2*>(as + (8 * ni) * kRow + u * 32);
          const uint32_t bl0 = f16_lo_of_e4m3x4(b.x), bl1 = f16_lo_of_e4m3x4(b.y);
          const uint32_t bh0 = f16_hi_of_e4m3x4(b.x), bh1 = f16_hi_of_e4m3x4(b.y);
          const int tok0 = kWT * wm + 8 * ni + 2 * t;
          const float sa0 = ss[tok0 * kKc + u], sa1 = ss[(tok0 + 1) * kKc + u];
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            float tt[4], d[4];
            hmma_16x8x16_f32(tt, al[mi], bl0, bl1, zero);
            hmma_16x8x16_f32(d, ah[mi], bh0, bh1, tt);
            float* a = acc[mi][ni];
            a[0] = fmaf(d[0] * sa0, sw, a[0]);
            a[1] = fmaf(d[1] * sa1, sw, a[1]);
            a[2] = fmaf(d[2] * sa0, sw, a[2]);
            a[3] = fmaf(d[3] * sa1, sw, a[3]);
          }
        }
        if (kb + 1 == split_end) {  // block-uniform: the decode plan's split ends here
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < kNi; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                tot[i][j][e] = split == 0 ? acc[i][j][e] : tot[i][j][e] + acc[i][j][e];
                acc[i][j][e] = 0.f;
              }
          ++split;
          split_end = min(nkb, split_end + p.kbps);
        }
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNi; ++ni) {
      const int r0 = n0 + 32 * wn + 16 * mi + g, r1 = r0 + 8;
      const int t0 = m0 + kWT * wm + 8 * ni + 2 * t, t1 = t0 + 1;
      const float* v = tot[mi][ni];
      auto put = [&](int tok, int row, float x) {
        if (tok < p.m && row < p.n) p.out[size_t(tok) * p.n + row] = p.round ? round_bf16(x) : x;
      };
      put(t0, r0, v[0]);
      put(t1, r0, v[1]);
      put(t0, r1, v[2]);
      put(t1, r1, v[3]);
    }
}

// One warp per (row, 32-block), as act_quant_kernel: lane i quantises element 32 kb + i.
__global__ void __launch_bounds__(256)
    act_quant_rows_kernel(const float* x, long long x_stride, int m, int k, uint8_t* codes,
                          float* scales) {
  const int nkb = k / 32;
  const long long item = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (item >= (long long)m * nkb) return;
  const int row = int(item / nkb), kb = int(item % nkb), lane = threadIdx.x & 31;
  const float v = x[size_t(row) * size_t(x_stride) + size_t(kb) * 32 + lane];
  float s;
  codes[size_t(row) * k + size_t(kb) * 32 + lane] = warp_quant_fp8_block(v, &s);
  if (lane == 0) scales[size_t(row) * nkb + kb] = s;
}

}  // namespace

void act_quant_fp8_rows(const float* x, long long x_stride, int m, int k, uint8_t* codes,
                        float* scales, cudaStream_t stream) {
  require(m >= 1 && k > 0 && k % 32 == 0 && x_stride >= k,
          "act_quant_fp8_rows: m = %d must be >= 1, k = %d a multiple of 32 and x_stride = %lld "
          ">= k",
          m, k, x_stride);
  const long long items = (long long)m * (k / 32);
  act_quant_rows_kernel<<<unsigned((items + 7) / 8), 256, 0, stream>>>(x, x_stride, m, k, codes,
                                                                       scales);
  UF_CUDA_CHECK(cudaGetLastError());
}

namespace {

// fp8_gemm_set_legacy (process-wide, read at each launch).
std::atomic<bool> g_legacy{false};

// Sets the f16 kernel's shared-memory attributes on the current device (once per device) and
// launches it on an m-tiles x n-blocks grid.
template <int kNi, int kWm, int kMinBlocks>
void launch_f16(const GemmParams& p, cudaStream_t stream) {
  using Tl = F16Tile<kNi, kWm>;
  static PerDeviceOnce once;
  once([] {
    UF_CUDA_CHECK(cudaFuncSetAttribute(fp8_gemm_f16_kernel<kNi, kWm, kMinBlocks>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       Tl::kSmemBytes));
    prefer_shared_carveout(fp8_gemm_f16_kernel<kNi, kWm, kMinBlocks>);
  });
  const dim3 grid{unsigned((p.m + Tl::kBM - 1) / Tl::kBM), unsigned((p.n + kBN - 1) / kBN)};
  fp8_gemm_f16_kernel<kNi, kWm, kMinBlocks><<<grid, Tl::kThreads, Tl::kSmemBytes, stream>>>(p);
}

}  // namespace

void fp8_gemm_set_legacy(bool on) { g_legacy.store(on); }

void fp8_gemm_prefill(const Fp8WeightView& w, const QuantActView& a, int kb_per_split, float* out,
                      bool round, cudaStream_t stream) {
  require(w.n > 0 && w.n % 16 == 0 && w.k > 0 && w.k % 32 == 0 && a.k == w.k && a.m >= 1 &&
              kb_per_split >= 1,
          "fp8_gemm_prefill: shape n = %d, k = %d (activations m = %d, k = %d), kb_per_split = %d: "
          "needs n %% 16 == 0, k %% 32 == 0, equal k, m >= 1",
          w.n, w.k, a.m, a.k, kb_per_split);
  require((a.m + 31) / 32 <= 65535, "fp8_gemm_prefill: %d rows exceed one launch", a.m);
  // Function attributes belong to the current device's context (tensor-parallel ranks): set once
  // per device (no-ops afterwards; not stream work, so capture-safe).
  int dev = 0;
  UF_CUDA_CHECK(cudaGetDevice(&dev));
  require(dev >= 0 && dev < kMaxDevices, "fp8_gemm_prefill: device %d beyond %d", dev, kMaxDevices);
  static PerDeviceOnce once;
  once([] {
    UF_CUDA_CHECK(cudaFuncSetAttribute(
        fp8_gemm_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile<64>::kSmemBytes));
    UF_CUDA_CHECK(cudaFuncSetAttribute(
        fp8_gemm_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile<32>::kSmemBytes));
    prefer_shared_carveout(fp8_gemm_kernel<64>);
    prefer_shared_carveout(fp8_gemm_kernel<32>);
  });
  const GemmParams p{w.data, w.scale, a.codes, a.scales,     out,
                     w.n,    a.m,     w.k,     kb_per_split, round ? 1 : 0};
  static int sms[kMaxDevices] = {};
  if (sms[dev] == 0) sms[dev] = device_sm_count();
  if (!g_legacy.load(std::memory_order_relaxed)) {
    // 64-token blocks of 8 warps (32 x 32 warp tiles, 2 blocks an SM) where they give every SM a
    // block, else 32-token blocks of 8 warps (32 x 16 warp tiles: twice the blocks, as many warps
    // a block as the legacy kernel's small tiles). The arithmetic of an output is the same. On the
    // H200 (session 8, a 512-row chunk's 168 small-grid calls: wkv, the shared expert) 32 x 32
    // tiles on 4-warp blocks ran 80 us a call, these 67, the legacy kernel 72; wider (32 x 64) or
    // taller (16-warp) blocks for the large grids were no faster than the 64-token blocks.
    const size_t nb = size_t((w.n + kBN - 1) / kBN);
    require(nb <= 65535, "fp8_gemm_prefill: n = %d exceeds one launch", w.n);
    if (nb * size_t((a.m + 63) / 64) >= size_t(sms[dev]))
      launch_f16<4, 2, 2>(p, stream);
    else
      launch_f16<2, 2, 2>(p, stream);
    UF_CUDA_CHECK(cudaGetLastError());
    return;
  }
  // 64-row tiles where they give at least one block per SM; 32-row tiles (twice the blocks, each
  // weight tile read twice as often) for the small grids of narrow weights or few rows. The
  // arithmetic of an output is the same in both.
  const unsigned nb = unsigned((w.n + kBN - 1) / kBN);
  const unsigned m64 = unsigned((a.m + 63) / 64);
  if (size_t(nb) * m64 >= size_t(sms[dev])) {
    fp8_gemm_kernel<64><<<dim3{nb, m64}, kThreads, Tile<64>::kSmemBytes, stream>>>(p);
  } else {
    const unsigned m32 = unsigned((a.m + 31) / 32);
    fp8_gemm_kernel<32><<<dim3{nb, m32}, kThreads, Tile<32>::kSmemBytes, stream>>>(p);
  }
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
