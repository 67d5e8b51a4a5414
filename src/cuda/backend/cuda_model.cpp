// The CUDA forward's host orchestration: cpu/model.cpp line by line, every op on the device.
#include "cuda/backend/cuda_model.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "cuda/backend/backend_kernels.h"
#include "cuda/backend/model_internal.h"
#include "cuda/cuda_check.h"
#include "cuda/device_weights.h"
#include "cuda/gemv.h"
#include "cuda/ops/attention.h"
#include "cuda/ops/index_split.h"
#include "cuda/tp/nccl_comm.h"
#include "cuda/weight_uploader.h"
#include "model/rope.h"
#include "model/synthetic.h"

namespace uf::cuda {

namespace {

// Entries a query at position p can see of a ratio-r compressed stream.
inline int64_t visible(int64_t p, int r) { return (p + 1) / r; }

}  // namespace

namespace {

DeviceLinear make_linear(const model::Weight& w, LinearKind kind, DeviceArena& arena) {
  if (w.empty()) return {};
  return DeviceLinear(w, kind, arena);
}

}  // namespace

CudaModel::CudaModel(model::ModelConfig cfg, const model::Checkpoint& ckpt,
                     std::vector<int64_t> engram_token_map, CudaModelOptions opts,
                     tp::TpGroup* group, int rank)
    : cfg_(std::move(cfg)), opts_(opts), token_map_(std::move(engram_token_map)) {
  UF_CHECK(!opts_.reference_index_keys,
           "the CUDA backend implements only the owner-keys index mode; the reference's stale-key "
           "decode quirk runs on the CPU backend (--backend cpu --reference-index-keys)");
  UF_CHECK(opts_.max_rows >= 1 && opts_.max_rows <= engine::kMaxVerifyRows,
           "CUDA backend: max_rows {} outside 1..{}", opts_.max_rows, engine::kMaxVerifyRows);
  UF_CHECK(opts_.max_chunk >= 1, "CUDA backend: max_chunk {} must be positive", opts_.max_chunk);
  int n_dev = 0;
  UF_CUDA_CHECK(cudaGetDeviceCount(&n_dev));
  UF_CHECK(opts_.device >= 0 && opts_.device < n_dev, "CUDA device {} requested, {} present",
           opts_.device, n_dev);
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  UF_CUDA_CHECK(cudaStreamCreate(&stream_));
  main_stream_ = stream_;
  for (int i = 0; i < kSideStreams; ++i) {
    UF_CUDA_CHECK(cudaStreamCreateWithFlags(&side_[i], cudaStreamNonBlocking));
    UF_CUDA_CHECK(cudaEventCreateWithFlags(&fork_ev_[i], cudaEventDisableTiming));
    UF_CUDA_CHECK(cudaEventCreateWithFlags(&side_done_[i], cudaEventDisableTiming));
  }

  w_ = model::bind_weights(cfg_, ckpt);
  H_ = cfg_.n_heads;
  G_ = cfg_.o_groups;
  Hi_ = cfg_.index_n_heads;
  inter_ = cfg_.moe_inter_dim;
  if (group && group->size() > 1) {
    group_ = group;
    tp_ = group->size();
    rank_ = rank;
    UF_CHECK(rank >= 0 && rank < tp_ && group->device(rank) == opts_.device,
             "CUDA TP: rank {} of {} on device {} but the group puts it on device {}", rank, tp_,
             opts_.device, group->device(rank));
    H_ /= tp_;
    G_ /= tp_;
    index_split_ = !tp_index_heads_split(cfg_, opts_);
    if (!index_split_) Hi_ /= tp_;  // else every rank holds every index head
    inter_ /= tp_;
    // tp > 2 needs a sum whose order is the same on every rank: the P2P sum's rank order, else
    // all-gather + the rank-order sum (its scratch: ensure_gather).
    ordered_sum_ =
        (opts_.tp_ordered_sum || tp_ > 2) && !(opts_.tp_p2p_allreduce && group->peer_all_reduce());
    split_head_ = opts_.tp_split_head;
    split_ranks_ = tp_;
    shard_weights();
  } else if (opts_.index_split_simulated_ranks > 1) {
    UF_CHECK(
        cfg_.candidate_source_layer < 0 || opts_.candidate_lists,
        "index_split_simulated_ranks needs candidate_lists (the entry split's pool is a list)");
    index_split_ = true;
    split_ranks_ = opts_.index_split_simulated_ranks;
  }
  if (!cfg_.engram_layer_ids.empty()) {
    UF_CHECK(
        int64_t(token_map_.size()) == cfg_.vocab_size,
        "the model has Engram layers but the Engram token map has {} entries for a vocab of {}",
        token_map_.size(), cfg_.vocab_size);
    hasher_.emplace(cfg_, token_map_.at(size_t(cfg_.engram_pad_id)));
  }
  hc_.hc = cfg_.hc_mult;
  hc_.dim = cfg_.dim;
  hc_.sinkhorn_iters = cfg_.hc_sinkhorn_iters;
  hc_.norm_eps = float(cfg_.norm_eps);
  hc_.hc_eps = float(cfg_.hc_eps);

  const int B = (cfg_.n_mtp_layers > 0) ? cfg_.dspark_block_size : 0;
  tmax_ = std::max({opts_.max_chunk, opts_.max_rows, B, 1});
  decode_rows_ = std::max(opts_.max_rows, B);

  // ---- weights ----
  // Copied through pinned staging buffers by several host threads (cuda/weight_uploader.h); the
  // scope's finish() below is the barrier before any kernel reads a weight.
  UploaderOptions up_opts;
  up_opts.on_progress = [rank](const UploadProgress& p) {
    if (p.bytes_done < p.bytes_enqueued)
      spdlog::info("rank {}: weights {:.2f} of {:.2f} GB on the device ({:.0f} s)", rank,
                   double(p.bytes_done) * 1e-9, double(p.bytes_enqueued) * 1e-9, p.seconds);
  };
  UploadScope load_scope(opts_.device, up_opts);
  // Every DeviceLinear below takes its prefill GEMM from this (ranks share their options).
  const ScopedPrefillGemm prefill_gemm(opts_.prefill_gemm_bf16 ? PrefillGemm::kBf16
                                                               : PrefillGemm::kFp8Bitwise);
  embed_ = upload_weight(w_.embed, arena_);
  norm_ = upload_weight(w_.norm, arena_);
  head_slices_ = split_head_ ? tp_ : std::max(opts_.head_slice_of, 1);
  if (!split_head_ && head_slices_ > 1) {
    // Bench-only slice (CudaModelOptions::head_slice_of): rank 0's vocab rows, a view.
    UF_CHECK(tp_ == 1 && cfg_.vocab_size % head_slices_ == 0,
             "head_slice_of = {} needs tp = 1 (got {}) and a vocab ({}) it divides", head_slices_,
             tp_, cfg_.vocab_size);
    model::Weight slice = w_.head;
    slice.rows = cfg_.vocab_size / head_slices_;
    head_ = DeviceLinear(slice, LinearKind::kF32Bf16X, arena_);
  } else {
    head_ = DeviceLinear(w_.head, LinearKind::kF32Bf16X, arena_);
  }
  // Prefill spans expand with the next mixes on the tensor cores (hc_post_mixes_mma).
  const bool mix_mma = opts_.prefill_gemm_bf16 && tmax_ > kMaxDecodeRows;
  int max_ratio = 1, max_topk = 1;
  for (int l = 0; l < cfg_.n_total_layers(); ++l) {
    const auto& r = cfg_.role(l);
    const auto& L = w_.layers[size_t(l)];
    const auto& A = L.attn;
    auto op = std::make_unique<LayerOps>();
    op->attn_norm = upload_weight(L.attn_norm, arena_);
    op->ffn_norm = upload_weight(L.ffn_norm, arena_);
    op->hc_attn_fn = upload_weight(L.hc_attn_fn, arena_);
    op->hc_attn_scale = upload_weight(L.hc_attn_scale, arena_);
    op->hc_attn_base = upload_weight(L.hc_attn_base, arena_);
    op->hc_ffn_fn = upload_weight(L.hc_ffn_fn, arena_);
    op->hc_ffn_scale = upload_weight(L.hc_ffn_scale, arena_);
    op->hc_ffn_base = upload_weight(L.hc_ffn_base, arena_);
    if (mix_mma) {
      op->hc_attn_terms = hc_fn_terms(hc_, op->hc_attn_fn, arena_);
      op->hc_ffn_terms = hc_fn_terms(hc_, op->hc_ffn_fn, arena_);
    }
    op->q_norm = upload_weight(A.q_norm, arena_);
    op->kv_norm = upload_weight(A.kv_norm, arena_);
    op->c_norm = upload_weight(A.c_norm, arena_);
    op->i_k_norm = upload_weight(A.i_k_norm, arena_);
    op->wq_a = make_linear(A.wq_a, LinearKind::kAuto, arena_);
    op->wq_b = make_linear(A.wq_b, LinearKind::kAuto, arena_);
    op->wkv = make_linear(A.wkv, LinearKind::kAuto, arena_);
    op->wo_a = make_linear(A.wo_a, LinearKind::kBf16OutBf16X, arena_);
    op->wo_b = make_linear(A.wo_b, LinearKind::kAuto, arena_);
    // Ratio 1: cpu::linear; ratio > 1: linear_f32 (fp32 pre-pool rows). Their inputs (the normed
    // attention input, the normed latents) are bf16 values, so prefill calls take the tensor
    // cores (the *Bf16XPrefill kinds); decode calls keep dense_rows.
    const auto bf16_out = [](const model::Weight& w) {
      return w.format == model::WFormat::kBF16 ? LinearKind::kBf16OutBf16XPrefill
                                               : LinearKind::kAuto;
    };
    op->c_wkv = make_linear(
        A.c_wkv, r.compress_ratio > 1 ? LinearKind::kF32Bf16XPrefill : bf16_out(A.c_wkv), arena_);
    op->c_wgate = make_linear(A.c_wgate, LinearKind::kF32Bf16XPrefill, arena_);
    op->i_wq_b = make_linear(A.i_wq_b, LinearKind::kAuto, arena_);
    op->i_weights_proj = make_linear(A.i_weights_proj, bf16_out(A.i_weights_proj), arena_);
    op->i_wk = make_linear(A.i_wk, bf16_out(A.i_wk), arena_);
    const auto sink = A.attn_sink.to_vector();
    op->sink = arena_.upload(sink);
    const auto rope = model::Rope::for_layer(cfg_, l);
    op->freqs = arena_.upload(rope.freqs());
    op->rope_dim = rope.dim();
    MoeShape ms;
    ms.dim = cfg_.dim;
    ms.inter = inter_;
    ms.n_experts = r.n_routed_experts;
    ms.top_k = r.n_activated_experts;
    ms.score_func = cfg_.score_func;
    ms.gate_temp = float(cfg_.gate_temp);
    ms.route_scale = float(cfg_.route_scale);
    ms.swiglu_limit = float(cfg_.swiglu_limit);
    op->moe = std::make_unique<DeviceMoe>(L.moe, ms, arena_);
    op->moe->set_fork_shared(opts_.graph_branches);
    max_topk = std::max(max_topk, ms.top_k);
    if (r.engram) {
      EngramShape es;
      es.hc = cfg_.hc_mult;
      es.dim = cfg_.dim;
      es.n_cols = hasher_->n_cols();
      es.head_dim = cfg_.engram_head_dim;
      es.norm_eps = float(cfg_.norm_eps);
      if (const auto it = shard_row0_.find(L.engram.table.name); it != shard_row0_.end()) {
        es.row_begin = it->second;  // TP: this rank's slice of the table's rows
        es.rows_total = cfg_.engram_num_embeddings.at(size_t(r.engram_index));
      }
      op->engram = std::make_unique<DeviceEngram>(L.engram, es, arena_);
      engram_gather_ = std::max(engram_gather_, size_t(op->engram->gathered_floats_per_row()));
    }
    op->main_proj = make_linear(L.main_proj, LinearKind::kAuto, arena_);
    op->markov_head = make_linear(L.markov_head, LinearKind::kF32Bf16X, arena_);
    op->main_norm = upload_weight(L.main_norm, arena_);
    op->norm = upload_weight(L.norm, arena_);
    if (r.kv_source && r.compress_ratio > 1) max_ratio = std::max(max_ratio, r.compress_ratio);
    layers_.push_back(std::move(op));
  }
  const UploadStats loaded = load_scope.finish();
  spdlog::info("rank {}: {:.2f} GB of weights on device {} in {:.2f} s ({:.1f} GB/s)", rank,
               double(loaded.bytes) * 1e-9, opts_.device, loaded.seconds, loaded.gb_per_s());

  // ---- fixed scratch for tmax rows ----
  const size_t T = size_t(tmax_), hc = size_t(cfg_.hc_mult), D = size_t(cfg_.dim), H = size_t(H_),
               hd = size_t(cfg_.head_dim);
  X_ = arena_.alloc<float>(T * hc * D);
  R_ = arena_.alloc<float>(T * hc * D);
  pre_ = arena_.alloc<float>(T * hc);
  apre_ = arena_.alloc<float>(T * hc);
  apost_ = arena_.alloc<float>(T * hc);
  acomb_ = arena_.alloc<float>(T * hc * hc);
  fpost_ = arena_.alloc<float>(T * hc);
  fcomb_ = arena_.alloc<float>(T * hc * hc);
  x_ = arena_.alloc<float>(T * D);
  y_ = arena_.alloc<float>(T * D);
  qr_ = arena_.alloc<float>(T * size_t(cfg_.q_lora_rank));
  q_ = arena_.alloc<float>(T * H * hd);
  kv_ = arena_.alloc<float>(T * hd);
  o_ = arena_.alloc<float>(T * H * hd);
  o2_ = arena_.alloc<float>(T * size_t(G_) * size_t(cfg_.o_lora_rank));
  ckv_kv_ = arena_.alloc<float>(T * hd);
  ckv_gate_ = arena_.alloc<float>(T * hd);
  if (!cfg_.index_source_layers.empty()) {
    iq_ = arena_.alloc<float>(T * size_t(Hi_) * size_t(cfg_.index_head_dim));
    iw_ = arena_.alloc<float>(T * size_t(Hi_));
  }
  const size_t MH = size_t(std::max(n_taps(), 1)) * D;
  mh_ = arena_.alloc<float>(T * MH);
  logits_ = arena_.alloc<float>(T * size_t(cfg_.vocab_size));
  emb_ = arena_.alloc<float>(size_t(std::max(cfg_.dspark_markov_rank, 1)));
  ids_ = arena_.alloc<int32_t>(T);
  gate_i_ = arena_.alloc<int32_t>(T * size_t(max_topk));
  gate_w_ = arena_.alloc<float>(T * size_t(max_topk));
  if (opts_.fold_moe_combine && tp_ == 1 && cfg_.hc_mult <= 4)  // hc_post_mixes_moe: hc <= 4
    moe_slots_ = arena_.alloc<float>(size_t(kMaxDecodeRows) * size_t(max_topk + 1) * D);
  vis_ = arena_.alloc<int32_t>(T);
  width_ = arena_.alloc<int32_t>(T);
  if (hasher_)
    hash_ = arena_.alloc<int64_t>(size_t(hasher_->n_layers()) * T * size_t(hasher_->n_cols()));
  win_ptrs_ = arena_.alloc<const float*>(T * size_t(cfg_.window_size + std::max(B, 0) + 1));
  pool_kv_ptrs_ = arena_.alloc<const float*>(T * size_t(max_ratio));
  pool_gate_ptrs_ = arena_.alloc<const float*>(T * size_t(max_ratio));
  key_ptrs_ = arena_.alloc<const uint16_t*>(T);
  mix_scratch_ = arena_.alloc<float>(hc_mixes_scratch_floats(hc_, tmax_));
  // Every span attends in split mode (attend): for steps and draft blocks T * H CTAs alone would
  // leave most SMs idle, and for prefill chunks the split kernels stage each KV row once for 8
  // heads where the one-CTA-per-(row, head) reference path reads it once per head. Prefill chunks
  // go in groups of rows whose scratch stays within kAttnScratchBytes (at least 64 rows, at
  // least a step or a draft block).
  {
    constexpr size_t kAttnScratchBytes = size_t(64) << 20;
    const int slots = cfg_.window_size + std::max(cfg_.index_topk, std::max(B, 0));
    const size_t row_bytes =
        sparse_attn_scratch_floats(1, H_, cfg_.head_dim, slots) * sizeof(float);
    const int fit = int(std::min<size_t>(kAttnScratchBytes / row_bytes, size_t(T)));
    attn_rows_ = std::max({opts_.max_rows, B, std::min(64, int(T)), fit});
    attn_scratch_ =
        arena_.alloc<float>(sparse_attn_scratch_floats(attn_rows_, H_, cfg_.head_dim, slots));
  }
  emit_ = arena_.alloc<float>(T * hd);
  if (!cfg_.index_source_layers.empty())
    emit_keys_ = arena_.alloc<float>(T * size_t(cfg_.index_head_dim));
  if (opts_.device_verify && rank_ == 0) {  // TP: rank 0 holds the logits and verifies
    verify_plan_ = std::make_unique<VerifyPlan>(cfg_.vocab_size);
    verify_q_ = arena_.alloc<float>(size_t(sampling::kMaxDraft) * size_t(cfg_.vocab_size));
    verify_tokens_ = arena_.alloc<int32_t>(size_t(sampling::kMaxDraft));
    verify_seed_ = arena_.alloc<unsigned long long>(2);
    verify_out_ = arena_.alloc<sampling::VerifyResult>(1);
  }
  block_bytes_ = span_block(tmax_).bytes;
  block_dev_ = arena_.alloc<uint8_t>(block_bytes_);
  if (n_taps() > 0 && cfg_.n_mtp_layers > 0) {  // DSpark ring writes at commit
    const int keep = std::min(tmax_, cfg_.window_size);
    commit_bytes_ = commit_block(keep).bytes;
    commit_dev_ = arena_.alloc<uint8_t>(commit_bytes_);
    commit_mh_ = arena_.alloc<float>(size_t(keep) * size_t(n_taps()) * size_t(cfg_.dim));
    UF_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&commit_host_), commit_bytes_,
                                cudaHostAllocDefault));
    UF_CUDA_CHECK(cudaEventCreateWithFlags(&commit_done_, cudaEventDisableTiming));
  }
  UF_CUDA_CHECK(
      cudaHostAlloc(reinterpret_cast<void**>(&block_host_), block_bytes_, cudaHostAllocDefault));
  topk_.assign(size_t(cfg_.n_layers), nullptr);
  for (int l : cfg_.index_source_layers)
    topk_[size_t(l)] = arena_.alloc<int32_t>(T * size_t(std::max(cfg_.index_topk, 1)));
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  // The ordered sum's scratch: [T, dim] partials, and the Engram gathers of a row-split table
  // (at most kMaxDecodeRows rows per DeviceEngram chunk).
  if (ordered_sum_) ensure_gather(std::max(T * D, size_t(kMaxDecodeRows) * engram_gather_));
  if (head_slices_ > 1) {
    const size_t Vl = size_t(cfg_.vocab_size / head_slices_);
    head_part_ = arena_.alloc<float>(T * Vl);
    if (split_head_) head_gather_ = arena_.alloc<float>(size_t(tp_) * T * Vl);
  }
  // The index-score scratch for the callers' largest sessions (CudaModelOptions::max_seq), before
  // any graph is captured.
  if (opts_.max_seq > 0) ensure_index_width(model::index_score_width(cfg_, opts_.max_seq));
  // The device holds the shards now (uploads are synchronous): drop the host copies; no split
  // weight is read on the host after construction (the Markov / confidence views are replicated).
  if (tp_ > 1) {
    for (model::Weight* w : tp_split_weights(w_, split_head_, !index_split_))
      *w = model::Weight{};  // no dangling views
    shard_bytes_.clear();
    shard_bytes_.shrink_to_fit();
  }
}

