#include "server/model_engine.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <random>

#include "core/error.h"
#include "core/log.h"
#include "kv/blake3.h"

namespace uf::server {

namespace {
struct CachedPrefix : PreparedState {
  std::shared_ptr<const kv::SessionSnapshot> snapshot;
  // KV sharing: the directory version this server claimed in prepare(); publish under it.
  std::optional<kv::SessionVersion> version;
};

// ---- the published bundle ----
// One published snapshot carries every state the engine keeps for the session (the prompt's
// state and the final state), because the next turn's prompt usually extends the previous
// *prompt*, not the generated tail (e.g. thinking is dropped from history). Layout, little
// endian: "UFKVBND1", u32 count, then per state: u64 T, T x i32 tokens, u64 B, B bytes. The
// manifest's token list is the longest state's tokens; every state must be a prefix of it.
constexpr size_t kMaxTrackedSessions = size_t{1} << 20;

constexpr char kBundleMagic[8] = {'U', 'F', 'K', 'V', 'B', 'N', 'D', '1'};

size_t bundle_size(const std::vector<kv::SessionSnapshot>& snaps) {
  size_t n = sizeof(kBundleMagic) + 4;
  for (const auto& s : snaps) n += 8 + s.tokens.size() * 4 + 8 + s.bytes.size();
  return n;
}

void write_bundle(const std::vector<kv::SessionSnapshot>& snaps, uint8_t* out) {
  auto put = [&](const void* p, size_t n) {
    if (n) std::memcpy(out, p, n);
    out += n;
  };
  put(kBundleMagic, sizeof(kBundleMagic));
  const uint32_t count = uint32_t(snaps.size());
  put(&count, 4);
  for (const auto& s : snaps) {
    const uint64_t t = s.tokens.size(), b = s.bytes.size();
    put(&t, 8);
    put(s.tokens.data(), t * 4);
    put(&b, 8);
    put(s.bytes.data(), b);
  }
}

// The longest state of a (verified) bundle whose tokens are a proper prefix of `prompt` and of
// the manifest's tokens; null when none fits or the bundle is malformed (`why` says which).
std::shared_ptr<kv::SessionSnapshot> pick_from_bundle(std::span<const uint8_t> data,
                                                      std::span<const int32_t> manifest_tokens,
                                                      std::span<const int32_t> prompt,
                                                      std::string& why) {
  size_t off = 0;
  auto take = [&](void* dst, size_t n) {
    if (n > data.size() - off) return false;
    if (n) std::memcpy(dst, data.data() + off, n);
    off += n;
    return true;
  };
  char magic[8];
  uint32_t count = 0;
  if (!take(magic, 8) || std::memcmp(magic, kBundleMagic, 8) != 0 || !take(&count, 4)) {
    why = "the fetched snapshot is not a session bundle";
    return nullptr;
  }
  std::shared_ptr<kv::SessionSnapshot> best;
  for (uint32_t i = 0; i < count; ++i) {
    uint64_t t = 0, b = 0;
    if (!take(&t, 8) || t > (data.size() - off) / 4) {
      why = fmt::format("session bundle state {} has a bad token count at byte {}", i, off);
      return nullptr;
    }
    std::vector<int32_t> tokens(t);
    take(tokens.data(), t * 4);
    if (!take(&b, 8) || b > data.size() - off) {
      why = fmt::format("session bundle state {} has a bad byte count at byte {}", i, off);
      return nullptr;
    }
    const size_t at = off;
    off += b;
    const bool in_manifest = t <= manifest_tokens.size() &&
                             std::equal(tokens.begin(), tokens.end(), manifest_tokens.begin());
    const bool proper_prefix =
        t < prompt.size() && std::equal(tokens.begin(), tokens.end(), prompt.begin());
    if (!in_manifest) {
      why = fmt::format("session bundle state {} is not a prefix of its manifest's tokens", i);
      return nullptr;
    }
    if (proper_prefix && t > 0 && (!best || t > best->tokens.size())) {
      best = std::make_shared<kv::SessionSnapshot>();
      best->tokens = std::move(tokens);
      best->bytes.assign(data.begin() + at, data.begin() + at + b);
    }
  }
  if (off != data.size()) {
    why = fmt::format("session bundle has {} trailing bytes", data.size() - off);
    return nullptr;
  }
  if (!best) why = "no state of the fetched snapshot is a proper prefix of the prompt";
  return best;
}

std::string hash_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  UF_CHECK(f.good(), "cannot read {} for the KV compatibility fingerprint", p.string());
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  kv::Blake3Digest d = kv::blake3(text.data(), text.size());
  return kv::to_hex(std::span<const uint8_t>(d.data(), 8));  // 64 bits: a label, not security
}

EngineFinish to_engine_finish(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kStop:
      return EngineFinish::kStopToken;
    case engine::FinishReason::kLength:
      return EngineFinish::kLength;
    case engine::FinishReason::kCancelled:
      return EngineFinish::kCancelled;
  }
  return EngineFinish::kError;
}

