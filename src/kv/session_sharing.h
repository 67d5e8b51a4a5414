#pragma once
// The KV-sharing flow of design.md section 6, on top of a SessionDirectory and a UcxNode, for the
// server's preparation thread:
//
//   acquire(session, prompt)   lookup -> (fetch from the owner, check, verify) -> claim
//   publish(session, ...)      after a turn: offer this server's snapshot to the others
//   on_change(...)             another server claimed a session: drop our copy early
//
// Snapshots are published under the session key (SHA-256 hex of the session id) with the
// directory version (epoch, seq) in their manifest, so a fetcher reads exactly the version the
// directory points to. Every failure is a Status; the caller then recomputes the prompt.

#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "kv/manifest.h"
#include "kv/session_directory.h"
#include "kv/status.h"
#include "kv/ucx_transfer.h"

namespace uf::kv {

struct SessionSharingConfig {
  std::string server_id;    // this server's name in the directory (unique per server)
  std::string fingerprint;  // this server's compatibility fingerprint
  ManifestLimits limits;
  size_t min_reuse_tokens = 1;  // below this common prefix a fetch is not worth it
  FetchOptions fetch;           // timeout etc.
};

struct Acquired {
  // kOk: this server now owns the session at `version`. Otherwise the reason (kUnavailable,
  // kStale, kMismatch, kCorrupt, kTimeout, ...); the request is then served by recomputing.
  Status status;
  SessionVersion version;
  // Where the reusable KV comes from: none (new session, or nothing reusable), the local copy
  // the caller said it holds, or bytes fetched from the previous owner.
  enum class Source { kNone, kLocal, kFetched } source = Source::kNone;
  size_t reuse_tokens = 0;                  // common prefix with the prompt
  std::shared_ptr<RegisteredBuffer> bytes;  // kFetched: the snapshot (first manifest.byte_size)
  Manifest manifest;                        // kFetched: its manifest
  std::string fetch_error;                  // why a fetch was attempted and failed, if it was
};

class SessionSharing {
 public:
  SessionSharing(SessionDirectory& directory, UcxNode& node, SessionSharingConfig config);
  ~SessionSharing();
  SessionSharing(const SessionSharing&) = delete;
  SessionSharing& operator=(const SessionSharing&) = delete;

  // `local_seq`: the seq of a local copy this server holds for the session (0 if none) under
  // `local_epoch`. Claims the session in every successful case.
  Acquired acquire(std::string_view session_id, std::span<const int32_t> prompt,
                   std::string_view local_epoch = {}, uint64_t local_seq = 0);

  // Offers a snapshot (the state after `tokens`) to other servers, for the version this server
  // claimed; replaces an older snapshot of the session. The buffer (from UcxNode::allocate) must
  // be exactly the snapshot's size; the span form copies.
  Status publish(std::string_view session_id, const SessionVersion& version,
                 std::span<const int32_t> tokens, std::shared_ptr<RegisteredBuffer> bytes);
  Status publish(std::string_view session_id, const SessionVersion& version,
                 std::span<const int32_t> tokens, std::span<const uint8_t> bytes);

  // Takes over the directory's change callback (set in the constructor). Routes notifications: a
  // session claimed by another server is unpublished here, then `drop_local` (if set) is told its
  // key so the engine can free its copy.
  void set_drop_local(std::function<void(const std::string& key)> drop_local);

 private:
  void on_change(const OwnershipChange& change);

  SessionDirectory& dir_;
  UcxNode& node_;
  SessionSharingConfig config_;
  std::mutex drop_mu_;
  std::function<void(const std::string&)> drop_local_;
};

}  // namespace uf::kv
