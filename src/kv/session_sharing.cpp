#include "kv/session_sharing.h"

#include <fmt/format.h>

#include <cstring>

namespace uf::kv {

namespace {
constexpr unsigned kHashThreads = 4;  // BLAKE3 of a published snapshot (large ones only)
}

SessionSharing::SessionSharing(SessionDirectory& directory, UcxNode& node,
                               SessionSharingConfig config)
    : dir_(directory), node_(node), config_(std::move(config)) {
  dir_.set_change_callback([this](const OwnershipChange& c) { on_change(c); });
}

SessionSharing::~SessionSharing() {
  dir_.set_change_callback(nullptr);  // returns once no notification is being delivered
}

void SessionSharing::set_drop_local(std::function<void(const std::string&)> drop_local) {
  std::lock_guard lock(drop_mu_);
  drop_local_ = std::move(drop_local);
}

void SessionSharing::on_change(const OwnershipChange& c) {
  if (c.resync || c.version.owner == config_.server_id) return;
  node_.remove(c.key);
  std::lock_guard lock(drop_mu_);
  if (drop_local_) drop_local_(c.key);
}

Acquired SessionSharing::acquire(std::string_view session_id, std::span<const int32_t> prompt,
                                 std::string_view local_epoch, uint64_t local_seq) {
  Acquired a;
  DirectoryResult seen = dir_.lookup(session_id);
  if (!seen.status.is_ok() && seen.status.code() != StatusCode::kNotFound) {
    a.status = seen.status;
    return a;
  }
  const SessionVersion& v = seen.version;
  if (seen.status.is_ok() && v.owner == config_.server_id) {
    if (local_seq == v.seq && local_epoch == v.epoch) {
      // Still ours and our copy is current: nothing to fetch, nothing to claim.
      a.status = Status::ok();
      a.version = v;
      a.source = Acquired::Source::kLocal;
      return a;
    }
  } else if (seen.status.is_ok() && !v.address.empty()) {
    ReceiverExpectations ex;
    ex.fingerprint = config_.fingerprint;
    ex.request_tokens = prompt;
    ex.limits = config_.limits;
    ex.min_common_prefix = config_.min_reuse_tokens;
    FetchOptions opt = config_.fetch;
    opt.expect_seq = v.seq;
    FetchResult f = node_.fetch(v.address, session_key(session_id), ex, opt);
    if (f.status.is_ok() && f.manifest.epoch != v.epoch)
      f.status = {StatusCode::kStale, fmt::format("the owner's snapshot is from epoch '{}', the "
                                                  "directory is at '{}'",
                                                  f.manifest.epoch, v.epoch)};
    if (f.status.is_ok()) {
      a.source = Acquired::Source::kFetched;
      a.bytes = std::move(f.bytes);
      a.manifest = std::move(f.manifest);
      a.reuse_tokens = f.common_prefix;
    } else {
      a.fetch_error = f.status.to_string();
    }
  }
  DirectoryResult claimed =
      dir_.claim(session_id, {v.epoch, v.seq, config_.server_id, node_.address()});
  if (!claimed.status.is_ok()) {
    // Someone else moved first (or the directory restarted): what we fetched is not ours to use.
    a.status = claimed.status;
    a.source = Acquired::Source::kNone;
    a.bytes.reset();
    a.reuse_tokens = 0;
    return a;
  }
  a.status = Status::ok();
  a.version = claimed.version;
  return a;
}

Status SessionSharing::publish(std::string_view session_id, const SessionVersion& version,
                               std::span<const int32_t> tokens,
                               std::shared_ptr<RegisteredBuffer> bytes) {
  if (!bytes) return {StatusCode::kInvalid, "publishing a session snapshot without bytes"};
  Manifest m = make_manifest(config_.fingerprint, tokens, bytes->span(), version.epoch, version.seq,
                             kHashThreads);
  return node_.publish(session_key(session_id), std::move(m), std::move(bytes));
}

Status SessionSharing::publish(std::string_view session_id, const SessionVersion& version,
                               std::span<const int32_t> tokens, std::span<const uint8_t> bytes) {
  std::shared_ptr<RegisteredBuffer> buf = node_.allocate(bytes.size());
  if (!buf)
    return {StatusCode::kInternal,
            fmt::format("cannot register {} bytes for a session snapshot", bytes.size())};
  if (!bytes.empty()) std::memcpy(buf->data(), bytes.data(), bytes.size());
  return publish(session_id, version, tokens, std::move(buf));
}

}  // namespace uf::kv
