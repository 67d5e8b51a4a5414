// DeviceEngram (ops/engram.h): cpu::engram_forward on the device, by chunks of kChunkRows rows.
// A decode step (<= 8 rows) is one chunk and its projection the FP8 GEMV; a prefill chunk's
// projection takes the prefill GEMM (DeviceLinear: bitwise the GEMV's results): the projection
// [(hc + 1) dim, n_cols head_dim] is the largest FP8 weight of the model (157 MB), and re-reading
// it every 8 rows made the two Engram layers ~7% of a 512-row prefill chunk.
//
// Per chunk: gather_kernel dequantises the hashed table rows (FP8 with per-row E8M0 scales, or
// BF16 / F32) to bf16 values (a row-split table: the rows this rank holds, +0 for the others,
// then the caller's reduce sums the ranks); DeviceLinear(wkv) projects them (the CPU's linear()
// dispatch); gate_kernel (one block per (row, hc copy)) computes the copy's gate with the CPU's
// exact fp32 order (dot8 partial sums for |h|^2, |k|^2 and the weighted dot, threads 0..7 =
// partials 0..7) and writes out = bf16(h + gate * value). expf may differ from glibc by an ulp.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/gemv.h"
#include "cuda/kernels/common.cuh"
#include "cuda/ops/elementwise_common.cuh"
#include "cuda/ops/engram.h"