void CudaModel::connect_collectives() {
  if (tp_ == 1) return;
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  const size_t n = size_t(tp_) * 64;
  UF_CUDA_CHECK(cudaMemsetAsync(x_, 0, n * sizeof(float), stream_));
  group_->all_reduce_sum_rank(rank_, x_, n, tp::CommDType::kF32, stream_);
  group_->all_gather_rank(rank_, x_, y_, 64, tp::CommDType::kF32, stream_);
  sync();
}

CudaModel::~CudaModel() {
  drop_graphs();
  if (block_host_) cudaFreeHost(block_host_);
  if (commit_host_) cudaFreeHost(commit_host_);
  if (commit_done_) cudaEventDestroy(commit_done_);
  if (gather_) cudaFree(gather_);
  if (score_) cudaFree(score_);
  if (keep_) cudaFree(keep_);
  if (index_ws_) cudaFree(index_ws_);
  if (cand_list_) cudaFree(cand_list_);
  if (cand_n_) cudaFree(cand_n_);
  free_index_split();
  for (int i = 0; i < kSideStreams; ++i) {
    if (side_done_[i]) cudaEventDestroy(side_done_[i]);
    if (fork_ev_[i]) cudaEventDestroy(fork_ev_[i]);
    if (side_[i]) cudaStreamDestroy(side_[i]);
  }
  if (main_stream_) cudaStreamDestroy(main_stream_);
}