uint64_t fresh_seed() {
  static std::mt19937_64 rng{std::random_device{}()};
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  return rng();
}
}  // namespace

std::string kv_fingerprint(const KvFingerprintInputs& in) {
  std::string model = hash_file(in.model_dir / "config.json");
  if (std::filesystem::exists(in.model_dir / "inference" / "config.json"))
    model += hash_file(in.model_dir / "inference" / "config.json");
  return fmt::format("uf-kv1;model={};tok={};max_seq={};gpus={};kv={};numerics={}", model,
                     hash_file(in.tokenizer), in.max_seq, in.gpu_count, in.kv_dtype, in.numerics);
}

ModelEngine::ModelEngine(std::unique_ptr<engine::Backend> backend,
                         const engine::HardwareProfile& profile, ModelEngineOptions options)
    : backend_(std::move(backend)),
      loop_(*backend_, profile),
      options_(std::move(options)),
      cache_(options_.host_cache_bytes) {
  if (!options_.sharing) return;
  const KvSharingOptions& so = *options_.sharing;
  UF_CHECK(!so.server_id.empty(), "KV sharing needs a server id (--server-id)");
  UF_CHECK(!so.fingerprint.empty(), "KV sharing needs a compatibility fingerprint");
  if (so.redis_host.empty()) {
    directory_ = kv::make_in_process_directory();
  } else {
    kv::RedisDirectoryConfig rc;
    rc.host = so.redis_host;
    rc.port = so.redis_port;
    directory_ = kv::make_redis_directory(rc);
  }
  kv::UcxNodeConfig nc;
  nc.listen_host = so.listen_host;
  nc.listen_port = so.listen_port;
  nc.advertise_host = so.advertise_host;
  nc.max_published_bytes =
      so.max_published_bytes ? so.max_published_bytes : options_.host_cache_bytes;
  nc.arena_bytes = nc.max_published_bytes;  // published snapshots are written into the arena
  node_ = std::make_unique<kv::UcxNode>(nc);
  kv::SessionSharingConfig sc;
  sc.server_id = so.server_id;
  sc.fingerprint = so.fingerprint;
  sc.fetch.timeout = std::chrono::milliseconds(so.fetch_timeout_ms);
  if (so.test_corrupt_fetch)
    sc.fetch.test_corrupt_in_flight = [](std::span<uint8_t> b) {
      if (!b.empty()) b[b.size() / 2] ^= 0x5a;
    };
  sharing_ = std::make_unique<kv::SessionSharing>(*directory_, *node_, sc);
  sharing_->set_drop_local([this](const std::string& key) { drop_local(key); });
  spdlog::info("KV sharing: server id '{}', directory {}, UCX listener {} ({}), fingerprint {}",
               so.server_id, directory_->describe(), node_->address(), node_->transports(),
               so.fingerprint);
}

ModelEngine::~ModelEngine() {
  sharing_.reset();  // no drop notifications after this
  node_.reset();
  directory_.reset();
}

