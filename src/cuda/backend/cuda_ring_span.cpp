// Ring-layout spans (decode steps, verify rows, prefill chunks after the first) as a span program.
//
// The host-driven path (cuda_model.cpp) passes positions as kernel arguments and builds slot lists
// of session pointers per layer, so its launches differ at every step. Here the host writes every
// input that depends on the position or the session into one pinned block (plan_ring_span: ids,
// positions, Engram ids, ring and compressed-KV base pointers, the compressor's pooled rows, the
// indexer's widths) and does all the bookkeeping and checks of the CPU's span logic; the program
// (ring_program) copies the block to the device and launches kernels that read it there. The
// program's launches depend on (rows, all_logits, head) only, so they are captured once as a CUDA
// graph and replayed for every step of every session: a decode step is one memcpy node plus
// kernels, launched by one cudaGraphLaunch.
//
// Work that a position may or may not need (a compressor emitting 0 or more entries) always runs
// on the largest count the row count allows (SpanBlock::Layer::gmax) into model scratch; a copy
// kernel moves the first n_emit rows into the session. A row's values never depend on the other
// rows of its call, so padding rows change nothing (spec == plain holds as before).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "core/error.h"
#include "cuda/backend/backend_kernels.h"
#include "cuda/backend/cuda_model.h"
#include "cuda/backend/model_internal.h"
#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#include "cuda/ops/attention.h"
#include "cuda/tp/nccl_comm.h"

namespace uf::cuda {

namespace {

// Entries a query at position p can see of a ratio-r compressed stream.
inline int64_t visible(int64_t p, int r) { return (p + 1) / r; }

// The most compressed entries T consecutive positions can emit at ratio r (multiples of r).
inline int max_emitted(int T, int r) { return r == 1 ? T : (T + r - 1) / r; }

constexpr size_t kPtr = sizeof(void*);

}  // namespace

CudaModel::SpanBlock CudaModel::span_block(int T) const {
  SpanBlock b;
  b.T = T;
  BlockPacker pk;
  b.p0 = pk.add(1, sizeof(int64_t));
  b.ids = pk.add(size_t(T), sizeof(int32_t));
  b.pos = pk.add(size_t(T), sizeof(int64_t));
  if (hasher_)
    b.hash = pk.add(size_t(hasher_->n_layers()) * size_t(T) * size_t(hasher_->n_cols()),
                    sizeof(int64_t));
  b.layers.resize(size_t(cfg_.n_layers));
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const auto& role = cfg_.role(l);
    auto& L = b.layers[size_t(l)];
    L.window = pk.add(1, kPtr);
    if (role.compress_ratio <= 0) continue;
    L.ckv_src = pk.add(1, kPtr);
    if (role.kv_source) {
      const int r = role.compress_ratio;
      L.gmax = max_emitted(T, r);
      L.n_emit = pk.add(1, sizeof(int32_t));
      L.emit_pos = pk.add(size_t(L.gmax), sizeof(int64_t));
      L.ckv_dst = pk.add(1, kPtr);
      if (role.index_source) L.ikey_dst = pk.add(1, kPtr);
      if (r > 1) {
        L.raw_kv = pk.add(1, kPtr);
        L.raw_gate = pk.add(1, kPtr);
        L.pool_kv = pk.add(size_t(L.gmax) * size_t(r), kPtr);
        L.pool_gate = pk.add(size_t(L.gmax) * size_t(r), kPtr);
      }
    }
    if (role.index_source) {
      L.vis = pk.add(size_t(T), sizeof(int32_t));
      L.width = pk.add(size_t(T), sizeof(int32_t));
      L.keys = pk.add(size_t(T), kPtr);
    }
  }
  b.bytes = pk.bytes();
  return b;
}

// ---------------------------------------------------------------------------------------------
// Host: the span's inputs and the CPU span logic's bookkeeping (cpu/model.cpp, ring layout).

