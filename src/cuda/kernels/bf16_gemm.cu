// The prefill GEMM on dequantised bf16 operands (cuda/prefill_gemm.h: why, and what it
// guarantees), its activation QDQ and the weight's bf16 copy.
//
// Shapes: out [m, n] fp32 = a [m, k] bf16 x w [n, k]^T bf16 (both K-contiguous), k % 32 == 0,
// n % 16 == 0, any m >= 1.
//
// Tiling
//   A CTA computes BM activation rows x 128 weight rows: TileSmall (BM 64, 4 warps of 32 x 64,
//   72 KB, three CTAs an SM) or TileLarge (BM 128, 8 warps of 64 x 32, 96 KB, two an SM; where
//   its grid fills the SMs twice). A warp's tile is WM / 16 x WN / 8 mma.sync m16n8k16 bf16 (fp32
//   accumulate) per k16 step. K is walked in 64-wide tiles through a 3-stage cp.async pipeline;
//   a stage holds A [BM][64] and W [128][64] bf16, rows of 128 bytes whose 16-byte chunks are
//   XOR-swizzled by row % 8 (chunk c of row r stored at c ^ (r & 7)), so an ldmatrix of 8 rows at
//   one chunk reads 8 distinct bank groups. Fragments come from ldmatrix.x4: A's four 8 x 8
//   matrices (rows 0-7 / 8-15 at k 0-7, then at k 8-15) are the mma's a0..a3; W's (n 0-7 at k
//   lo, n 0-7 at k hi, n 8-15 at k lo, n 8-15 at k hi) are b0, b1 of two n8 tiles. Rows past m or
//   n and K past the split's end are zero-filled (cp.async src-size 0): they add exact zeros and
//   are never stored. The tile shape changes which thread holds an output, never its operations.
// Split K (bf16_gemm_splits, a function of n and k): grid (m tiles, n tiles, S) in clusters of
//   (1, 1, S). CTA s walks the K tiles of split s; then every CTA stores its fp32 tile in its own
//   shared memory, and after a cluster barrier CTA r adds float4s [r * Q / S, (r + 1) * Q / S) of
//   the S tiles (Q = BM * 128 / 4) in split order (distributed shared memory reads, explicit fadd),
//   rounds them to bf16 when asked and stores them; a second barrier keeps every CTA's shared
//   memory alive until the others have read it.
// Order of an output's sum: within a split, the mma's k16 steps in K order (the tensor core's
//   own sum of 16 exact products into the fp32 accumulator), then the splits in order. Nothing
//   depends on m or on the other rows.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/elementwise_common.cuh"
#include "cuda/prefill_gemm.h"