// Events are recorded and waited on at enqueue time, so one event per side stream serves every
// fork and join in turn.
void CudaModel::fork(int side) {
  UF_CHECK(open_side_ < 0 && side >= 0 && side < kSideStreams,
           "fork({}): side {} is open (branches start from the main stream)", side, open_side_);
  if (!opts_.graph_branches) {  // the branch runs in place, on the main stream
    open_side_ = side;
    return;
  }
  UF_CUDA_CHECK(cudaEventRecord(fork_ev_[side], main_stream_));
  UF_CUDA_CHECK(cudaStreamWaitEvent(side_[side], fork_ev_[side], 0));
  stream_ = side_[side];
  open_side_ = side;
}

void CudaModel::unfork() {
  UF_CHECK(open_side_ >= 0, "unfork: no branch is open");
  if (!opts_.graph_branches) {
    open_side_ = -1;
    return;
  }
  UF_CUDA_CHECK(cudaEventRecord(side_done_[open_side_], stream_));
  stream_ = main_stream_;
  open_side_ = -1;
}

void CudaModel::join(int side) {
  if (!opts_.graph_branches) return;
  UF_CUDA_CHECK(cudaStreamWaitEvent(stream_, side_done_[side], 0));
}

int64_t CudaModel::compressed_id(int32_t token) const {
  UF_CHECK(token >= 0 && token < cfg_.vocab_size, "token id {} is outside the vocab of {}", token,
           cfg_.vocab_size);
  return token_map_.at(size_t(token));
}