std::string ModelEngine::kv_address() const { return node_ ? node_->address() : std::string(); }

void ModelEngine::drop_local(const std::string& sharing_key) {
  std::string key;
  {
    std::lock_guard lock(versions_mu_);
    auto it = sharing_keys_.find(sharing_key);
    if (it == sharing_keys_.end()) return;
    key = it->second;
    sharing_keys_.erase(it);
    published_.erase(key);
  }
  cache_.erase(key);
  core::log_event({{"event", "kv_drop_local"}, {"session", key}});
}

void ModelEngine::publish_snapshots(const std::string& key, const kv::SessionVersion& version,
                                    const std::vector<kv::SessionSnapshot>& snapshots) {
  if (snapshots.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  auto buf = node_->allocate(bundle_size(snapshots));
  kv::Status st = buf ? kv::Status::ok()
                      : kv::Status(kv::StatusCode::kInternal, "cannot register snapshot memory");
  if (st.is_ok()) {
    write_bundle(snapshots, buf->data());
    st = sharing_->publish(key, version, snapshots.back().tokens, buf);
  }
  nlohmann::json ev = {
      {"event", "kv_publish"},
      {"session", key},
      {"epoch", version.epoch},
      {"seq", version.seq},
      {"tokens", snapshots.back().tokens.size()},
      {"bytes", buf ? buf->size() : 0},
      {"ok", st.is_ok()},
      {"ms",
       std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count()}};
  if (!st.is_ok()) ev["reason"] = st.to_string();
  core::log_event(ev);
  if (!st.is_ok()) return;
  std::lock_guard lock(versions_mu_);
  // Bounded bookkeeping: forgetting a session only costs a redundant claim on its next turn (a
  // local copy stays exact whatever the directory says).
  if (published_.size() >= kMaxTrackedSessions) {
    published_.clear();
    sharing_keys_.clear();
  }
  published_[key] = version;
  sharing_keys_[kv::session_key(key)] = key;
}

void ModelEngine::warm_up(int32_t bos_id) {
  auto session = backend_->new_session(options_.max_seq);
  engine::GenerationParams p;
  p.max_new_tokens = 2;
  p.mode = options_.mode;
  p.verify = options_.verify;
  const std::vector<int32_t> prompt = {bos_id};
  loop_.run(*session, prompt, p, [](auto, const auto&) { return true; });
}

std::shared_ptr<PreparedState> ModelEngine::prepare(const GenerationRequest& request) {
  auto out = std::make_shared<CachedPrefix>();
  if (request.session_key.empty()) return out;
  out->snapshot = cache_.find_prefix(request.session_key, request.prompt_ids);
  if (out->snapshot) {
    out->reused_tokens = int(out->snapshot->tokens.size());
    out->reused_bytes = out->snapshot->bytes.size();
    out->kv_source = KvSource::kLocal;
  }
  if (!sharing_) return out;

  // Directory lookup -> (fetch from the owner, verify) -> claim. A local snapshot stays usable
  // whatever the directory says: the state is a function of its tokens alone.
  const auto t0 = std::chrono::steady_clock::now();
  kv::SessionVersion mine;
  {
    std::lock_guard lock(versions_mu_);
    if (auto it = published_.find(request.session_key); it != published_.end()) mine = it->second;
  }
  kv::Acquired a = sharing_->acquire(request.session_key, request.prompt_ids, mine.epoch, mine.seq);
  nlohmann::json ev = {{"event", "kv_fetch"},
                       {"request_id", request.request_id},
                       {"session", request.session_key},
                       {"prompt_tokens", request.prompt_ids.size()}};
  std::string why;
  if (!a.status.is_ok()) {
    why = a.status.to_string();
  } else {
    out->version = a.version;
    ev["epoch"] = a.version.epoch;
    ev["seq"] = a.version.seq;
    if (!a.fetch_error.empty()) why = a.fetch_error;
    if (a.source == kv::Acquired::Source::kFetched && a.bytes) {
      ev["fetched_bytes"] = a.manifest.byte_size;
      auto remote = pick_from_bundle(a.bytes->span().first(a.manifest.byte_size),
                                     a.manifest.token_ids, request.prompt_ids, why);
      if (remote && (!out->snapshot || remote->tokens.size() > out->snapshot->tokens.size())) {
        out->reused_tokens = int(remote->tokens.size());
        out->reused_bytes = remote->bytes.size();
        out->kv_source = KvSource::kRemote;
        out->snapshot = std::move(remote);
      }
    }
  }
  ev["kv_source"] = kv_source_name(out->kv_source);
  ev["reused_tokens"] = out->reused_tokens;
  ev["ms"] =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!why.empty()) {
    ev["reason"] = why;
    ev["fallback"] = out->snapshot ? "local" : "recompute";
  }
  core::log_event(ev);
  return out;
}