namespace uf::cuda {
namespace {

using namespace detail;

constexpr int kBN = 128;  // weight rows (outputs) a CTA: both tile shapes (the split plan's unit)
constexpr int kBK = 64;   // K a pipeline stage
constexpr int kStages = 3;
constexpr int kRowBytes = kBK * 2;
constexpr int kMaxSplits = 8;  // portable cluster size
constexpr int kMinKTilesPerSplit = 8;
// The split plan aims at column tiles x splits >= kSplitTarget: 32 (a 512-row call's 8 row tiles
// give 256 CTAs) measured 61.33 / 61.35 ms a 512-row chunk against 61.66 / 61.89 with 16 and
// 62.24 / 62.47 with 48 (H200, same run). A build-time knob for A/B tests
// (scripts/build-variant).
#ifndef UF_BF16_SPLIT_TARGET
#define UF_BF16_SPLIT_TARGET 32
#endif
constexpr int kSplitTarget = UF_BF16_SPLIT_TARGET;

// A CTA's tile: BM activation rows x kBN weight rows, warps of WM x WN (WM / 16 m16 tiles, WN / 8
// n8 tiles each). Every shape gives every output the same operations in the same order (one
// thread's accumulator, the k16 steps of its split in K order), so the shape is chosen per call.
template <int BM_, int WM_, int WN_, int kMinBlocks_>
struct Tile {
  static constexpr int BM = BM_, WM = WM_, WN = WN_, kMinBlocks = kMinBlocks_;
  static constexpr int kWarpsM = BM / WM, kWarpsN = kBN / WN;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kMi = WM / 16, kNj = WN / 8;
  static constexpr int kABytes = BM * kRowBytes, kWBytes = kBN * kRowBytes;
  static constexpr int kStageBytes = kABytes + kWBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static constexpr int kTilePitch = kBN + 4;  // floats a row of the fp32 tile of the split sum
  static_assert(BM * kTilePitch * 4 <= kSmemBytes, "the split sum's tile fits the stages");
  static_assert(kNj % 2 == 0 && (BM * 8) % kThreads == 0 && (kBN * 8) % kThreads == 0, "shape");
};
// 64 x 128, 4 warps of 32 x 64, 72 KB: three CTAs an SM (small grids: split K fills the GPU).
using TileSmall = Tile<64, 32, 64, 3>;
// 128 x 128, 8 warps of 64 x 32, 96 KB: two CTAs an SM, each weight tile read once per 128 rows.
using TileLarge = Tile<128, 64, 32, 2>;

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile.
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return uint32_t(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Rows row0 .. row0 + kRows - 1 of src (ld elements apart) at K tile kk, 8 chunks of 8 values a
// row, into a swizzled stage at dst: chunk q of the kRows * 8 on thread q % kThreads. Rows >= nrows
// and K >= kend are zero-filled; kend is a multiple of 32, so a chunk is wholly inside or outside.
template <int kRows, int kThreads>
__device__ __forceinline__ void load_rows(uint32_t dst, const uint16_t* src, int row0, int nrows,
                                          int ld, int kk, int kend, int tid) {
#pragma unroll
  for (int i = 0; i < kRows * 8 / kThreads; ++i) {
    const int q = tid + i * kThreads, r = q >> 3, c = q & 7;
    const int gr = row0 + r, gk = kk + c * 8;
    const bool v = gr < nrows && gk < kend;
    cp16_zfill(dst + swz(r, c), v ? src + size_t(gr) * ld + gk : src, v);
  }
}

struct Bf16GemmParams {
  const uint16_t* a;
  const uint16_t* w;
  float* out;
  int m, n, k;
  int kps;  // K a split (a multiple of kBK)
  int ldo;  // out's row stride (floats)
  int round;
  int vec_out;  // out 16-byte aligned: vector stores
};

__device__ __forceinline__ float maybe_round(float v, bool round) {
  return round ? round_bf16(v) : v;
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    bf16_gemm_kernel(const Bf16GemmParams p) {
  constexpr int kBM = C::BM, kThreads = C::kThreads, kABytes = C::kABytes;
  constexpr int kStageBytes = C::kStageBytes, kTilePitch = C::kTilePitch;
  constexpr int kMi = C::kMi, kNj = C::kNj;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t sbase = uint32_t(__cvta_generic_to_shared(smem));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % C::kWarpsM, wn = warp / C::kWarpsM;
  const int m0 = blockIdx.x * kBM, n0 = blockIdx.y * kBN;
  const int S = gridDim.z;
  const int kbeg = blockIdx.z * p.kps, kend = min(p.k, kbeg + p.kps);
  const int ntiles = kend > kbeg ? (kend - kbeg + kBK - 1) / kBK : 0;
  pdl_wait();     // a is the previous kernel's output
  pdl_trigger();  // the next kernel may launch (it waits for this one's end before reading)

  // One K tile into a stage: A's BM rows and W's 128, 8 chunks of 16 bytes each.
  auto load = [&](int stage, int kt) {
    const int kk = kbeg + kt * kBK;
    const uint32_t sa = sbase + uint32_t(stage * kStageBytes);
    load_rows<kBM, kThreads>(sa, p.a, m0, p.m, p.k, kk, kend, tid);
    load_rows<kBN, kThreads>(sa + kABytes, p.w, n0, p.n, p.k, kk, kend, tid);
  };

  float acc[kMi][kNj][4];
#pragma unroll
  for (int i = 0; i < kMi; ++i)
#pragma unroll
    for (int j = 0; j < kNj; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ntiles) load(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ntiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile kt landed for all; every warp is done with tile kt - 1's stage
    if (kt + kStages - 1 < ntiles) load((kt + kStages - 1) % kStages, kt + kStages - 1);
    cp_async_commit();
    const uint32_t sa = sbase + uint32_t((kt % kStages) * kStageBytes), sw = sa + kABytes;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t af[kMi][4], bfr[kNj / 2][4];
#pragma unroll
      for (int i = 0; i < kMi; ++i)
        ldsm_x4(sa + swz(wm * C::WM + i * 16 + (lane & 15), ks * 2 + (lane >> 4)), af[i]);
#pragma unroll
      for (int j = 0; j < kNj / 2; ++j)
        ldsm_x4(sw + swz(wn * C::WN + j * 16 + (lane & 7) + ((lane >> 4) << 3),
                         ks * 2 + ((lane >> 3) & 1)),
                bfr[j]);
#pragma unroll
      for (int i = 0; i < kMi; ++i)
#pragma unroll
        for (int j = 0; j < kNj; ++j)
          mma_bf16(acc[i][j], af[i][0], af[i][1], af[i][2], af[i][3], bfr[j >> 1][(j & 1) * 2],
                   bfr[j >> 1][(j & 1) * 2 + 1]);
    }
  }
  cp_async_wait<0>();

  const int g = lane >> 2, t = lane & 3;
  if (S == 1) {
#pragma unroll
    for (int i = 0; i < kMi; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = m0 + wm * C::WM + i * 16 + g + 8 * h;
        if (r >= p.m) continue;
#pragma unroll
        for (int j = 0; j < kNj; ++j) {
          const int c = n0 + wn * C::WN + j * 8 + 2 * t;
          if (c < p.n) {
            float* o = p.out + size_t(r) * p.ldo + c;
            const float v0 = maybe_round(acc[i][j][2 * h], p.round);
            const float v1 = maybe_round(acc[i][j][2 * h + 1], p.round);
            if (p.vec_out) {
              *reinterpret_cast<float2*>(o) = make_float2(v0, v1);
            } else {
              o[0] = v0;
              o[1] = v1;
            }
          }
        }
      }
    return;
  }

  // Split K: this CTA's fp32 tile into its shared memory, then the cluster's sum in split order.
  __syncthreads();  // every warp is done with the stages
  float* tile = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < kMi; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < kNj; ++j) {
        const int r = wm * C::WM + i * 16 + g + 8 * h, c = wn * C::WN + j * 8 + 2 * t;
        *reinterpret_cast<float2*>(tile + r * kTilePitch + c) =
            make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
      }
  cluster_barrier();
  const int rank = int(cluster_ctarank());
  constexpr int kQuads = kBM * kBN / 4;
  const int q0 = rank * kQuads / S, q1 = (rank + 1) * kQuads / S;
  for (int q = q0 + tid; q < q1; q += kThreads) {
    const int r = q / (kBN / 4), c = (q % (kBN / 4)) * 4;
    if (m0 + r >= p.m || n0 + c >= p.n) continue;
    const uint32_t local = sbase + uint32_t((r * kTilePitch + c) * 4);
    float4 v = ld_cluster_f4(cluster_map(local, 0));
    for (int s = 1; s < S; ++s) {
      const float4 u = ld_cluster_f4(cluster_map(local, uint32_t(s)));
      v.x = ew::fadd(v.x, u.x);
      v.y = ew::fadd(v.y, u.y);
      v.z = ew::fadd(v.z, u.z);
      v.w = ew::fadd(v.w, u.w);
    }
    const bool rd = p.round != 0;
    const float4 o4 = make_float4(maybe_round(v.x, rd), maybe_round(v.y, rd), maybe_round(v.z, rd),
                                  maybe_round(v.w, rd));
    float* o = p.out + size_t(m0 + r) * p.ldo + n0 + c;
    if (p.vec_out) {
      *reinterpret_cast<float4*>(o) = o4;
    } else {
      o[0] = o4.x;
      o[1] = o4.y;
      o[2] = o4.z;
      o[3] = o4.w;
    }
  }
  cluster_barrier();  // no CTA leaves while another may still read its tile
}

// The bf16 bits of an FP8 QDQ value: the code's value (ew::e4m3_to_f32, core's decoder) times its
// power-of-two scale, exact in bf16.
__device__ __forceinline__ uint32_t qdq_bf16_bits(uint8_t code, float s) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(ew::e4m3_to_f32(code) * s));
}

