#pragma once
// Device helpers shared by the decode kernels (sm_90a and sm_100a).
//
//  - mma_e4m3_16x8x32: one warp-wide FP8 tensor-core product D[16x8] = A[16x32] * B[32x8] in fp32
//    (mma.sync m16n8k32, available on sm_89+; still valid on sm_100a). The decode GEMVs put 16
//    weight rows in A and up to 8 token rows in B ("swap AB"), so one mma is exactly one 32-wide K
//    block: the per-block partial that the reference scales and adds in K order.
//  - K permutation: a dot product over one 32-block does not care about the order of its 32 terms,
//    so every kernel loads A and B with the SAME bijection of the block's 32 positions onto the mma
//    fragment positions, chosen so that loads are contiguous. Each kernel states its mapping.
//  - Activation quantization (act_quant, ue8m0): amax floored at 1e-4, scale = 2^ceil(log2(amax /
//    448)) from the fp32 bits, code = e4m3_satfinite_rne(x / scale), bit-exact with core/quant.h
//    (computed as x * (1 / scale), the same bits: see pow2_scale_inv).
//  - PDL (programmatic dependent launch): kernels call pdl_wait() before reading anything an
//    earlier kernel wrote, and pdl_trigger() early so the next kernel's blocks can start loading
//    their (independent) weights while this one drains.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>

#include "cuda/cuda_check.h"

namespace uf::cuda::detail {

constexpr float kFp8MaxInv = 1.0f / 448.0f;
constexpr float kActAmaxFloor = 1e-4f;

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The GPU's global nanosecond timer (%globaltimer: the same clock on every SM).
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// D = A * B with C = 0. a: 4 regs of 4 e4m3 (rows g, g+8; K halves), b: 2 regs (K halves).
__device__ __forceinline__ void mma_e4m3_16x8x32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

// d += A * B: A 16x16 bf16 (a0: row g, K lo; a1: row g+8, K lo; a2: row g, K hi; a3: row g+8,
// K hi), B 16x8 bf16 (b0: K lo, b1: K hi; column g), fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The bits of a bf16x2 (low half = .x); with __floats2bfloat162_rn(lo, hi): two fp32 values as
// an mma operand register.
__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

// Two fp32 values rounded to bf16 (nearest even) as one mma operand register (lo = .x).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return bf16x2_bits(__floats2bfloat162_rn(lo, hi));
}

