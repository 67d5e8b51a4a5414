// The CED prefill shortcut (model-arch.md §4.8): the decoder's global KV comes only from the first
// decoder layer's compressor on the encoder output, so the encoder layers and that KV path run on
// every prompt token while the decoder layers run only on the last `replay` tokens ("decoder SWA
// bounded replay", their windows truncated at the replay start). Not bit-equal to the full
// prefill; check-fixture measures the difference.
#include <algorithm>

#include "core/error.h"
#include "cpu/model.h"
#include "cpu/norm.h"
#include "cpu/span.h"

namespace uf::cpu {

void CpuModel::prefill_ced(CpuSession& s, std::span<const int32_t> tokens, int replay,
                           float* logits, Hooks* hooks) const {
  UF_CHECK(s.len == 0, "CED prefill needs an empty session (it has {} tokens)", s.len);
  const int S = int(tokens.size());
  UF_CHECK(S > 0 && S <= s.cap, "CED prefill: {} tokens for a session of capacity {}", S, s.cap);
  const int dec = cfg_.n_layers / 2;
  for (int l = dec + 1; l < cfg_.n_layers; ++l)
    UF_CHECK(!cfg_.role(l).kv_source,
             "CED prefill: decoder layer {} is a KV source; only the first decoder layer ({}) may "
             "be one",
             l, dec);
  const int n = std::min(S, replay > 0 ? replay : cfg_.window_size);
  const int hc = cfg_.hc_mult, D = cfg_.dim, MH = n_taps() * D;
  Span all;
  init_span(all, s, tokens, /*prefill_layout=*/true, hooks);
  std::vector<float> X(size_t(S) * size_t(hc) * size_t(D)), pre(size_t(S) * size_t(hc));
  std::vector<float> mh(size_t(S) * size_t(std::max(MH, 1)));
  embed(all, tokens, X.data(), pre.data());
  run_layers(all, X.data(), pre.data(), 0, dec, MH ? mh.data() : nullptr);
  if (cfg_.role(dec).kv_source) {
    // The first decoder layer's attention input on every token: only its KV path runs here.
    std::vector<float> x(size_t(S) * size_t(D));
    hc_pre(hc_, X.data(), pre.data(), S, x.data());
    rms_norm(w_.layers[size_t(dec)].attn_norm, float(cfg_.norm_eps), x.data(), S, D, x.data());
    kv_path(all, dec, x.data());
  }
  // The decoder on the tail, as a prefill-layout span starting at S - n.
  Span tail;
  tail.s = &s;
  tail.p0 = S - n;
  tail.T = n;
  tail.prefill = true;
  tail.hooks = hooks;
  tail.pos.assign(all.pos.begin() + (S - n), all.pos.end());
  if (!all.hash_ids.empty()) {
    const size_t per = all.hash_ids.size() / size_t(S);
    tail.hash_ids.assign(all.hash_ids.begin() + int64_t(size_t(S - n) * per), all.hash_ids.end());
  }
  tail.topk.assign(size_t(cfg_.n_layers), {});
  tail.cand.assign(size_t(n), {});
  tail.emits_any = all.emits_any;
  tail.kv_done.assign(size_t(cfg_.n_layers), 0);
  tail.kv_done[size_t(dec)] = 1;
  tail.pub_start.assign(size_t(n), s.publisher);
  std::vector<float> Xt(X.begin() + int64_t(size_t(S - n) * hc * D), X.end());
  std::vector<float> pt(pre.begin() + int64_t(size_t(S - n) * hc), pre.end());
  run_layers(tail, Xt.data(), pt.data(), dec, cfg_.n_layers,
             MH ? mh.data() + int64_t(S - n) * MH : nullptr);
  head(tail, Xt.data(), pt.data(), n - 1, 1, logits);
  int pub = s.publisher;
  for (int l : cfg_.kv_source_layers)
    if (all.emits_any[size_t(l)]) pub = l;
  commit(s, tokens, MH ? mh.data() : nullptr, S, pub);
}

}  // namespace uf::cpu