GenerationResult ModelEngine::generate(const GenerationRequest& request,
                                       const std::shared_ptr<PreparedState>& prepared,
                                       TokenSink& sink) {
  GenerationResult result;
  try {
    auto session = backend_->new_session(options_.max_seq);
    std::span<const int32_t> prompt(request.prompt_ids);
    auto* cached = dynamic_cast<CachedPrefix*>(prepared.get());
    if (cached && cached->snapshot) {
      try {
        backend_->restore(*session, cached->snapshot->bytes);
        prompt = prompt.subspan(cached->snapshot->tokens.size());
      } catch (const std::exception& e) {
        // Another server's snapshot passed BLAKE3 and the fingerprint, yet this backend rejects
        // it: recompute rather than fail the request.
        if (cached->kv_source != KvSource::kRemote) throw;
        core::log_event({{"event", "kv_restore_failed"},
                         {"request_id", request.request_id},
                         {"session", request.session_key},
                         {"reason", e.what()},
                         {"fallback", "recompute"}});
        session = backend_->new_session(options_.max_seq);
      }
    }
    engine::GenerationParams p;
    p.sampling.temperature = float(request.sampling.temperature);
    p.sampling.top_p = float(request.sampling.top_p);
    p.sampling.top_k = request.sampling.top_k;
    p.seed = request.sampling.seed ? *request.sampling.seed : fresh_seed();
    p.max_new_tokens = request.max_new_tokens;
    p.stop_token_ids = request.stop_token_ids;
    p.mode = options_.mode;
    p.verify = options_.verify;
    p.draft_tokens = options_.draft_tokens;

    const bool keep = !request.session_key.empty();
    const bool share = keep && sharing_ && cached && cached->version;
    std::vector<kv::SessionSnapshot> taken;  // published after the turn when sharing
    auto store = [&](engine::SessionState& s) {
      kv::SessionSnapshot snap{s.tokens(), backend_->snapshot(s)};
      if (share && (taken.empty() || taken.back().tokens != snap.tokens)) taken.push_back(snap);
      cache_.put(request.session_key, std::move(snap));
    };
    bool first = true;
    auto r = loop_.run(
        *session, prompt, p,
        [&](std::span<const int32_t> tokens, const engine::StepStats& st) {
          sink.on_step(StepEvent{tokens, st.ms, first});
          first = false;
          return !(request.cancel && request.cancel->load(std::memory_order_relaxed));
        },
        request.cancel, keep ? engine::PrefillCallback(store) : nullptr);
    if (keep) store(*session);
    if (share) publish_snapshots(request.session_key, *cached->version, taken);
    result.finish = to_engine_finish(r.finish);
    result.generated_tokens = int(r.tokens.size());
    result.decode_steps = r.steps;
    result.decode_ms = r.step_ms;
  } catch (const std::exception& e) {
    spdlog::error("request {}: generation failed: {}", request.request_id, e.what());
    result.finish = EngineFinish::kError;
    result.error = e.what();
  }
  return result;
}

}  // namespace uf::server