void CudaModel::plan_ring_span(Span& sp, SpanBlock& b, std::span<const int32_t> tokens,
                               int ced_dec) {
  CudaSession& s = *sp.s;
  uint8_t* h = block_host_;
  const int T = sp.T, hd = cfg_.head_dim, ihd = cfg_.index_head_dim, W = cfg_.window_size;
  const int64_t p0 = sp.p0;
  int64_t widest = 0;  // the most index scores a row of the span has
  *b.at<int64_t>(h, b.p0) = p0;
  for (int t = 0; t < T; ++t) {
    const int32_t id = tokens[size_t(t)];
    UF_CHECK(id >= 0 && id < cfg_.vocab_size,
             "token id {} at position {} is outside the vocab of {}", id, p0 + t, cfg_.vocab_size);
    b.at<int32_t>(h, b.ids)[t] = id;
    b.at<int64_t>(h, b.pos)[t] = p0 + t;
  }
  if (hasher_) {  // [engram layer][row][col], as upload_hash
    const int nl = hasher_->n_layers(), nc = hasher_->n_cols();
    const size_t per = hasher_->ids_per_position();
    int64_t* dst = b.at<int64_t>(h, b.hash);
    for (int e = 0; e < nl; ++e)
      for (int t = 0; t < T; ++t)
        std::copy_n(sp.hash.begin() + int64_t(size_t(t) * per + size_t(e) * size_t(nc)), nc,
                    dst + (int64_t(e) * T + t) * nc);
  }
  // A CED encoder chunk (ced_dec >= 0) runs layers [0, ced_dec) and layer ced_dec's KV path only.
  const int n_layers = ced_dec >= 0 ? ced_dec + 1 : cfg_.n_layers;
  for (int l = 0; l < n_layers; ++l) {
    const auto& role = cfg_.role(l);
    const auto& L = b.layers[size_t(l)];
    auto& st = s.layers[size_t(l)];
    const bool kv_only = l == ced_dec;
    *b.at<float*>(h, L.window) = st.window.data;
    if (role.compress_ratio > 0) {
      const int r = role.compress_ratio;
      if (role.kv_source) {
        // CudaModel::kv_path: the entries this span emits are consecutive from e0.
        int64_t e0 = 0;
        int n = 0;
        int64_t* epos = b.at<int64_t>(h, L.emit_pos);
        if (r == 1) {
          e0 = p0;
          n = T;
          for (int t = 0; t < T; ++t) epos[t] = p0 + t;
        } else {
          auto row = [&](float* local, const DeviceRing& ring, int64_t p) -> const float* {
            const float* v = p >= p0 ? local + (p - p0) * hd : ring.get(p);
            UF_CHECK(v, "layer {}: the compressor's row of position {} is gone", l, p);
            return v;
          };
          const float** kr = b.at<const float*>(h, L.pool_kv);
          const float** gr = b.at<const float*>(h, L.pool_gate);
          for (int t = 0; t < T; ++t) {
            const int64_t p = p0 + t;
            if ((p + 1) % r) continue;
            for (int i = 0; i < r; ++i) {
              kr[n * r + i] = row(ckv_kv_, st.raw_kv, p + 1 - r + i);
              gr[n * r + i] = row(ckv_gate_, st.raw_gate, p + 1 - r + i);
            }
            if (n == 0) e0 = p / r;
            epos[n] = (p / r) * r;
            ++n;
          }
          for (int g = n; g < L.gmax; ++g) {  // padding groups pool scratch rows (discarded)
            for (int i = 0; i < r; ++i) {
              kr[g * r + i] = ckv_kv_;
              gr[g * r + i] = ckv_gate_;
            }
            epos[g] = 0;
          }
          *b.at<float*>(h, L.raw_kv) = st.raw_kv.data;
          *b.at<float*>(h, L.raw_gate) = st.raw_gate.data;
          for (int t = std::max(0, T - st.raw_kv.slots); t < T; ++t) {
            st.raw_kv.put(p0 + t);
            st.raw_gate.put(p0 + t);
          }
        }
        UF_CHECK(n <= L.gmax, "layer {}: {} compressed entries from {} rows (at most {})", l, n, T,
                 L.gmax);
        UF_CHECK(n == 0 || e0 + n <= st.ckv_cap,
                 "layer {}: compressed KV of {} entries cannot take entry {}", l, st.ckv_cap,
                 e0 + n - 1);
        *b.at<int32_t>(h, L.n_emit) = n;
        *b.at<uint16_t*>(h, L.ckv_dst) = st.ckv + e0 * hd;
        if (role.index_source) *b.at<uint16_t*>(h, L.ikey_dst) = st.ikeys + e0 * ihd;
        if (n > 0) {
          sp.emits_any[size_t(l)] = 1;
          st.ckv_n = std::max(st.ckv_n, e0 + n);
          if (role.index_source) st.ikeys_n = std::max(st.ikeys_n, e0 + n);
        }
      }
      if (kv_only) continue;
      if (role.index_source) {
        // CudaModel::indexer, ring layout: every row scores its visible entries.
        const auto& owner = s.layers[size_t(role.index_keys_from)];
        const int cand_src = cfg_.candidate_source_layer;
        for (int t = 0; t < T; ++t) {
          const int64_t p = p0 + t;
          const int v = int(visible(p, r));
          UF_CHECK(owner.ikeys_n >= v,
                   "layer {}: index keys of layer {} hold {} entries, position {} needs {}", l,
                   role.index_keys_from, owner.ikeys_n, p, v);
          UF_CHECK(v <= index_width_, "layer {}: {} index scores exceed the scratch width {}", l, v,
                   index_width_);
          if (role.candidate_restricted && cand_src >= 0 && v > 0)
            UF_CHECK(sp.cand_width[size_t(t)] == v,
                     "layer {}: candidate pool of width {} does not match {} index scores", l,
                     sp.cand_width[size_t(t)], v);
          b.at<int32_t>(h, L.vis)[t] = v;
          b.at<int32_t>(h, L.width)[t] = v;
          widest = std::max<int64_t>(widest, v);
          b.at<const uint16_t*>(h, L.keys)[t] = owner.ikeys;
          if (role.candidate_source) sp.cand_width[size_t(t)] = v;
        }
        sp.topk_valid[size_t(l)] = 1;
      }
      UF_CHECK(role.topk_from < 0 || sp.topk_valid[size_t(role.topk_from)],
               "layer {}: its top-k comes from layer {}, which has not run its indexer", l,
               role.topk_from);
      *b.at<const uint16_t*>(h, L.ckv_src) = s.layers[size_t(role.kv_from)].ckv;
    }
    if (kv_only) continue;
    // The window rows before the span must still be in the ring; then the span's rows go in.
    const int64_t gone = st.window.first_missing(std::max<int64_t>(0, p0 - W + 1), p0);
    UF_CHECK(gone < 0, "layer {}: window KV of position {} is gone (span at {})", l, gone, p0);
    UF_CHECK(st.window.slots == W + opts_.max_rows,
             "layer {}: window ring of {} slots, the span program expects {}", l, st.window.slots,
             W + opts_.max_rows);
    for (int t = std::max(0, T - st.window.slots); t < T; ++t) st.window.put(p0 + t);
  }
  b.score_bucket = T <= opts_.max_rows ? score_bucket(widest) : 0;
  b.score_stride =
      T <= opts_.max_rows ? int(score_buckets_[size_t(b.score_bucket)]) : score_stride(widest);
}

