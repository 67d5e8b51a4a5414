#pragma once
// Internal to CudaModel (cuda_model.cpp, cuda_dspark.cpp, cuda_ced.cpp): the per-layer device
// weights, the span's host-side bookkeeping and the stream-ordered upload helper.

#include <memory>
#include <vector>

#include "cuda/backend/cuda_model.h"
#include "cuda/cuda_check.h"

namespace uf::cuda {

// One layer's weights on the device, bound as CpuModel uses them (LinearKind = the CPU function
// each call site uses).
struct CudaModel::LayerOps {
  DeviceWeight attn_norm, ffn_norm;
  DeviceWeight hc_attn_fn, hc_attn_scale, hc_attn_base, hc_ffn_fn, hc_ffn_scale, hc_ffn_base;
  DeviceWeight q_norm, kv_norm, c_norm, i_k_norm;
  DeviceLinear wq_a, wq_b, wkv, wo_a, wo_b;
  DeviceLinear c_wkv, c_wgate, i_wq_b, i_weights_proj, i_wk;
  const float* sink = nullptr;   // [n_heads]
  const float* freqs = nullptr;  // [rope_dim / 2]
  int rope_dim = 0;
  std::unique_ptr<DeviceMoe> moe;
  std::unique_ptr<DeviceEngram> engram;
  // DSpark stage extras.
  DeviceLinear main_proj, markov_head;
  DeviceWeight main_norm, norm;
};

// What one span shares between its layers (cpu/span.h's twin, host side).
struct CudaModel::Span {
  CudaSession* s = nullptr;
  int64_t p0 = 0;
  int T = 0;
  bool prefill = false;
  std::vector<int64_t> pos;         // [T]
  std::vector<int64_t> hash;        // [T, n_engram_layers * n_cols] (host; uploaded per span)
  std::vector<uint8_t> topk_valid;  // [layer] its indexer produced top-k rows in this span
  std::vector<int64_t> cand_width;  // [row] width of the candidate pool (0 = none)
  std::vector<uint8_t> emits_any;   // [layer]
  std::vector<int> pub_start;       // [row]
  std::vector<uint8_t> kv_done;     // [layer]
};

template <typename T>
inline void CudaModel::to_device(T* dst, const std::vector<T>& src) {
  if (src.empty()) return;
  // The bytes stay alive until the next sync(): an asynchronous copy from pageable memory may
  // read its source after returning.
  const auto* b = reinterpret_cast<const uint8_t*>(src.data());
  staging_.emplace_back(b, b + src.size() * sizeof(T));
  UF_CUDA_CHECK(cudaMemcpyAsync(dst, staging_.back().data(), staging_.back().size(),
                                cudaMemcpyHostToDevice, stream_));
}

}  // namespace uf::cuda