// A generic pointer into shared memory as its 32-bit shared-window address (ldmatrix, cp.async).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// bf16 storage back to fp32 (a shift; exact): the KV store's index keys (cuda_session.h).
__device__ __forceinline__ float bf16_bits_to_f32(uint32_t h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ float bf16_at(const uint16_t* p) { return bf16_bits_to_f32(__ldg(p)); }
// Four consecutive bf16 (an 8-byte load: .x holds elements 0, 1) as a float4.
__device__ __forceinline__ float4 bf16x4_to_float4(uint2 v) {
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                     __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
}

// Streaming weight loads: read once per step, so keep them out of L1.
__device__ __forceinline__ uint2 ld_stream_u2(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p));
  return v;
}
// FP4 rows are loaded 16 bytes per row per K block; the neighbouring block's half of the same
// 32-byte sector comes from L1, so these keep the L1 allocation.
__device__ __forceinline__ uint32_t ld_nc_u32(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// UE8M0 -> fp32 exactly as core/dtypes.h: 0 -> 2^-127 (subnormal), 255 -> NaN.
__device__ __forceinline__ float e8m0_to_f32(uint32_t c) {
  const uint32_t bits = c == 0 ? 0x00400000u : (c == 255 ? 0x7fc00000u : c << 23);
  return __uint_as_float(bits);
}

__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// 2^ceil(log2(amax * max_inv)) from the fp32 bits, as core::pow2_scale.
__device__ __forceinline__ float pow2_scale(float amax, float max_inv) {
  const uint32_t bits = __float_as_uint(amax * max_inv);
  const int e = int((bits >> 23) & 0xff);
  const int l2 = e - 127 + ((bits & 0x7fffff) != 0 ? 1 : 0);
  return __uint_as_float(uint32_t(l2 + 127) << 23);
}

// 1 / s exactly, for s = pow2_scale(amax, kFp8MaxInv) with amax >= kActAmaxFloor (the activation
// scales): s = 2^e with -22 <= e <= 120 for finite amax (amax * kFp8MaxInv lies in [2^-23,
// 2^120)), so 1 / s = 2^-e is a normal float: exponent field 254 - (e + 127). Then x * (1 / s) and
// x / s are the correctly rounded values of the same exact real x * 2^-e, so they are bitwise equal
// for every x (subnormal results, overflow to inf, zeros, infinities alike); a NaN x gives NaN
// either way, and the e4m3 conversion makes every NaN the one code 0x7f. amax = inf (an inf in the
// block) gives s = inf (field 255): 1 / s = 0, and x * 0 == x / inf (signed zero for finite x, NaN
// for infinite x).
__device__ __forceinline__ float pow2_scale_inv(float s) {
  const uint32_t f = __float_as_uint(s) >> 23;
  return f >= 255u ? 0.0f : __uint_as_float((254u - f) << 23);
}

__device__ __forceinline__ uint8_t f32_to_e4m3(float x) {
  return uint8_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}
// Two codes in one conversion (low byte = lo): each byte is f32_to_e4m3 of its value (the
// conversion rounds the two lanes independently; f32_to_e4m3 is this with hi = 0).
__device__ __forceinline__ uint32_t f32x2_to_e4m3x2(float lo, float hi) {
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}
// Four codes packed little-endian (byte i = f32_to_e4m3(v_i * inv)).
__device__ __forceinline__ uint32_t f32x4_to_e4m3x4(float v0, float v1, float v2, float v3,
                                                    float inv) {
  return f32x2_to_e4m3x2(v0 * inv, v1 * inv) | (f32x2_to_e4m3x2(v2 * inv, v3 * inv) << 16);
}

// Quantizes one 32-block held one value per lane (the full warp participates). Returns the
// lane's code; *scale gets the block's power-of-two scale.
__device__ __forceinline__ uint8_t warp_quant_fp8_block(float x, float* scale) {
  float a = fabsf(x);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  const float s = pow2_scale(fmaxf(a, kActAmaxFloor), kFp8MaxInv);
  *scale = s;
  // x * (1 / s): bitwise the reference's IEEE division by the power of two s (pow2_scale_inv).
  return f32_to_e4m3(x * pow2_scale_inv(s));
}

// 8 packed E2M1 codes (low nibble = even element) -> 8 e4m3 bytes holding value * 2^-6, by bit
// placement only: nibble [s e1 e0 m] -> byte [s 0 0 e1 e0 m 0 0] (e4m3 exponent field 00e1e0,
// mantissa m00). For e = e1e0 >= 1 the e4m3 value is 2^(e-7) (1 + m/2) = e2m1 * 2^-6; for e = 0
// (0 or 0.5) it is the e4m3 subnormal (m/2) * 2^-6.
// Callers multiply the fp32 partial's scale by 2^6 (exact). Output order (byte 0 first):
//   lo = elements [0,2,4,6] (low nibbles), hi = elements [1,3,5,7] (high nibbles).
__device__ __forceinline__ void e2m1x8_to_e4m3_scaled(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
  hi = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}
constexpr float kE2M1ToE4M3Rescale = 64.0f;  // undoes the 2^-6 of e2m1x8_to_e4m3_scaled

// ---- Warp-private weight streaming through shared memory (cp.async, 16-byte pieces) ----
// A warp owns a 16-row weight tile and streams it in chunks of 8 K blocks: 16 rows x kChunkBytes
// per stage, kStages stages deep. Lane pieces are laid out so that one warp instruction copies
// whole 128-byte lines (2 rows x 256 B for FP8, 4 rows x 128 B for FP4): few memory requests per
// byte, unlike fragment-shaped 8-byte loads. Rows are padded so that the fragment reads from
// shared memory are bank-conflict free (FP8: 8-byte reads, pad 32; FP4: 4-byte reads, pad 16).
template <int kBytesPerKb, int kStagesT>
struct TileStream {
  static constexpr int kStages = kStagesT;
  static constexpr int kChunkKb = 8;
  static constexpr int kChunkBytes = kChunkKb * kBytesPerKb;
  static constexpr int kRowStride = kChunkBytes + (kBytesPerKb == 32 ? 32 : 16);
  static constexpr int kStageBytes = 16 * kRowStride;
  static constexpr int kWarpBytes = kStages * kStageBytes;
  static constexpr int kPiecesPerRow = kChunkBytes / 16;
  static constexpr int kPiecesPerLane = 16 * kPiecesPerRow / 32;

  // Copies K blocks [kb, kb + nkb) (nkb <= 8) of the tile's 16 rows into stage buffer dst.
  __device__ __forceinline__ static void issue(uint8_t* dst, const uint8_t* tile, size_t row_bytes,
                                               int kb, int nkb, int lane) {
#pragma unroll
    for (int i = 0; i < kPiecesPerLane; ++i) {
      const int q = lane + 32 * i, row = q / kPiecesPerRow, col = q % kPiecesPerRow;
      if (col * 16 < nkb * kBytesPerKb) {
        const uint32_t d = uint32_t(__cvta_generic_to_shared(dst + row * kRowStride + col * 16));
        const uint8_t* src = tile + row * row_bytes + size_t(kb) * kBytesPerKb + col * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
      }
    }
  }
};

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
// A 16-byte cp.async to shared address dst; !valid zero-fills it (source size 0).
__device__ __forceinline__ void cp16_zfill(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// Items first, first + stride, .. < n through load(i) -> store(i, v), every load of a batch of
// kBatch issued before the batch's first store: one memory round trip a batch, where a plain loop
// of dependent load / store pairs pays one a trip (the compiler does not pipeline it). Used by the
// decode MoE kernels' prologues after their PDL wait (session 18: the 7-row routed experts alone
// 61.5 -> 60.2 us; the step unchanged, its first use of the data still waits one round trip).
template <int kBatch, typename T, typename Load, typename Store>
__device__ __forceinline__ void batched_copy(int n, int first, int stride, Load&& load,
                                             Store&& store) {
  for (int i0 = first; i0 < n; i0 += kBatch * stride) {
    T v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + j * stride;
      v[j] = i < n ? load(i) : T{};
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + j * stride;
      if (i < n) store(i, v[j]);
    }
  }
}

// Four 8 x 8 b16 matrices from shared memory (lane l gives the row address of matrix l / 8).
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The same, each matrix transposed (lane l of matrix i gets its elements (2 (l % 4), l / 4) and
// (2 (l % 4) + 1, l / 4)): a row-major [k][n] tile as the mma's A or B fragment along k.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Two 8 x 8 b16 matrices (lanes 0..15 give the row addresses).
__device__ __forceinline__ void ldsm_x2(uint32_t addr, uint32_t (&r)[2]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// ---- Thread-block clusters (sm_90+) ----
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
// Shared address `addr` (this CTA's window) in the window of cluster rank `cta`. A CTA's window is
// contiguous: map once, then add offsets.
__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, uint32_t cta) {
  uint32_t remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(cta));
  return remote;
}
// The two halves of a cluster barrier, for work between them: arrive relaxed early (what it
// publishes is fenced separately, e.g. by fence_mbarrier_init), wait where the other CTAs' state
// is needed.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
}

