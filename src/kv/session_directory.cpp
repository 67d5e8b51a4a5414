#include "kv/session_directory.h"

#include <fmt/format.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <mutex>
#include <random>
#include <unordered_map>

#include "kv/blake3.h"

namespace uf::kv {

std::string session_key(std::string_view session_id) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(session_id.data(), session_id.size(), md, &len, EVP_sha256(), nullptr);
  return to_hex(std::span<const uint8_t>(md, len));
}

std::string random_uuid() {
  uint8_t b[16];
  if (RAND_bytes(b, sizeof(b)) != 1) {
    // OpenSSL's generator failed (no entropy source?): fall back to the OS one via random_device.
    std::random_device rd;
    for (auto& x : b) x = static_cast<uint8_t>(rd());
  }
  b[6] = static_cast<uint8_t>((b[6] & 0x0f) | 0x40);  // version 4
  b[8] = static_cast<uint8_t>((b[8] & 0x3f) | 0x80);  // RFC 4122 variant
  std::string h = to_hex(b);
  return fmt::format("{}-{}-{}-{}-{}", h.substr(0, 8), h.substr(8, 4), h.substr(12, 4),
                     h.substr(16, 4), h.substr(20));
}

namespace {

class InProcessDirectory final : public SessionDirectory {
 public:
  explicit InProcessDirectory(InProcessDirectoryConfig config)
      : config_(config), epoch_(random_uuid()) {}

  DirectoryResult lookup(std::string_view session_id) override {
    std::lock_guard lock(mu_);
    ++stats_.calls;
    Entry* e = find_live(session_key(session_id));
    if (!e) return {{StatusCode::kNotFound, "no owner for this session"}, {epoch_, 0, {}, {}}};
    return {Status::ok(), e->version};
  }

  DirectoryResult claim(std::string_view session_id, const ClaimRequest& req) override {
    OwnershipChange change;
    bool notify = false;
    DirectoryResult result;
    {
      std::lock_guard lock(mu_);
      ++stats_.calls;
      if (++claims_since_sweep_ >= 1024) sweep_expired();
      std::string key = session_key(session_id);
      Entry* e = find_live(key);
      uint64_t cur = e ? e->version.seq : 0;
      if (req.epoch != epoch_ || req.seq != cur)
        return {{StatusCode::kStale, std::string(kStaleMessage)}, {}};
      Entry& ne = sessions_[key];
      ne.version = {epoch_, cur + 1, req.owner, req.address};
      ne.expires = Clock::now() + config_.ttl;
      result = {Status::ok(), ne.version};
      change = {key, ne.version, false};
      notify = static_cast<bool>(callback_);
      if (notify) ++stats_.notifications;
    }
    if (notify) {
      std::lock_guard lock(cb_mu_);
      if (callback_) callback_(change);
    }
    return result;
  }

  DirectoryResult check(std::string_view session_id, std::string_view epoch,
                        uint64_t seq) override {
    std::lock_guard lock(mu_);
    ++stats_.calls;
    Entry* e = find_live(session_key(session_id));
    SessionVersion cur = e ? e->version : SessionVersion{epoch_, 0, {}, {}};
    if (epoch != epoch_ || seq != cur.seq)
      return {{StatusCode::kStale, std::string(kStaleMessage)}, cur};
    return {Status::ok(), cur};
  }

  void set_change_callback(ChangeCallback callback) override {
    std::lock_guard cb_lock(cb_mu_);  // waits for a delivery in progress
    std::lock_guard lock(mu_);
    callback_ = std::move(callback);
  }

  DirectoryStats stats() const override {
    std::lock_guard lock(mu_);
    return stats_;
  }

  std::string describe() const override { return "in-process directory, epoch " + epoch_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Entry {
    SessionVersion version;
    Clock::time_point expires;
  };

  // The live entry for a key (refreshing its TTL, as every access does), or null.
  Entry* find_live(const std::string& key) {
    auto it = sessions_.find(key);
    if (it == sessions_.end()) return nullptr;
    Clock::time_point now = Clock::now();
    if (it->second.expires <= now) {
      sessions_.erase(it);
      return nullptr;
    }
    it->second.expires = now + config_.ttl;
    return &it->second;
  }

  // Sessions nobody touches again would otherwise stay forever.
  void sweep_expired() {
    claims_since_sweep_ = 0;
    Clock::time_point now = Clock::now();
    std::erase_if(sessions_, [now](const auto& kv) { return kv.second.expires <= now; });
  }

  InProcessDirectoryConfig config_;
  std::string epoch_;
  size_t claims_since_sweep_ = 0;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> sessions_;
  ChangeCallback callback_;  // written under cb_mu_ and mu_, called under cb_mu_
  std::mutex cb_mu_;
  DirectoryStats stats_;
};

}  // namespace

std::unique_ptr<SessionDirectory> make_in_process_directory(InProcessDirectoryConfig config) {
  return std::make_unique<InProcessDirectory>(config);
}

}  // namespace uf::kv
