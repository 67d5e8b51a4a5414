// Tensor parallelism inside CudaModel: the rank's weight shards (model/tp_plan.h) and the
// all-reduce of a split-K partial (cuda/tp/nccl_comm.h).
//
// Numerics against one GPU (N ranks):
//  - wo_b: each rank's fp32 partial over its o_groups columns (DeviceLinear::apply_partial; the
//    FP8 activation quantisation is per 32 inputs and the split is at 32-column blocks, so the
//    quantised inputs are the same), fp32 sum over ranks, one bf16 rounding: only the fp32
//    summation order differs.
//  - index scores with tp_index_split_entries (the default): each rank scores its range of
//    entries with every head (or, for calls under index_split_min_work, whole rows), so every
//    score and selection is one GPU's bit for bit (cuda_index_split.cpp). Split by heads: per-rank
//    fp32 sums of the same per-head bf16 terms, fp32 sum, one bf16 rounding: only the fp32 order
//    differs. Every rank then selects from identical scores.
//  - MoE: DeviceMoe::apply_partial, the rank's routed + shared output in fp32 with no rounding
//    after w2 (SwiGLU and its FP8 quantisation are per 32 intermediate features and the split keeps
//    those blocks whole, so they are one GPU's), fp32 sum over ranks, one bf16 rounding. It drops
//    the per-expert bf16 roundings of apply() (the reference rounds each expert's output), which a
//    split-K product cannot keep: closer to exact arithmetic, not bitwise one GPU's. (DeviceMoe's
//    apply_partial_experts + combine_experts would be bitwise, at a (top_k + 1)x larger reduce.)
//  - Engram tables: split by rows (unevenly: model/tp_plan.h). Each rank gathers the rows it holds
//    and +0 for the others; the same all-reduce sums them, and since one rank alone contributes
//    each value the sum is that value: bitwise one GPU's (up to the sign of an exact zero).
//  - The sum: by default the one-shot peer-to-peer all-reduce (cuda/tp/p2p_allreduce.h, one kernel
//    per call, CudaModelOptions::tp_p2p_allreduce, where every pair of GPUs has peer access):
//    ((b0 + b1) + b2) + ... in rank order on every rank. Without it (or with tp_ordered_sum set):
//    NCCL's fp32 all-reduce at N = 2 (a + b: exact order-free), else all-gather + an fp32 sum in
//    rank order (CudaModelOptions::tp_ordered_sum), whose order never depends on the element
//    count. All three give bitwise the same values: at N = 2 a + b is commutative, at N > 2 the
//    P2P kernel and the gather-sum add in the same rank order. Collectives are elementwise over
//    rows, so a row's result never depends on the other rows (spec == plain holds at every N), and
//    every rank holds bitwise the same activations, hence the same KV, index keys and top-k.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>

#include "core/error.h"
#include "cuda/backend/backend_kernels.h"
#include "cuda/backend/cuda_model.h"
#include "cuda/backend/model_internal.h"
#include "cuda/ops/elementwise.h"
#include "cuda/tp/nccl_comm.h"
#include "cuda/tp/p2p_allreduce.h"
#include "model/tp_plan.h"

