#pragma once
// Internal to CudaModel (cuda_model.cpp, cuda_dspark.cpp, cuda_ced.cpp): the per-layer device
// weights, the span's host-side bookkeeping and the stream-ordered upload helper.

#include <spdlog/spdlog.h>

#include <chrono>
#include <memory>
#include <vector>

#include "cuda/backend/cuda_model.h"
#include "cuda/cuda_check.h"
#include "cuda/ops/mhc_prefill.h"

namespace uf::cuda {

// Appends 16-byte aligned arrays to a pinned block's layout (SpanBlock offsets: span, draft and
// commit programs).
class BlockPacker {
 public:
  size_t add(size_t count, size_t elem) {
    const size_t off = align(bytes_);
    bytes_ = off + count * elem;
    return off;
  }
  size_t bytes() const { return align(bytes_); }

 private:
  static size_t align(size_t n) { return (n + 15) / 16 * 16; }
  size_t bytes_ = 0;
};

// One layer's weights on the device, bound as CpuModel uses them (LinearKind = the CPU function
// each call site uses).
struct CudaModel::LayerOps {
  DeviceWeight attn_norm, ffn_norm;
  DeviceWeight hc_attn_fn, hc_attn_scale, hc_attn_base, hc_ffn_fn, hc_ffn_scale, hc_ffn_base;
  // The fns as bf16 terms for the prefill expand on the tensor cores (empty: not used).
  HcFnTerms hc_attn_terms, hc_ffn_terms;
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
  // Span programs: the device block whose fields the layers read (null: the host-driven path).
  const SpanBlock* program = nullptr;
};

// Where a span program's inputs sit in the block (byte offsets; the layout depends on the row
// count and the config only). Written on the host by plan_ring_span, read on the device.
struct CudaModel::SpanBlock {
  int T = 0;
  size_t bytes = 0;
  // index_select's score row stride (host value, set by plan_ring_span): a graph step's
  // (T <= max_rows) is its width bucket's (score_bucket; the scratch width unless
  // CudaModelOptions::tp_score_buckets), fixed at its capture; an eager span's is its widest row,
  // so that a TP rank sums the live columns, not the largest session's width.
  int score_stride = 0;
  int score_bucket = 0;  // graph steps: the index into CudaModel::score_buckets_ (graph key)
  size_t p0 = 0;         // int64: the span's first position
  size_t ids = 0;        // int32 [T]: token ids
  size_t pos = 0;        // int64 [T]: positions p0 + t
  size_t hash = 0;  // int64 [engram layers, T, n_cols]: Engram ids (CudaModel::upload_hash order)
  struct Layer {
    int gmax = 0;         // KV sources: compressed entries the program computes (>= emitted)
    size_t window = 0;    // float*: the window ring's rows
    size_t raw_kv = 0;    // float*: ratio > 1, the compressor's pre-pool ring (kv, gate)
    size_t raw_gate = 0;  //
    size_t pool_kv = 0;   // const float* [gmax * ratio]: pooled rows (padding: any valid row)
    size_t pool_gate = 0;
    size_t n_emit = 0;    // int32: entries this span emits (<= gmax)
    size_t emit_pos = 0;  // int64 [gmax]: RoPE position of each emitted entry (entry * ratio)
    size_t ckv_dst = 0;   // uint16_t*: where the first emitted entry goes in the compressed KV
    size_t ikey_dst = 0;  // uint16_t*: ... in the index keys (bf16)
    size_t ckv_src = 0;   // const uint16_t*: the compressed KV (bf16) the layer's top-k indexes
    size_t vis = 0;       // indexer: int32 [T] visible entries, int32 [T] scored width,
    size_t width = 0;     //          const uint16_t* [T] key banks (bf16)
    size_t keys = 0;
  };
  std::vector<Layer> layers;         // backbone layers (span programs)
  std::vector<size_t> stage_window;  // float*: each DSpark stage's window ring (draft programs)

  template <typename V>
  V* at(uint8_t* base, size_t off) const {
    return reinterpret_cast<V*>(base + off);
  }
};

// Graph keys: span programs use rows * 4 + all_logits * 2 + head (4..35 for up to 8 rows; plus
// the score width bucket * kScoreBucketGraphKey under TP with tp_score_buckets); draft
// programs 0 / 1 (without / with the head), the device draft 2, commits kCommitGraphKey + rows.
// Capture runs the program on the model's stream in thread-local mode (TP ranks capture on their
// own threads).
inline constexpr int kCommitGraphKey = 64;
// Span programs of score width bucket b > 0 (CudaModelOptions::tp_score_buckets): key + b * this.
inline constexpr int kScoreBucketGraphKey = 256;
template <typename Program>
void CudaModel::launch_program(int key, Program&& program) {
  // Under TP every rank captures and replays the same program, NCCL collectives included (NCCL
  // records them into the graph); ranks replay in the same order because they run the same steps.
  if (!opts_.cuda_graphs) {
    program();
    return;
  }
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    const auto t0 = std::chrono::steady_clock::now();
    cudaGraph_t graph = nullptr;
    UF_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      program();
    } catch (...) {
      cudaStreamEndCapture(stream_, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    UF_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    size_t nodes = 0;
    cudaGraphGetNodes(graph, nullptr, &nodes);
    cudaGraphDestroy(graph);
    UF_CUDA_CHECK(err);
    it = graphs_.emplace(key, exec).first;
    ++graph_captures_;
    spdlog::debug(
        "CUDA graph {} captured: {} nodes in {:.1f} ms", key, nodes,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  UF_CUDA_CHECK(cudaGraphLaunch(it->second, stream_));
}

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
