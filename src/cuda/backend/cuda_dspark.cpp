// DSpark draft rounds on the device (cpu/dspark.cpp's twin) and the commit path that feeds their
// window rings. Two ways to run the Markov loop (the bias of slot i needs the token chosen for
// slot i-1, so it runs slot by slot, one small GEMV each):
//   - draft(): the head logits come back to the host once per round, the engine's sampler picks
//     each slot on the host (the reference path; TP, or device drafting off);
//   - draft_on_device(): the loop, the transform, the draw and the confidences of every slot run
//     on the device after the stages, in one launch sequence replayed as one CUDA graph (key 2);
//     the per-call inputs (sampling parameters, the B uniforms) ride in the pinned block; one copy
//     brings tokens and confidences back. The q rows stay on the device for verification.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "cuda/backend/backend_kernels.h"
#include "cuda/backend/cuda_model.h"
#include "cuda/backend/model_internal.h"
#include "cuda/cuda_check.h"
#include "cuda/ops/attention.h"
#include "sampling/rng.h"

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
// committed positions, into that stage's ring. The host tags the ring slots and fills the commit
// block; the program reads positions and ring bases from the device, so commits of up to max_rows
// rows replay one graph per row count. Nothing here waits for the device: the next step's
// launches are stream-ordered after it.
void CudaModel::dspark_write(CudaSession& s, const float* main_hidden, int n, int64_t p0) {
  const int MH = n_taps() * cfg_.dim;
  UF_CHECK(n >= 1 && n <= std::min(tmax_, cfg_.window_size) && commit_host_,
           "dspark_write: {} rows (at most the span capacity {} and the window {})", n, tmax_,
           cfg_.window_size);
  const SpanBlock b = commit_block(n);
  // The previous commit's block copy must have run before its pinned bytes are rewritten.
  UF_CUDA_CHECK(cudaEventSynchronize(commit_done_));
  uint8_t* h = commit_host_;
  for (int i = 0; i < n; ++i) b.at<int64_t>(h, b.pos)[i] = p0 + i;
  for (int st = 0; st < cfg_.n_mtp_layers; ++st) {
    auto& ring = s.layers[size_t(cfg_.n_layers + st)].window;
    UF_CHECK(ring.slots == cfg_.window_size + opts_.max_rows,
             "dspark_write: DSpark stage {} ring of {} slots, the commit program expects {}", st,
             ring.slots, cfg_.window_size + opts_.max_rows);
    for (int i = 0; i < n; ++i) ring.put(p0 + i);
    *b.at<float*>(h, b.stage_window[size_t(st)]) = ring.data;
  }
  UF_CUDA_CHECK(cudaMemcpyAsync(commit_mh_, main_hidden, size_t(n) * size_t(MH) * sizeof(float),
                                cudaMemcpyDeviceToDevice, stream_));
  auto program = [&] { commit_program(b); };
  if (n <= opts_.max_rows)
    launch_program(kCommitGraphKey + n, program);
  else
    program();  // prefill commits: up to a window of rows, not worth a graph each
  UF_CUDA_CHECK(cudaEventRecord(commit_done_, stream_));
}

CudaModel::SpanBlock CudaModel::commit_block(int n) const {
  SpanBlock b;
  b.T = n;
  BlockPacker pk;
  b.pos = pk.add(size_t(n), sizeof(int64_t));
  for (int st = 0; st < cfg_.n_mtp_layers; ++st) b.stage_window.push_back(pk.add(1, sizeof(void*)));
  b.bytes = pk.bytes();
  return b;
}

void CudaModel::commit_program(const SpanBlock& b) {
  const int n = b.T, D = cfg_.dim, hd = cfg_.head_dim;
  UF_CUDA_CHECK(
      cudaMemcpyAsync(commit_dev_, commit_host_, b.bytes, cudaMemcpyHostToDevice, stream_));
  const int64_t* pos = b.at<int64_t>(commit_dev_, b.pos);
  const auto& S0 = *layers_[size_t(cfg_.n_layers)];
  S0.main_proj.apply(commit_mh_, n, x_, stream_);
  rms_norm(S0.main_norm, float(cfg_.norm_eps), x_, n, D, x_, stream_);
  for (int st = 0; st < cfg_.n_mtp_layers; ++st) {
    project_kv(cfg_.n_layers + st, x_, n, 0, kv_, pos);
    put_ring_rows(kv_, n, hd, pos, b.at<float*>(commit_dev_, b.stage_window[size_t(st)]),
                  cfg_.window_size + opts_.max_rows, stream_);
  }
}

