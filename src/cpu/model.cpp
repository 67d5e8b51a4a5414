#include "cpu/model.h"

#include <algorithm>
#include <cmath>

#include "core/dtypes.h"
#include "core/error.h"
#include "core/quant.h"
#include "cpu/attention.h"
#include "cpu/compressor.h"
#include "cpu/engram.h"
#include "cpu/indexer.h"
#include "cpu/linear.h"
#include "cpu/norm.h"
#include "cpu/span.h"

namespace uf::cpu {

namespace {

// Entries a query at position p can see of a ratio-r compressed stream.
inline int64_t visible(int64_t p, int r) { return (p + 1) / r; }

}  // namespace

CpuModel::CpuModel(model::ModelConfig cfg, const model::Checkpoint& ckpt,
                   std::vector<int64_t> engram_token_map, ModelOptions opts)
    : cfg_(std::move(cfg)), opts_(opts), token_map_(std::move(engram_token_map)) {
  w_ = model::bind_weights(cfg_, ckpt);
  for (int l = 0; l < cfg_.n_total_layers(); ++l) {
    ropes_.push_back(Rope::for_layer(cfg_, l));
    const auto& r = cfg_.role(l);
    MoeParams m;
    m.n_experts = r.n_routed_experts;
    m.top_k = r.n_activated_experts;
    m.score_func = cfg_.score_func;
    m.gate_temp = float(cfg_.gate_temp);
    m.route_scale = float(cfg_.route_scale);
    m.swiglu_limit = float(cfg_.swiglu_limit);
    moe_.push_back(m);
  }
  hc_.hc = cfg_.hc_mult;
  hc_.dim = cfg_.dim;
  hc_.sinkhorn_iters = cfg_.hc_sinkhorn_iters;
  hc_.norm_eps = float(cfg_.norm_eps);
  hc_.hc_eps = float(cfg_.hc_eps);
  if (!cfg_.engram_layer_ids.empty()) {
    UF_CHECK(
        int64_t(token_map_.size()) == cfg_.vocab_size,
        "the model has Engram layers but the Engram token map has {} entries for a vocab of {}",
        token_map_.size(), cfg_.vocab_size);
    hasher_.emplace(cfg_, token_map_.at(size_t(cfg_.engram_pad_id)));
  }
}

int64_t CpuModel::compressed_id(int32_t token) const {
  UF_CHECK(token >= 0 && token < cfg_.vocab_size, "token id {} is outside the vocab of {}", token,
           cfg_.vocab_size);
  return token_map_.at(size_t(token));
}

std::unique_ptr<CpuSession> CpuModel::new_session(int64_t max_seq) const {
  auto s = std::make_unique<CpuSession>();
  s->cap = max_seq;
  s->layers.resize(size_t(cfg_.n_total_layers()));
  for (int l = 0; l < cfg_.n_total_layers(); ++l) {
    const auto& r = cfg_.role(l);
    auto& L = s->layers[size_t(l)];
    L.window.init(cfg_.window_size + opts_.max_rows, cfg_.head_dim);
    if (r.kv_source && r.compress_ratio > 1) {
      L.raw_kv.init(r.compress_ratio + opts_.max_rows, cfg_.head_dim);
      L.raw_gate.init(r.compress_ratio + opts_.max_rows, cfg_.head_dim);
    }
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Projections shared by backbone and DSpark attention.

void CpuModel::project_q(int l, const float* x, int T, const int64_t* pos, float* qr,
                         float* q) const {
  const auto& A = w_.layers[size_t(l)].attn;
  const int H = cfg_.n_heads, hd = cfg_.head_dim, R = cfg_.q_lora_rank;
  linear(A.wq_a, x, T, qr);
  rms_norm(A.q_norm, float(cfg_.norm_eps), qr, T, R, qr);
  linear(A.wq_b, qr, T, q);
  for (int t = 0; t < T; ++t) ropes_[size_t(l)].apply_many(q + int64_t(t) * H * hd, H, hd, pos[t]);
}

void CpuModel::project_kv(int l, const float* x, int T, const int64_t* pos, float* kv) const {
  const auto& A = w_.layers[size_t(l)].attn;
  const int hd = cfg_.head_dim;
  linear(A.wkv, x, T, kv);
  rms_norm(A.kv_norm, float(cfg_.norm_eps), kv, T, hd, kv);
  for (int t = 0; t < T; ++t) {
    ropes_[size_t(l)].apply(kv + int64_t(t) * hd, hd, pos[t]);
    core::fake_quant_fp8(kv + int64_t(t) * hd, size_t(hd), 32);
  }
}

void CpuModel::output_proj(int l, float* o, int T, const int64_t* pos, float* out) const {
  const auto& A = w_.layers[size_t(l)].attn;
  const int H = cfg_.n_heads, hd = cfg_.head_dim, G = cfg_.o_groups, R = cfg_.o_lora_rank;
  for (int t = 0; t < T; ++t)
    ropes_[size_t(l)].apply_many(o + int64_t(t) * H * hd, H, hd, pos[t], /*inverse=*/true);
  // wo_a is block-diagonal over groups: a bf16 einsum without activation quantisation.
  const int gin = H * hd / G;
  std::vector<float> o2(size_t(T) * size_t(G) * size_t(R));
  for (int g = 0; g < G; ++g)
    linear_bf16_out_rows(A.wo_a, int64_t(g) * R, R, o + int64_t(g) * gin, H * hd, T,
                         o2.data() + int64_t(g) * R, G * R);
  linear(A.wo_b, o2.data(), T, out);
}

// ---------------------------------------------------------------------------------------------
// Span setup, embedding, head.

void CpuModel::init_span(Span& sp, CpuSession& s, std::span<const int32_t> tokens,
                         bool prefill_layout, Hooks* hooks) const {
  sp.s = &s;
  sp.p0 = s.len;
  sp.T = int(tokens.size());
  sp.prefill = prefill_layout;
  sp.hooks = hooks;
  sp.pos.resize(size_t(sp.T));
  for (int t = 0; t < sp.T; ++t) sp.pos[size_t(t)] = sp.p0 + t;
  sp.topk.assign(size_t(cfg_.n_layers), {});
  sp.cand.assign(size_t(sp.T), {});
  sp.emits_any.assign(size_t(cfg_.n_layers), 0);
  sp.kv_done.assign(size_t(cfg_.n_layers), 0);
  sp.pub_start.assign(size_t(sp.T), s.publisher);
  if (hasher_) {
    const int hl = hasher_->history_len();
    std::vector<int64_t> ctx, ids;
    for (int64_t i = std::max<int64_t>(0, s.len - hl); i < s.len; ++i)
      ctx.push_back(compressed_id(s.toks[size_t(i)]));
    for (int32_t t : tokens) ids.push_back(compressed_id(t));
    sp.hash_ids = hasher_->hash(ctx, ids);
    if (hooks)
      hooks->on_i64(sp.info(Tap::kEngramHash, -1, sp.T, int(hasher_->ids_per_position())),
                    sp.hash_ids.data());
  }
  // Reference index keys: the publisher before each row follows from which owners emit at which
  // positions (an owner of ratio r emits at p iff (p + 1) % r == 0).
  if (opts_.index_keys == IndexKeys::kReference && !prefill_layout) {
    int pub = s.publisher;
    for (int t = 0; t < sp.T; ++t) {
      sp.pub_start[size_t(t)] = pub;
      const int last = last_emitter(sp.pos[size_t(t)]);
      if (last >= 0) pub = last;
    }
  }
}

int CpuModel::last_emitter(int64_t p) const {
  int last = -1;
  for (int l : cfg_.kv_source_layers)
    if ((p + 1) % cfg_.role(l).compress_ratio == 0) last = std::max(last, l);
  return last;
}

void CpuModel::embed(const Span& sp, std::span<const int32_t> tokens, float* X,
                     float* pre_mix) const {
  const int hc = cfg_.hc_mult, D = cfg_.dim;
  for (int t = 0; t < sp.T; ++t) {
    const int32_t id = tokens[size_t(t)];
    UF_CHECK(id >= 0 && id < cfg_.vocab_size,
             "token id {} at position {} is outside the vocab of {}", id, sp.pos[size_t(t)],
             cfg_.vocab_size);
    float* x = X + int64_t(t) * hc * D;
    w_.embed.row(id, x);
    for (int c = 1; c < hc; ++c) std::copy(x, x + D, x + int64_t(c) * D);
    for (int c = 0; c < hc; ++c) pre_mix[t * hc + c] = c == 0 ? 1.f : 0.f;
  }
}

void CpuModel::head(const Span& sp, const float* X, const float* pre_mix, int row0, int n,
                    float* logits) const {
  const int hc = cfg_.hc_mult, D = cfg_.dim;
  std::vector<float> x(size_t(n) * size_t(D));
  hc_pre(hc_, X + int64_t(row0) * hc * D, pre_mix + row0 * hc, n, x.data());
  rms_norm(w_.norm, float(cfg_.norm_eps), x.data(), n, D, x.data());
  if (sp.hooks) {
    TapInfo i = sp.info(Tap::kFinalHidden, -1, n, D);
    i.p0 = sp.p0 + row0;
    sp.hooks->on(i, x.data());
  }
  linear_f32(w_.head, x.data(), n, logits);
}

// ---------------------------------------------------------------------------------------------
// The stack.

bool CpuModel::needs_row_by_row(const CpuSession& s, int T) const {
  // Reference index keys in ring layout: a row may read a LATER layer's keys (the last
  // publisher); processed layer by layer, that layer has not yet written this span's entries.
  // Rows are then run one by one, which changes no value (rows are computed independently).
  if (opts_.index_keys != IndexKeys::kReference || T <= 1) return false;
  const int64_t end = s.len + T;
  for (int reader : cfg_.index_source_layers)
    for (int owner : cfg_.kv_source_layers) {
      if (owner <= reader) continue;
      const int64_t needed = end / cfg_.role(reader).compress_ratio;
      const int64_t have = s.len / cfg_.role(owner).compress_ratio;
      if (needed > have) return true;
    }
  return false;
}

void CpuModel::forward(CpuSession& s, std::span<const int32_t> tokens, bool prefill_layout,
                       bool all_logits, float* logits, float* main_hidden, int* publisher,
                       Hooks* hooks) const {
  const int T = int(tokens.size());
  UF_CHECK(T > 0, "forward: no tokens");
  UF_CHECK(s.len + T <= s.cap, "session of capacity {} cannot take {} more tokens after {}", s.cap,
           T, s.len);
  if (!prefill_layout && needs_row_by_row(s, T)) {
    // Row by row on a scratch view of the session: positions advance, nothing is committed.
    const int64_t len0 = s.len;
    const size_t ntok0 = s.toks.size();
    const int pub0 = s.publisher;
    const int V = cfg_.vocab_size, MH = n_taps() * cfg_.dim;
    for (int t = 0; t < T; ++t) {
      int pub = 0;
      float* lg = all_logits ? logits + int64_t(t) * V : (t == T - 1 ? logits : nullptr);
      std::vector<float> tmp;
      if (!lg) {
        tmp.resize(size_t(V));
        lg = tmp.data();
      }
      forward(s, tokens.subspan(size_t(t), 1), false, false, lg,
              main_hidden ? main_hidden + int64_t(t) * MH : nullptr, &pub, hooks);
      if (publisher) publisher[t] = pub;
      s.len += 1;
      s.toks.push_back(tokens[size_t(t)]);
      s.publisher = pub;
    }
    s.len = len0;
    s.toks.resize(ntok0);
    s.publisher = pub0;
    return;
  }
  Span sp;
  init_span(sp, s, tokens, prefill_layout, hooks);
  const int hc = cfg_.hc_mult, D = cfg_.dim;
  std::vector<float> X(size_t(T) * size_t(hc) * size_t(D)), pre(size_t(T) * size_t(hc));
  embed(sp, tokens, X.data(), pre.data());
  std::vector<float> mh;
  if (!main_hidden && n_taps() > 0) {
    mh.resize(size_t(T) * size_t(n_taps()) * size_t(D));
    main_hidden = mh.data();
  }
  run_layers(sp, X.data(), pre.data(), 0, cfg_.n_layers, main_hidden);
  if (all_logits)
    head(sp, X.data(), pre.data(), 0, T, logits);
  else
    head(sp, X.data(), pre.data(), T - 1, 1, logits);
  if (publisher) {
    for (int t = 0; t < T; ++t) {
      int pub = sp.pub_start[size_t(t)];
      if (prefill_layout) {
        for (int l : cfg_.kv_source_layers)
          if (sp.emits_any[size_t(l)]) pub = l;
      } else if (last_emitter(sp.pos[size_t(t)]) >= 0) {
        pub = last_emitter(sp.pos[size_t(t)]);
      }
      publisher[t] = pub;
    }
  }
}

void CpuModel::run_layers(Span& sp, float* X, float* pre_mix, int l0, int l1,
                          float* main_hidden) const {
  const int hc = cfg_.hc_mult, D = cfg_.dim, T = sp.T;
  for (int l = l0; l < l1; ++l) {
    const auto& role = cfg_.role(l);
    if (role.engram) {
      EngramParams ep;
      ep.hc = hc;
      ep.dim = D;
      ep.n_cols = hasher_->n_cols();
      ep.head_dim = cfg_.engram_head_dim;
      ep.norm_eps = float(cfg_.norm_eps);
      std::vector<int64_t> ids(size_t(T) * size_t(ep.n_cols));
      const size_t per = hasher_->ids_per_position();
      for (int t = 0; t < T; ++t)
        std::copy_n(
            sp.hash_ids.begin() + int64_t(t * per + size_t(role.engram_index) * size_t(ep.n_cols)),
            ep.n_cols, ids.begin() + int64_t(t) * ep.n_cols);
      engram_forward(w_.layers[size_t(l)].engram, ep, ids.data(), X, T, X);
      if (sp.hooks) sp.hooks->on(sp.info(Tap::kEngramOut, l, T, hc * D), X);
    }
    if (role.dspark_tap && main_hidden) {
      const auto& ids = cfg_.dspark_target_layer_ids;
      const int tap = int(std::find(ids.begin(), ids.end(), l) - ids.begin());
      const int MH = n_taps() * D;
      for (int t = 0; t < T; ++t)
        for (int d = 0; d < D; ++d) {
          float sum = 0;
          for (int c = 0; c < hc; ++c) sum += X[(int64_t(t) * hc + c) * D + d];
          main_hidden[int64_t(t) * MH + int64_t(tap) * D + d] = core::round_bf16(sum / float(hc));
        }
      if (l == ids.back() && sp.hooks)
        sp.hooks->on(sp.info(Tap::kMainHidden, -1, T, MH), main_hidden);
    }
    block(sp, l, X, pre_mix);
  }
}

void CpuModel::block(Span& sp, int l, float* X, float* pre_mix) const {
  const int hc = cfg_.hc_mult, D = cfg_.dim, T = sp.T;
  const auto& L = w_.layers[size_t(l)];
  std::vector<float> R(X, X + int64_t(T) * hc * D);
  std::vector<float> apre(size_t(T) * size_t(hc)), apost(size_t(T) * size_t(hc)),
      acomb(size_t(T) * size_t(hc * hc));
  hc_mixes(hc_, L.hc_attn_fn, L.hc_attn_scale, L.hc_attn_base, X, T, apre.data(), apost.data(),
           acomb.data());
  std::vector<float> x(size_t(T) * size_t(D)), y(size_t(T) * size_t(D));
  hc_pre(hc_, X, pre_mix, T, x.data());
  rms_norm(L.attn_norm, float(cfg_.norm_eps), x.data(), T, D, x.data());
  if (sp.hooks) sp.hooks->on(sp.info(Tap::kAttnIn, l, T, D), x.data());
  attention(sp, l, x.data(), y.data());
  if (sp.hooks) sp.hooks->on(sp.info(Tap::kAttnOut, l, T, D), y.data());
  hc_post(hc_, y.data(), R.data(), apost.data(), acomb.data(), T, X);

  R.assign(X, X + int64_t(T) * hc * D);
  std::vector<float> fpost(size_t(T) * size_t(hc)), fcomb(size_t(T) * size_t(hc * hc));
  hc_mixes(hc_, L.hc_ffn_fn, L.hc_ffn_scale, L.hc_ffn_base, X, T, pre_mix, fpost.data(),
           fcomb.data());
  hc_pre(hc_, X, apre.data(), T, x.data());
  rms_norm(L.ffn_norm, float(cfg_.norm_eps), x.data(), T, D, x.data());
  if (sp.hooks) sp.hooks->on(sp.info(Tap::kFfnIn, l, T, D), x.data());
  const auto& mp = moe_[size_t(l)];
  std::vector<int32_t> gi(size_t(T) * size_t(mp.top_k));
  std::vector<float> gw(size_t(T) * size_t(mp.top_k));
  moe_forward(L.moe, mp, x.data(), T, D, cfg_.moe_inter_dim, y.data(), gi.data(), gw.data());
  if (sp.hooks) {
    sp.hooks->on_i32(sp.info(Tap::kGateI, l, T, mp.top_k), gi.data());
    sp.hooks->on(sp.info(Tap::kGateW, l, T, mp.top_k), gw.data());
    sp.hooks->on(sp.info(Tap::kFfnOut, l, T, D), y.data());
  }
  hc_post(hc_, y.data(), R.data(), fpost.data(), fcomb.data(), T, X);
  if (sp.hooks) {
    sp.hooks->on(sp.info(Tap::kLayerOut, l, T, hc * D), X);
    sp.hooks->on(sp.info(Tap::kPreMix, l, T, hc), pre_mix);
  }
}

// ---------------------------------------------------------------------------------------------
// Attention.

void CpuModel::kv_path(Span& sp, int l, const float* x) const {
  const auto& role = cfg_.role(l);
  const auto& A = w_.layers[size_t(l)].attn;
  auto& st = sp.s->layers[size_t(l)];
  const int hd = cfg_.head_dim, r = role.compress_ratio, T = sp.T;
  const float eps = float(cfg_.norm_eps);
  std::vector<int64_t> entries;
  std::vector<float> lat;  // [n, hd] normed latents before RoPE
  if (r == 1) {
    lat.resize(size_t(T) * size_t(hd));
    linear(A.c_wkv, x, T, lat.data());
    rms_norm(A.c_norm, eps, lat.data(), T, hd, lat.data());
    for (int t = 0; t < T; ++t) entries.push_back(sp.pos[size_t(t)]);
  } else {
    std::vector<float> kv(size_t(T) * size_t(hd)), gate(size_t(T) * size_t(hd));
    linear_f32(A.c_wkv, x, T, kv.data());
    linear_f32(A.c_wgate, x, T, gate.data());
    auto row = [&](const std::vector<float>& local, const PosRing& ring, int64_t p) {
      const float* v = p >= sp.p0 ? local.data() + (p - sp.p0) * hd : ring.get(p);
      UF_CHECK(v, "layer {}: the compressor's row of position {} is gone", l, p);
      return v;
    };
    std::vector<const float*> kr(static_cast<size_t>(r)), gr(static_cast<size_t>(r));
    std::vector<float> pooled(static_cast<size_t>(hd));
    for (int t = 0; t < T; ++t) {
      const int64_t p = sp.pos[size_t(t)];
      if ((p + 1) % r) continue;
      for (int i = 0; i < r; ++i) {
        kr[size_t(i)] = row(kv, st.raw_kv, p + 1 - r + i);
        gr[size_t(i)] = row(gate, st.raw_gate, p + 1 - r + i);
      }
      compress_pool(kr.data(), gr.data(), r, hd, pooled.data());
      for (int c = 0; c < hd; ++c) pooled[size_t(c)] = core::round_bf16(pooled[size_t(c)]);
      rms_norm(A.c_norm, eps, pooled.data(), 1, hd, pooled.data());
      lat.insert(lat.end(), pooled.begin(), pooled.end());
      entries.push_back(p / r);
    }
    for (int t = std::max(0, T - st.raw_kv.slots); t < T; ++t) {
      std::copy_n(kv.data() + int64_t(t) * hd, hd, st.raw_kv.put(sp.pos[size_t(t)]));
      std::copy_n(gate.data() + int64_t(t) * hd, hd, st.raw_gate.put(sp.pos[size_t(t)]));
    }
  }
  const int n = int(entries.size());
  if (n == 0) return;
  sp.emits_any[size_t(l)] = 1;
  const int64_t need = entries.back() + 1;
  if (int64_t(st.ckv.size()) < need * hd) st.ckv.resize(size_t(need * hd));
  const auto& rope = ropes_[size_t(l)];
  if (role.index_source) {
    const int ihd = cfg_.index_head_dim;
    std::vector<float> k(size_t(n) * size_t(ihd));
    linear(A.i_wk, lat.data(), n, k.data());
    rms_norm(A.i_k_norm, eps, k.data(), n, ihd, k.data());
    if (int64_t(st.ikeys.size()) < need * ihd) st.ikeys.resize(size_t(need * ihd));
    for (int i = 0; i < n; ++i) {
      float* ki = k.data() + int64_t(i) * ihd;
      rope.apply(ki, ihd, entries[size_t(i)] * r);
      core::fake_quant_fp4_e8m0_scale(ki, size_t(ihd), 32);
      std::copy_n(ki, ihd, st.ikeys.data() + entries[size_t(i)] * ihd);
    }
  }
  for (int i = 0; i < n; ++i) {
    float* li = lat.data() + int64_t(i) * hd;
    rope.apply(li, hd, entries[size_t(i)] * r);
    core::fake_quant_fp4_e4m3_scale(li, size_t(hd), 16);
    std::copy_n(li, hd, st.ckv.data() + entries[size_t(i)] * hd);
  }
}

int CpuModel::keys_source(const Span& sp, int l, int row) const {
  const auto& role = cfg_.role(l);
  if (opts_.index_keys == IndexKeys::kOwner) return role.index_keys_from;
  // Reference: an owner that emits publishes its own keys before scoring; otherwise the indexer
  // reads whatever was published last (earlier in this row, or before it).
  if (sp.prefill) {
    if (role.kv_source && sp.emits_any[size_t(l)]) return l;
    int pub = sp.pub_start[size_t(row)];
    for (int o : cfg_.kv_source_layers)
      if (o < l && sp.emits_any[size_t(o)]) pub = o;
    return pub >= 0 ? pub : role.index_keys_from;
  }
  const int64_t p = sp.pos[size_t(row)];
  if (role.kv_source && (p + 1) % role.compress_ratio == 0) return l;
  int pub = sp.pub_start[size_t(row)];
  for (int o : cfg_.kv_source_layers)
    if (o < l && (p + 1) % cfg_.role(o).compress_ratio == 0) pub = o;
  return pub >= 0 ? pub : role.index_keys_from;
}

void CpuModel::indexer(Span& sp, int l, const float* x, const float* qr) const {
  const auto& role = cfg_.role(l);
  const auto& A = w_.layers[size_t(l)].attn;
  const int T = sp.T, Hi = cfg_.index_n_heads, ihd = cfg_.index_head_dim, r = role.compress_ratio;
  auto& out = sp.topk[size_t(l)];
  out.assign(size_t(T), {});
  const int64_t end_entries = (sp.p0 + T) / r;
  if (sp.prefill && end_entries == 0) return;  // the reference skips the indexer entirely
  std::vector<float> q(size_t(T) * size_t(Hi) * size_t(ihd)), w(size_t(T) * size_t(Hi));
  linear(A.i_wq_b, qr, T, q.data());
  linear(A.i_weights_proj, x, T, w.data());
  const float wscale = float(std::pow(double(ihd), -0.5) * std::pow(double(Hi), -0.5));
  for (auto& v : w) v = core::round_bf16(v * wscale);
  for (int t = 0; t < T; ++t) {
    float* qt = q.data() + int64_t(t) * Hi * ihd;
    ropes_[size_t(l)].apply_many(qt, Hi, ihd, sp.pos[size_t(t)]);
    core::fake_quant_fp4_e8m0_scale(qt, size_t(Hi) * size_t(ihd), 32);
  }
  const int cand_src = cfg_.candidate_source_layer;
  // Checked before the parallel loop: an exception must not leave an OpenMP region.
  for (int t = 0; t < T; ++t) {
    const int64_t p = sp.pos[size_t(t)];
    const int vis = int(visible(p, r));
    const int src = keys_source(sp, l, t);
    const auto& keys = sp.s->layers[size_t(src)].ikeys;
    UF_CHECK(int64_t(keys.size()) >= int64_t(vis) * ihd,
             "layer {}: index keys of layer {} hold {} entries, position {} needs {}", l, src,
             keys.size() / size_t(ihd), p, vis);
    if (role.candidate_restricted && cand_src >= 0 && (sp.prefill ? end_entries : vis) > 0)
      UF_CHECK(int64_t(sp.cand[size_t(t)].size()) == (sp.prefill ? end_entries : vis),
               "layer {}: candidate pool of width {} does not match {} index scores", l,
               sp.cand[size_t(t)].size(), sp.prefill ? end_entries : vis);
  }
#pragma omp parallel for schedule(dynamic, 4) if (T >= 8)
  for (int t = 0; t < T; ++t) {
    const int64_t p = sp.pos[size_t(t)];
    const int vis = int(visible(p, r));
    const int width = sp.prefill ? int(end_entries) : vis;
    if (width == 0) continue;
    const auto& keys = sp.s->layers[size_t(keys_source(sp, l, t))].ikeys;
    std::vector<float> score(static_cast<size_t>(width));
    index_scores_row(q.data() + int64_t(t) * Hi * ihd, w.data() + int64_t(t) * Hi, Hi, ihd,
                     keys.data(), vis, width, score.data());
    if (role.candidate_source) {
      sp.cand[size_t(t)].resize(size_t(width));
      candidate_mask(score.data(), width, vis, cfg_.candidate_topk_blocks,
                     cfg_.candidate_block_size, sp.cand[size_t(t)].data());
    } else if (role.candidate_restricted && cand_src >= 0) {
      const auto& c = sp.cand[size_t(t)];
      for (int i = 0; i < width; ++i)
        if (!c[size_t(i)]) score[size_t(i)] = -INFINITY;
    }
    const int k = std::min(cfg_.index_topk, width);
    auto& sel = out[size_t(t)];
    sel.resize(size_t(k));
    topk_select(score.data(), width, k, vis, sel.data());
    if (sp.hooks) {
#pragma omp critical(uf_cpu_hooks)
      {
        TapInfo i = sp.info(Tap::kIndexScores, l, 1, width);
        i.p0 = p;
        i.bank_offset = sp.prefill ? T : cfg_.window_size;
        sp.hooks->on(i, score.data());
        i.tap = Tap::kTopk;
        i.width = k;
        sp.hooks->on_i32(i, sel.data());
      }
    }
  }
}

void CpuModel::attention(Span& sp, int l, const float* x, float* out) const {
  const auto& role = cfg_.role(l);
  const auto& A = w_.layers[size_t(l)].attn;
  auto& st = sp.s->layers[size_t(l)];
  const int T = sp.T, H = cfg_.n_heads, hd = cfg_.head_dim, W = cfg_.window_size;
  std::vector<float> qr(size_t(T) * size_t(cfg_.q_lora_rank)), q(size_t(T) * H * size_t(hd)),
      kv(size_t(T) * size_t(hd));
  project_q(l, x, T, sp.pos.data(), qr.data(), q.data());
  project_kv(l, x, T, sp.pos.data(), kv.data());
  const std::vector<int32_t>* topk_rows = nullptr;
  const float* ckv = nullptr;
  if (role.compress_ratio > 0) {
    if (role.kv_source && !sp.kv_done[size_t(l)]) kv_path(sp, l, x);
    if (role.index_source) indexer(sp, l, x, qr.data());
    if (role.topk_from >= 0) topk_rows = sp.topk[size_t(role.topk_from)].data();
    ckv = sp.s->layers[size_t(role.kv_from)].ckv.data();
  }
  const std::vector<float> sink = A.attn_sink.to_vector();
  const float scale = float(std::pow(double(hd), -0.5));
  std::vector<float> o(size_t(T) * H * size_t(hd));
  // Every window position older than the span must still be in the ring (checked here: an
  // exception must not leave the OpenMP region below).
  if (!sp.prefill)
    for (int64_t q = std::max<int64_t>(0, sp.p0 - W + 1); q < sp.p0; ++q)
      UF_CHECK(st.window.get(q), "layer {}: window KV of position {} is gone (span at {})", l, q,
               sp.p0);
#pragma omp parallel for schedule(dynamic, 4) if (T >= 8)
  for (int t = 0; t < T; ++t) {
    const int64_t p = sp.pos[size_t(t)];
    std::vector<const float*> slots;
    auto window_row = [&](int64_t qpos) -> const float* {
      if (qpos >= sp.p0) return kv.data() + (qpos - sp.p0) * hd;
      return st.window.get(qpos);
    };
    if (sp.prefill) {
      const int wd = std::min(T, W);
      const int64_t lo = std::max(sp.p0, p - W + 1);
      for (int j = 0; j < wd; ++j) slots.push_back(lo + j <= p ? window_row(lo + j) : nullptr);
    } else {
      for (int j = 0; j < W; ++j) {
        const int64_t qpos = p - W + 1 + j;
        slots.push_back(qpos >= 0 ? window_row(qpos) : nullptr);
      }
    }
    if (topk_rows)
      for (int32_t e : topk_rows[t]) slots.push_back(e >= 0 ? ckv + int64_t(e) * hd : nullptr);
    sparse_attn_row(q.data() + int64_t(t) * H * hd, H, hd, slots.data(), int(slots.size()),
                    sink.data(), scale, o.data() + int64_t(t) * H * hd);
  }
  for (int t = std::max(0, T - st.window.slots); t < T; ++t)
    std::copy_n(kv.data() + int64_t(t) * hd, hd, st.window.put(sp.pos[size_t(t)]));
  output_proj(l, o.data(), T, sp.pos.data(), out);
}

}  // namespace uf::cpu
