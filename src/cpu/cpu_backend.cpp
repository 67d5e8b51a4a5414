#include "cpu/cpu_backend.h"

#include "core/error.h"
#include "engine/bytes.h"

namespace uf::cpu {

namespace {
constexpr uint32_t kSnapshotMagic = 0x55464331;  // "UFC1"
}

CpuBackend::CpuBackend(const std::filesystem::path& model_dir,
                       std::vector<int64_t> engram_token_map, ModelOptions opts)
    : ckpt_(model::Checkpoint::open(model_dir)) {
  model_ = std::make_unique<CpuModel>(model::ModelConfig::load(model_dir), ckpt_,
                                      std::move(engram_token_map), opts);
}

CpuSession& CpuBackend::session(engine::SessionState& s) {
  auto* c = dynamic_cast<CpuSession*>(&s);
  UF_CHECK(c, "the CPU backend was given a session of another backend");
  return *c;
}

std::unique_ptr<engine::SessionState> CpuBackend::new_session(int64_t max_seq) {
  return model_->new_session(max_seq);
}

void CpuBackend::prefill(engine::SessionState& st, std::span<const int32_t> tokens,
                         const engine::PrefillOptions& opts, std::span<float> logits) {
  auto& s = session(st);
  const int V = config().vocab_size;
  const size_t rows = opts.all_logits ? tokens.size() : 1;
  UF_CHECK(logits.size() >= rows * size_t(V), "prefill: logits buffer holds {} values, needs {}",
           logits.size(), rows * size_t(V));
  UF_CHECK(!tokens.empty(), "prefill: empty prompt");
  s.pending_rows = 0;
  if (opts.ced_shortcut && s.len == 0 && !opts.all_logits) {
    model_->prefill_ced(s, tokens, opts.replay, logits.data());
    return;
  }
  const size_t chunk = size_t(opts.chunk > 0 ? opts.chunk : kDefaultChunk);
  const int MH = model_->n_taps() * config().dim;
  for (size_t b = 0; b < tokens.size(); b += chunk) {
    const auto part = tokens.subspan(b, std::min(chunk, tokens.size() - b));
    const int T = int(part.size());
    std::vector<float> mh(size_t(T) * size_t(std::max(MH, 1)));
    std::vector<int> pub(static_cast<size_t>(T));
    const bool last = b + part.size() == tokens.size();
    std::vector<float> tmp;
    float* out;
    if (opts.all_logits) {
      out = logits.data() + b * size_t(V);
    } else if (last) {
      out = logits.data();
    } else {
      tmp.resize(size_t(V));
      out = tmp.data();
    }
    // The first chunk of a fresh session is the reference's prefill; later chunks use the decode
    // (ring) layout.
    model_->forward(s, part, /*prefill_layout=*/s.len == 0, opts.all_logits, out, mh.data(),
                    pub.data());
    model_->commit(s, part, MH ? mh.data() : nullptr, T, pub.back());
  }
}

void CpuBackend::decode_rows(engine::SessionState& st, std::span<const int32_t> tokens,
                             std::span<float> logits) {
  auto& s = session(st);
  const int T = int(tokens.size()), V = config().vocab_size;
  UF_CHECK(T >= 1 && T <= max_rows(), "decode_rows: {} rows, allowed 1..{}", T, max_rows());
  UF_CHECK(logits.size() >= size_t(T) * size_t(V), "decode_rows: logits buffer too small");
  const int MH = model_->n_taps() * config().dim;
  s.pending_tokens.assign(tokens.begin(), tokens.end());
  s.pending_main_hidden.assign(size_t(T) * size_t(std::max(MH, 1)), 0.f);
  s.pending_publisher.assign(size_t(T), -1);
  model_->forward(s, tokens, /*prefill_layout=*/false, /*all_logits=*/true, logits.data(),
                  s.pending_main_hidden.data(), s.pending_publisher.data());
  s.pending_rows = T;
}

void CpuBackend::commit(engine::SessionState& st, int n) {
  auto& s = session(st);
  UF_CHECK(n >= 0 && n <= s.pending_rows, "commit: {} rows accepted but {} are pending", n,
           s.pending_rows);
  if (n > 0)
    model_->commit(s, s.pending_tokens, model_->n_taps() ? s.pending_main_hidden.data() : nullptr,
                   n, s.pending_publisher[size_t(n - 1)]);
  s.pending_rows = 0;
}

engine::DraftBlock CpuBackend::draft(engine::SessionState& st, int32_t anchor,
                                     const engine::DraftSampler& sampler) {
  return model_->draft(session(st), anchor, sampler);
}

std::vector<uint8_t> CpuBackend::snapshot(const engine::SessionState& st) const {
  const auto* s = dynamic_cast<const CpuSession*>(&st);
  UF_CHECK(s, "snapshot: not a CPU session");
  engine::ByteWriter w;
  w.put(kSnapshotMagic);
  w.put<int64_t>(s->len);
  w.put<int64_t>(s->cap);
  w.put<int32_t>(s->publisher);
  w.put_vec(s->toks);
  w.put<uint64_t>(s->layers.size());
  for (const auto& L : s->layers) {
    for (const PosRing* r : {&L.window, &L.raw_kv, &L.raw_gate}) {
      w.put<int32_t>(r->slots);
      w.put<int32_t>(r->width);
      w.put_vec(r->data);
      w.put_vec(r->pos);
    }
    w.put_vec(L.ckv);
    w.put_vec(L.ikeys);
  }
  return w.take();
}

void CpuBackend::restore(engine::SessionState& st, std::span<const uint8_t> bytes) const {
  auto* s = dynamic_cast<CpuSession*>(&st);
  UF_CHECK(s, "restore: not a CPU session");
  engine::ByteReader r(bytes);
  UF_CHECK(r.get<uint32_t>("magic") == kSnapshotMagic, "restore: not a CPU session snapshot");
  s->len = r.get<int64_t>("length");
  s->cap = r.get<int64_t>("capacity");
  s->publisher = r.get<int32_t>("publisher");
  r.get_vec(s->toks, "tokens");
  const auto n = r.get<uint64_t>("layer count");
  UF_CHECK(n == size_t(config().n_total_layers()), "restore: snapshot has {} layers, the model {}",
           n, config().n_total_layers());
  s->layers.resize(n);
  for (auto& L : s->layers) {
    for (PosRing* ring : {&L.window, &L.raw_kv, &L.raw_gate}) {
      ring->slots = r.get<int32_t>("ring slots");
      ring->width = r.get<int32_t>("ring width");
      r.get_vec(ring->data, "ring data");
      r.get_vec(ring->pos, "ring positions");
    }
    r.get_vec(L.ckv, "compressed KV");
    r.get_vec(L.ikeys, "index keys");
  }
  UF_CHECK(r.done(), "restore: {} trailing bytes after the snapshot", "some");
  s->pending_rows = 0;
}

}  // namespace uf::cpu
