// The CED prefill shortcut on the device (cpu/ced.cpp's twin): the encoder layers and the first
// decoder layer's KV path on every prompt token, the decoder layers on the last `replay` tokens
// only (a prefill-layout span starting there). The whole prompt must fit one span
// (CudaModelOptions::max_chunk): longer prompts are an error (prefill without the shortcut).
#include <algorithm>

#include "core/error.h"
#include "cuda/backend/cuda_model.h"
#include "cuda/backend/model_internal.h"

namespace uf::cuda {

void CudaModel::prefill_ced(CudaSession& s, std::span<const int32_t> tokens, int replay,
                            float* logits) {
  UF_CHECK(s.len == 0, "CED prefill needs an empty session (it has {} tokens)", s.len);
  const int S = int(tokens.size());
  UF_CHECK(S > 0 && S <= s.cap, "CED prefill: {} tokens for a session of capacity {}", S, s.cap);
  UF_CHECK(S <= tmax_,
           "CED prefill on the CUDA backend: a prompt of {} tokens exceeds the span capacity {} "
           "(max_chunk); prefill without the shortcut",
           S, tmax_);
  const int dec = cfg_.n_layers / 2;
  for (int l = dec + 1; l < cfg_.n_layers; ++l)
    UF_CHECK(!cfg_.role(l).kv_source,
             "CED prefill: decoder layer {} is a KV source; only the first decoder layer ({}) may "
             "be one",
             l, dec);
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  const int n = std::min(S, replay > 0 ? replay : cfg_.window_size);
  const int hc = cfg_.hc_mult, D = cfg_.dim, MH = n_taps() * D;
  Span all;
  init_span(all, s, tokens, /*prefill_layout=*/true);
  // Taps of rows the decoder never sees stay zero, as the CPU's fresh buffer.
  if (MH) UF_CUDA_CHECK(cudaMemsetAsync(mh_, 0, size_t(S) * size_t(MH) * sizeof(float), stream_));
  embed(all, tokens, X_, pre_);
  run_layers(all, X_, pre_, 0, dec, MH ? mh_ : nullptr);
  if (cfg_.role(dec).kv_source) {
    // The first decoder layer's attention input on every token: only its KV path runs here.
    hc_pre(hc_, X_, pre_, S, x_, stream_);
    rms_norm(layers_[size_t(dec)]->attn_norm, float(cfg_.norm_eps), x_, S, D, x_, stream_);
    kv_path(all, dec, x_);
  }
  // The decoder on the tail, as a prefill-layout span starting at S - n.
  Span tail;
  tail.s = &s;
  tail.p0 = S - n;
  tail.T = n;
  tail.prefill = true;
  tail.pos.assign(all.pos.begin() + (S - n), all.pos.end());
  if (!all.hash.empty()) {
    const size_t per = all.hash.size() / size_t(S);
    tail.hash.assign(all.hash.begin() + int64_t(size_t(S - n) * per), all.hash.end());
    upload_hash(tail);  // stream-ordered after the encoder's Engram reads
  }
  tail.topk_valid.assign(size_t(cfg_.n_layers), 0);
  tail.cand_width.assign(size_t(n), 0);
  tail.emits_any = all.emits_any;
  tail.kv_done.assign(size_t(cfg_.n_layers), 0);
  tail.kv_done[size_t(dec)] = 1;
  tail.pub_start.assign(size_t(n), s.publisher);
  float* Xt = X_ + int64_t(S - n) * hc * D;
  float* pt = pre_ + int64_t(S - n) * hc;
  run_layers(tail, Xt, pt, dec, cfg_.n_layers, MH ? mh_ + int64_t(S - n) * MH : nullptr);
  if (logits || split_head_) head(Xt, pt, n - 1, 1, logits_);  // split head: a collective
  if (logits) {                                                // null: a TP rank other than 0
    UF_CUDA_CHECK(cudaMemcpyAsync(logits, logits_, size_t(cfg_.vocab_size) * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream_));
  }
  sync();
  int pub = s.publisher;
  for (int l : cfg_.kv_source_layers)
    if (all.emits_any[size_t(l)]) pub = l;
  commit(s, tokens, MH ? mh_ : nullptr, S, pub);
}

}  // namespace uf::cuda