// ---------------------------------------------------------------------------------------------
// Device: launches only, every varying input read from block_dev_.

void CudaModel::ring_program(const SpanBlock& b, bool all_logits, bool head_rows, int ced_dec) {
  const int T = b.T;
  UF_CUDA_CHECK(cudaMemcpyAsync(block_dev_, block_host_, b.bytes, cudaMemcpyHostToDevice, stream_));
  Span sp;
  sp.T = T;
  sp.program = &b;
  embed_rows(embed_, b.at<int32_t>(block_dev_, b.ids), T, cfg_.hc_mult, X_, pre_, stream_);
  if (ced_dec >= 0) {  // a CED encoder chunk
    run_layers(sp, X_, pre_, 0, ced_dec, n_taps() > 0 ? mh_ : nullptr);
    ced_decoder_kv(sp, X_, pre_, T);
    return;
  }
  run_layers(sp, X_, pre_, 0, cfg_.n_layers, n_taps() > 0 ? mh_ : nullptr);
  if (head_rows) head(X_, pre_, all_logits ? 0 : T - 1, all_logits ? T : 1, logits_);
}

void CudaModel::attention_program(const SpanBlock& b, int l, const float* x, float* out) {
  const auto& role = cfg_.role(l);
  const auto& op = *layers_[size_t(l)];
  const auto& L = b.layers[size_t(l)];
  const int T = b.T, hd = cfg_.head_dim, W = cfg_.window_size;
  const int64_t* pos = b.at<int64_t>(block_dev_, b.pos);
  const int slots = W + opts_.max_rows;  // CudaSession window rings (new_session)
  float* const* ring = b.at<float*>(block_dev_, L.window);
  // Graph branches (CudaModelOptions::graph_branches): the compressor (it reads only x) and the
  // indexer (x and the normed qr) on side streams beside the q / kv projections; the attention
  // joins them. Off, fork / join run them in place. Their buffers (the
  // compressor's rows and entries, the index queries, scores and selections) are theirs alone,
  // and a layer that is both keeps its keys' order: the index scores wait for the compressor.
  const bool kv_branch = role.compress_ratio > 0 && role.kv_source;
  const bool index_branch = role.compress_ratio > 0 && role.index_source;
  if (kv_branch) {
    fork(0);
    kv_program(b, l, x);
    unfork();
  }
  const LinearCall calls[] = {{&op.wq_a, qr_}, {&op.wkv, kv_}};
  DeviceLinear::apply_group(calls, x, T, stream_);
  // One launch after the projections (bitwise the ops): rms_norm(q_norm) on qr, and on kv
  // rms_norm(kv_norm) + rope + qdq_fp8 (blocks of 32), for steps with the window ring put and the
  // slot list. q's rope rides on the attention's q staging (attend).
  RowChain c[2];
  int nc = 0;
  if (cfg_.q_lora_rank <= kRowChainMaxNorm) {
    RowChain& q = c[nc++];
    q.rows = T;
    q.n = cfg_.q_lora_rank;
    q.y = qr_;
    q.norm = op.q_norm;
    q.eps = float(cfg_.norm_eps);
  } else {
    rms_norm(op.q_norm, float(cfg_.norm_eps), qr_, T, cfg_.q_lora_rank, qr_, stream_);
  }
  RowChain& kvc = c[nc++];
  kvc.rows = T;
  kvc.n = hd;
  kvc.y = kv_;
  kvc.norm = op.kv_norm;
  kvc.eps = float(cfg_.norm_eps);
  kvc.qdq = QdqKind::kFp8;
  kvc.qdq_block = 32;
  kvc.freqs = op.freqs;
  kvc.rope_dim = op.rope_dim;
  kvc.positions = pos;
  // Steps (T <= max_rows) put the span's KV rows into the window ring and build the slot list in
  // the same launch, BEFORE the attention reads the ring. That cannot overwrite a row the attention
  // reads: row t reads ring rows of positions q in [p0 - W + 1, p0 - 1] only (its positions >= p0
  // come from kv_), the put writes positions p in [p0, p0 + T - 1], and two positions share a slot
  // only if they differ by a multiple of slots = W + max_rows, while 0 < p - q <= T + W - 2 <
  // W + max_rows. The slot list holds pointers only (no ring row is read in this launch), and
  // nothing between here and the attention writes the window ring (the compressor and the indexer
  // have their own buffers). Longer chunks put their last `slots` rows after the attention: those
  // can take slots of window positions still to be read.
  const bool early = T <= opts_.max_rows;
  WindowSlotsJob ws;
  ws.pos = pos;
  ws.p0 = b.at<int64_t>(block_dev_, b.p0);
  ws.T = T;
  ws.W = W;
  ws.ring = ring;
  ws.ring_slots = slots;
  ws.local = kv_;
  ws.hd = hd;
  ws.out = win_ptrs_;
  if (early) {
    kvc.ring = ring;
    kvc.ring_pos = pos;
    kvc.ring_slots = slots;
  }
  row_chains(c, nc, early ? &ws : nullptr, stream_);
  if (index_branch) {
    fork(1);
    index_queries(l, x, qr_, T, 0, pos);
    if (kv_branch) join(0);  // this layer's new index keys
    index_select(l, T, b.at<const uint16_t*>(block_dev_, L.keys), b.at<int32_t>(block_dev_, L.vis),
                 b.at<int32_t>(block_dev_, L.width), b.score_stride);
    unfork();
  }
  op.wq_b.apply(qr_, T, q_, stream_);
  const int32_t* topk = nullptr;
  int k = 0;
  const uint16_t* const* ckv = nullptr;
  if (kv_branch) join(0);
  if (index_branch) join(1);
  if (role.compress_ratio > 0) {
    if (role.topk_from >= 0) {  // plan_ring_span checked that its indexer ran
      topk = topk_[size_t(role.topk_from)];
      k = cfg_.index_topk;
    }
    ckv = b.at<const uint16_t*>(block_dev_, L.ckv_src);
  }
  if (!early) build_window_slots(pos, ws.p0, T, W, ring, slots, kv_, hd, win_ptrs_, stream_);
  attend(l, T, win_ptrs_, W, topk, k, nullptr, ckv, 0, pos);
  if (!early) put_ring_rows(kv_, T, hd, pos, ring, slots, stream_);  // after the attention read it
  output_proj(l, o_, T, out);
}