// act_quant_rows_kernel's quantisation (fp8_gemm.cu: one warp per (row, 32-block)), stored as the
// dequantised value.
__global__ void __launch_bounds__(256)
    act_qdq_bf16_kernel(const float* x, long long x_stride, int m, int k, uint16_t* out) {
  pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  pdl_trigger();
  const int nkb = k / 32;
  const long long item = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (item >= (long long)m * nkb) return;  // warp-uniform
  const int row = int(item / nkb), kb = int(item % nkb), lane = threadIdx.x & 31;
  const float v = x[size_t(row) * size_t(x_stride) + size_t(kb) * 32 + lane];
  float s;
  const uint8_t code = warp_quant_fp8_block(v, &s);
  out[size_t(row) * k + size_t(kb) * 32 + lane] = uint16_t(qdq_bf16_bits(code, s));
}

// The same values, 4 blocks a warp with 16-byte loads (k % 128 == 0, 16-byte aligned rows): lane
// l holds elements 4 l .. 4 l + 3 of the warp's 128, block l / 8; the block's amax is the max over
// its 8 lanes (a max is exact in any order), then warp_quant_fp8_block's scale and conversion.
__global__ void __launch_bounds__(256)
    act_qdq_bf16_vec_kernel(const float* x, long long x_stride, int m, int k, uint16_t* out) {
  pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  pdl_trigger();
  const int nq = k / 128;
  const long long item = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (item >= (long long)m * nq) return;  // warp-uniform
  const int row = int(item / nq), q = int(item % nq), lane = threadIdx.x & 31;
  const float4 v = *reinterpret_cast<const float4*>(x + size_t(row) * size_t(x_stride) +
                                                    size_t(q) * 128 + lane * 4);
  float a = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  const float s = pow2_scale(fmaxf(a, kActAmaxFloor), kFp8MaxInv), inv = pow2_scale_inv(s);
  auto qdq = [&](float e) { return qdq_bf16_bits(detail::f32_to_e4m3(e * inv), s); };
  *reinterpret_cast<uint2*>(out + size_t(row) * k + size_t(q) * 128 + lane * 4) =
      make_uint2(qdq(v.x) | (qdq(v.y) << 16), qdq(v.z) | (qdq(v.w) << 16));
}

