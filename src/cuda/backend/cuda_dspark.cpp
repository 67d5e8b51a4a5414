// DSpark draft rounds on the device (cpu/dspark.cpp's twin) and the commit path that feeds their
// window rings. The head logits come back to the host once per round; the Markov bias of slot i
// needs the token chosen for slot i-1, so it runs slot by slot (one small GEMV each).
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "cuda/backend/backend_kernels.h"
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

CudaModel::SpanBlock CudaModel::draft_block() const {
  const int B = cfg_.dspark_block_size;
  SpanBlock b;
  b.T = B;
  size_t off = 0;
  auto add = [&](size_t count, size_t elem) {
    const size_t at = (off + 15) / 16 * 16;
    off = at + count * elem;
    return at;
  };
  b.p0 = add(1, sizeof(int64_t));
  b.ids = add(size_t(B), sizeof(int32_t));
  b.pos = add(size_t(B), sizeof(int64_t));
  for (int st = 0; st < cfg_.n_mtp_layers; ++st) b.stage_window.push_back(add(1, sizeof(void*)));
  b.bytes = (off + 15) / 16 * 16;
  return b;
}

// Slots: ring slots 0 .. min(W, p+1)-1 in slot order (slot k holds the latest position congruent
// to k), then the block's own entries; the same list for every row.
void CudaModel::draft_attention(const SpanBlock& b, int stage, const float* x, float* out) {
  const int B = b.T, H = H_, hd = cfg_.head_dim, W = cfg_.window_size, l = cfg_.n_layers + stage;
  const auto& op = *layers_[size_t(l)];
  const int64_t* pos = b.at<int64_t>(block_dev_, b.pos);
  project_q(l, x, B, 0, qr_, q_, pos);
  project_kv(l, x, B, 0, kv_, pos);
  build_draft_slots(b.at<int64_t>(block_dev_, b.p0), W, B,
                    b.at<float*>(block_dev_, b.stage_window[size_t(stage)]), W + opts_.max_rows,
                    kv_, hd, win_ptrs_, stream_);
  const float scale = float(std::pow(double(hd), -0.5));
  sparse_attn(q_, B, H, hd, win_ptrs_, W + B, nullptr, 0, nullptr, op.sink, scale, o_, stream_,
              nullptr, attn_scratch_);
  output_proj(l, o_, B, 0, out, pos);
}

// The stages on the block (anchor + noise), non-causal over the stage's window ring and the block
// itself; every input that depends on the position or the session comes from the block.
void CudaModel::draft_program(const SpanBlock& b, bool head_rows) {
  const int B = b.T, hc = cfg_.hc_mult, D = cfg_.dim;
  const float eps = float(cfg_.norm_eps);
  UF_CUDA_CHECK(cudaMemcpyAsync(block_dev_, block_host_, b.bytes, cudaMemcpyHostToDevice, stream_));
  // Embed the block and expand to hc copies; pre_mix starts one-hot and is carried across stages.
  embed_rows(embed_, b.at<int32_t>(block_dev_, b.ids), B, hc, X_, pre_, stream_);
  for (int st = 0; st < cfg_.n_mtp_layers; ++st)
    layer(cfg_.n_layers + st, X_, B, pre_,
          [&](const float* x, float* out) { draft_attention(b, st, x, out); });
  if (!head_rows) return;
  // --- head of the last stage: x5 stays in x_, xn in y_ ---
  const auto& LS = *layers_[size_t(cfg_.n_layers + cfg_.n_mtp_layers - 1)];
  hc_pre(hc_, X_, pre_, B, x_, stream_);          // x5
  rms_norm(LS.norm, eps, x_, B, D, y_, stream_);  // xn
  apply_head(y_, B, logits_);
}

engine::DraftBlock CudaModel::draft(CudaSession& s, int32_t anchor,
                                    const engine::DraftSampler& sampler) {
  UF_CHECK(cfg_.n_mtp_layers > 0 && cfg_.dspark_block_size > 0,
           "draft: the model has no DSpark stages");
  UF_CHECK(s.len > 0, "draft: the session has no committed position yet");
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  const int B = cfg_.dspark_block_size, D = cfg_.dim, W = cfg_.window_size, V = cfg_.vocab_size;
  const int64_t p = s.len - 1;
  engine::DraftBlock out;
  out.position = p;
  out.anchor = anchor;
  // The block's inputs (host checks as the CPU's draft: the ring holds every slot it lists).
  const SpanBlock b = draft_block();
  UF_CHECK(b.bytes <= block_bytes_, "draft program: a block of {} bytes exceeds {}", b.bytes,
           block_bytes_);
  uint8_t* h = block_host_;
  *b.at<int64_t>(h, b.p0) = p;
  for (int i = 0; i < B; ++i) {
    const int32_t id = i == 0 ? anchor : cfg_.dspark_noise_token_id;
    UF_CHECK(id >= 0 && id < V, "draft: token {} outside the vocab", id);
    b.at<int32_t>(h, b.ids)[i] = id;
    b.at<int64_t>(h, b.pos)[i] = p + 1 + i;
  }
  const int64_t nring = std::min<int64_t>(W, p + 1);
  for (int st = 0; st < cfg_.n_mtp_layers; ++st) {
    const auto& ring = s.layers[size_t(cfg_.n_layers + st)].window;
    UF_CHECK(ring.slots == W + opts_.max_rows,
             "draft: DSpark stage {} ring of {} slots, the draft program expects {}", st,
             ring.slots, W + opts_.max_rows);
    for (int64_t k = 0; k < nring; ++k) {
      const int64_t qpos = p - ((p - k) % W);
      UF_CHECK(ring.get(qpos), "draft: DSpark stage {} ring lacks position {}", st, qpos);
    }
    *b.at<float*>(h, b.stage_window[size_t(st)]) = ring.data;
  }
  // TP: rank 0 alone runs the replicated head and the Markov loop; a split head is a collective
  // every rank runs.
  const bool head_rows = rank_ == 0 || split_head_;
  launch_program(head_rows ? 1 : 0, [&] { draft_program(b, head_rows); });
  if (rank_ != 0) {
    sync();
    return out;
  }
  const int last = cfg_.n_layers + cfg_.n_mtp_layers - 1;
  const auto& LS = *layers_[size_t(last)];
  const auto& LW = w_.layers[size_t(last)];
  const int Rk = cfg_.dspark_markov_rank;
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