namespace uf::cuda {

namespace {

// model/weights.cpp's naming: "x.weight" -> "x.scale", anything else + ".scale".
std::string scale_name(const std::string& name) {
  const std::string suffix = ".weight";
  if (name.size() > suffix.size() &&
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
    return name.substr(0, name.size() - suffix.size()) + ".scale";
  return name + ".scale";
}

}  // namespace

model::TpOptions backend_tp_options(bool split_head, bool split_index_heads) {
  model::TpOptions o;
  o.split_head = split_head;
  o.split_index_heads = split_index_heads;
  o.split_wq_a = false;
  o.split_engram_tables = true;  // ~98 GB each at release: rows over the ranks
  o.split_engram_wkv = false;    // 157 MB a layer: replicated, no all-gather
  return o;
}

bool tp_index_heads_split(const model::ModelConfig& cfg, const CudaModelOptions& o) {
  return !(o.tp_index_split_entries && (cfg.candidate_source_layer < 0 || o.candidate_lists));
}

std::vector<model::Weight*> tp_split_weights(model::ModelWeights& w, bool split_head,
                                             bool split_index_heads) {
  std::vector<model::Weight*> out;
  if (split_head) out.push_back(&w.head);
  for (auto& L : w.layers) {
    auto& A = L.attn;
    for (model::Weight* x : {&A.attn_sink, &A.wq_b, &A.wo_a, &A.wo_b}) out.push_back(x);
    if (split_index_heads)
      for (model::Weight* x : {&A.i_wq_b, &A.i_weights_proj}) out.push_back(x);
    for (auto& e : L.moe.experts)
      for (model::Weight* x : {&e.w1, &e.w2, &e.w3}) out.push_back(x);
    for (model::Weight* x : {&L.moe.shared.w1, &L.moe.shared.w2, &L.moe.shared.w3})
      out.push_back(x);
    out.push_back(&L.engram.table);
  }
  return out;
}

ShardResult shard_model_weights(model::ModelWeights& weights, const model::ModelConfig& cfg, int tp,
                                int rank_, HostShards& storage, bool split_head,
                                std::unordered_map<std::string, int64_t>* row_begin,
                                bool split_index_heads) {
  const auto plan =
      model::make_tp_plan(cfg, tp, rank_, backend_tp_options(split_head, split_index_heads));
  std::unordered_map<std::string, const model::TensorShard*> by_name;
  size_t n_split = 0;
  for (const auto& s : plan.shards) {
    by_name[s.name] = &s;
    if (s.mode == model::ShardMode::kSplit) ++n_split;
  }
  ShardResult res;
  // Column slices are strided in the whole tensor: copied afterwards by several threads.
  struct Copy {
    const model::TensorShard* s;
    const uint8_t* full;
    uint8_t* dst;
  };
  std::vector<Copy> copies;
  auto find = [&](const std::string& name) -> const model::TensorShard& {
    const auto it = by_name.find(name);
    UF_CHECK(it != by_name.end(), "CUDA TP rank {}: tensor '{}' is not in the sharding plan", rank_,
             name);
    return *it->second;
  };
  // A row range is a view into the whole tensor (the checkpoint's mapping, which outlives the
  // upload), so only column slices take host memory and a copy.
  auto place = [&](const model::TensorShard& s, const uint8_t* full) -> const uint8_t* {
    ++res.tensors;
    if (const uint8_t* view = model::shard_view(s, full)) {
      res.viewed_bytes += s.nbytes;
      return view;
    }
    auto& bytes = storage.emplace_back(std::make_unique_for_overwrite<uint8_t[]>(s.nbytes));
    copies.push_back(Copy{&s, full, bytes.get()});
    res.copied_bytes += s.nbytes;
    return bytes.get();
  };
  auto shard = [&](model::Weight& w) {
    if (w.empty()) return;
    const auto& s = find(w.name);
    if (s.mode != model::ShardMode::kSplit) return;
    UF_CHECK(s.dim == 0 || s.dim == 1, "CUDA TP: {} is split along dimension {}", w.name, s.dim);
    const int64_t feats = s.feat_end - s.feat_begin;
    UF_CHECK(feats > 0, "CUDA TP rank {}: {} has an empty shard (more ranks than rows?)", rank_,
             w.name);
    if (w.scale) {
      const auto& sc = find(scale_name(w.name));
      UF_CHECK(sc.mode == model::ShardMode::kSplit && sc.dim == s.dim &&
                   sc.feat_begin == s.feat_begin && sc.feat_end == s.feat_end,
               "CUDA TP rank {}: the scale of {} is not split with its weight (features "
               "[{}, {}) vs [{}, {}))",
               rank_, w.name, sc.feat_begin, sc.feat_end, s.feat_begin, s.feat_end);
      w.scale = place(sc, w.scale);
    }
    w.data = place(s, w.data);
    if (s.dim == 0) {
      w.rows = feats;
      if (row_begin) (*row_begin)[w.name] = s.feat_begin;
    } else {
      w.cols = feats;
    }
  };
  for (model::Weight* x : tp_split_weights(weights, split_head, split_index_heads)) shard(*x);
  // The copies, largest first, over up to 16 threads (each takes its own page faults).
  std::sort(copies.begin(), copies.end(),
            [](const Copy& a, const Copy& b) { return a.s->nbytes > b.s->nbytes; });
  const int threads = int(std::min<size_t>(
      copies.size(), size_t(std::clamp(int(std::thread::hardware_concurrency()), 1, 16))));
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < copies.size();)
      model::copy_shard(*copies[i].s, copies[i].full, copies[i].dst);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  // Every split tensor of the plan (weights and their scales) must have been placed: a tensor the
  // plan splits but the model kept whole would silently compute with the wrong slice count.
  UF_CHECK(res.tensors == n_split,
           "CUDA TP rank {}: the plan splits {} tensors but the CUDA model sharded {}; a split "
           "tensor (engram.wkv, wq_a?) is not supported by the CUDA TP path yet",
           rank_, n_split, res.tensors);
  return res;
}

void CudaModel::shard_weights() {
  // Row ranges are views; column slices are host copies on up to 16 threads (the released model
  // at TP 8: 50.5 GB of rank 0's split bytes read in place, 12.6 GB copied; session 19). Before,
  // every split tensor was copied, one thread a rank: 40-83 s at TP 4 (docs/perf.md, session 12).
  spdlog::info("rank {}: placing its shards of the split tensors (host)", rank_);
  const auto t0 = std::chrono::steady_clock::now();
  const ShardResult r = shard_model_weights(w_, cfg_, tp_, rank_, shard_bytes_, split_head_,
                                            &shard_row0_, !index_split_);
  spdlog::info("rank {}: {} shards: {:.2f} GB copied, {:.2f} GB read in place, in {:.1f} s", rank_,
               r.tensors, double(r.copied_bytes) * 1e-9, double(r.viewed_bytes) * 1e-9,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

void CudaModel::apply_head(const float* x, int n, float* logits_dev) {
  if (head_slices_ == 1) {
    head_.apply(x, n, logits_dev, stream_);
    return;
  }
  if (!split_head_) {
    // Bench slice (head_slice_of): this rank's columns, and copies of them standing in for the
    // other ranks' slices (the writes of the gather; the samplers then see whole rows of logit
    // values, not stale memory).
    const size_t V = size_t(cfg_.vocab_size), Vl = V / size_t(head_slices_);
    head_.apply(x, n, head_part_, stream_);
    for (int r = 0; r < head_slices_; ++r)
      UF_CUDA_CHECK(cudaMemcpy2DAsync(logits_dev + size_t(r) * Vl, V * sizeof(float), head_part_,
                                      Vl * sizeof(float), Vl * sizeof(float), size_t(n),
                                      cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  // Rank r's logits are vocab columns [r * Vl, (r + 1) * Vl): gathered as [tp, n, Vl], then each
  // rank's block is copied into its column range of the [n, vocab] rows.
  const int V = cfg_.vocab_size, Vl = V / tp_;
  head_.apply(x, n, head_part_, stream_);
  gather_columns(head_part_, size_t(n), size_t(Vl), logits_dev, size_t(V), head_gather_);
}

void CudaModel::gather_columns(const float* src, size_t rows, size_t cols, float* dst, size_t ld,
                               float* scratch) {
  tp::PeerAllReduce* p2p = group_->peer_all_reduce();
  if (p2p && opts_.tp_p2p_allreduce && !opts_.tp_ordered_sum) {
    // One kernel: every rank's block lands in its columns of the rows directly.
    p2p->gather_rank(rank_, src, rows, cols, dst, ld, stream_);
    return;
  }
  group_->all_gather_rank(rank_, src, scratch, rows * cols, tp::CommDType::kF32, stream_);
  for (int r = 0; r < tp_; ++r)
    UF_CUDA_CHECK(cudaMemcpy2DAsync(dst + size_t(r) * cols, ld * sizeof(float),
                                    scratch + size_t(r) * rows * cols, cols * sizeof(float),
                                    cols * sizeof(float), rows, cudaMemcpyDeviceToDevice, stream_));
}

void CudaModel::ensure_gather(size_t n) {
  if (n <= gather_cap_) return;
  // Only at construction and session creation (stream idle): decode never allocates.
  if (gather_) UF_CUDA_CHECK(cudaFree(gather_));
  gather_ = nullptr;
  UF_CUDA_CHECK(cudaMalloc(&gather_, size_t(tp_) * n * sizeof(float)));
  gather_cap_ = n;
}

void CudaModel::all_reduce_round(float* buf, size_t n) {
  if (tp_ <= 1 || n == 0) return;
  // CudaBackend attaches the P2P object only where it is to be used; tp_ordered_sum (tests of the
  // gather-sum path) wins over it.
  tp::PeerAllReduce* p2p = group_->peer_all_reduce();
  if (p2p && opts_.tp_p2p_allreduce && !opts_.tp_ordered_sum) {
    p2p->sum_rank(rank_, buf, n, stream_, /*round_bf16=*/true);  // the rounding in the kernel
    return;
  }
  if (ordered_sum_) {
    UF_CHECK(n <= gather_cap_, "CUDA TP: a sum of {} values exceeds the gather scratch of {}", n,
             gather_cap_);
    group_->all_gather_rank(rank_, buf, gather_, n, tp::CommDType::kF32, stream_);
    sum_ranks_round_bf16(gather_, tp_, int64_t(n), buf, stream_);
    return;
  }
  group_->all_reduce_sum_rank(rank_, buf, n, tp::CommDType::kF32, stream_);
  round_bf16(buf, int64_t(n), stream_);
}

}  // namespace uf::cuda