CudaModel::SpanBlock CudaModel::draft_block() const {
  const int B = cfg_.dspark_block_size;
  SpanBlock b;
  b.T = B;
  BlockPacker pk;
  b.p0 = pk.add(1, sizeof(int64_t));
  b.ids = pk.add(size_t(B), sizeof(int32_t));
  b.pos = pk.add(size_t(B), sizeof(int64_t));
  for (int st = 0; st < cfg_.n_mtp_layers; ++st) b.stage_window.push_back(pk.add(1, sizeof(void*)));
  b.bytes = pk.bytes();
  return b;
}

// Slots: ring slots 0 .. min(W, p+1)-1 in slot order (slot k holds the latest position congruent
// to k), then the block's own entries; the same list for every row.
void CudaModel::draft_attention(const SpanBlock& b, int stage, const float* x, float* out) {
  const int B = b.T, hd = cfg_.head_dim, W = cfg_.window_size, l = cfg_.n_layers + stage;
  const int64_t* pos = b.at<int64_t>(block_dev_, b.pos);
  project_qkv(l, x, B, 0, qr_, q_, kv_, pos);
  build_draft_slots(b.at<int64_t>(block_dev_, b.p0), W, B,
                    b.at<float*>(block_dev_, b.stage_window[size_t(stage)]), W + opts_.max_rows,
                    kv_, hd, win_ptrs_, stream_);
  attend(l, B, win_ptrs_, W + B, nullptr, 0, nullptr, nullptr, 0, pos);
  output_proj(l, o_, B, out);
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

// The draft program's inputs in the pinned block: p0 = the last committed position, the ids
// (anchor + noise) and positions of the block, and each stage's ring, after the host checks of
// the CPU's draft (the ring holds every slot the program lists). `who` names the caller.
void CudaModel::fill_draft_block(const CudaSession& s, const SpanBlock& b, int32_t anchor,
                                 const char* who) {
  const int B = cfg_.dspark_block_size, W = cfg_.window_size, V = cfg_.vocab_size;
  const int64_t p = s.len - 1;
  uint8_t* h = block_host_;
  *b.at<int64_t>(h, b.p0) = p;
  UF_CHECK(anchor >= 0 && anchor < V, "{}: anchor {} outside the vocab of {}", who, anchor, V);
  for (int i = 0; i < B; ++i) {
    const int32_t id = i == 0 ? anchor : cfg_.dspark_noise_token_id;
    UF_CHECK(id >= 0 && id < V, "{}: token {} outside the vocab", who, id);
    b.at<int32_t>(h, b.ids)[i] = id;
    b.at<int64_t>(h, b.pos)[i] = p + 1 + i;
  }
  const int64_t nring = std::min<int64_t>(W, p + 1);
  for (int st = 0; st < cfg_.n_mtp_layers; ++st) {
    const auto& ring = s.layers[size_t(cfg_.n_layers + st)].window;
    UF_CHECK(ring.slots == W + opts_.max_rows,
             "{}: DSpark stage {} ring of {} slots, the draft program expects {}", who, st,
             ring.slots, W + opts_.max_rows);
    for (int64_t k = 0; k < nring; ++k) {
      const int64_t qpos = p - ((p - k) % W);
      UF_CHECK(ring.get(qpos), "{}: DSpark stage {} ring lacks position {}", who, st, qpos);
    }
    *b.at<float*>(h, b.stage_window[size_t(st)]) = ring.data;
  }
}

engine::DraftBlock CudaModel::draft(CudaSession& s, int32_t anchor,
                                    const engine::DraftSampler& sampler) {
  UF_CHECK(cfg_.n_mtp_layers > 0 && cfg_.dspark_block_size > 0,
           "draft: the model has no DSpark stages");
  UF_CHECK(s.len > 0, "draft: the session has no committed position yet");
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  const int B = cfg_.dspark_block_size, D = cfg_.dim, V = cfg_.vocab_size;
  const int64_t p = s.len - 1;
  engine::DraftBlock out;
  out.position = p;
  out.anchor = anchor;
  // The block's inputs (host checks as the CPU's draft: the ring holds every slot it lists).
  const SpanBlock b = draft_block();
  UF_CHECK(b.bytes <= block_bytes_, "draft program: a block of {} bytes exceeds {}", b.bytes,
           block_bytes_);
  fill_draft_block(s, b, anchor, "draft");
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
  device_drafts_.clear();  // logits_ is reused below: the device draft's rows are no longer valid
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

// ---------------------------------------------------------------------------------------------
// The draft sampler on the device.

namespace {
constexpr int kDeviceDraftGraphKey = 2;  // span programs use 4..35, the host draft 0 / 1
}  // namespace

bool CudaModel::device_draft_available() const {
  // Under TP only rank 0 has a verify plan: it runs the Markov loop (CudaBackend::draft_on_device
  // runs the peers' stages beside it).
  return opts_.device_draft && verify_plan_ != nullptr && cfg_.n_mtp_layers > 0 &&
         cfg_.dspark_block_size > 0;
}

CudaModel::DraftInputs CudaModel::draft_inputs(const SpanBlock& b) const {
  DraftInputs in;
  auto align = [](size_t n) { return (n + 15) / 16 * 16; };
  in.params = align(b.bytes);
  in.uniforms = align(in.params + sizeof(DeviceSamplingParams));
  in.bytes = align(in.uniforms + size_t(cfg_.dspark_block_size) * sizeof(float));
  return in;
}

void CudaModel::prepare_device_draft() {
  if (!device_draft_available() || draft_q_) return;
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  const int B = cfg_.dspark_block_size, D = cfg_.dim, Rk = cfg_.dspark_markov_rank,
            V = cfg_.vocab_size;
  const auto& LW = w_.layers[size_t(cfg_.n_layers + cfg_.n_mtp_layers - 1)];
  UF_CHECK(Rk >= 1 && LW.markov_embed.rows == V && LW.markov_embed.cols == Rk,
           "device draft: Markov embedding of {} x {}, expected {} x {}", LW.markov_embed.rows,
           LW.markov_embed.cols, V, Rk);
  UF_CHECK(int64_t(LW.conf_proj.rows) * LW.conf_proj.cols == int64_t(D) + Rk,
           "device draft: confidence projection of {} x {} values, expected {}", LW.conf_proj.rows,
           LW.conf_proj.cols, D + Rk);
  const SpanBlock b = draft_block();
  UF_CHECK(draft_inputs(b).bytes <= block_bytes_,
           "device draft: a block of {} bytes exceeds the span block of {}", draft_inputs(b).bytes,
           block_bytes_);
  markov_embed_dev_ = upload_weight(LW.markov_embed, arena_);
  conf_proj_dev_ = arena_.upload(LW.conf_proj.to_vector());
  draft_emb_ = arena_.alloc<float>(size_t(B) * size_t(Rk));
  draft_bias_ = arena_.alloc<float>(size_t(V));
  draft_q_ = arena_.alloc<float>(size_t(B) * size_t(V));
  draft_pre_ = arena_.alloc<float>(1);
  draft_prev_ = arena_.alloc<int32_t>(size_t(B));
  draft_result_ = arena_.alloc<int32_t>(2 * size_t(B));
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  // Capture now (capture_step_graphs' reason: no capture once requests run on other threads).
  // Under TP the program's collectives need the peers: captured at the first draft instead,
  // when CudaBackend runs every rank's part (thread-local capture on each rank's thread).
  if (opts_.cuda_graphs && tp_ == 1) {
    auto s = new_session(int64_t(opts_.max_rows) + 2);
    const std::vector<int32_t> toks(1, 0);
    std::vector<float> logits(static_cast<size_t>(V));
    forward(*s, toks, false, true, logits.data(), mh_, nullptr);
    commit(*s, toks, mh_, 1, -1);
    sampling::SamplingParams sp;
    sp.top_p = 0.9f;  // the top-p path (the graph does not depend on the parameters' values)
    draft_on_device(*s, 0, sp, 0, 1);
    device_drafts_.clear();
  }
}

void CudaModel::device_draft_program(const SpanBlock& b, const DraftInputs& in) {
  const int B = b.T, V = cfg_.vocab_size, Rk = cfg_.dspark_markov_rank, D = cfg_.dim;
  const auto& LS = *layers_[size_t(cfg_.n_layers + cfg_.n_mtp_layers - 1)];
  const auto* params = b.at<DeviceSamplingParams>(block_dev_, in.params);
  const float* u = b.at<float>(block_dev_, in.uniforms);
  const int32_t* anchor = b.at<int32_t>(block_dev_, b.ids);  // ids[0] = the anchor
  int32_t* tokens = draft_result_;
  float* conf = reinterpret_cast<float*>(draft_result_ + B);
  for (int i = 0; i < B; ++i) {
    float* emb = draft_emb_ + int64_t(i) * Rk;
    // The Markov row of the previous token (the anchor, then slot i-1's draw; a device int).
    embed_rows(markov_embed_dev_, i == 0 ? anchor : draft_prev_ + (i - 1), 1, 1, emb, draft_pre_,
               stream_);
    LS.markov_head.apply(emb, 1, draft_bias_, stream_);  // as draft(): one row per slot
    sample_slot_on_device(logits_ + int64_t(i) * V, draft_bias_, V, params, u + i,
                          draft_q_ + int64_t(i) * V, tokens + i, draft_prev_ + i, stream_);
  }
  draft_confidence_on_device(conf_proj_dev_, x_, draft_emb_, B, D, Rk, conf, stream_);
}

engine::DraftBlock CudaModel::draft_on_device(CudaSession& s, int32_t anchor,
                                              const sampling::SamplingParams& params, uint64_t seed,
                                              uint64_t step) {
  UF_CHECK(device_draft_available(),
           "draft_on_device: device drafting is off (CudaModelOptions::device_draft and "
           "device_verify, rank 0, a model with DSpark stages)");
  sampling::validate(params);
  if (!draft_q_) prepare_device_draft();
  UF_CHECK(s.len > 0, "draft_on_device: the session has no committed position yet");
  UF_CUDA_CHECK(cudaSetDevice(opts_.device));
  const int B = cfg_.dspark_block_size, V = cfg_.vocab_size;
  const int64_t p = s.len - 1;
  SpanBlock b = draft_block();
  const DraftInputs in = draft_inputs(b);
  UF_CHECK(in.bytes <= block_bytes_, "draft_on_device: a block of {} bytes exceeds {}", in.bytes,
           block_bytes_);
  b.bytes = in.bytes;  // draft_program's upload covers the sampling inputs too
  fill_draft_block(s, b, anchor, "draft_on_device");
  uint8_t* h = block_host_;
  for (int i = 0; i < B; ++i)
    b.at<float>(h, in.uniforms)[i] =
        sampling::stream_uniform(seed, step, sampling::RngPurpose::kDraft, uint32_t(i));
  *b.at<DeviceSamplingParams>(h, in.params) = device_sampling_params(params);
  launch_program(kDeviceDraftGraphKey, [&] {
    draft_program(b, /*head_rows=*/true);
    device_draft_program(b, in);
  });
  std::vector<int32_t> result(2 * size_t(B));
  UF_CUDA_CHECK(cudaMemcpyAsync(result.data(), draft_result_, result.size() * sizeof(int32_t),
                                cudaMemcpyDeviceToHost, stream_));
  sync();
  engine::DraftBlock out;
  out.position = p;
  out.anchor = anchor;
  out.tokens.assign(result.begin(), result.begin() + B);
  out.confidence.resize(size_t(B));
  std::memcpy(out.confidence.data(), result.data() + B, size_t(B) * sizeof(float));
  for (int i = 0; i < B; ++i)
    UF_CHECK(out.tokens[size_t(i)] >= 0 && out.tokens[size_t(i)] < V,
             "draft_on_device: slot {} drew token {} (outside the vocab of {}): its q row had no "
             "positive weight (NaN logits?); T {} top_p {} top_k {}",
             i, out.tokens[size_t(i)], V, params.temperature, params.top_p, params.top_k);
  device_drafts_ = out.tokens;
  return out;
}

sampling::VerifyResult CudaModel::verify_last_drafted(sampling::VerifyMode mode,
                                                      const sampling::SamplingParams& params,
                                                      std::span<const int32_t> tokens,
                                                      uint64_t seed, uint64_t step, int rows) {
  const int g = int(tokens.size());
  UF_CHECK(g == 0 || (g <= int(device_drafts_.size()) &&
                      std::equal(tokens.begin(), tokens.end(), device_drafts_.begin())),
           "verify_last_drafted: the {} drafts are not a prefix of the last device draft's {} "
           "(no draft_on_device since, or a host draft() in between): its q rows would not match",
           g, device_drafts_.size());
  return verify_on_device(mode, params, draft_q_, tokens, seed, step, rows);
}

std::vector<float> CudaModel::device_draft_probs(int rows) const {
  UF_CHECK(draft_q_ && rows >= 0 && rows <= cfg_.dspark_block_size,
           "device_draft_probs: {} rows (device draft prepared: {})", rows, draft_q_ != nullptr);
  UF_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return download(draft_q_, size_t(rows) * size_t(cfg_.vocab_size));
}

std::vector<float> CudaModel::device_draft_logits(int rows) const {
  UF_CHECK(rows >= 0 && rows <= cfg_.dspark_block_size, "device_draft_logits: {} rows", rows);
  UF_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return download(logits_, size_t(rows) * size_t(cfg_.vocab_size));
}

}  // namespace uf::cuda
