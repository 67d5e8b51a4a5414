#pragma once
// Host-memory session cache: recent conversations' KV state, so that the next turn of a
// conversation continues from it instead of recomputing the shared prefix.
//
// A session keeps up to `max_per_session` snapshots (typically the state right after the prompt
// and the state at the end of generation): the next turn's prompt re-encodes earlier assistant
// turns (thinking is dropped from history), so it often shares the previous *prompt* exactly but
// not the generated tail. Reuse is exact: a snapshot is used only when its token ids are a prefix
// of the new prompt, and the rest of the prompt is prefilled on top of it.
//
// Bounded by bytes with least-recently-used eviction across all snapshots; thread-safe (the
// preparation thread looks up, the engine thread stores).

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

namespace uf::kv {

struct SessionSnapshot {
  std::vector<int32_t> tokens;  // committed token ids the state covers
  std::vector<uint8_t> bytes;   // the backend's snapshot
  uint64_t size() const { return bytes.size() + tokens.size() * sizeof(int32_t); }
};

struct HostCacheStats {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  uint64_t bytes = 0;
  uint64_t snapshots = 0;
};

class HostSessionCache {
 public:
  explicit HostSessionCache(uint64_t capacity_bytes, int max_per_session = 2);

  // Stores a snapshot (replacing one with the same tokens). Evicts least-recently-used snapshots
  // until the cache fits; a snapshot larger than the whole capacity is not stored.
  void put(const std::string& session_key, SessionSnapshot snapshot);

  // The longest snapshot of the session whose tokens are a proper prefix of `prompt` (at least one
  // prompt token is left to prefill, which yields the logits of the last position). Counts a hit or
  // a miss and marks the snapshot recently used.
  std::shared_ptr<const SessionSnapshot> find_prefix(const std::string& session_key,
                                                     std::span<const int32_t> prompt);

  void erase(const std::string& session_key);  // e.g. another server now owns the session
  HostCacheStats stats() const;
  uint64_t capacity() const { return capacity_; }

 private:
  struct Entry {
    std::string key;
    std::shared_ptr<const SessionSnapshot> snap;
  };
  using List = std::list<Entry>;
  void evict_locked();
  void remove_locked(List::iterator it);

  mutable std::mutex mu_;
  uint64_t capacity_;
  int max_per_session_;
  List lru_;  // front = most recently used
  std::unordered_map<std::string, std::vector<List::iterator>> by_key_;
  HostCacheStats stats_;
};

}  // namespace uf::kv
