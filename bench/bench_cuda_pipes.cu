// bench_cuda_pipes: the issue rate of the instructions the decode MoE's inner loops are made of,
// in warp instructions per SM per clock (the SM issues at most 4: one per scheduler). The FP4
// expert kernels turn every weight byte into f16 HMMA operands; which instruction family bounds
// them decides how the conversion should be written, so this bench measures each family alone
// and the two ways of turning 8 E2M1 values into 4 f16x2 operands:
//   via e4m3   e2m1x8_to_e4m3_scaled (bit placement into two e4m3x4 registers) + 4 F2FP
//              (cvt.rn.f16x2.e4m3x2): what moe_fp4.cu / moe_prefill.cu do;
//   direct     bit placement straight into f16x2 (sign to bit 15, magnitude bits to 11..9:
//              the value times 2^-14, 0.5 as an f16 subnormal): shifts and LOP3 only.
// Method: one 1024-thread CTA per SM, each thread runs 8 independent chains of the operation
// (latency hidden by 32 warps x 8 chains) for `iters` rounds; thread 0 reads clock64 around the
// loop (after a CTA barrier), so the figure is per SM clock whatever the clock rate. The chains
// feed their results back so nothing is dead code; the feedback adds two logic ops per chain and
// round to the composite rows (the same two to both).
//
//   bench_cuda_pipes [--iters N]

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"

namespace {

constexpr int kThreads = 1024;
constexpr int kChains = 8;

using uf::cuda::detail::e2m1x8_to_e4m3_scaled;

struct F2fp {  // cvt.rn.f16x2.e4m3x2 (F2FP ... UNPACK_B): 1 instruction a chain
  static constexpr int kInstr = 1;
  __device__ static void step(uint32_t& r, uint32_t) {
    asm volatile("{.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, l;}"
                 : "=r"(r)
                 : "r"(r));
  }
};
struct Lop3 {
  static constexpr int kInstr = 1;
  __device__ static void step(uint32_t& r, uint32_t k) {
    asm volatile("lop3.b32 %0, %0, %1, 0x0E000E00, 0xEA;" : "+r"(r) : "r"(k));
  }
};
struct Shf {
  static constexpr int kInstr = 1;
  __device__ static void step(uint32_t& r, uint32_t) {
    asm volatile("shf.l.wrap.b32 %0, %0, %0, 3;" : "+r"(r));
  }
};
struct Prmt {
  static constexpr int kInstr = 1;
  __device__ static void step(uint32_t& r, uint32_t k) {
    asm volatile("prmt.b32 %0, %0, %1, 0x5140;" : "+r"(r) : "r"(k));
  }
};
struct Iadd {
  static constexpr int kInstr = 1;
  __device__ static void step(uint32_t& r, uint32_t k) {
    asm volatile("add.u32 %0, %0, %1;" : "+r"(r) : "r"(k));
  }
};
struct Ffma {
  static constexpr int kInstr = 1;
  __device__ static void step(uint32_t& r, uint32_t k) {
    float f = __uint_as_float(r);
    asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(f) : "f"(__uint_as_float(k)));
    r = __float_as_uint(f);
  }
};
struct Hfma2 {
  static constexpr int kInstr = 1;
  __device__ static void step(uint32_t& r, uint32_t k) {
    asm volatile("fma.rn.f16x2 %0, %0, %1, %1;" : "+r"(r) : "r"(k));
  }
};
struct Bf16Pack {  // cvt.rn.bf16x2.f32 (F2FP.BF16.F32.PACK_AB), the epilogues' rounding
  static constexpr int kInstr = 1;
  __device__ static void step(uint32_t& r, uint32_t k) {
    asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;"
                 : "=r"(r)
                 : "f"(__uint_as_float(r)), "f"(__uint_as_float(k)));
  }
};
struct Hmma {  // mma.m16n8k16 f16 -> f32: per chain one HMMA.16816.F32
  static constexpr int kInstr = 1;
};

// 8 E2M1 -> 4 f16x2 through e4m3 (the kernels' way), plus one LOP3 feeding the outputs back.
__device__ __forceinline__ uint32_t via_e4m3(uint32_t q) {
  uint32_t lo, hi, r[4];
  e2m1x8_to_e4m3_scaled(q, lo, hi);
  asm volatile(
      "{.reg .b16 a, b, c, d;\n\tmov.b32 {a, b}, %4;\n\tmov.b32 {c, d}, %5;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, a;\n\tcvt.rn.f16x2.e4m3x2 %1, b;\n\t"
      "cvt.rn.f16x2.e4m3x2 %2, c;\n\tcvt.rn.f16x2.e4m3x2 %3, d;}"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(lo), "r"(hi));
  uint32_t x;
  asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(x) : "r"(r[0] ^ r[1]), "r"(r[2]), "r"(r[3]));
  return x;
}
// 8 E2M1 -> 4 f16x2 by bit placement only: nibble n (bits 4n..4n+3) and nibble n + 4 go to the
// low and high halves of output n; sign to bit 15 / 31, magnitude to bits 11..9 / 27..25.
__device__ __forceinline__ uint32_t direct_f16(uint32_t q) {
  uint32_t r[4];
  r[3] = (q & 0x80008000u) | ((q >> 3) & 0x0E000E00u);
  r[2] = ((q << 4) & 0x80008000u) | ((q << 1) & 0x0E000E00u);
  r[1] = ((q << 8) & 0x80008000u) | ((q << 5) & 0x0E000E00u);
  r[0] = ((q << 12) & 0x80008000u) | ((q << 9) & 0x0E000E00u);
  uint32_t x;
  asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(x) : "r"(r[0] ^ r[1]), "r"(r[2]), "r"(r[3]));
  return x;
}
struct ViaE4m3 {
  static constexpr int kInstr = 4;  // f16x2 outputs a round
  __device__ static void step(uint32_t& r, uint32_t k) { r = via_e4m3(r ^ k); }
};
struct Direct {
  static constexpr int kInstr = 4;
  __device__ static void step(uint32_t& r, uint32_t k) { r = direct_f16(r ^ k); }
};