// x's bf16 bits where x is bf16-exact (or NaN), else a NaN (the *Bf16X kinds' contract: a row
// with a value that is not bf16-exact gets NaN outputs, never silently rounded ones).
__device__ __forceinline__ uint32_t bf16_exact_bits(float v) {
  const uint16_t b = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return (__uint_as_float(uint32_t(b) << 16) == v || v != v) ? b : 0x7fc0u;
}
__global__ void bf16_exact_kernel(const float* x, long long x_stride, int m, int k, uint16_t* out) {
  pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  pdl_trigger();
  const long long n = (long long)m * k;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / k, c = i % k;
    out[i] = uint16_t(bf16_exact_bits(x[r * x_stride + c]));
  }
}

// The same, 4 values a thread (k % 4 == 0, 16-byte aligned rows): block (x, row).
__global__ void bf16_exact_vec_kernel(const float* x, long long x_stride, int k, uint16_t* out) {
  pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  pdl_trigger();
  const int r = blockIdx.y, c = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (c >= k) return;
  const float4 v = *reinterpret_cast<const float4*>(x + r * x_stride + c);
  *reinterpret_cast<uint2*>(out + size_t(r) * k + c) =
      make_uint2(bf16_exact_bits(v.x) | (bf16_exact_bits(v.y) << 16),
                 bf16_exact_bits(v.z) | (bf16_exact_bits(v.w) << 16));
}

__global__ void fp8_weight_to_bf16_kernel(DeviceWeight w, uint16_t* out) {
  const int64_t total = w.rows * w.cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(ew::weight_at(w, i / w.cols, i % w.cols)));
}

std::atomic<int> g_force_tile{0};

template <class C>
void launch(const Bf16GemmParams& p, int splits, cudaStream_t stream) {
  static PerDeviceOnce once;
  once([] {
    UF_CUDA_CHECK(cudaFuncSetAttribute(bf16_gemm_kernel<C>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
    prefer_shared_carveout(bf16_gemm_kernel<C>);
  });
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim =
      dim3(unsigned((p.m + C::BM - 1) / C::BM), unsigned((p.n + kBN - 1) / kBN), unsigned(splits));
  cfg.blockDim = dim3(C::kThreads);
  cfg.dynamicSmemBytes = C::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = unsigned(splits);
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 2;
  UF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, bf16_gemm_kernel<C>, p));
}

}  // namespace

int bf16_gemm_splits(int n, int k) {
  const int n_tiles = (n + kBN - 1) / kBN, k_tiles = (k + kBK - 1) / kBK;
  // kSplitTarget column tiles x splits fill the GPU at 8 row tiles (512 rows); a split keeps
  // >= 512 of K.
  const int want = std::max(1, std::min({kMaxSplits, (kSplitTarget + n_tiles - 1) / n_tiles,
                                         k_tiles / kMinKTilesPerSplit}));
  const int tiles_per_split = (k_tiles + want - 1) / want;
  return (k_tiles + tiles_per_split - 1) / tiles_per_split;  // no empty split
}