namespace uf::cuda {

namespace {

// Rows per chunk: the gathered rows and the projection's output of one chunk are this object's
// scratch (128 rows: 3 + 13 MB at the released dims); the GEMM runs at ~130 TFLOP/s from 64 rows.
constexpr int kChunkRows = 128;

// e[t, c * head_dim + i] = bf16(table[ids[t, c], i]). grid (m * n_cols), block 128. The object
// holds global rows [row_begin, row_begin + table.rows) of rows_total; other rows of the table
// give +0 (another rank holds them). An id outside the table writes NaN (the CPU throws; a
// device kernel cannot, so the error shows downstream).
__global__ void gather_kernel(DeviceWeight table, int64_t row_begin, int64_t rows_total,
                              const int64_t* ids, int n_cols, int head_dim, float* e) {
  detail::pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  detail::pdl_trigger();
  const int item = blockIdx.x;  // t * n_cols + c
  const int64_t row = ids[item];
  float* dst = e + int64_t(item) * head_dim;
  const bool ok = row >= 0 && row < rows_total;
  const int64_t local = row - row_begin;
  const bool mine = ok && local >= 0 && local < table.rows;
  for (int i = threadIdx.x; i < head_dim; i += blockDim.x)
    dst[i] = mine ? detail::round_bf16(ew::weight_at(table, local, i))
                  : (ok ? 0.0f : __uint_as_float(0x7fc00000u));
}

// One block per (t, copy c): X [m, hc, D], kv [m, (hc + 1) * D], wt [hc, D] = q_weight * k_weight.
// The three dot8 chains (threads 0..7, element d on chain d % 8, in increasing d) are the CPU's
// serial order, so they cannot be split; what made them slow (100 us a call at D = 5120) was each
// step waiting on three strided global loads. The block now stages h, k and w by chunks of
// kGateChunk elements in shared memory with coalesced 16-byte loads, and the chains walk the
// chunk from there: the same operations in the same order, so the same bits.
constexpr int kGateThreads = 256;
constexpr int kGateChunk = 1024;

__global__ void __launch_bounds__(kGateThreads)
    gate_kernel(const float* X, const float* kv, const float* wt, int hc, int D, float eps,
                float dim_scale, float* out) {
  detail::pdl_wait();  // PDL-launched: the previous kernel's outputs are read below
  detail::pdl_trigger();
  __shared__ float4 sh[kGateChunk / 4], sk[kGateChunk / 4], sw[kGateChunk / 4];
  __shared__ float s_hh[8], s_kk[8], s_hk[8];
  __shared__ float s_gate;
  const int t = blockIdx.x / hc, c = blockIdx.x % hc, tid = threadIdx.x;
  const float* h = X + (int64_t(t) * hc + c) * D;
  const float* key = kv + int64_t(t) * (hc + 1) * D;
  const float* k = key + int64_t(c) * D;
  const float* value = key + int64_t(hc) * D;
  const float* w = wt + int64_t(c) * D;
  // 16-byte staging needs D % 4 == 0 and aligned rows (true for the model: D = 5120 and
  // cudaMalloc'd buffers); anything else stages element by element.
  const bool vec = D % 4 == 0 && ((reinterpret_cast<uintptr_t>(h) | reinterpret_cast<uintptr_t>(k) |
                                   reinterpret_cast<uintptr_t>(w)) &
                                  15) == 0;
  float hh = 0.f, kk = 0.f, hk = 0.f;
  for (int d0 = 0; d0 < D; d0 += kGateChunk) {
    const int n = min(kGateChunk, D - d0);
    if (vec) {
      for (int i = tid; i < n / 4; i += kGateThreads) {
        sh[i] = reinterpret_cast<const float4*>(h + d0)[i];
        sk[i] = reinterpret_cast<const float4*>(k + d0)[i];
        sw[i] = reinterpret_cast<const float4*>(w + d0)[i];
      }
    } else {
      for (int i = tid; i < n; i += kGateThreads) {
        reinterpret_cast<float*>(sh)[i] = h[d0 + i];
        reinterpret_cast<float*>(sk)[i] = k[d0 + i];
        reinterpret_cast<float*>(sw)[i] = w[d0 + i];
      }
    }
    __syncthreads();
    if (tid < 8) {
      const float* ph = reinterpret_cast<const float*>(sh);
      const float* pk = reinterpret_cast<const float*>(sk);
      const float* pw = reinterpret_cast<const float*>(sw);
      // d0 % 8 == 0, so chain tid takes the chunk's elements tid, tid + 8, ... as before.
#pragma unroll 8
      for (int i = tid; i < n; i += 8) {
        hh = __fadd_rn(hh, __fmul_rn(ph[i], ph[i]));
        kk = __fadd_rn(kk, __fmul_rn(pk[i], pk[i]));
        hk = __fadd_rn(hk, __fmul_rn(__fmul_rn(ph[i], pw[i]), pk[i]));
      }
    }
    __syncthreads();
  }
  if (tid < 8) {
    s_hh[tid] = hh;
    s_kk[tid] = kk;
    s_hk[tid] = hk;
  }
  __syncthreads();
  if (tid == 0) {
    auto tree = [](const float* s) {
      return __fadd_rn(__fadd_rn(__fadd_rn(s[0], s[1]), __fadd_rn(s[2], s[3])),
                       __fadd_rn(__fadd_rn(s[4], s[5]), __fadd_rn(s[6], s[7])));
    };
    const float fd = float(D);
    const float rstd =
        __fmul_rn(__fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(tree(s_hh), fd), eps))),
                  __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(tree(s_kk), fd), eps))));
    const float dot = __fmul_rn(__fmul_rn(tree(s_hk), rstd), dim_scale);
    const float mag = __fsqrt_rn(fmaxf(fabsf(dot), 1e-6f));
    s_gate = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-copysignf(mag, dot))));
  }
  __syncthreads();
  const float gate = s_gate;
  float* o = out + (int64_t(t) * hc + c) * D;
  // Each element is read (h) and written (o) by the same thread: out may alias X.
  for (int d = tid; d < D; d += blockDim.x)
    o[d] = detail::round_bf16(__fadd_rn(h[d], __fmul_rn(gate, value[d])));
}

}  // namespace

struct DeviceEngram::Impl {
  EngramShape s;
  DeviceWeight table;
  DeviceLinear wkv;
  float* wt = nullptr;  // [hc, D]
  float dim_scale = 0;
  float* e = nullptr;   // [8, n_cols * head_dim]
  float* kv = nullptr;  // [8, (hc + 1) * D]
};

