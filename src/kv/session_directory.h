#pragma once
// Who owns a session's KV right now. Every server asks the directory before reusing or fetching
// a session, and claims the session when it starts serving it:
//
//   lookup(id)             -> {epoch, seq, owner, address}; seq 0 = nobody owns it (NotFound)
//   claim(id, epoch, seq)  -> seq+1 with this server as owner, if (epoch, seq) is still current,
//                             else STALE ("STALE ownership changed, expired or directory
//                             restarted")
//   check(id, epoch, seq)  -> OK while (epoch, seq) is still current (a local copy is valid)
//
// The epoch is a random UUID chosen when the directory's storage is first used; when the
// storage is lost (Redis restart, FLUSHALL) a new epoch appears and every older version is void.
// Every access refreshes the session's TTL. Calls never throw on the request path: failures come
// back as a Status (kUnavailable when the store cannot be reached).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "kv/status.h"

namespace uf::kv {

// The exact text a stale claim or check answers with (also the Redis script's error reply).
inline constexpr std::string_view kStaleMessage =
    "STALE ownership changed, expired or directory restarted";

struct SessionVersion {
  std::string epoch;
  uint64_t seq = 0;     // 0: nobody owns the session in this epoch
  std::string owner;    // server id
  std::string address;  // where the owner serves snapshots (UCX listener "host:port")
};

struct DirectoryResult {
  Status status;  // kOk, kNotFound (lookup of an unknown session), kStale, kUnavailable, ...
  SessionVersion version;
};

struct ClaimRequest {
  std::string epoch;  // as read by lookup
  uint64_t seq = 0;   // as read by lookup
  std::string owner;
  std::string address;
};

struct OwnershipChange {
  std::string key;  // session key (SHA-256 hex of the session id)
  SessionVersion version;
  // Set on a (re)subscription instead of a change: notifications may have been missed, so a
  // server should re-check its local copies before trusting them.
  bool resync = false;
};
using ChangeCallback = std::function<void(const OwnershipChange&)>;

struct DirectoryStats {
  uint64_t calls = 0;
  uint64_t failures = 0;    // calls answered kUnavailable / kInternal
  uint64_t reconnects = 0;  // successful (re)connections after the first
  uint64_t script_loads = 0;
  uint64_t notifications = 0;
};

// SHA-256 hex of a session id: the directory never stores raw ids (they come from clients).
std::string session_key(std::string_view session_id);
// A fresh random (version 4) UUID.
std::string random_uuid();

class SessionDirectory {
 public:
  virtual ~SessionDirectory() = default;
  virtual DirectoryResult lookup(std::string_view session_id) = 0;
  virtual DirectoryResult claim(std::string_view session_id, const ClaimRequest& request) = 0;
  virtual DirectoryResult check(std::string_view session_id, std::string_view epoch,
                                uint64_t seq) = 0;
  // Called (from a directory-owned thread, or inline for the in-process one) on every successful
  // claim by any server. One callback per directory; setting another (or nullptr) returns only
  // once the previous one is no longer running, so its owner may then be destroyed.
  virtual void set_change_callback(ChangeCallback callback) = 0;
  virtual DirectoryStats stats() const = 0;
  virtual std::string describe() const = 0;
};

// Single server without Redis: the same semantics in memory.
struct InProcessDirectoryConfig {
  std::chrono::milliseconds ttl = std::chrono::hours(24);
};
std::unique_ptr<SessionDirectory> make_in_process_directory(InProcessDirectoryConfig config = {});

struct RedisDirectoryConfig {
  std::string host = "127.0.0.1";
  int port = 6379;
  std::string key_prefix = "uf:kv:";      // keys: <prefix>epoch, <prefix>s:<sha256 hex>
  std::string channel = "uf:kv:changes";  // pub/sub channel of ownership changes
  std::chrono::milliseconds ttl = std::chrono::hours(24);
  std::chrono::milliseconds connect_timeout{250};
  std::chrono::milliseconds command_timeout{500};
  std::chrono::milliseconds backoff_initial{25};
  std::chrono::milliseconds backoff_max{5000};
  // Run a subscriber thread (own connection) delivering to the change callback; it starts when
  // the callback is set.
  bool subscribe = true;
};
std::unique_ptr<SessionDirectory> make_redis_directory(RedisDirectoryConfig config);

}  // namespace uf::kv
