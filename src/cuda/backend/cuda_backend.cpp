#include "cuda/backend/cuda_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>

#include "core/dtypes.h"
#include "core/error.h"
#include "core/log.h"
#include "cuda/backend/rank_workers.h"
#include "cuda/cuda_check.h"
#include "cuda/tp/nccl_comm.h"
#include "cuda/tp/p2p_allreduce.h"
#include "engine/bytes.h"

namespace uf::cuda {

namespace {
// CpuBackend's magic: the byte format is the same.
constexpr uint32_t kSnapshotMagic = 0x55464331;  // "UFC1"

// The session's bf16 compressed KV and index keys (cuda_session.h) in the snapshot's fp32 format
// and back. A value that bf16 cannot hold exactly is refused: the CPU backend's entries are FP4
// QDQ values, so such a snapshot was not made by this model, and rounding it would change the
// attention and the scores silently.
std::vector<float> bf16_to_f32(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = core::bf16_to_float(v[i]);
  return out;
}
std::vector<uint16_t> f32_to_bf16_exact(const std::vector<float>& v, const char* what, size_t l) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = core::float_to_bf16(v[i]);
    UF_CHECK(core::bf16_to_float(out[i]) == v[i] || std::isnan(v[i]),
             "restore: layer {} {} value {} (index {}) is not exact in bf16", l, what, v[i], i);
  }
  return out;
}
}  // namespace

CudaTpSession::~CudaTpSession() {
  // Free each rank's buffers with its device current.
  int cur = 0;
  cudaGetDevice(&cur);
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (r < devices.size()) cudaSetDevice(devices[r]);
    ranks[r].reset();
  }
  cudaSetDevice(cur);
}