// ---- mbarriers fed by remote stores (sm_90+) ----
// A one-arrival mbarrier at shared address `bar` whose phase 0 completes when `bytes` of st.async
// have landed in this CTA (the arrival is made here, with the byte count it expects). Then
// fence_mbarrier_init and a cluster barrier before any remote CTA stores against it.
__device__ __forceinline__ void mbarrier_init_expect(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "mbarrier.init.shared::cta.b64 [%0], 1;\n\t"
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
      "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Spins until phase `parity` of the mbarrier at `bar` completes; the stores it counted are then
// visible to this thread.
__device__ __forceinline__ void mbarrier_wait_cluster(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "wait_%=:\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra wait_%=;\n\t}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// 16 bytes to shared::cluster address `dst` (another CTA's, from cluster_map), counted against
// the mbarrier at shared::cluster address `bar` in that same CTA. Fire and forget.
__device__ __forceinline__ void st_async_f32x4(uint32_t dst, float4 v, uint32_t bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(dst),
      "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
      : "memory");
}

// Host: every decode kernel asks for the largest shared-memory carve-out, so that consecutive
// kernels never make an SM drain to switch its L1 / shared-memory split.
template <typename Kernel>
void prefer_shared_carveout(Kernel kernel) {
  UF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     int(cudaSharedmemCarveoutMaxShared)));
}

// Host: "configure this kernel once" for attributes (cudaFuncSetAttribute), which belong to the
// CURRENT device's context: once per device, not per process. A process-wide once configures only
// the first GPU to get there, and a tensor-parallel rank on any other GPU then launches with the
// 48 KB default and fails (cudaErrorInvalidValue; seen at TP 4 with the real head_dim). Use:
//   static PerDeviceOnce once;
//   once([&] { raise_smem(kernel, bytes); });
class PerDeviceOnce {
 public:
  static constexpr int kMaxDevices = 64;
  template <typename F>
  void operator()(F&& configure) {
    int dev = 0;
    UF_CUDA_CHECK(cudaGetDevice(&dev));
    require(dev >= 0 && dev < kMaxDevices, "PerDeviceOnce: device %d beyond %d", dev, kMaxDevices);
    std::call_once(flags_[dev], std::forward<F>(configure));
  }

 private:
  std::once_flag flags_[kMaxDevices];
};

// Raises a kernel's dynamic shared-memory limit, never lowers it: the attribute belongs to the
// kernel, and an MoeFp4 of a smaller shape must not invalidate the launches of a larger one.
template <typename Kernel>
void raise_smem(Kernel kernel, int bytes) {
  cudaFuncAttributes fa{};
  UF_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
  if (fa.maxDynamicSharedSizeBytes < bytes)
    UF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// Host: launch with programmatic stream serialization (PDL) allowed, plus `extra` (null: none),
// e.g. an L2 access-policy window (kernels/l2_window.h).
template <typename Kernel, typename... Args>
void launch_pdl_with(const cudaLaunchAttribute* extra, Kernel kernel, dim3 grid, dim3 block,
                     size_t smem, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (extra) attr[1] = *extra;
  cfg.attrs = attr;
  cfg.numAttrs = extra ? 2 : 1;
  UF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}
template <typename Kernel, typename... Args>
void launch_pdl(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args... args) {
  launch_pdl_with(nullptr, kernel, grid, block, smem, stream, args...);
}

}  // namespace uf::cuda::detail