DeviceEngram::DeviceEngram(const model::EngramWeights& w, const EngramShape& shape,
                           DeviceArena& arena)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.s = shape;
  const int hc = shape.hc, D = shape.dim, K = shape.n_cols * shape.head_dim;
  require(hc > 0 && D > 0 && shape.n_cols > 0 && shape.head_dim > 0,
          "DeviceEngram: empty shape (hc %d, dim %d, n_cols %d, head_dim %d)", hc, D, shape.n_cols,
          shape.head_dim);
  require(w.table.cols == shape.head_dim && !w.table.empty(),
          "DeviceEngram: table '%s' has %lld columns, expected head_dim %d", w.table.name.c_str(),
          static_cast<long long>(w.table.cols), shape.head_dim);
  require(w.wkv.cols == K && w.wkv.rows == int64_t(hc + 1) * D,
          "DeviceEngram: wkv '%s' is [%lld, %lld], expected [%d, %d]", w.wkv.name.c_str(),
          static_cast<long long>(w.wkv.rows), static_cast<long long>(w.wkv.cols), (hc + 1) * D, K);
  if (m.s.rows_total == 0) m.s.rows_total = w.table.rows;
  require(m.s.row_begin >= 0 && m.s.row_begin + w.table.rows <= m.s.rows_total,
          "DeviceEngram: table '%s' slice [%lld, %lld) outside a table of %lld rows",
          w.table.name.c_str(), static_cast<long long>(m.s.row_begin),
          static_cast<long long>(m.s.row_begin + w.table.rows),
          static_cast<long long>(m.s.rows_total));
  m.table = upload_weight(w.table, arena);
  m.wkv = DeviceLinear(w.wkv, LinearKind::kAuto, arena, kChunkRows);
  const std::vector<float> qw = w.q_weight.to_vector(), kw = w.k_weight.to_vector();
  require(qw.size() == size_t(hc) * D && kw.size() == size_t(hc) * D,
          "DeviceEngram: q_weight / k_weight have %zu / %zu values, expected %d", qw.size(),
          kw.size(), hc * D);
  std::vector<float> wt(qw.size());
  for (size_t i = 0; i < wt.size(); ++i) wt[i] = qw[i] * kw[i];
  m.wt = arena.upload(wt);
  m.dim_scale = float(std::pow(double(D), -0.5));
  m.e = arena.alloc<float>(size_t(kChunkRows) * K);
  m.kv = arena.alloc<float>(size_t(kChunkRows) * (hc + 1) * D);
}

DeviceEngram::~DeviceEngram() = default;
DeviceEngram::DeviceEngram(DeviceEngram&&) noexcept = default;
DeviceEngram& DeviceEngram::operator=(DeviceEngram&&) noexcept = default;

bool DeviceEngram::split() const { return impl_->table.rows != impl_->s.rows_total; }

int64_t DeviceEngram::gathered_floats_per_row() const {
  return int64_t(impl_->s.n_cols) * impl_->s.head_dim;
}

void DeviceEngram::apply(const int64_t* ids, const float* X, int T, float* out, cudaStream_t stream,
                         const RowReduce& reduce) const {
  const Impl& m = *impl_;
  const int hc = m.s.hc, D = m.s.dim;
  require(split() == bool(reduce),
          "DeviceEngram: a %s table %s a cross-rank reduce (rows [%lld, %lld) of %lld)",
          split() ? "row-split" : "whole", split() ? "needs" : "must not get",
          static_cast<long long>(m.s.row_begin),
          static_cast<long long>(m.s.row_begin + m.table.rows),
          static_cast<long long>(m.s.rows_total));
  for (int t0 = 0; t0 < T; t0 += kChunkRows) {
    const int rows = std::min(kChunkRows, T - t0);
    detail::launch_pdl(gather_kernel, dim3(unsigned(rows * m.s.n_cols)), dim3(128), 0, stream,
                       m.table, m.s.row_begin, m.s.rows_total, ids + int64_t(t0) * m.s.n_cols,
                       m.s.n_cols, m.s.head_dim, m.e);
    UF_CUDA_CHECK(cudaGetLastError());
    if (reduce) reduce(m.e, size_t(rows) * size_t(gathered_floats_per_row()));
    m.wkv.apply(m.e, rows, m.kv, stream);
    const int64_t off = int64_t(t0) * hc * D;
    detail::launch_pdl(gate_kernel, dim3(unsigned(rows * hc)), dim3(kGateThreads), 0, stream,
                       X + off, m.kv, m.wt, hc, D, m.s.norm_eps, m.dim_scale, out + off);
    UF_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace uf::cuda
