// The CED prefill shortcut on the device (cpu/ced.cpp's twin): the encoder layers and the first
// decoder layer's KV path on every prompt token, the decoder layers on the last `replay` tokens
// only (a prefill-layout span starting there, windows truncated at its start, as the CPU).
//
// A prompt longer than the span capacity (CudaModelOptions::max_chunk) runs its encoder part in
// chunks: the first chunk in the prefill layout, the others in the ring layout (the span program
// limited to the encoder and the first decoder layer's KV path: plan_ring_span / ring_program's
// ced_dec), each committed before the next. The last chunk holds at least the decoder's tail, so
// the decoder then runs on rows already in X. Chunking changes only what chunked prefill changes
// (each encoder layer's attention sees the same keys; fp32 orders differ): the test bounds it
// against the CPU's one-span CED.
#include <algorithm>

#include "core/error.h"
#include "cuda/backend/cuda_model.h"
#include "cuda/backend/model_internal.h"

namespace uf::cuda {

void CudaModel::ced_decoder_kv(Span& sp, float* X, float* pre_mix, int T) {
  const int dec = cfg_.n_layers / 2;
  if (!cfg_.role(dec).kv_source) return;
  // The first decoder layer's attention input on every token: only its KV path runs here.
  hc_pre(hc_, X, pre_mix, T, x_, stream_);
  rms_norm(layers_[size_t(dec)]->attn_norm, float(cfg_.norm_eps), x_, T, cfg_.dim, x_, stream_);
  if (sp.program)
    kv_program(*sp.program, dec, x_);
  else
    kv_path(sp, dec, x_);
}

int CudaModel::ced_encoder_chunk(CudaSession& s, std::span<const int32_t> tokens, Span& sp,
                                 bool last) {
  const int T = int(tokens.size()), dec = cfg_.n_layers / 2;
  init_span(sp, s, tokens, /*prefill_layout=*/false, /*upload_hash=*/false);
  SpanBlock b = span_block(T);
  UF_CHECK(b.bytes <= block_bytes_, "CED chunk: a block of {} bytes exceeds {}", b.bytes,
           block_bytes_);
  plan_ring_span(sp, b, tokens, dec);
  // Taps of rows the decoder never sees stay zero, as the CPU's fresh buffer.
  if (last && n_taps() > 0)
    UF_CUDA_CHECK(
        cudaMemsetAsync(mh_, 0, size_t(T) * size_t(n_taps() * cfg_.dim) * sizeof(float), stream_));
  ring_program(b, false, false, dec);  // eagerly: chunk lengths vary, a graph would not be reused
  int pub = s.publisher;
  for (int l : cfg_.kv_source_layers)
    if (sp.emits_any[size_t(l)]) pub = l;
  if (!last) {  // the last chunk is committed after the decoder tail
    sync();
    commit(s, tokens, nullptr, T, pub);
  }
  return pub;
}

void CudaModel::prefill_ced(CudaSession& s, std::span<const int32_t> tokens, int replay,
                            float* logits) {
  UF_CHECK(s.len == 0, "CED prefill needs an empty session (it has {} tokens)", s.len);
  const int S = int(tokens.size());
  UF_CHECK(S > 0 && S <= s.cap, "CED prefill: {} tokens for a session of capacity {}", S, s.cap);
  const int dec = cfg_.n_layers / 2;
  for (int l = dec + 1; l < cfg_.n_layers; ++l)
    UF_CHECK(!cfg_.role(l).kv_source,
             "CED prefill: decoder layer {} is a KV source; only the first decoder layer ({}) may "
             "be one",
             l, dec);
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  const int n = std::min(S, replay > 0 ? replay : cfg_.window_size);
  UF_CHECK(n <= tmax_, "CED prefill: a decoder replay of {} tokens exceeds the span capacity {}", n,
           tmax_);
  const int hc = cfg_.hc_mult, D = cfg_.dim, MH = n_taps() * D;
  // The last chunk: at least the decoder's tail, at most the span capacity; the encoder chunks
  // before it are full spans (the first one in the prefill layout).
  const int last = std::max(n, S - (S - 1) / tmax_ * tmax_);
  const int head_len = S - last;
  Span all;  // the last chunk (the whole prompt when it fits one span)
  int pub = s.publisher;
  if (head_len == 0) {
    init_span(all, s, tokens, /*prefill_layout=*/true);
    // Taps of rows the decoder never sees stay zero, as the CPU's fresh buffer.
    if (MH) UF_CUDA_CHECK(cudaMemsetAsync(mh_, 0, size_t(S) * size_t(MH) * sizeof(float), stream_));
    embed(all, tokens, X_, pre_);
    run_layers(all, X_, pre_, 0, dec, MH ? mh_ : nullptr);
    ced_decoder_kv(all, X_, pre_, S);
    for (int l : cfg_.kv_source_layers)
      if (all.emits_any[size_t(l)]) pub = l;
  } else {
    for (int a = 0; a < head_len; a += tmax_) {
      const auto part = tokens.subspan(size_t(a), size_t(std::min(tmax_, head_len - a)));
      if (a == 0) {  // the first chunk: prefill layout, committed without DSpark rows
        Span first;
        init_span(first, s, part, /*prefill_layout=*/true);
        embed(first, part, X_, pre_);
        run_layers(first, X_, pre_, 0, dec, nullptr);
        ced_decoder_kv(first, X_, pre_, int(part.size()));
        sync();
        int first_pub = s.publisher;
        for (int l : cfg_.kv_source_layers)
          if (first.emits_any[size_t(l)]) first_pub = l;
        commit(s, part, nullptr, int(part.size()), first_pub);
      } else {
        Span chunk;
        ced_encoder_chunk(s, part, chunk, /*last=*/false);
      }
    }
    // The last chunk's encoder part (ring layout), its rows left in X_ for the decoder.
    pub = ced_encoder_chunk(s, tokens.subspan(size_t(head_len)), all, /*last=*/true);
  }
  const int T = int(all.pos.size());  // rows of the last chunk
  // The decoder on the tail, as a prefill-layout span starting at S - n.
  Span tail;
  tail.s = &s;
  tail.p0 = S - n;
  tail.T = n;
  tail.prefill = true;
  tail.pos.assign(all.pos.end() - n, all.pos.end());
  if (!all.hash.empty()) {
    const size_t per = all.hash.size() / size_t(T);
    tail.hash.assign(all.hash.end() - int64_t(size_t(n) * per), all.hash.end());
    upload_hash(tail);  // stream-ordered after the encoder's Engram reads
  }
  tail.topk_valid.assign(size_t(cfg_.n_layers), 0);
  tail.cand_width.assign(size_t(n), 0);
  tail.emits_any.assign(size_t(cfg_.n_layers), 0);
  tail.kv_done.assign(size_t(cfg_.n_layers), 0);
  tail.kv_done[size_t(dec)] = 1;
  tail.pub_start.assign(size_t(n), s.publisher);
  float* Xt = X_ + int64_t(T - n) * hc * D;
  float* pt = pre_ + int64_t(T - n) * hc;
  run_layers(tail, Xt, pt, dec, cfg_.n_layers, MH ? mh_ + int64_t(T - n) * MH : nullptr);
  if (logits || split_head_) head(Xt, pt, n - 1, 1, logits_);  // split head: a collective
  if (logits) {                                                // null: a TP rank other than 0
    UF_CUDA_CHECK(cudaMemcpyAsync(logits, logits_, size_t(cfg_.vocab_size) * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream_));
  }
  sync();
  // pub: the last KV source that emitted in the last chunk (earlier chunks are committed).
  commit(s, tokens.subspan(size_t(head_len)), MH ? mh_ : nullptr, T, pub);
}

}  // namespace uf::cuda