void CudaModel::kv_program(const SpanBlock& b, int l, const float* x) {
  const auto& role = cfg_.role(l);
  const auto& op = *layers_[size_t(l)];
  const auto& L = b.layers[size_t(l)];
  const int T = b.T, hd = cfg_.head_dim, r = role.compress_ratio, G = L.gmax;
  const int64_t* pos = b.at<int64_t>(block_dev_, b.pos);
  const int64_t* emit_pos = b.at<int64_t>(block_dev_, L.emit_pos);
  const int32_t* n = b.at<int32_t>(block_dev_, L.n_emit);
  // Launch 1: the G entries' source (c_wkv's rows, or compress_pool + round_bf16 of the pre-pool
  // rows) and rms_norm(c_norm); without an indexer also finish_entries' latent chain (rope + FP4,
  // E4M3 scales, blocks of 16) and copy_rows_to into the session. Launch 2 (indexer layers), after
  // i_wk read the normed latents: the keys' chain (rms_norm + rope + FP4, UE8M0 scales, blocks of
  // 32) and the latents' chain, each with its copy. Bitwise the unfused ops.
  RowChain src;
  src.rows = G;
  src.n = hd;
  src.y = emit_;
  src.norm = op.c_norm;
  src.eps = float(cfg_.norm_eps);
  auto entries = [&](RowChain& e) {
    e.freqs = op.freqs;
    e.rope_dim = op.rope_dim;
    e.positions = emit_pos;
    e.copy_n = n;
  };
  RowChain lat;
  lat.rows = G;
  lat.n = hd;
  lat.y = emit_;
  entries(lat);
  lat.qdq = QdqKind::kFp4E4m3;
  lat.qdq_block = 16;
  lat.copy_dst_bf16 = b.at<uint16_t*>(block_dev_, L.ckv_dst);
  if (!role.index_source) {  // the latents' chain continues the source's
    src.freqs = lat.freqs;
    src.rope_dim = lat.rope_dim;
    src.positions = lat.positions;
    src.qdq = lat.qdq;
    src.qdq_block = lat.qdq_block;
    src.copy_n = lat.copy_n;
    src.copy_dst_bf16 = lat.copy_dst_bf16;
  }
  RowChain c[3];
  int nc = 0;
  c[nc++] = src;
  if (r == 1) {
    op.c_wkv.apply(x, T, emit_, stream_);
    row_chains(c, nc, nullptr, stream_);
  } else {
    const LinearCall kv_gate[] = {{&op.c_wkv, ckv_kv_}, {&op.c_wgate, ckv_gate_}};
    DeviceLinear::apply_group(kv_gate, x, T, stream_);
    c[0].pool_kv = b.at<const float*>(block_dev_, L.pool_kv);
    c[0].pool_gate = b.at<const float*>(block_dev_, L.pool_gate);
    c[0].pool_r = r;
    c[0].pool_round = true;
    // The span's pre-pool rows into the rings (put_ring_rows). Steps (T <= max_rows) do it in the
    // pooling's launch: a group reads ring rows of positions q in [p0 - r + 1, p0 - 1] only (later
    // ones from the span's rows), the puts write positions p in [p0, p0 + T - 1], and 0 < p - q <=
    // T + r - 2 < raw_slots = r + max_rows, so no slot is both read and written. Longer chunks
    // put after the pooling (a later launch).
    const int raw_slots = r + opts_.max_rows;  // new_session
    RowChain put[2];
    put[0].y = ckv_kv_;
    put[0].ring = b.at<float*>(block_dev_, L.raw_kv);
    put[1].y = ckv_gate_;
    put[1].ring = b.at<float*>(block_dev_, L.raw_gate);
    for (RowChain& e : put) {
      e.rows = T;
      e.n = hd;
      e.ring_pos = pos;
      e.ring_slots = raw_slots;
    }
    if (T <= opts_.max_rows) {
      c[nc++] = put[0];
      c[nc++] = put[1];
      row_chains(c, nc, nullptr, stream_);
    } else {
      row_chains(c, nc, nullptr, stream_);
      row_chains(put, 2, nullptr, stream_);
    }
  }
  if (!role.index_source) return;
  RowChain fin[2];
  op.i_wk.apply(emit_, G, emit_keys_, stream_);
  fin[0].rows = G;
  fin[0].n = cfg_.index_head_dim;
  fin[0].y = emit_keys_;
  fin[0].norm = op.i_k_norm;
  fin[0].eps = float(cfg_.norm_eps);
  entries(fin[0]);
  fin[0].qdq = QdqKind::kFp4E8m0;
  fin[0].qdq_block = 32;
  fin[0].copy_dst_bf16 = b.at<uint16_t*>(block_dev_, L.ikey_dst);
  fin[1] = lat;
  row_chains(fin, 2, nullptr, stream_);
}