template <typename Op>
__global__ void __launch_bounds__(kThreads, 1)
    pipe_kernel(uint32_t seed, int iters, uint32_t* sink, long long* cycles) {
  uint32_t r[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) r[c] = seed * (threadIdx.x + 7 * c + 1);
  const uint32_t k = seed | 1u;
  __syncthreads();
  const long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) Op::step(r[c], k);
  }
  __syncthreads();
  const long long t1 = clock64();
  uint32_t x = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) x ^= r[c];
  if (x == 0x12345678u) sink[0] = x;  // practically never: keeps the chains live
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <>
__global__ void __launch_bounds__(kThreads, 1) pipe_kernel<Hmma>(uint32_t seed, int iters,
                                                                 uint32_t* sink,
                                                                 long long* cycles) {
  float d[kChains][4];
  const uint32_t a = seed * (threadIdx.x + 1), b = seed ^ threadIdx.x;
#pragma unroll
  for (int c = 0; c < kChains; ++c) d[c][0] = d[c][1] = d[c][2] = d[c][3] = float(c);
  __syncthreads();
  const long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, "
          "{%5,%5}, {%0,%1,%2,%3};"
          : "+f"(d[c][0]), "+f"(d[c][1]), "+f"(d[c][2]), "+f"(d[c][3])
          : "r"(a), "r"(b));
  }
  __syncthreads();
  const long long t1 = clock64();
  float x = 0.f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) x += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  if (x == 1234.5f) sink[0] = 1u;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

// Warp instructions (or f16x2 outputs) per SM per clock: the median over the CTAs.
template <typename Op>
double rate(int sms, int iters, uint32_t* sink, long long* cycles) {
  pipe_kernel<Op><<<sms, kThreads>>>(0x9E3779B9u, iters, sink, cycles);  // warm-up
  pipe_kernel<Op><<<sms, kThreads>>>(0x85EBCA6Bu, iters, sink, cycles);
  UF_CUDA_CHECK(cudaGetLastError());
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<long long> c(static_cast<size_t>(sms));
  UF_CUDA_CHECK(cudaMemcpy(c.data(), cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  std::sort(c.begin(), c.end());
  const double warp_ops = double(kThreads / 32) * iters * kChains * Op::kInstr;
  return warp_ops / double(c[c.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 4096;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
  cudaDeviceProp prop;
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  uint32_t* sink;
  long long* cycles;
  UF_CUDA_CHECK(cudaMalloc(&sink, 4));
  UF_CUDA_CHECK(cudaMalloc(&cycles, size_t(sms) * sizeof(long long)));
  std::printf("device: %s, %d SMs; warp instructions per SM per clock (issue limit 4)\n", prop.name,
              sms);
  struct Row {
    const char* name;
    double v;
  };
  const Row rows[] = {
      {"F2FP cvt.rn.f16x2.e4m3x2", rate<F2fp>(sms, iters, sink, cycles)},
      {"F2FP cvt.rn.bf16x2.f32", rate<Bf16Pack>(sms, iters, sink, cycles)},
      {"LOP3", rate<Lop3>(sms, iters, sink, cycles)},
      {"SHF", rate<Shf>(sms, iters, sink, cycles)},
      {"PRMT", rate<Prmt>(sms, iters, sink, cycles)},
      {"IADD", rate<Iadd>(sms, iters, sink, cycles)},
      {"FFMA", rate<Ffma>(sms, iters, sink, cycles)},
      {"HFMA2", rate<Hfma2>(sms, iters, sink, cycles)},
      {"HMMA.16816.F32", rate<Hmma>(sms, iters, sink, cycles)},
  };
  for (const Row& r : rows) std::printf("  %-28s %6.3f\n", r.name, r.v);
  std::printf("8 E2M1 -> 4 f16x2 operands, f16x2 outputs per SM per clock (+2 feedback ops):\n");
  std::printf("  %-28s %6.3f\n", "via e4m3 + F2FP", rate<ViaE4m3>(sms, iters, sink, cycles));
  std::printf("  %-28s %6.3f\n", "direct bit placement", rate<Direct>(sms, iters, sink, cycles));
  UF_CUDA_CHECK(cudaFree(sink));
  UF_CUDA_CHECK(cudaFree(cycles));
  return 0;
}
