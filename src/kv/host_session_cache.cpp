#include "kv/host_session_cache.h"

#include <algorithm>

namespace uf::kv {

HostSessionCache::HostSessionCache(uint64_t capacity_bytes, int max_per_session)
    : capacity_(capacity_bytes), max_per_session_(std::max(1, max_per_session)) {}

void HostSessionCache::remove_locked(List::iterator it) {
  auto& vec = by_key_[it->key];
  vec.erase(std::remove(vec.begin(), vec.end(), it), vec.end());
  if (vec.empty()) by_key_.erase(it->key);
  stats_.bytes -= it->snap->size();
  stats_.snapshots -= 1;
  lru_.erase(it);
}

void HostSessionCache::evict_locked() {
  while (stats_.bytes > capacity_ && !lru_.empty()) {
    remove_locked(std::prev(lru_.end()));
    stats_.evictions += 1;
  }
}

void HostSessionCache::put(const std::string& key, SessionSnapshot snapshot) {
  auto snap = std::make_shared<const SessionSnapshot>(std::move(snapshot));
  if (snap->size() > capacity_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto found = by_key_.find(key); found != by_key_.end()) {
    // Replace a snapshot of the same tokens; beyond the per-session limit drop the oldest.
    auto same = std::find_if(found->second.begin(), found->second.end(),
                             [&](List::iterator it) { return it->snap->tokens == snap->tokens; });
    if (same != found->second.end()) remove_locked(*same);
  }
  lru_.push_front(Entry{key, snap});
  by_key_[key].push_back(lru_.begin());
  stats_.bytes += snap->size();
  stats_.snapshots += 1;
  auto& mine = by_key_[key];
  while (int(mine.size()) > max_per_session_) {
    auto oldest = *std::max_element(mine.begin(), mine.end(), [&](auto a, auto b) {
      return std::distance(lru_.begin(), a) < std::distance(lru_.begin(), b);
    });
    remove_locked(oldest);
  }
  evict_locked();
}

std::shared_ptr<const SessionSnapshot> HostSessionCache::find_prefix(
    const std::string& key, std::span<const int32_t> prompt) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = by_key_.find(key);
  List::iterator best = lru_.end();
  if (found != by_key_.end()) {
    for (auto it : found->second) {
      const auto& t = it->snap->tokens;
      if (t.empty() || t.size() >= prompt.size()) continue;
      if (!std::equal(t.begin(), t.end(), prompt.begin())) continue;
      if (best == lru_.end() || t.size() > best->snap->tokens.size()) best = it;
    }
  }
  if (best == lru_.end()) {
    stats_.misses += 1;
    return nullptr;
  }
  stats_.hits += 1;
  lru_.splice(lru_.begin(), lru_, best);  // iterators stay valid
  return best->snap;
}

void HostSessionCache::erase(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = by_key_.find(key);
  if (found == by_key_.end()) return;
  auto its = found->second;
  for (auto it : its) remove_locked(it);
}

HostCacheStats HostSessionCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace uf::kv