// ---------------------------------------------------------------------------------------------
// The step: plan, then replay (or run) the program.

void CudaModel::forward_ring(CudaSession& s, std::span<const int32_t> tokens, bool all_logits,
                             float* logits, float* main_hidden, int* publisher, bool keep_logits) {
  const auto entered = std::chrono::steady_clock::now();
  const int T = int(tokens.size());
  Span sp;
  init_span(sp, s, tokens, /*prefill_layout=*/false, /*upload_hash=*/false);
  SpanBlock b = span_block(T);
  UF_CHECK(b.bytes <= block_bytes_, "span program: a block of {} bytes exceeds {}", b.bytes,
           block_bytes_);
  plan_ring_span(sp, b, tokens);
  last_plan_host_us_ =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - entered).count();
  // A split head is a collective: every rank runs it.
  const bool head_rows = logits || split_head_ || keep_logits;
  auto program = [&] { ring_program(b, all_logits, head_rows); };
  if (T <= opts_.max_rows)
    launch_program(
        T * 4 + (all_logits ? 2 : 0) + (head_rows ? 1 : 0) + b.score_bucket * kScoreBucketGraphKey,
        program);
  else
    program();  // long prefill chunks: one graph per chunk length would not be reused
  last_launch_host_us_ =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - entered).count();
  const size_t MH = size_t(n_taps()) * size_t(cfg_.dim);
  if (main_hidden && MH > 0 && main_hidden != mh_)
    UF_CUDA_CHECK(cudaMemcpyAsync(main_hidden, mh_, size_t(T) * MH * sizeof(float),
                                  cudaMemcpyDeviceToDevice, stream_));
  if (logits) {
    const size_t rows = all_logits ? size_t(T) : 1;
    UF_CUDA_CHECK(cudaMemcpyAsync(logits, logits_, rows * size_t(cfg_.vocab_size) * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream_));
  }
  sync();
  if (publisher) {
    for (int t = 0; t < T; ++t) {
      const int last = last_emitter(sp.pos[size_t(t)]);
      publisher[t] = last >= 0 ? last : sp.pub_start[size_t(t)];
    }
  }
}