namespace {

// The per-rank steps: the one-GPU backend's bodies; `logits` is null on TP ranks other than 0.

void prefill_rank(CudaModel& m, CudaSession& s, std::span<const int32_t> tokens,
                  const engine::PrefillOptions& opts, float* logits) {
  const int V = m.config().vocab_size;
  s.pending_rows = 0;
  if (opts.ced_shortcut && s.len == 0 && !opts.all_logits) {
    m.prefill_ced(s, tokens, opts.replay, logits);
    return;
  }
  // Chunks are bounded by the span scratch (CudaModelOptions::max_chunk).
  const size_t cap = size_t(m.max_span_rows());
  const size_t chunk = std::min(size_t(opts.chunk > 0 ? opts.chunk : int(cap)), cap);
  const int MH = m.n_taps() * m.config().dim;
  std::vector<float> tmp;
  std::vector<int> pub;
  for (size_t b = 0; b < tokens.size(); b += chunk) {
    const auto part = tokens.subspan(b, std::min(chunk, tokens.size() - b));
    const int T = int(part.size());
    pub.assign(size_t(T), 0);
    const bool last = b + part.size() == tokens.size();
    float* out = nullptr;
    if (!logits) {
      out = nullptr;
    } else if (opts.all_logits) {
      out = logits + b * size_t(V);
    } else if (last) {
      out = logits;
    } else {
      tmp.resize(size_t(V));
      out = tmp.data();
    }
    // The first chunk of a fresh session is the reference's prefill; later chunks use the decode
    // (ring) layout.
    m.forward(s, part, /*prefill_layout=*/s.len == 0, opts.all_logits, out, nullptr, pub.data());
    m.commit(s, part, MH ? m.scratch_main_hidden() : nullptr, T, pub.back());
  }
}

// keep: the logits rows stay on the device for verify_last (device verification).
void decode_rank(CudaModel& m, CudaSession& s, std::span<const int32_t> tokens, float* logits,
                 bool keep = false) {
  const int T = int(tokens.size());
  s.pending_rows = 0;
  s.pending_tokens.assign(tokens.begin(), tokens.end());
  s.pending_publisher.assign(size_t(T), -1);
  m.forward(s, tokens, /*prefill_layout=*/false, /*all_logits=*/true, logits, s.pending_main_hidden,
            s.pending_publisher.data(), keep);
  s.pending_rows = T;
}

void commit_rank(CudaModel& m, CudaSession& s, int n) {
  UF_CHECK(n >= 0 && n <= s.pending_rows, "commit: {} rows accepted but {} are pending", n,
           s.pending_rows);
  if (n > 0)
    m.commit(s, s.pending_tokens, m.n_taps() ? s.pending_main_hidden : nullptr, n,
             s.pending_publisher[size_t(n - 1)]);
  s.pending_rows = 0;
}

// The CPU backend's format: the device rows come back as the CPU vectors would hold them (rings
// whole, compressed KV and index keys up to the highest entry ever written).
std::vector<uint8_t> snapshot_rank(CudaModel& m, const CudaSession& sess) {
  const auto* s = &sess;
  m.synchronize();
  const int hd = m.config().head_dim, ihd = m.config().index_head_dim;
  engine::ByteWriter w;
  w.put(kSnapshotMagic);
  w.put<int64_t>(s->len);
  w.put<int64_t>(s->cap);
  w.put<int32_t>(s->publisher);
  w.put_vec(s->toks);
  w.put<uint64_t>(s->layers.size());
  std::vector<float> buf;
  for (const auto& L : s->layers) {
    for (const DeviceRing* r : {&L.window, &L.raw_kv, &L.raw_gate}) {
      w.put<int32_t>(r->slots);
      w.put<int32_t>(r->width);
      m.download_ring(*r, buf);
      w.put_vec(buf);
      w.put_vec(r->pos);
    }
    w.put_vec(bf16_to_f32(download(L.ckv, size_t(L.ckv_n) * size_t(hd))));
    w.put_vec(bf16_to_f32(download(L.ikeys, size_t(L.ikeys_n) * size_t(ihd))));
  }
  UF_CUDA_CHECK(cudaGetLastError());
  return w.take();
}

void restore_rank(CudaModel& m, CudaSession& sess, std::span<const uint8_t> bytes) {
  auto* s = &sess;
  m.synchronize();
  const int hd = m.config().head_dim, ihd = m.config().index_head_dim;
  engine::ByteReader r(bytes);
  UF_CHECK(r.get<uint32_t>("magic") == kSnapshotMagic, "restore: not a session snapshot");
  const auto len = r.get<int64_t>("length");
  const auto cap = r.get<int64_t>("capacity");
  UF_CHECK(cap <= s->alloc_cap && len <= cap,
           "restore: snapshot of capacity {} (length {}) into a CUDA session allocated for {}", cap,
           len, s->alloc_cap);
  const auto publisher = r.get<int32_t>("publisher");
  std::vector<int32_t> toks;
  r.get_vec(toks, "tokens");
  const auto n = r.get<uint64_t>("layer count");
  UF_CHECK(n == s->layers.size(), "restore: snapshot has {} layers, the model {}", n,
           s->layers.size());
  std::vector<float> buf;
  std::vector<int64_t> pos;
  for (size_t l = 0; l < n; ++l) {
    auto& L = s->layers[l];
    for (DeviceRing* ring : {&L.window, &L.raw_kv, &L.raw_gate}) {
      const auto slots = r.get<int32_t>("ring slots");
      const auto width = r.get<int32_t>("ring width");
      UF_CHECK(slots == ring->slots && width == ring->width,
               "restore: layer {} ring of {} x {} in the snapshot, {} x {} in the session", l,
               slots, width, ring->slots, ring->width);
      r.get_vec(buf, "ring data");
      r.get_vec(pos, "ring positions");
      UF_CHECK(pos.size() == size_t(slots), "restore: layer {} ring has {} tags for {} slots", l,
               pos.size(), slots);
      m.upload_ring(*ring, buf);
      ring->set_tags(pos);
    }
    r.get_vec(buf, "compressed KV");
    UF_CHECK(buf.size() % size_t(hd) == 0 && int64_t(buf.size() / size_t(hd)) <= L.ckv_cap,
             "restore: layer {} compressed KV of {} values does not fit {} entries", l, buf.size(),
             L.ckv_cap);
    L.ckv_n = int64_t(buf.size() / size_t(hd));
    if (!buf.empty()) {
      const std::vector<uint16_t> ckv = f32_to_bf16_exact(buf, "compressed KV", l);
      UF_CUDA_CHECK(
          cudaMemcpy(L.ckv, ckv.data(), ckv.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
    }
    r.get_vec(buf, "index keys");
    UF_CHECK(buf.size() % size_t(ihd) == 0 &&
                 (buf.empty() || (L.ikeys && int64_t(buf.size() / size_t(ihd)) <= L.ckv_cap)),
             "restore: layer {} index keys of {} values do not fit", l, buf.size());
    L.ikeys_n = int64_t(buf.size() / size_t(ihd));
    if (!buf.empty()) {
      const std::vector<uint16_t> keys = f32_to_bf16_exact(buf, "index key", l);
      UF_CUDA_CHECK(
          cudaMemcpy(L.ikeys, keys.data(), keys.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
    }
  }
  UF_CHECK(r.done(), "restore: {} trailing bytes after the snapshot", "some");
  s->len = len;
  s->cap = cap;
  s->publisher = publisher;
  s->toks = std::move(toks);
  s->pending_rows = 0;
}

}  // namespace

// The one-shot P2P sum (cuda/tp/p2p_allreduce.h) where every pair of GPUs has peer access, else
// NCCL (logged). Its per-kernel capacity: a decode step's [max_rows, dim] partials in one kernel,
// and at least 1 Mi floats (4 MiB a source rank and slot) so that index-score rows and prefill
// chunks take few kernels. A rank that waits longer than UF_P2P_TIMEOUT_S (default 300 s; 0 =
// forever) for a peer prints what it waited for and traps: the error then stops the call, where a
// dead or diverged rank would otherwise hang the server without a word. The ranks run the same
// work in lockstep, so a legitimate wait is milliseconds.
static std::unique_ptr<tp::PeerAllReduce> make_peer_all_reduce(const model::ModelConfig& cfg,
                                                               const CudaModelOptions& opts,
                                                               const std::vector<int>& devices) {
  std::string why;
  if (!tp::PeerAllReduce::supported(devices, &why)) {
    spdlog::warn("TP sums run on NCCL: the peer-to-peer all-reduce is unavailable ({})", why);
    return nullptr;
  }
  const size_t cap =
      std::max(size_t(1) << 20, size_t(std::max(opts.max_rows, 1)) * size_t(cfg.dim));
  const char* t = std::getenv("UF_P2P_TIMEOUT_S");
  const double timeout_s = t && *t ? std::atof(t) : 300.0;
  const char* c = std::getenv("UF_P2P_CTAS");  // for measurements; PeerAllReduce checks the range
  const int ctas = c && *c ? std::atoi(c) : tp::PeerAllReduce::kDefaultCtas;
  auto p2p = std::make_unique<tp::PeerAllReduce>(devices, cap, ctas, timeout_s);
  spdlog::info("TP sums: one-shot peer-to-peer all-reduce over {} GPUs ({} CTAs, {:.1f} MiB a GPU)",
               devices.size(), p2p->ctas(), double(p2p->bytes_per_rank()) / (1 << 20));
  return p2p;
}

CudaBackend::CudaBackend(const std::filesystem::path& model_dir,
                         std::vector<int64_t> engram_token_map, CudaModelOptions opts)
    : CudaBackend(model::ModelConfig::load(model_dir), model::Checkpoint::open(model_dir),
                  std::move(engram_token_map), opts) {}

CudaBackend::CudaBackend(model::ModelConfig cfg, model::Checkpoint ckpt,
                         std::vector<int64_t> engram_token_map, CudaModelOptions opts)
    : ckpt_(std::move(ckpt)) {
  const int n = opts.tp;
  UF_CHECK(n >= 1, "CUDA backend: --tp {} must be at least 1", n);
  if (n == 1) {
    models_.push_back(
        std::make_unique<CudaModel>(std::move(cfg), ckpt_, std::move(engram_token_map), opts));
    models_[0]->capture_step_graphs();
    models_[0]->prepare_device_draft();  // no-op unless device drafting is on
    return;
  }
  if (opts.tp_split_head && cfg.vocab_size % n != 0) {
    spdlog::info("TP {}: the head stays replicated (vocab {} does not split into {} slices)", n,
                 cfg.vocab_size, n);
    opts.tp_split_head = false;
  }
  // The plan's own message names the config field that does not divide.
  model::validate_tp(cfg, n,
                     backend_tp_options(opts.tp_split_head, tp_index_heads_split(cfg, opts)));
  if (tp_index_heads_split(cfg, opts))
    spdlog::info("TP {}: the indexer split by index heads (the ranks' scores summed)", n);
  else
    spdlog::info(
        "TP {}: the indexer split by entries from {} rows x positions (smaller calls score "
        "whole rows on every rank)",
        n, opts.index_split_min_work);
  const int gpus = device_count();
  UF_CHECK(n <= gpus, "CUDA backend: --tp {} needs {} GPUs but {} are visible to this process", n,
           n, gpus);
  group_ = tp::TpGroup::create(n);
  std::vector<int> devices;
  for (int r = 0; r < n; ++r) devices.push_back(group_->device(r));
  if (opts.tp_p2p_allreduce && !opts.tp_ordered_sum)
    group_->attach_peer_all_reduce(make_peer_all_reduce(cfg, opts, devices));
  workers_ = std::make_unique<RankWorkers>(n, [devices](int rank) {
    const int d = devices[size_t(rank)];
    const cudaError_t set = cudaSetDevice(d);
    UF_CHECK(set == cudaSuccess, "TP worker of rank {}: cudaSetDevice({}) failed: {}", rank, d,
             cudaGetErrorString(set));
  });
  models_.resize(size_t(n));
  // Each rank builds (shards, uploads) on its own thread and device.
  workers_->run([&](int r) {
    CudaModelOptions o = opts;
    o.device = devices[size_t(r)];
    models_[size_t(r)] =
        std::make_unique<CudaModel>(cfg, ckpt_, engram_token_map, o, group_.get(), r);
  });
  // All ranks at once: the captures' first replays run the collectives. The device draft's
  // buffers are rank 0's (its graph is captured at first use, with the peers' draft graphs).
  // A phase of its own: every constructor (allocations, uploads, the staging's cudaFreeHost) has
  // returned before any rank starts a collective (tp::TpGroup::host_barrier says why).
  workers_->run([&](int r) { models_[size_t(r)]->connect_collectives(); });
  spdlog::info("TP {}: every rank loaded; capturing the decode graphs on all ranks", n);
  workers_->run([&](int r) {
    models_[size_t(r)]->capture_step_graphs();
    if (r == 0) models_[0]->prepare_device_draft();
  });
}

CudaBackend::~CudaBackend() {
  if (workers_) {
    // Each model frees its device memory with its device current.
    try {
      workers_->run([&](int r) { models_[size_t(r)].reset(); });
    } catch (...) {  // a destructor must not throw; the process is going down anyway
    }
    workers_.reset();
  }
  models_.clear();
  group_.reset();
}

std::string CudaBackend::device_arch(int device) {
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return fmt::format("sm{}{}", prop.major, prop.minor);
}

int CudaBackend::device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

CudaSession& CudaBackend::session(engine::SessionState& s) {
  auto* c = dynamic_cast<CudaSession*>(&s);
  UF_CHECK(c, "the CUDA backend was given a session of another backend (or of another TP degree)");
  return *c;
}

CudaSession& CudaBackend::rank_session(engine::SessionState& s, int rank) {
  if (auto* t = dynamic_cast<CudaTpSession*>(&s)) {
    UF_CHECK(rank >= 0 && rank < int(t->ranks.size()), "TP session has no rank {}", rank);
    return *t->ranks[size_t(rank)];
  }
  UF_CHECK(rank == 0, "a one-GPU CUDA session has no rank {}", rank);
  return session(s);
}

void CudaBackend::each_rank(engine::SessionState& s,
                            const std::function<void(int, CudaModel&, CudaSession&)>& f) const {
  if (!workers_) {
    f(0, *models_[0], session(s));
    return;
  }
  auto* t = dynamic_cast<CudaTpSession*>(&s);
  UF_CHECK(t && t->ranks.size() == models_.size(),
           "the CUDA backend (TP = {}) was given a session of another backend or TP degree",
           models_.size());
  workers_->run([&](int r) { f(r, *models_[size_t(r)], *t->ranks[size_t(r)]); });
}

std::unique_ptr<engine::SessionState> CudaBackend::new_session(int64_t max_seq) {
  if (!workers_) return models_[0]->new_session(max_seq);
  auto t = std::make_unique<CudaTpSession>();
  t->ranks.resize(models_.size());
  for (int r = 0; r < tp(); ++r) t->devices.push_back(group_->device(r));
  workers_->run([&](int r) { t->ranks[size_t(r)] = models_[size_t(r)]->new_session(max_seq); });
  return t;
}

void CudaBackend::prefill(engine::SessionState& st, std::span<const int32_t> tokens,
                          const engine::PrefillOptions& opts, std::span<float> logits) {
  const int V = config().vocab_size;
  const size_t rows = opts.all_logits ? tokens.size() : 1;
  UF_CHECK(logits.size() >= rows * size_t(V), "prefill: logits buffer holds {} values, needs {}",
           logits.size(), rows * size_t(V));
  UF_CHECK(!tokens.empty(), "prefill: empty prompt");
  each_rank(st, [&](int r, CudaModel& m, CudaSession& s) {
    prefill_rank(m, s, tokens, opts, r == 0 ? logits.data() : nullptr);
  });
}

void CudaBackend::decode_rows(engine::SessionState& st, std::span<const int32_t> tokens,
                              std::span<float> logits) {
  const int T = int(tokens.size()), V = config().vocab_size;
  UF_CHECK(T >= 1 && T <= max_rows(), "decode_rows: {} rows, allowed 1..{}", T, max_rows());
  if (logits.empty()) {  // the logits stay on the device for verify_last_rows
    UF_CHECK(device_verify(), "decode_rows: no logits buffer, and no device verification");
    // Rank 0 keeps its logits on its device; the other ranks run the same forward (collectives).
    each_rank(st, [&](int r, CudaModel& m, CudaSession& s) {
      decode_rank(m, s, tokens, nullptr, /*keep=*/r == 0);
    });
    return;
  }
  UF_CHECK(logits.size() >= size_t(T) * size_t(V), "decode_rows: logits buffer too small");
  each_rank(st, [&](int r, CudaModel& m, CudaSession& s) {
    decode_rank(m, s, tokens, r == 0 ? logits.data() : nullptr);
  });
}

bool CudaBackend::device_verify() const {
  // Under TP rank 0 holds the whole logits rows (the head is replicated, or gathered when split)
  // and verifies alone.
  return models_[0]->options().device_verify;
}

sampling::VerifyResult CudaBackend::verify_last_rows(engine::SessionState& st,
                                                     sampling::VerifyMode mode,
                                                     const sampling::SamplingParams& params,
                                                     std::span<const float> draft_probs,
                                                     std::span<const int32_t> tokens, uint64_t seed,
                                                     uint64_t step) {
  UF_CHECK(device_verify(), "verify_last_rows: device verification is off on this backend");
  const CudaSession& s = rank_session(st, 0);  // rank 0 holds the logits
  UF_CHECK(s.pending_rows == int(tokens.size()) + 1,
           "verify_last_rows: {} drafts, but the last decode_rows forwarded {} rows", tokens.size(),
           s.pending_rows);
  if (draft_probs.empty() && !tokens.empty()) {  // the q rows of the last draft_on_device
    UF_CHECK(device_draft(),
             "verify_last_rows: no draft rows given, and no device drafting on this backend");
    return models_[0]->verify_last_drafted(mode, params, tokens, seed, step, s.pending_rows);
  }
  return models_[0]->verify_last(mode, params, draft_probs, tokens, seed, step, s.pending_rows);
}

bool CudaBackend::device_draft() const {
  return device_verify() && models_[0]->device_draft_available();
}

engine::DraftBlock CudaBackend::draft_on_device(engine::SessionState& st, int32_t anchor,
                                                const sampling::SamplingParams& params,
                                                uint64_t seed, uint64_t step) {
  UF_CHECK(device_draft(),
           "draft_on_device: device drafting is off on this backend (--no-device-verify, or "
           "CudaModelOptions::device_draft = false)");
  if (tp() == 1) return models_[0]->draft_on_device(session(st), anchor, params, seed, step);
  // TP: rank 0 runs the whole device draft; the others run the stages with it (their
  // collectives, and the split head's gather), as in draft(). The Markov loop has no collective.
  engine::DraftBlock out;
  each_rank(st, [&](int r, CudaModel& m, CudaSession& s) {
    if (r == 0)
      out = m.draft_on_device(s, anchor, params, seed, step);
    else
      m.draft(s, anchor, {});  // a peer never calls the sampler
  });
  return out;
}

void CudaBackend::fast_forward(engine::SessionState& st, int64_t len, uint64_t seed) {
  each_rank(st, [&](int, CudaModel& m, CudaSession& s) { m.fast_forward(s, len, seed); });
}

void CudaBackend::commit(engine::SessionState& st, int n) {
  each_rank(st, [&](int, CudaModel& m, CudaSession& s) { commit_rank(m, s, n); });
}

engine::DraftBlock CudaBackend::draft(engine::SessionState& st, int32_t anchor,
                                      const engine::DraftSampler& sampler) {
  engine::DraftBlock out;
  each_rank(st, [&](int r, CudaModel& m, CudaSession& s) {
    auto b = m.draft(s, anchor, sampler);
    if (r == 0) out = std::move(b);
  });
  return out;
}

// Every rank holds the same state (replicated KV): the snapshot is rank 0's, in the one-GPU
// format, so it restores at any TP degree and on the CPU backend.
std::vector<uint8_t> CudaBackend::snapshot(const engine::SessionState& st) const {
  auto& s = const_cast<engine::SessionState&>(st);
  std::vector<uint8_t> out;
  each_rank(s, [&](int r, CudaModel& m, CudaSession& rs) {
    if (r == 0) out = snapshot_rank(m, rs);
  });
  return out;
}

std::vector<uint8_t> CudaBackend::snapshot_of_rank(const engine::SessionState& st, int rank) const {
  UF_CHECK(rank >= 0 && rank < tp(), "snapshot_of_rank: rank {} outside 0..{}", rank, tp() - 1);
  auto& s = const_cast<engine::SessionState&>(st);
  std::vector<uint8_t> out;
  each_rank(s, [&](int r, CudaModel& m, CudaSession& rs) {
    if (r == rank) out = snapshot_rank(m, rs);
  });
  return out;
}

void CudaBackend::restore(engine::SessionState& st, std::span<const uint8_t> bytes) const {
  each_rank(st, [&](int, CudaModel& m, CudaSession& s) { restore_rank(m, s, bytes); });
}

}  // namespace uf::cuda
