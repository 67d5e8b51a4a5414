// DSpark draft rounds (model-arch.md §5) and the commit path that feeds their window rings.
#include <algorithm>
#include <cmath>

#include "core/dtypes.h"
#include "core/error.h"
#include "cpu/attention.h"
#include "cpu/linear.h"
#include "cpu/model.h"
#include "cpu/norm.h"

namespace uf::cpu {

void CpuModel::commit(CpuSession& s, std::span<const int32_t> tokens, const float* main_hidden,
                      int n, int publisher_after) const {
  UF_CHECK(n >= 0 && n <= int(tokens.size()), "commit: {} rows of {}", n, tokens.size());
  if (n == 0) return;
  const int64_t p0 = s.len;
  s.toks.insert(s.toks.end(), tokens.begin(), tokens.begin() + n);
  s.len += n;
  s.publisher = publisher_after;
  if (main_hidden && cfg_.n_mtp_layers > 0 && cfg_.dspark_block_size > 0) {
    // Only the last window positions can ever be attended by a draft round.
    const int keep = std::min(n, cfg_.window_size);
    dspark_write(s, main_hidden + int64_t(n - keep) * n_taps() * cfg_.dim, keep, p0 + n - keep);
  }
}

// Each stage's main_kv (kv_norm(wkv(main_norm(main_proj(main_hidden)))), RoPE, FP8) at the
// committed positions, into that stage's ring: what the reference writes at slot p % window.
void CpuModel::dspark_write(CpuSession& s, const float* main_hidden, int n, int64_t p0) const {
  const int D = cfg_.dim, hd = cfg_.head_dim;
  const auto& S0 = w_.layers[size_t(cfg_.n_layers)];
  std::vector<float> mx(size_t(n) * size_t(D)), kv(size_t(n) * size_t(hd));
  linear(S0.main_proj, main_hidden, n, mx.data());
  rms_norm(S0.main_norm, float(cfg_.norm_eps), mx.data(), n, D, mx.data());
  std::vector<int64_t> pos(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) pos[size_t(i)] = p0 + i;
  for (int st = 0; st < cfg_.n_mtp_layers; ++st) {
    const int l = cfg_.n_layers + st;
    project_kv(l, mx.data(), n, pos.data(), kv.data());
    auto& ring = s.layers[size_t(l)].window;
    for (int i = std::max(0, n - ring.slots); i < n; ++i)
      std::copy_n(kv.data() + int64_t(i) * hd, hd, ring.put(pos[size_t(i)]));
  }
}

engine::DraftBlock CpuModel::draft(CpuSession& s, int32_t anchor,
                                   const engine::DraftSampler& sampler) const {
  UF_CHECK(cfg_.n_mtp_layers > 0 && cfg_.dspark_block_size > 0,
           "draft: the model has no DSpark stages");
  UF_CHECK(s.len > 0, "draft: the session has no committed position yet");
  const int B = cfg_.dspark_block_size, hc = cfg_.hc_mult, D = cfg_.dim, H = cfg_.n_heads,
            hd = cfg_.head_dim, W = cfg_.window_size, V = cfg_.vocab_size;
  const int64_t p = s.len - 1;
  engine::DraftBlock out;
  out.position = p;
  out.anchor = anchor;
  std::vector<int32_t> ids(size_t(B), cfg_.dspark_noise_token_id);
  ids[0] = anchor;
  std::vector<int64_t> pos(static_cast<size_t>(B));
  for (int i = 0; i < B; ++i) pos[size_t(i)] = p + 1 + i;
  // Embed the block and expand to hc copies; pre_mix starts one-hot and is carried across stages.
  std::vector<float> X(size_t(B) * size_t(hc) * size_t(D)), pre(size_t(B) * size_t(hc));
  for (int i = 0; i < B; ++i) {
    UF_CHECK(ids[size_t(i)] >= 0 && ids[size_t(i)] < V, "draft: token {} outside the vocab",
             ids[size_t(i)]);
    float* x = X.data() + int64_t(i) * hc * D;
    w_.embed.row(ids[size_t(i)], x);
    for (int c = 1; c < hc; ++c) std::copy(x, x + D, x + int64_t(c) * D);
    for (int c = 0; c < hc; ++c) pre[size_t(i * hc + c)] = c == 0 ? 1.f : 0.f;
  }
  const float scale = float(std::pow(double(hd), -0.5));
  for (int st = 0; st < cfg_.n_mtp_layers; ++st) {
    const int l = cfg_.n_layers + st;
    const auto& L = w_.layers[size_t(l)];
    const auto& ring = s.layers[size_t(l)].window;
    // --- attention sublayer (window ring + the block itself, non-causal) ---
    std::vector<float> R(X);
    std::vector<float> apre(size_t(B) * size_t(hc)), apost(size_t(B) * size_t(hc)),
        acomb(size_t(B) * size_t(hc * hc));
    // MixOrder::kLanes16: the order of the reference's F.linear on the 5-row block (cpu/mhc.cpp).
    hc_mixes(hc_, L.hc_attn_fn, L.hc_attn_scale, L.hc_attn_base, X.data(), B, apre.data(),
             apost.data(), acomb.data(), MixOrder::kLanes16);
    std::vector<float> x(size_t(B) * size_t(D)), y(size_t(B) * size_t(D));
    hc_pre(hc_, X.data(), pre.data(), B, x.data());
    rms_norm(L.attn_norm, float(cfg_.norm_eps), x.data(), B, D, x.data());
    std::vector<float> qr(size_t(B) * size_t(cfg_.q_lora_rank)), q(size_t(B) * H * size_t(hd)),
        kv(size_t(B) * size_t(hd)), o(size_t(B) * H * size_t(hd));
    project_q(l, x.data(), B, pos.data(), qr.data(), q.data());
    project_kv(l, x.data(), B, pos.data(), kv.data());
    // Slots: ring slots 0 .. min(W, p+1)-1 in slot order (slot k holds the latest position
    // congruent to k), then the block's own entries.
    std::vector<const float*> slots;
    const int64_t nring = std::min<int64_t>(W, p + 1);
    for (int64_t k = 0; k < nring; ++k) {
      const int64_t qpos = p - ((p - k) % W);
      const float* v = ring.get(qpos);
      UF_CHECK(v, "draft: DSpark stage {} ring lacks position {}", st, qpos);
      slots.push_back(v);
    }
    for (int i = 0; i < B; ++i) slots.push_back(kv.data() + int64_t(i) * hd);
    const std::vector<float> sink = L.attn.attn_sink.to_vector();
    for (int i = 0; i < B; ++i)
      sparse_attn_row(q.data() + int64_t(i) * H * hd, H, hd, slots.data(), int(slots.size()),
                      sink.data(), scale, o.data() + int64_t(i) * H * hd);
    output_proj(l, o.data(), B, pos.data(), y.data());
    hc_post(hc_, y.data(), R.data(), apost.data(), acomb.data(), B, X.data());
    // --- MoE sublayer ---
    R = X;
    std::vector<float> fpost(size_t(B) * size_t(hc)), fcomb(size_t(B) * size_t(hc * hc));
    hc_mixes(hc_, L.hc_ffn_fn, L.hc_ffn_scale, L.hc_ffn_base, X.data(), B, pre.data(), fpost.data(),
             fcomb.data(), MixOrder::kLanes16);
    hc_pre(hc_, X.data(), apre.data(), B, x.data());
    rms_norm(L.ffn_norm, float(cfg_.norm_eps), x.data(), B, D, x.data());
    const auto& mp = moe_[size_t(l)];
    std::vector<int32_t> gi(size_t(B) * size_t(mp.top_k));
    std::vector<float> gw(size_t(B) * size_t(mp.top_k));
    moe_forward(L.moe, mp, x.data(), B, D, cfg_.moe_inter_dim, y.data(), gi.data(), gw.data());
    hc_post(hc_, y.data(), R.data(), fpost.data(), fcomb.data(), B, X.data());
  }
  // --- head of the last stage ---
  const auto& LS = w_.layers[size_t(cfg_.n_layers + cfg_.n_mtp_layers - 1)];
  const int Rk = cfg_.dspark_markov_rank;
  std::vector<float> x5(size_t(B) * size_t(D)), xn(size_t(B) * size_t(D));
  hc_pre(hc_, X.data(), pre.data(), B, x5.data());
  rms_norm(LS.norm, float(cfg_.norm_eps), x5.data(), B, D, xn.data());
  out.logits.resize(size_t(B) * size_t(V));
  out.markov_bias.resize(size_t(B) * size_t(V));
  linear_f32(w_.head, xn.data(), B, out.logits.data());
  const std::vector<float> proj = LS.conf_proj.to_vector();
  std::vector<float> emb(static_cast<size_t>(Rk)), cat(static_cast<size_t>(D + Rk));
  int32_t prev = anchor;
  for (int i = 0; i < B; ++i) {
    LS.markov_embed.row(prev, emb.data());
    float* bias = out.markov_bias.data() + int64_t(i) * V;
    linear_f32(LS.markov_head, emb.data(), 1, bias);
    float* lg = out.logits.data() + int64_t(i) * V;
    for (int v = 0; v < V; ++v) lg[v] += bias[v];
    std::copy_n(x5.data() + int64_t(i) * D, D, cat.begin());
    std::copy(emb.begin(), emb.end(), cat.begin() + D);
    out.confidence.push_back(dot_f32(proj.data(), cat.data(), D + Rk));
    prev = sampler(i, std::span<const float>(lg, size_t(V)));
    UF_CHECK(prev >= 0 && prev < V, "draft: the sampler chose token {} outside the vocab", prev);
    out.tokens.push_back(prev);
  }
  return out;
}

}  // namespace uf::cpu