sampling::VerifyResult CudaModel::verify_last(sampling::VerifyMode mode,
                                              const sampling::SamplingParams& params,
                                              std::span<const float> draft_probs,
                                              std::span<const int32_t> tokens, uint64_t seed,
                                              uint64_t step, int rows) {
  const int g = int(tokens.size()), V = cfg_.vocab_size;
  UF_CHECK(draft_probs.size() >= size_t(std::max(g, 0)) * size_t(V),
           "verify_last: {} draft values for {} rows", draft_probs.size(), g);
  UF_CHECK(verify_plan_, "device verification is off (CudaModelOptions::device_verify)");
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  if (g > 0 && g <= sampling::kMaxDraft)
    UF_CUDA_CHECK(cudaMemcpyAsync(verify_q_, draft_probs.data(), size_t(g) * V * sizeof(float),
                                  cudaMemcpyHostToDevice, stream_));
  return verify_on_device(mode, params, verify_q_, tokens, seed, step, rows);
}

// The target rows' transform and the verification of g drafts whose q rows are at q (device).
sampling::VerifyResult CudaModel::verify_on_device(sampling::VerifyMode mode,
                                                   const sampling::SamplingParams& params,
                                                   const float* q, std::span<const int32_t> tokens,
                                                   uint64_t seed, uint64_t step, int rows) {
  UF_CHECK(verify_plan_, "device verification is off (CudaModelOptions::device_verify)");
  const int g = int(tokens.size()), V = cfg_.vocab_size;
  UF_CHECK(g >= 0 && g <= sampling::kMaxDraft && rows == g + 1,
           "device verification: {} drafts for {} logits rows (at most {} drafts)", g, rows,
           sampling::kMaxDraft);
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  const unsigned long long seed_step[2] = {seed, step};
  if (g > 0)
    UF_CUDA_CHECK(cudaMemcpyAsync(verify_tokens_, tokens.data(), size_t(g) * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, stream_));
  UF_CUDA_CHECK(
      cudaMemcpyAsync(verify_seed_, seed_step, sizeof(seed_step), cudaMemcpyHostToDevice, stream_));
  logits_to_probs_on_device(*verify_plan_, logits_, rows, V, params, verify_plan_->target_probs(),
                            stream_);
  verify_probs_on_device(*verify_plan_, mode, verify_plan_->target_probs(), g > 0 ? q : nullptr,
                         verify_tokens_, g, V, verify_seed_, nullptr, verify_out_, nullptr,
                         stream_);
  sampling::VerifyResult out;
  UF_CUDA_CHECK(cudaMemcpyAsync(&out, verify_out_, sizeof(out), cudaMemcpyDeviceToHost, stream_));
  sync();
  return out;
}