void CudaModel::sync() {
  UF_CUDA_CHECK(cudaGetLastError());
  UF_CUDA_CHECK(cudaStreamSynchronize(stream_));
  staging_.clear();
}

void CudaModel::ensure_index_width(int64_t width) {
  if (width <= index_width_) return;
  drop_graphs();  // they hold the score buffers and their row stride
  for (void* p : {static_cast<void*>(score_), static_cast<void*>(keep_), index_ws_,
                  static_cast<void*>(cand_list_), static_cast<void*>(cand_n_)})
    if (p) UF_CUDA_CHECK(cudaFree(p));
  score_ = nullptr;
  keep_ = nullptr;
  index_ws_ = nullptr;
  cand_list_ = nullptr;
  cand_n_ = nullptr;
  // The candidate lists hold the pool's blocks: topk_blocks * block_size entries a row, or all
  // of a row's blocks when it has fewer (the rows' width rounded up to whole blocks). Their
  // scores share score_, so its rows are as wide as the wider of the two; under TP they are
  // summed whole ([T, cand_cap_]), so a short session sums no more than its width.
  const int64_t bs = std::max(cfg_.candidate_block_size, 1);
  cand_cap_ =
      opts_.candidate_lists && cfg_.candidate_source_layer >= 0
          ? std::min<int64_t>(int64_t(cfg_.candidate_topk_blocks) * bs, (width + bs - 1) / bs * bs)
          : 0;
  int64_t cols = std::max(width, cand_cap_);
  // A rank's range of the entry-split indexer may round past a short width.
  if (index_split_)
    cols = std::max(
        cols, rank_position_range(width, split_ranks_, 0, model::index_split_align(cfg_)).len);
  const size_t n = size_t(tmax_) * size_t(cols);
  UF_CUDA_CHECK(cudaMalloc(&score_, n * sizeof(float)));
  UF_CUDA_CHECK(cudaMalloc(&keep_, size_t(tmax_) * size_t(width)));
  UF_CUDA_CHECK(cudaMemset(keep_, 0, size_t(tmax_) * size_t(width)));
  if (cand_cap_ > 0) {
    UF_CUDA_CHECK(cudaMalloc(&cand_list_, size_t(tmax_) * size_t(cand_cap_) * sizeof(int32_t)));
    UF_CUDA_CHECK(cudaMalloc(&cand_n_, size_t(tmax_) * sizeof(int32_t)));
  }
  size_t ws = std::max(topk_select_workspace_bytes(tmax_, int(cols), cfg_.index_topk),
                       candidate_mask_workspace_bytes(tmax_, int(width), cfg_.candidate_topk_blocks,
                                                      cfg_.candidate_block_size));
  if (index_split_) {
    alloc_index_split(width);
    // The merge's selection (tp x k pairs a row) and the candidate pool's over the gathered block
    // maxima (blocks of one) share the workspace.
    const int N = split_ranks_;
    ws = std::max({ws, topk_select_workspace_bytes(tmax_, N * cfg_.index_topk, cfg_.index_topk),
                   candidate_mask_workspace_bytes(tmax_, int(N * isplit_.split_blocks),
                                                  cfg_.candidate_topk_blocks, 1)});
  }
  if (ws > 0) UF_CUDA_CHECK(cudaMalloc(&index_ws_, ws));
  index_width_ = width;
  // Graph steps' score widths: 4096 * 4^b entries below the scratch width, then the scratch's.
  score_buckets_.clear();
  if (tp_ > 1 && opts_.tp_score_buckets)
    for (int64_t b = 4096; b < width; b *= 4) score_buckets_.push_back(b);
  score_buckets_.push_back(width);
  // The ordered TP sum gathers whole score rows too.
  if (ordered_sum_) ensure_gather(n);
}

std::unique_ptr<CudaSession> CudaModel::new_session(int64_t max_seq) {
  UF_CHECK(max_seq > 0, "new_session: capacity {} must be positive", max_seq);
  auto s = std::make_unique<CudaSession>();
  s->cap = max_seq;
  s->alloc_cap = max_seq;
  s->layers.resize(size_t(cfg_.n_total_layers()));
  for (int l = 0; l < cfg_.n_total_layers(); ++l) {
    const auto& r = cfg_.role(l);
    auto& L = s->layers[size_t(l)];
    L.window.init(cfg_.window_size + opts_.max_rows, cfg_.head_dim, s->arena);
    if (r.kv_source && r.compress_ratio > 1) {
      L.raw_kv.init(r.compress_ratio + opts_.max_rows, cfg_.head_dim, s->arena);
      L.raw_gate.init(r.compress_ratio + opts_.max_rows, cfg_.head_dim, s->arena);
    }
    if (r.kv_source && r.compress_ratio > 0) {
      L.ckv_cap = max_seq / r.compress_ratio + 1;
      L.ckv = s->arena.alloc<uint16_t>(size_t(L.ckv_cap) * size_t(cfg_.head_dim));
      if (r.index_source)
        L.ikeys = s->arena.alloc<uint16_t>(size_t(L.ckv_cap) * size_t(cfg_.index_head_dim));
    }
  }
  s->pending_main_hidden =
      s->arena.alloc<float>(size_t(opts_.max_rows) * size_t(std::max(n_taps(), 1) * cfg_.dim));
  ensure_index_width(model::index_score_width(cfg_, max_seq));
  return s;
}

