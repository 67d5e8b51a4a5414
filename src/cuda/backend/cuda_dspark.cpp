// DSpark draft rounds on the device (cpu/dspark.cpp's twin) and the commit path that feeds their
// window rings. The head logits come back to the host once per round; the Markov bias of slot i
// needs the token chosen for slot i-1, so it runs slot by slot (one small GEMV each).
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "cuda/backend/cuda_model.h"
#include "cuda/backend/model_internal.h"
#include "cuda/cuda_check.h"
#include "cuda/ops/attention.h"

namespace uf::cuda {

namespace {

// cpu::dot_f32's order: 8 interleaved partial sums, combined pairwise.
float dot8(const float* a, const float* b, int n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  for (int j = 0; i < n; ++i, ++j) s[j] += a[i] * b[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

}  // namespace

void CudaModel::commit(CudaSession& s, std::span<const int32_t> tokens, const float* main_hidden,
                       int n, int publisher_after) {
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
// committed positions, into that stage's ring.
void CudaModel::dspark_write(CudaSession& s, const float* main_hidden, int n, int64_t p0) {
  const int D = cfg_.dim, hd = cfg_.head_dim;
  UF_CHECK(n <= tmax_, "dspark_write: {} rows exceed the span capacity {}", n, tmax_);
  const auto& S0 = *layers_[size_t(cfg_.n_layers)];
  S0.main_proj.apply(main_hidden, n, x_, stream_);
  rms_norm(S0.main_norm, float(cfg_.norm_eps), x_, n, D, x_, stream_);
  for (int st = 0; st < cfg_.n_mtp_layers; ++st) {
    const int l = cfg_.n_layers + st;
    project_kv(l, x_, n, p0, kv_);
    auto& ring = s.layers[size_t(l)].window;
    for (int i = std::max(0, n - ring.slots); i < n; ++i)
      UF_CUDA_CHECK(cudaMemcpyAsync(ring.put(p0 + i), kv_ + int64_t(i) * hd,
                                    size_t(hd) * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  }
  sync();
}

engine::DraftBlock CudaModel::draft(CudaSession& s, int32_t anchor,
                                    const engine::DraftSampler& sampler) {
  UF_CHECK(cfg_.n_mtp_layers > 0 && cfg_.dspark_block_size > 0,
           "draft: the model has no DSpark stages");
  UF_CHECK(s.len > 0, "draft: the session has no committed position yet");
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  const int B = cfg_.dspark_block_size, hc = cfg_.hc_mult, D = cfg_.dim, H = H_, hd = cfg_.head_dim,
            W = cfg_.window_size, V = cfg_.vocab_size;
  const float eps = float(cfg_.norm_eps);
  const int64_t p = s.len - 1;
  engine::DraftBlock out;
  out.position = p;
  out.anchor = anchor;
  std::vector<int32_t> ids(size_t(B), cfg_.dspark_noise_token_id);
  ids[0] = anchor;
  for (int i = 0; i < B; ++i)
    UF_CHECK(ids[size_t(i)] >= 0 && ids[size_t(i)] < V, "draft: token {} outside the vocab",
             ids[size_t(i)]);
  // Embed the block and expand to hc copies; pre_mix starts one-hot and is carried across stages.
  to_device(ids_, ids);
  embed_rows(embed_, ids_, B, hc, X_, pre_, stream_);
  const float scale = float(std::pow(double(hd), -0.5));
  const size_t stream_bytes = size_t(B) * size_t(hc) * size_t(D) * sizeof(float);
  for (int st = 0; st < cfg_.n_mtp_layers; ++st) {
    const int l = cfg_.n_layers + st;
    const auto& op = *layers_[size_t(l)];
    const auto& ring = s.layers[size_t(l)].window;
    // --- attention sublayer (window ring + the block itself, non-causal) ---
    UF_CUDA_CHECK(cudaMemcpyAsync(R_, X_, stream_bytes, cudaMemcpyDeviceToDevice, stream_));
    hc_mixes(hc_, op.hc_attn_fn, op.hc_attn_scale, op.hc_attn_base, X_, B, apre_, apost_, acomb_,
             stream_);
    hc_pre(hc_, X_, pre_, B, x_, stream_);
    rms_norm(op.attn_norm, eps, x_, B, D, x_, stream_);
    project_q(l, x_, B, p + 1, qr_, q_);
    project_kv(l, x_, B, p + 1, kv_);
    // Slots: ring slots 0 .. min(W, p+1)-1 in slot order (slot k holds the latest position
    // congruent to k), then the block's own entries; the same list for every row.
    std::vector<const float*> one;
    const int64_t nring = std::min<int64_t>(W, p + 1);
    for (int64_t k = 0; k < nring; ++k) {
      const int64_t qpos = p - ((p - k) % W);
      const float* v = ring.get(qpos);
      UF_CHECK(v, "draft: DSpark stage {} ring lacks position {}", st, qpos);
      one.push_back(v);
    }
    for (int i = 0; i < B; ++i) one.push_back(kv_ + int64_t(i) * hd);
    const int n_slots = int(one.size());
    std::vector<const float*> slots;
    slots.reserve(size_t(B) * one.size());
    for (int i = 0; i < B; ++i) slots.insert(slots.end(), one.begin(), one.end());
    to_device(win_ptrs_, slots);
    sparse_attn(q_, B, H, hd, win_ptrs_, n_slots, nullptr, 0, nullptr, op.sink, scale, o_, stream_);
    output_proj(l, o_, B, p + 1, y_);
    hc_post(hc_, y_, R_, apost_, acomb_, B, X_, stream_);
    // --- MoE sublayer ---
    UF_CUDA_CHECK(cudaMemcpyAsync(R_, X_, stream_bytes, cudaMemcpyDeviceToDevice, stream_));
    hc_mixes(hc_, op.hc_ffn_fn, op.hc_ffn_scale, op.hc_ffn_base, X_, B, pre_, fpost_, fcomb_,
             stream_);
    hc_pre(hc_, X_, apre_, B, x_, stream_);
    rms_norm(op.ffn_norm, eps, x_, B, D, x_, stream_);
    op.moe->apply(x_, B, y_, gate_i_, gate_w_, stream_);
    if (tp_ > 1) all_reduce_round(y_, size_t(B) * size_t(D));  // as CudaModel::block
    hc_post(hc_, y_, R_, fpost_, fcomb_, B, X_, stream_);
  }
  if (rank_ != 0 && !split_head_) {  // TP: rank 0 alone runs the replicated head, Markov loop
    sync();
    return out;
  }
  // --- head of the last stage ---
  const int last = cfg_.n_layers + cfg_.n_mtp_layers - 1;
  const auto& LS = *layers_[size_t(last)];
  const auto& LW = w_.layers[size_t(last)];
  const int Rk = cfg_.dspark_markov_rank;
  hc_pre(hc_, X_, pre_, B, x_, stream_);          // x5
  rms_norm(LS.norm, eps, x_, B, D, y_, stream_);  // xn
  apply_head(y_, B, logits_);
  if (rank_ != 0) {  // split head: every rank ran it (a collective); rank 0 goes on alone
    sync();
    return out;
  }
  out.logits.resize(size_t(B) * size_t(V));
  out.markov_bias.resize(size_t(B) * size_t(V));
  std::vector<float> x5(size_t(B) * size_t(D));
  UF_CUDA_CHECK(cudaMemcpyAsync(out.logits.data(), logits_, out.logits.size() * sizeof(float),
                                cudaMemcpyDeviceToHost, stream_));
  UF_CUDA_CHECK(
      cudaMemcpyAsync(x5.data(), x_, x5.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  sync();
  const std::vector<float> proj = LW.conf_proj.to_vector();
  std::vector<float> emb(static_cast<size_t>(Rk)), cat(static_cast<size_t>(D + Rk));
  int32_t prev = anchor;
  for (int i = 0; i < B; ++i) {
    LW.markov_embed.row(prev, emb.data());
    float* bias = out.markov_bias.data() + int64_t(i) * V;
    to_device(emb_, emb);
    LS.markov_head.apply(emb_, 1, logits_, stream_);
    UF_CUDA_CHECK(
        cudaMemcpyAsync(bias, logits_, size_t(V) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    sync();
    float* lg = out.logits.data() + int64_t(i) * V;
    for (int v = 0; v < V; ++v) lg[v] += bias[v];
    std::copy_n(x5.data() + int64_t(i) * D, D, cat.begin());
    std::copy(emb.begin(), emb.end(), cat.begin() + D);
    out.confidence.push_back(dot8(proj.data(), cat.data(), D + Rk));
    prev = sampler(i, std::span<const float>(lg, size_t(V)));
    UF_CHECK(prev >= 0 && prev < V, "draft: the sampler chose token {} outside the vocab", prev);
    out.tokens.push_back(prev);
  }
  return out;
}

}  // namespace uf::cuda