void CudaModel::capture_step_graphs() {
  // Under TP, every rank runs this at once (CudaBackend: one worker thread per rank): the first
  // replay of each graph runs its collectives.
  if (!opts_.cuda_graphs) return;
  const auto t0 = std::chrono::steady_clock::now();
  const int M = opts_.max_rows;
  // The score width buckets (tp_score_buckets; else one) of the scratch width the session below
  // leaves: one pass of the verify keys each, then the commits and the draft.
  const int64_t passes = int64_t(std::max<size_t>(score_buckets_.size(), 1));
  auto s = new_session(int64_t(M) * (M + 1) / 2 * (passes + 1) + 2);
  // Every rank's session is allocated before any rank's first collective (host_barrier: an
  // allocation phase must not overlap a peer's collective).
  if (group_) group_->host_barrier();
  const std::vector<int32_t> toks(size_t(M), 0);
  std::vector<float> logits(size_t(M) * size_t(cfg_.vocab_size));
  struct Unforce {  // forced_bucket_ back to -1 however the loop ends
    int& b;
    ~Unforce() { b = -1; }
  } unforce{forced_bucket_};
  for (int b = 0; b < int(score_buckets_.size()); ++b) {
    forced_bucket_ = b;  // the scratch session's rows are narrow: every bucket's graphs anyway
    for (int T = 1; T <= M; ++T)  // CudaBackend::decode_rows' keys
      forward(*s, std::span<const int32_t>(toks.data(), size_t(T)), false, true, logits.data(),
              nullptr, nullptr);
  }
  forced_bucket_ = -1;
  if (cfg_.n_mtp_layers > 0 && cfg_.dspark_block_size > 0) {
    for (int n = 1; n <= M; ++n) {  // commits of 1..M accepted rows
      forward(*s, std::span<const int32_t>(toks.data(), size_t(n)), false, true, logits.data(), mh_,
              nullptr);
      commit(*s, std::span<const int32_t>(toks.data(), size_t(n)), mh_, n, -1);
    }
    draft(*s, 0, [](int, std::span<const float>) { return int32_t(0); });
  }
  sync();
  spdlog::info(
      "{} CUDA graphs captured in {:.0f} ms", graphs_.size(),
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
}

void CudaModel::drop_graphs() {
  for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g);
  graphs_.clear();
}