void CudaModel::download_ring(const DeviceRing& r, std::vector<float>& out) const {
  out.resize(size_t(r.slots) * size_t(r.width));
  if (!out.empty())
    UF_CUDA_CHECK(
        cudaMemcpy(out.data(), r.data, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
}

void CudaModel::upload_ring(DeviceRing& r, const std::vector<float>& in) const {
  UF_CHECK(in.size() == size_t(r.slots) * size_t(r.width),
           "restore: ring data of {} values for {} slots of {}", in.size(), r.slots, r.width);
  if (!in.empty())
    UF_CUDA_CHECK(cudaMemcpy(r.data, in.data(), in.size() * sizeof(float), cudaMemcpyHostToDevice));
}

// ---------------------------------------------------------------------------------------------
// Projections shared by backbone and DSpark attention.

void CudaModel::project_qkv(int l, const float* x, int T, int64_t p0, float* qr, float* q,
                            float* kv, const int64_t* pos) {
  const auto& op = *layers_[size_t(l)];
  // wq_a and wkv read the same x: one launch, each output bitwise its own apply().
  const LinearCall calls[] = {{&op.wq_a, qr}, {&op.wkv, kv}};
  DeviceLinear::apply_group(calls, x, T, stream_);
  finish_q(l, qr, T, q);
  finish_kv(l, kv, T, p0, pos);
}

void CudaModel::finish_q(int l, float* qr, int T, float* q) {
  const auto& op = *layers_[size_t(l)];
  // rms_norm as a PDL launch (row_chains, bitwise the op), then wq_b. q's rope rides on the
  // attention's q staging (attend).
  RowChain c;
  c.rows = T;
  c.n = cfg_.q_lora_rank;
  c.y = qr;
  c.norm = op.q_norm;
  c.eps = float(cfg_.norm_eps);
  if (c.n <= kRowChainMaxNorm)
    row_chains(&c, 1, nullptr, stream_);
  else
    rms_norm(op.q_norm, c.eps, qr, T, c.n, qr, stream_);
  op.wq_b.apply(qr, T, q, stream_);
}

void CudaModel::project_kv(int l, const float* x, int T, int64_t p0, float* kv,
                           const int64_t* pos) {
  layers_[size_t(l)]->wkv.apply(x, T, kv, stream_);
  finish_kv(l, kv, T, p0, pos);
}

void CudaModel::finish_kv(int l, float* kv, int T, int64_t p0, const int64_t* pos) {
  const auto& op = *layers_[size_t(l)];
  // rms_norm(kv_norm) + rope + qdq_fp8 (blocks of 32) in one launch, bitwise the three ops.
  RowChain c;
  c.rows = T;
  c.n = cfg_.head_dim;
  c.y = kv;
  c.norm = op.kv_norm;
  c.eps = float(cfg_.norm_eps);
  c.freqs = op.freqs;
  c.rope_dim = op.rope_dim;
  c.p0 = p0;
  c.positions = pos;
  c.qdq = QdqKind::kFp8;
  c.qdq_block = 32;
  row_chains(&c, 1, nullptr, stream_);
}

void CudaModel::output_proj(int l, const float* o, int T, float* out) {
  const auto& op = *layers_[size_t(l)];
  const int H = H_, hd = cfg_.head_dim, G = G_, R = cfg_.o_lora_rank;
  // wo_a is block-diagonal over groups: a bf16 einsum without activation quantisation.
  const int gin = H * hd / G;
  for (int g = 0; g < G; ++g)
    op.wo_a.apply_rows(int64_t(g) * R, R, o + int64_t(g) * gin, H * hd, T, o2_ + int64_t(g) * R,
                       G * R, stream_);
  if (tp_ > 1) {
    // This rank's wo_b columns give an fp32 split-K partial; bf16 once after the sum.
    op.wo_b.apply_partial(o2_, T, out, stream_);
    all_reduce_round(out, size_t(T) * size_t(cfg_.dim));
  } else {
    op.wo_b.apply(o2_, T, out, stream_);
  }
}

// ---------------------------------------------------------------------------------------------
// Span setup, embedding, head.

void CudaModel::init_span(Span& sp, CudaSession& s, std::span<const int32_t> tokens,
                          bool prefill_layout, bool upload) {
  sp.s = &s;
  sp.p0 = s.len;
  sp.T = int(tokens.size());
  sp.prefill = prefill_layout;
  sp.pos.resize(size_t(sp.T));
  for (int t = 0; t < sp.T; ++t) sp.pos[size_t(t)] = sp.p0 + t;
  sp.topk_valid.assign(size_t(cfg_.n_layers), 0);
  sp.cand_width.assign(size_t(sp.T), 0);
  sp.emits_any.assign(size_t(cfg_.n_layers), 0);
  sp.kv_done.assign(size_t(cfg_.n_layers), 0);
  sp.pub_start.assign(size_t(sp.T), s.publisher);
  if (hasher_) {
    const int hl = hasher_->history_len();
    std::vector<int64_t> ctx, ids;
    for (int64_t i = std::max<int64_t>(0, s.len - hl); i < s.len; ++i)
      ctx.push_back(compressed_id(s.toks[size_t(i)]));
    for (int32_t t : tokens) ids.push_back(compressed_id(t));
    sp.hash = hasher_->hash(ctx, ids);
    if (upload) upload_hash(sp);
  }
}

void CudaModel::upload_hash(const Span& sp) {
  // Device layout [engram layer][row][col], so each layer's ids are one [T, n_cols] block.
  const int nl = hasher_->n_layers(), nc = hasher_->n_cols();
  const size_t per = hasher_->ids_per_position();
  std::vector<int64_t> by_layer(size_t(nl) * size_t(sp.T) * size_t(nc));
  for (int e = 0; e < nl; ++e)
    for (int t = 0; t < sp.T; ++t)
      std::copy_n(sp.hash.begin() + int64_t(size_t(t) * per + size_t(e) * size_t(nc)), nc,
                  by_layer.begin() + (int64_t(e) * sp.T + t) * nc);
  to_device(hash_, by_layer);
}

int CudaModel::last_emitter(int64_t p) const {
  int last = -1;
  for (int l : cfg_.kv_source_layers)
    if ((p + 1) % cfg_.role(l).compress_ratio == 0) last = std::max(last, l);
  return last;
}

void CudaModel::embed(const Span& sp, std::span<const int32_t> tokens, float* X, float* pre_mix) {
  for (int t = 0; t < sp.T; ++t) {
    const int32_t id = tokens[size_t(t)];
    UF_CHECK(id >= 0 && id < cfg_.vocab_size,
             "token id {} at position {} is outside the vocab of {}", id, sp.pos[size_t(t)],
             cfg_.vocab_size);
  }
  to_device(ids_, std::vector<int32_t>(tokens.begin(), tokens.end()));
  embed_rows(embed_, ids_, sp.T, cfg_.hc_mult, X, pre_mix, stream_);
}

void CudaModel::head(const float* X, const float* pre_mix, int row0, int n, float* logits_dev) {
  const int hc = cfg_.hc_mult, D = cfg_.dim;
  // hc_pre + rms_norm in one kernel (bitwise the two).
  hc_pre_norm(hc_, X + int64_t(row0) * hc * D, pre_mix + int64_t(row0) * hc, norm_,
              float(cfg_.norm_eps), n, x_, stream_);
  apply_head(x_, n, logits_dev);
}

// ---------------------------------------------------------------------------------------------
// The stack.

void CudaModel::forward(CudaSession& s, std::span<const int32_t> tokens, bool prefill_layout,
                        bool all_logits, float* logits, float* main_hidden, int* publisher,
                        bool keep_logits) {
  const int T = int(tokens.size());
  UF_CHECK(T > 0, "forward: no tokens");
  UF_CHECK(T <= tmax_, "forward: {} rows exceed the CUDA backend's span capacity of {}", T, tmax_);
  UF_CHECK(s.len + T <= s.cap, "session of capacity {} cannot take {} more tokens after {}", s.cap,
           T, s.len);
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  if (!prefill_layout) {
    forward_ring(s, tokens, all_logits, logits, main_hidden, publisher, keep_logits);
    return;
  }
  // The prefill layout (the first chunk of a fresh session, CED) stays host-driven.
  Span sp;
  init_span(sp, s, tokens, prefill_layout);
  embed(sp, tokens, X_, pre_);
  if (!main_hidden) main_hidden = mh_;
  run_layers(sp, X_, pre_, 0, cfg_.n_layers, n_taps() > 0 ? main_hidden : nullptr);
  const int V = cfg_.vocab_size;
  const int rows = all_logits ? T : 1;
  // A split head is a collective: every rank runs it, rank 0 alone downloads.
  if (logits || split_head_) head(X_, pre_, all_logits ? 0 : T - 1, rows, logits_);
  if (logits) {
    UF_CUDA_CHECK(cudaMemcpyAsync(logits, logits_, size_t(rows) * size_t(V) * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream_));
  }
  sync();
  if (publisher) {
    int pub = sp.pub_start.empty() ? s.publisher : sp.pub_start[0];
    for (int l : cfg_.kv_source_layers)
      if (sp.emits_any[size_t(l)]) pub = l;
    std::fill_n(publisher, T, pub);
  }
}

void CudaModel::run_layers(Span& sp, float* X, float* pre_mix, int l0, int l1, float* main_hidden) {
  const int hc = cfg_.hc_mult, D = cfg_.dim, T = sp.T;
  for (int l = l0; l < l1; ++l) {
    const auto& role = cfg_.role(l);
    if (role.engram) {
      const int64_t nc = hasher_->n_cols();
      const int64_t* hash =
          sp.program ? sp.program->at<int64_t>(block_dev_, sp.program->hash) : hash_;
      const DeviceEngram& engram = *layers_[size_t(l)]->engram;
      DeviceEngram::RowReduce reduce;  // a row-split table (TP): sum the ranks' gathers
      if (engram.split()) reduce = [this](float* v, size_t n) { all_reduce_round(v, n); };
      engram.apply(hash + int64_t(role.engram_index) * T * nc, X, T, X, stream_, reduce);
    }
    if (role.dspark_tap && main_hidden) {
      const auto& ids = cfg_.dspark_target_layer_ids;
      const int tap = int(std::find(ids.begin(), ids.end(), l) - ids.begin());
      const int MH = n_taps() * D;
      tap_mean(X, T, hc, D, main_hidden + int64_t(tap) * D, MH, stream_);
    }
    block(sp, l, X, pre_mix);
  }
}

void CudaModel::block(Span& sp, int l, float* X, float* pre_mix) {
  layer(l, X, sp.T, pre_mix, [&](const float* x, float* out) { attention(sp, l, x, out); });
}

// mHC around each sublayer in 2 fused kernels (ops/mhc.cu), bitwise the unfused ops:
// hc_mix_pre_norm (the mixes' finish + collapse + norm) before the sublayer, hc_post_mixes (the
// expand + the next sublayer's mixes partials over the new stream) after it; prefill spans take
// hc_post_mixes_mma for the latter (ops/mhc_prefill.h: the mixes on the tensor cores). The stream
// ping-pongs: the attention's expand writes R_, the FFN's writes X back (a fused expand cannot
// write in place), so no copy of X is needed. The partials of layer l's attention mixes come from
// layer l - 1's FFN expand when that was the previous layer() call on the same X and rows
// (mix_ready_) and nothing rewrote X in between: the caller applies Engram to X before an Engram
// layer (run_layers), so those layers, the first of a stack (after the embedding) and any call
// not preceded by its predecessor (CED's tail) compute them here (hc_mixes_partial). DSpark taps
// only read X. The stacks: backbone layers [0, n_layers), DSpark stages [n_layers, n_total).
void CudaModel::layer(int l, float* X, int T, float* pre_mix,
                      const std::function<void(const float* x, float* out)>& attention) {
  const auto& op = *layers_[size_t(l)];
  const float eps = float(cfg_.norm_eps);
  const bool ready =
      mix_ready_.layer == l && mix_ready_.X == X && mix_ready_.T == T && !cfg_.role(l).engram;
  mix_ready_ = MixReady{};
  if (!ready) hc_mixes_partial(hc_, op.hc_attn_fn, X, T, mix_scratch_, stream_);
  hc_mix_pre_norm(hc_, op.hc_attn_scale, op.hc_attn_base, mix_scratch_, X, pre_mix, op.attn_norm,
                  eps, T, x_, apre_, apost_, acomb_, stream_);
  attention(x_, y_);
  // The expand + the next sublayer's mixes: prefill spans on the tensor cores where the fn has
  // its terms (hc_post_mixes_mma: the same out, the mixes to fp32 re-association), decode rows
  // (spec == plain) and the expand alone on hc_post_mixes.
  const auto expand = [&](const float* R, const float* post, const float* comb, float* out,
                          const DeviceWeight& fn, const HcFnTerms& terms) {
    if (T > kMaxDecodeRows && !fn.empty() && !terms.empty())
      hc_post_mixes_mma(hc_, y_, R, post, comb, T, out, terms, mix_scratch_, stream_);
    else
      hc_post_mixes(hc_, y_, R, post, comb, T, out, fn, mix_scratch_, stream_);
  };
  expand(X, apost_, acomb_, R_, op.hc_ffn_fn, op.hc_ffn_terms);

  // As the CPU (and the reference): the FFN mixes' pre goes to pre_mix (the next layer's
  // attention), the FFN collapses with the attention's pre.
  hc_mix_pre_norm(hc_, op.hc_ffn_scale, op.hc_ffn_base, mix_scratch_, R_, apre_, op.ffn_norm, eps,
                  T, x_, pre_mix, fpost_, fcomb_, stream_);
  // fold_moe_combine: the routed + shared slots, combined inside the expand below.
  const bool fold = moe_slots_ && T <= kMaxDecodeRows;
  if (fold)
    op.moe->apply_partial_experts(x_, T, moe_slots_, gate_i_, gate_w_, stream_);
  else
    moe(l, x_, T, y_);
  const int next = l + 1;
  const int stack_end = l < cfg_.n_layers ? cfg_.n_layers : cfg_.n_total_layers();
  const bool fuse_next = next < stack_end && !cfg_.role(next).engram;
  const DeviceWeight next_fn = fuse_next ? layers_[size_t(next)]->hc_attn_fn : DeviceWeight{};
  const HcFnTerms next_terms = fuse_next ? layers_[size_t(next)]->hc_attn_terms : HcFnTerms{};
  if (fold) {
    const MoeSlots slots{moe_slots_, gate_i_, op.moe->top_k(), cfg_.role(l).n_routed_experts};
    hc_post_mixes_moe(hc_, slots, R_, fpost_, fcomb_, T, X, next_fn, mix_scratch_, stream_);
  } else {
    expand(R_, fpost_, fcomb_, X, next_fn, next_terms);
  }
  if (fuse_next) mix_ready_ = MixReady{next, X, T};
}

void CudaModel::moe(int l, const float* x, int T, float* y) {
  const auto& op = *layers_[size_t(l)];
  if (tp_ > 1) {
    // The rank's fp32 partial (no rounding after w2), summed over the ranks, rounded once.
    op.moe->apply_partial(x, T, y, gate_i_, gate_w_, stream_);
    all_reduce_round(y, size_t(T) * size_t(cfg_.dim));
  } else {
    op.moe->apply(x, T, y, gate_i_, gate_w_, stream_);
  }
}

// ---------------------------------------------------------------------------------------------
// Attention.

void CudaModel::kv_path(Span& sp, int l, const float* x) {
  const auto& role = cfg_.role(l);
  const auto& op = *layers_[size_t(l)];
  auto& st = sp.s->layers[size_t(l)];
  const int hd = cfg_.head_dim, r = role.compress_ratio, T = sp.T;
  const float eps = float(cfg_.norm_eps);
  // Entries of one span are consecutive (positions, or consecutive group ends): the latents are
  // computed in fp32 scratch (emit_, tmax rows) and go into the compressed KV at entries[0] as
  // bf16 (finish_entries).
  int64_t e0 = 0;
  int n = 0;
  float* lat = emit_;
  UF_CHECK(T <= tmax_, "layer {}: a span of {} rows exceeds the entry scratch of {}", l, T, tmax_);
  if (r == 1) {
    e0 = sp.pos[0];
    n = T;
    UF_CHECK(e0 + n <= st.ckv_cap, "layer {}: compressed KV of {} entries cannot take entry {}", l,
             st.ckv_cap, e0 + n - 1);
    op.c_wkv.apply(x, T, lat, stream_);
    rms_norm(op.c_norm, eps, lat, T, hd, lat, stream_);
  } else {
    const LinearCall kv_gate[] = {{&op.c_wkv, ckv_kv_}, {&op.c_wgate, ckv_gate_}};
    DeviceLinear::apply_group(kv_gate, x, T, stream_);
    auto row = [&](const float* local, const DeviceRing& ring, int64_t p) {
      const float* v = p >= sp.p0 ? local + (p - sp.p0) * hd : ring.get(p);
      UF_CHECK(v, "layer {}: the compressor's row of position {} is gone", l, p);
      return v;
    };
    std::vector<const float*> kr, gr;
    std::vector<int64_t> entries;
    for (int t = 0; t < T; ++t) {
      const int64_t p = sp.pos[size_t(t)];
      if ((p + 1) % r) continue;
      for (int i = 0; i < r; ++i) {
        kr.push_back(row(ckv_kv_, st.raw_kv, p + 1 - r + i));
        gr.push_back(row(ckv_gate_, st.raw_gate, p + 1 - r + i));
      }
      entries.push_back(p / r);
    }
    n = int(entries.size());
    if (n > 0) {
      e0 = entries[0];
      UF_CHECK(entries.back() < st.ckv_cap,
               "layer {}: compressed KV of {} entries cannot take entry {}", l, st.ckv_cap,
               entries.back());
      to_device(pool_kv_ptrs_, kr);
      to_device(pool_gate_ptrs_, gr);
      compress_pool(pool_kv_ptrs_, pool_gate_ptrs_, n, r, hd, lat, stream_);
      round_bf16(lat, int64_t(n) * hd, stream_);
      rms_norm(op.c_norm, eps, lat, n, hd, lat, stream_);
    }
    // After the pooling (stream order): the span's rows into the rings.
    for (int t = std::max(0, T - st.raw_kv.slots); t < T; ++t) {
      const int64_t p = sp.pos[size_t(t)];
      UF_CUDA_CHECK(cudaMemcpyAsync(st.raw_kv.put(p), ckv_kv_ + int64_t(t) * hd,
                                    size_t(hd) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
      UF_CUDA_CHECK(cudaMemcpyAsync(st.raw_gate.put(p), ckv_gate_ + int64_t(t) * hd,
                                    size_t(hd) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    }
  }
  if (n == 0) return;
  sp.emits_any[size_t(l)] = 1;
  const int64_t need = e0 + n;
  st.ckv_n = std::max(st.ckv_n, need);
  if (role.index_source) st.ikeys_n = std::max(st.ikeys_n, need);
  finish_entries(l, lat, n, st.ckv + e0 * hd,
                 role.index_source ? st.ikeys + e0 * cfg_.index_head_dim : nullptr, e0 * r, r,
                 nullptr);
}

void CudaModel::finish_entries(int l, float* lat, int n, uint16_t* lat_out, uint16_t* keys,
                               int64_t p0, int64_t stride, const int64_t* pos) {
  const auto& op = *layers_[size_t(l)];
  // The keys' rms_norm + rope + FP4 (UE8M0 scales, blocks of 32) and the latents' rope + FP4 (E4M3
  // scales, blocks of 16) in one launch after i_wk (which reads the latents before their rope).
  RowChain c[2];
  int nc = 0;
  auto entries = [&](RowChain& e, float* y, int width) {
    e.rows = n;
    e.n = width;
    e.y = y;
    e.freqs = op.freqs;
    e.rope_dim = op.rope_dim;
    e.p0 = p0;
    e.stride = stride;
    e.positions = pos;
  };
  if (cfg_.role(l).index_source) {
    // The keys in fp32 scratch (emit_keys_: n <= tmax rows), then as bf16 into the session.
    UF_CHECK(n <= tmax_, "finish_entries: {} entries exceed the key scratch of {}", n, tmax_);
    op.i_wk.apply(lat, n, emit_keys_, stream_);
    RowChain& k = c[nc++];
    entries(k, emit_keys_, cfg_.index_head_dim);
    k.y_bf16 = keys;
    k.norm = op.i_k_norm;
    k.eps = float(cfg_.norm_eps);
    k.qdq = QdqKind::kFp4E8m0;
    k.qdq_block = 32;
  }
  RowChain& v = c[nc++];
  entries(v, lat, cfg_.head_dim);
  v.y_bf16 = lat_out;
  v.qdq = QdqKind::kFp4E4m3;
  v.qdq_block = 16;
  row_chains(c, nc, nullptr, stream_);
}

void CudaModel::index_queries(int l, const float* x, const float* qr, int T, int64_t p0,
                              const int64_t* pos) {
  const auto& op = *layers_[size_t(l)];
  const int Hi = Hi_, ihd = cfg_.index_head_dim;
  op.i_wq_b.apply(qr, T, iq_, stream_);
  op.i_weights_proj.apply(x, T, iw_, stream_);
  // The whole model's index head count (not the rank's) sets the scale.
  const float wscale =
      float(std::pow(double(ihd), -0.5) * std::pow(double(cfg_.index_n_heads), -0.5));
  // scale_round_bf16(iw_) and the queries' rope + FP4 (UE8M0 scales, blocks of 32) in one launch.
  RowChain c[2];
  c[0].rows = T;
  c[0].n = Hi;
  c[0].y = iw_;
  c[0].scale_round = true;
  c[0].scale = wscale;
  c[1].rows = T;
  c[1].n = Hi * ihd;
  c[1].y = iq_;
  c[1].freqs = op.freqs;
  c[1].rope_dim = op.rope_dim;
  c[1].count = Hi;
  c[1].p0 = p0;
  c[1].positions = pos;
  c[1].qdq = QdqKind::kFp4E8m0;
  c[1].qdq_block = 32;
  row_chains(c, 2, nullptr, stream_);
}

int CudaModel::score_bucket(int64_t widest) const {
  if (forced_bucket_ >= 0) return std::min(forced_bucket_, int(score_buckets_.size()) - 1);
  int b = 0;
  while (b + 1 < int(score_buckets_.size()) && score_buckets_[size_t(b)] < widest) ++b;
  return b;
}

int CudaModel::score_stride(int64_t widest) const {
  // Whole 16-byte groups where the scratch allows (the row starts stay as aligned as with the
  // full width whenever index_width_ is a multiple of 4).
  return int(std::min<int64_t>(index_width_, std::max<int64_t>(4, (widest + 3) / 4 * 4)));
}

void CudaModel::index_select(int l, int T, const uint16_t* const* keys, const int32_t* vis,
                             const int32_t* width, int stride) {
  const auto& role = cfg_.role(l);
  const int Hi = Hi_, ihd = cfg_.index_head_dim;
  UF_CHECK(stride >= 1 && stride <= index_width_,
           "index_select: score stride {} outside 1..{} (the scratch width)", stride, index_width_);
  if (index_split_pays(l, T, stride)) {
    index_select_split(l, T, keys, vis, width, stride);
    return;
  }
  // The whole rows on this rank. Split by index heads, the rank's heads give an fp32 partial of
  // the head sum, rounded to bf16 once after the ranks' sum; a rank that holds every head (the
  // entry split's weights) scores as one GPU does.
  const bool head_partial = tp_ > 1 && !index_split_;
  if (role.candidate_restricted && cfg_.candidate_source_layer >= 0 && cand_listed_) {
    // The pool's entries only (EntryList): the same scores and selection as scoring every
    // visible entry and masking the rest, at the pool's size instead of the context's.
    const int cap = int(cand_cap_);
    const EntryList list{cand_list_, cand_n_, cand_cap_};
    if (head_partial) {
      index_scores_list(iq_, iw_, T, Hi, ihd, keys, list, score_, stream_, /*round_sum=*/false);
      all_reduce_round(score_, size_t(T) * size_t(cap));
    } else {
      index_scores_list(iq_, iw_, T, Hi, ihd, keys, list, score_, stream_);
    }
    topk_select(score_, T, cap, cand_n_, cfg_.index_topk, cand_n_, topk_[size_t(l)], stream_,
                index_ws_, cand_list_, cand_cap_);
    return;
  }
  if (head_partial) {
    index_scores_partial(iq_, iw_, T, Hi, ihd, keys, vis, width, stride, score_, stream_);
    all_reduce_round(score_, size_t(T) * size_t(stride));
  } else {
    index_scores(iq_, iw_, T, Hi, ihd, keys, vis, width, stride, score_, stream_);
  }
  if (role.candidate_source) {
    const EntryListOut out{cand_list_, cand_n_, cand_cap_};
    cand_listed_ = candidate_mask(score_, T, stride, width, vis, cfg_.candidate_topk_blocks,
                                  cfg_.candidate_block_size, keep_, stream_, index_ws_,
                                  cand_list_ ? &out : nullptr);
  } else if (role.candidate_restricted && cfg_.candidate_source_layer >= 0) {
    mask_scores(score_, keep_, T, stride, width, stream_);
  }
  topk_select(score_, T, stride, width, cfg_.index_topk, vis, topk_[size_t(l)], stream_, index_ws_);
}

void CudaModel::indexer(Span& sp, int l, const float* x, const float* qr) {
  const auto& role = cfg_.role(l);
  const int T = sp.T, r = role.compress_ratio;
  sp.topk_valid[size_t(l)] = 0;
  const int64_t end_entries = (sp.p0 + T) / r;
  if (sp.prefill && end_entries == 0) return;  // the reference skips the indexer entirely
  index_queries(l, x, qr, T, sp.p0, nullptr);
  const int cand_src = cfg_.candidate_source_layer;
  // Owner keys: the indexer always scores its owner's keys.
  const int src = role.index_keys_from;
  const auto& owner = sp.s->layers[size_t(src)];
  std::vector<int32_t> vis(static_cast<size_t>(T)), width(static_cast<size_t>(T));
  std::vector<const uint16_t*> keys(static_cast<size_t>(T), owner.ikeys);
  for (int t = 0; t < T; ++t) {
    const int64_t p = sp.pos[size_t(t)];
    const int v = int(visible(p, r));
    vis[size_t(t)] = v;
    width[size_t(t)] = int(end_entries);  // prefill layout: every row scores the span's entries
    UF_CHECK(owner.ikeys_n >= v,
             "layer {}: index keys of layer {} hold {} entries, position {} needs {}", l, src,
             owner.ikeys_n, p, v);
    UF_CHECK(width[size_t(t)] <= index_width_,
             "layer {}: {} index scores exceed the scratch width {}", l, width[size_t(t)],
             index_width_);
    if (role.candidate_restricted && cand_src >= 0 && width[size_t(t)] > 0)
      UF_CHECK(sp.cand_width[size_t(t)] == width[size_t(t)],
               "layer {}: candidate pool of width {} does not match {} index scores", l,
               sp.cand_width[size_t(t)], width[size_t(t)]);
  }
  to_device(vis_, vis);
  to_device(width_, width);
  to_device(key_ptrs_, keys);
  int widest = 0;
  for (int w : width) widest = std::max(widest, w);
  index_select(l, T, key_ptrs_, vis_, width_, score_stride(widest));
  if (role.candidate_source)
    for (int t = 0; t < T; ++t) sp.cand_width[size_t(t)] = width[size_t(t)];
  sp.topk_valid[size_t(l)] = 1;
}

void CudaModel::attend(int l, int T, const float* const* window, int n_window, const int32_t* topk,
                       int k, const uint16_t* ckv, const uint16_t* const* ckv_ref, int64_t p0,
                       const int64_t* pos) {
  const auto& op = *layers_[size_t(l)];
  const int H = H_, hd = cfg_.head_dim;
  const float scale = float(std::pow(double(hd), -0.5));
  // Prefill spans on the tensor cores (all rows in one launch, no scratch) once they give the
  // SMs enough CTAs (one a row and 8 heads: bench_cuda_attention, TP8 rank, 64 rows: 122 us
  // against the split path's 101, 512 rows: 286 against 802); where the kernel does not apply
  // it launches nothing and the split path below runs.
  const int64_t mma_ctas = int64_t(T) * ((H + 7) / 8);
  if (opts_.prefill_attention_mma && T > decode_rows_ && 2 * mma_ctas >= device_sm_count() &&
      sparse_attn_mma(q_, T, H, hd, window, n_window, topk, k, ckv, op.sink, scale, o_, stream_,
                      ckv_ref, AttnRope{op.freqs, op.rope_dim, p0, pos}))
    return;
  for (int t0 = 0; t0 < T; t0 += attn_rows_) {
    const int n = std::min(attn_rows_, T - t0);
    const int64_t o = int64_t(t0) * H * hd;
    // q's rope rides on its staging, the output's inverse rope on the merge.
    const AttnRope rope{op.freqs, op.rope_dim, p0 + t0, pos ? pos + t0 : nullptr};
    sparse_attn(q_ + o, n, H, hd, window + int64_t(t0) * n_window, n_window,
                topk ? topk + int64_t(t0) * k : nullptr, k, ckv, op.sink, scale, o_ + o, stream_,
                ckv_ref, attn_scratch_, rope);
  }
}

void CudaModel::attention(Span& sp, int l, const float* x, float* out) {
  if (sp.program) {
    attention_program(*sp.program, l, x, out);
    return;
  }
  // Host-driven spans are prefill-layout ones (forward, CED); ring spans are span programs.
  UF_CHECK(sp.prefill, "layer {}: a ring-layout span reached the host-driven attention", l);
  const auto& role = cfg_.role(l);
  auto& st = sp.s->layers[size_t(l)];
  const int T = sp.T, hd = cfg_.head_dim, W = cfg_.window_size;
  project_qkv(l, x, T, sp.p0, qr_, q_, kv_);
  const int32_t* topk = nullptr;
  int k = 0;
  const uint16_t* ckv = nullptr;
  if (role.compress_ratio > 0) {
    if (role.kv_source && !sp.kv_done[size_t(l)]) kv_path(sp, l, x);
    if (role.index_source) indexer(sp, l, x, qr_);
    if (role.topk_from >= 0 && sp.topk_valid[size_t(role.topk_from)]) {
      topk = topk_[size_t(role.topk_from)];
      k = cfg_.index_topk;  // rows with fewer selections are padded with -1 (empty slots)
    }
    ckv = sp.s->layers[size_t(role.kv_from)].ckv;
  }
  // The prefill layout: row t sees the span's own rows from max(p0, p - W + 1) to p.
  const int nw = std::min(T, W);
  std::vector<const float*> slots(size_t(T) * size_t(nw));
  for (int t = 0; t < T; ++t) {
    const int64_t p = sp.pos[size_t(t)];
    const float** row = slots.data() + int64_t(t) * nw;
    const int64_t lo = std::max(sp.p0, p - W + 1);
    for (int j = 0; j < nw; ++j) row[j] = lo + j <= p ? kv_ + (lo + j - sp.p0) * hd : nullptr;
  }
  to_device(win_ptrs_, slots);
  attend(l, T, win_ptrs_, nw, topk, k, ckv, nullptr, sp.p0, nullptr);
  // After the attention (stream order): the span's window KV into the ring.
  for (int t = std::max(0, T - st.window.slots); t < T; ++t)
    UF_CUDA_CHECK(cudaMemcpyAsync(st.window.put(sp.pos[size_t(t)]), kv_ + int64_t(t) * hd,
                                  size_t(hd) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  output_proj(l, o_, T, out);
}

}  // namespace uf::cuda