void bf16_gemm(const uint16_t* a, const uint16_t* w, int m, int n, int k, float* out, int ldo,
               bool round, cudaStream_t stream) {
  require(m >= 1 && n > 0 && n % 16 == 0 && k > 0 && k % 32 == 0,
          "bf16_gemm: m = %d must be >= 1, n = %d a multiple of 16, k = %d a multiple of 32", m, n,
          k);
  require(reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(out) % 4 == 0,
          "bf16_gemm: a and w must be 16-byte aligned, out 4-byte aligned");
  const int splits = bf16_gemm_splits(n, k);
  const int k_tiles = (k + kBK - 1) / kBK;
  const int kps = (k_tiles + splits - 1) / splits * kBK;
  require(ldo >= n, "bf16_gemm: ldo = %d < n = %d", ldo, n);
  const bool vec = reinterpret_cast<uintptr_t>(out) % 16 == 0 && ldo % 4 == 0;
  const Bf16GemmParams p{a, w, out, m, n, k, kps, ldo, round ? 1 : 0, vec ? 1 : 0};
  // The large tile where its grid alone fills the SMs twice (two CTAs an SM), else the small.
  const int n_tiles = (n + kBN - 1) / kBN;
  int force = g_force_tile.load(std::memory_order_relaxed);
  const bool large = force != 0
                         ? force == 2
                         : int64_t((m + TileLarge::BM - 1) / TileLarge::BM) * n_tiles * splits >=
                               2 * int64_t(device_sm_count());
  if (large)
    launch<TileLarge>(p, splits, stream);
  else
    launch<TileSmall>(p, splits, stream);
}

void bf16_gemm_force_tile(int tile) {
  require(tile >= 0 && tile <= 2, "bf16_gemm_force_tile: %d (0 auto, 1 small, 2 large)", tile);
  g_force_tile.store(tile, std::memory_order_relaxed);
}

void act_qdq_fp8_bf16_rows(const float* x, long long x_stride, int m, int k, uint16_t* out,
                           cudaStream_t stream) {
  require(m >= 1 && k > 0 && k % 32 == 0 && x_stride >= k,
          "act_qdq_fp8_bf16_rows: m = %d must be >= 1, k = %d a multiple of 32 and x_stride = "
          "%lld >= k",
          m, k, x_stride);
  if (k % 128 == 0 && x_stride % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(out) % 8 == 0) {
    const long long items = (long long)m * (k / 128);
    launch_pdl(act_qdq_bf16_vec_kernel, dim3(unsigned((items + 7) / 8)), dim3(256), 0, stream, x,
               x_stride, m, k, out);
  } else {
    const long long items = (long long)m * (k / 32);
    launch_pdl(act_qdq_bf16_kernel, dim3(unsigned((items + 7) / 8)), dim3(256), 0, stream, x,
               x_stride, m, k, out);
  }
  UF_CUDA_CHECK(cudaGetLastError());
}

void bf16_exact_rows(const float* x, long long x_stride, int m, int k, uint16_t* out,
                     cudaStream_t stream) {
  require(m >= 1 && k > 0 && x_stride >= k,
          "bf16_exact_rows: m = %d must be >= 1, k = %d > 0 and x_stride = %lld >= k", m, k,
          x_stride);
  if (k % 4 == 0 && x_stride % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(out) % 8 == 0 && m <= 65535) {
    const dim3 grid(unsigned((k / 4 + 255) / 256), unsigned(m));
    launch_pdl(bf16_exact_vec_kernel, grid, dim3(256), 0, stream, x, x_stride, k, out);
  } else {
    const long long n = (long long)m * k;
    const unsigned blocks = unsigned(std::min<long long>((n + 255) / 256, 8192));
    launch_pdl(bf16_exact_kernel, dim3(blocks), dim3(256), 0, stream, x, x_stride, m, k, out);
  }
  UF_CUDA_CHECK(cudaGetLastError());
}

void fp8_weight_to_bf16(const Fp8WeightView& w, uint16_t* out, cudaStream_t stream) {
  require(w.data && w.scale && w.n > 0 && w.k > 0 && w.k % 32 == 0,
          "fp8_weight_to_bf16: an FP8 32x32-block weight with k %% 32 == 0 (n = %d, k = %d)", w.n,
          w.k);
  DeviceWeight d;
  d.format = model::WFormat::kFP8;
  d.rows = w.n;
  d.cols = w.k;
  d.data = w.data;
  d.scale = w.scale;
  const int64_t total = int64_t(w.n) * w.k;
  const unsigned blocks = unsigned(std::min<int64_t>((total + 255) / 256, 4096));
  fp8_weight_to_bf16_kernel<<<blocks, 256, 0, stream>>>(d, out);
  UF_CUDA_CHECK(cudaGetLastError());
}

}  // namespace uf::cuda