// ---------------------------------------------------------------------------------------------
// Benchmarks: a session at a context length without running the model over it.

void CudaModel::fast_forward(CudaSession& s, int64_t len, uint64_t seed) {
  UF_CHECK(s.len == 0, "fast_forward: the session already holds {} tokens", s.len);
  UF_CHECK(len > 0 && len < s.cap, "fast_forward: {} tokens for a session of capacity {}", len,
           s.cap);
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  std::mt19937_64 rng(seed);
  s.toks.resize(size_t(len));
  for (auto& t : s.toks) t = int32_t(rng() % uint64_t(cfg_.vocab_size));
  s.len = len;
  // Random values, not zeros: an indexer over identical scores (all ties) or attention over zero
  // KV need not cost what real data costs.
  uint64_t fill_seed = seed;
  auto random = [&](float* p, size_t n) { fill_random_f32(p, n, ++fill_seed, 1.0f, stream_); };
  auto fill = [&](DeviceRing& ring) {
    if (!ring.data) return;
    random(ring.data, size_t(ring.slots) * size_t(ring.width));
    for (int64_t p = std::max<int64_t>(0, len - ring.slots); p < len; ++p) ring.put(p);
  };
  for (int l = 0; l < cfg_.n_total_layers(); ++l) {
    const auto& role = cfg_.role(l);
    auto& st = s.layers[size_t(l)];
    fill(st.window);
    fill(st.raw_kv);
    fill(st.raw_gate);
    if (st.ckv) {
      fill_random_bf16(st.ckv, size_t(st.ckv_cap) * size_t(cfg_.head_dim), ++fill_seed, 1.0f,
                       stream_);
      st.ckv_n = std::min(st.ckv_cap, len / std::max(role.compress_ratio, 1));
    }
    if (st.ikeys) {
      fill_random_bf16(st.ikeys, size_t(st.ckv_cap) * size_t(cfg_.index_head_dim), ++fill_seed,
                       1.0f, stream_);
      st.ikeys_n = st.ckv_n;
    }
  }
  for (int l : cfg_.kv_source_layers)
    if (len / cfg_.role(l).compress_ratio > 0) s.publisher = l;
  sync();
}

}  // namespace uf::cuda
