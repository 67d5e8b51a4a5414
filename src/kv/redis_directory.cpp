// The Redis session directory: one hash per session {epoch, seq, owner, address} under
// <prefix>s:<sha256 hex>, a global <prefix>epoch key, and three Lua scripts run with EVALSHA so
// each call is one atomic step. A subscriber thread with its own connection delivers ownership
// changes published by successful claims.

#include <fmt/format.h>
#include <hiredis/hiredis.h>
#include <openssl/evp.h>
#include <poll.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <charconv>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "core/log.h"
#include "kv/blake3.h"
#include "kv/session_directory.h"

namespace uf::kv {
namespace {

// Shared preamble: the epoch is created on first use (the client proposes a fresh UUID in
// ARGV[1]; it is only written when the key is missing, i.e. on first use or after a flush).
#define UF_KV_EPOCH_PREAMBLE                   \
  "local epoch = redis.call('GET', KEYS[1])\n" \
  "if not epoch then\n"                        \
  "  redis.call('SET', KEYS[1], ARGV[1])\n"    \
  "  epoch = ARGV[1]\n"                        \
  "end\n"

#define UF_KV_STALE "'STALE ownership changed, expired or directory restarted'"

// KEYS: epoch key, session key. ARGV: candidate epoch, ttl ms.
constexpr const char* kLookupLua = UF_KV_EPOCH_PREAMBLE
    "local h = redis.call('HMGET', KEYS[2], 'epoch', 'seq', 'owner', 'address')\n"
    "if h[1] ~= epoch then\n"
    "  if h[1] then redis.call('DEL', KEYS[2]) end\n"  // a version from a void epoch
    "  return {'NOTFOUND', epoch, '0', '', ''}\n"
    "end\n"
    "redis.call('PEXPIRE', KEYS[2], ARGV[2])\n"
    "return {'OK', h[1], h[2], h[3], h[4]}\n";

// ARGV: candidate epoch, ttl ms, epoch read, seq read, owner, address, channel, session key hex.
constexpr const char* kClaimLua = UF_KV_EPOCH_PREAMBLE
    "local h = redis.call('HMGET', KEYS[2], 'epoch', 'seq')\n"
    "local cur = 0\n"
    "if h[1] == epoch then\n"
    "  cur = tonumber(h[2])\n"
    "  redis.call('PEXPIRE', KEYS[2], ARGV[2])\n"
    "end\n"
    "if ARGV[3] ~= epoch or tonumber(ARGV[4]) ~= cur then\n"
    "  return redis.error_reply(" UF_KV_STALE
    ")\n"
    "end\n"
    "local seq = cur + 1\n"
    "redis.call('HSET', KEYS[2], 'epoch', epoch, 'seq', seq, 'owner', ARGV[5], 'address', "
    "ARGV[6])\n"
    "redis.call('PEXPIRE', KEYS[2], ARGV[2])\n"
    "redis.call('PUBLISH', ARGV[7], cjson.encode({key = ARGV[8], epoch = epoch, seq = seq, "
    "owner = ARGV[5], address = ARGV[6]}))\n"
    "return {'OK', epoch, tostring(seq), ARGV[5], ARGV[6]}\n";

// ARGV: candidate epoch, ttl ms, epoch held, seq held.
constexpr const char* kCheckLua = UF_KV_EPOCH_PREAMBLE
    "local h = redis.call('HMGET', KEYS[2], 'epoch', 'seq', 'owner', 'address')\n"
    "local cur = {'OK', epoch, '0', '', ''}\n"
    "if h[1] == epoch then\n"
    "  redis.call('PEXPIRE', KEYS[2], ARGV[2])\n"
    "  cur = {'OK', h[1], h[2], h[3], h[4]}\n"
    "end\n"
    "if ARGV[3] ~= epoch or tonumber(ARGV[4]) ~= tonumber(cur[3]) then\n"
    "  return redis.error_reply(" UF_KV_STALE
    ")\n"
    "end\n"
    "return cur\n";

enum ScriptId { kLookup, kClaim, kCheck, kNumScripts };
constexpr const char* kScriptNames[kNumScripts] = {"lookup", "claim", "check"};
constexpr const char* kScriptSources[kNumScripts] = {kLookupLua, kClaimLua, kCheckLua};

std::string sha1_hex(std::string_view s) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(s.data(), s.size(), md, &len, EVP_sha1(), nullptr);
  return to_hex(std::span<const uint8_t>(md, len));
}

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyDeleter>;

timeval to_timeval(std::chrono::milliseconds ms) {
  return {static_cast<time_t>(ms.count() / 1000),
          static_cast<suseconds_t>(ms.count() % 1000 * 1000)};
}

class RedisDirectory final : public SessionDirectory {
 public:
  explicit RedisDirectory(RedisDirectoryConfig config) : config_(std::move(config)) {
    epoch_key_ = config_.key_prefix + "epoch";
    for (int i = 0; i < kNumScripts; ++i) shas_[i] = sha1_hex(kScriptSources[i]);
    backoff_ = config_.backoff_initial;
  }

  ~RedisDirectory() override {
    {
      std::lock_guard lock(stop_mu_);
      stop_ = true;
    }
    stop_cv_.notify_all();
    if (subscriber_.joinable()) subscriber_.join();
    if (ctx_) redisFree(ctx_);
  }

  DirectoryResult lookup(std::string_view session_id) override {
    std::string key = session_key(session_id);
    return run(kLookup, key, {random_uuid(), ttl_ms()});
  }

  DirectoryResult claim(std::string_view session_id, const ClaimRequest& req) override {
    std::string key = session_key(session_id);
    return run(kClaim, key,
               {random_uuid(), ttl_ms(), req.epoch, std::to_string(req.seq), req.owner, req.address,
                config_.channel, key});
  }

  DirectoryResult check(std::string_view session_id, std::string_view epoch,
                        uint64_t seq) override {
    std::string key = session_key(session_id);
    return run(kCheck, key, {random_uuid(), ttl_ms(), std::string(epoch), std::to_string(seq)});
  }

  // The subscriber starts with the first callback, so its first resync event is not lost.
  void set_change_callback(ChangeCallback callback) override {
    std::lock_guard lock(cb_mu_);
    callback_ = std::move(callback);
    if (config_.subscribe && !subscriber_.joinable())
      subscriber_ = std::thread([this] { subscriber_loop(); });
  }

  DirectoryStats stats() const override {
    DirectoryStats s;
    s.calls = calls_.load();
    s.failures = failures_.load();
    s.reconnects = reconnects_.load();
    s.script_loads = script_loads_.load();
    s.notifications = notifications_.load();
    return s;
  }

  std::string describe() const override {
    return fmt::format("Redis directory at {}:{} (prefix '{}', channel '{}')", config_.host,
                       config_.port, config_.key_prefix, config_.channel);
  }

 private:
  using Clock = std::chrono::steady_clock;

  std::string ttl_ms() const { return std::to_string(config_.ttl.count()); }

  std::string where() const { return fmt::format("{}:{}", config_.host, config_.port); }

  DirectoryResult unavailable(std::string message) {
    ++failures_;
    return {{StatusCode::kUnavailable, std::move(message)}, {}};
  }

  // Drops a broken connection and schedules the next attempt (exponential backoff).
  void connection_lost_locked(const std::string& why) {
    if (ctx_) {
      redisFree(ctx_);
      ctx_ = nullptr;
    }
    last_error_ = why;
    next_attempt_ = Clock::now() + backoff_;
    if (!in_outage_) {
      in_outage_ = true;
      spdlog::warn(
          "KV directory: Redis at {} is unreachable ({}); session sharing falls back to "
          "recomputation until it is back",
          where(), why);
      core::log_event({{"event", "kv_directory_unavailable"}, {"redis", where()}, {"error", why}});
    }
    backoff_ = std::min(backoff_ * 2, config_.backoff_max);
  }

  bool ensure_connected_locked() {
    if (ctx_) return true;
    if (Clock::now() < next_attempt_) return false;  // fail fast while backing off
    timeval tv = to_timeval(config_.connect_timeout);
    redisContext* c = redisConnectWithTimeout(config_.host.c_str(), config_.port, tv);
    if (!c || c->err) {
      std::string why = c ? c->errstr : "cannot allocate a hiredis context";
      if (c) redisFree(c);
      connection_lost_locked("connect: " + why);
      return false;
    }
    timeval ctv = to_timeval(config_.command_timeout);
    redisSetTimeout(c, ctv);
    redisEnableKeepAlive(c);
    ctx_ = c;
    if (ever_connected_) {
      ++reconnects_;
      spdlog::info("KV directory: reconnected to Redis at {}", where());
      core::log_event({{"event", "kv_directory_reconnected"}, {"redis", where()}});
    }
    ever_connected_ = true;
    in_outage_ = false;
    backoff_ = config_.backoff_initial;
    return true;
  }

  DirectoryResult run(ScriptId id, const std::string& key, std::vector<std::string> args) {
    ++calls_;
    std::lock_guard lock(mu_);
    if (!ensure_connected_locked()) {
      auto wait =
          std::chrono::duration_cast<std::chrono::milliseconds>(next_attempt_ - Clock::now());
      return unavailable(fmt::format("Redis at {} is unreachable ({}); next reconnect in {} ms",
                                     where(), last_error_, std::max<int64_t>(0, wait.count())));
    }
    std::string session_full = config_.key_prefix + "s:" + key;
    std::vector<const char*> argv = {"EVALSHA", shas_[id].c_str(), "2", epoch_key_.c_str(),
                                     session_full.c_str()};
    std::vector<size_t> lens = {7, shas_[id].size(), 1, epoch_key_.size(), session_full.size()};
    for (const auto& a : args) {
      argv.push_back(a.c_str());
      lens.push_back(a.size());
    }
    ReplyPtr reply;
    for (int attempt = 0; attempt < 2; ++attempt) {
      reply.reset(static_cast<redisReply*>(
          redisCommandArgv(ctx_, static_cast<int>(argv.size()), argv.data(), lens.data())));
      if (!reply) {
        std::string why = ctx_->errstr;
        connection_lost_locked(why);
        return unavailable(fmt::format("Redis at {} failed during the {} script: {}", where(),
                                       kScriptNames[id], why));
      }
      bool noscript = reply->type == REDIS_REPLY_ERROR &&
                      std::string_view(reply->str, reply->len).starts_with("NOSCRIPT");
      if (!noscript || attempt == 1) break;
      // The script cache is empty (first use, restart, SCRIPT FLUSH): load and retry once.
      ReplyPtr load(
          static_cast<redisReply*>(redisCommand(ctx_, "SCRIPT LOAD %s", kScriptSources[id])));
      if (!load) {
        std::string why = ctx_->errstr;
        connection_lost_locked(why);
        return unavailable(fmt::format("Redis at {} failed while loading the {} script: {}",
                                       where(), kScriptNames[id], why));
      }
      ++script_loads_;
      if (load->type != REDIS_REPLY_STRING || std::string_view(load->str, load->len) != shas_[id])
        return internal(fmt::format("Redis at {} did not load the {} script ({})", where(),
                                    kScriptNames[id], reply_text(load.get())));
    }
    if (reply->type == REDIS_REPLY_ERROR) {
      std::string_view msg(reply->str, reply->len);
      if (msg == kStaleMessage) return {{StatusCode::kStale, std::string(kStaleMessage)}, {}};
      // Errors such as LOADING, BUSY or READONLY: the store is there but cannot answer now.
      return unavailable(fmt::format("Redis at {} answered the {} script with '{}'", where(),
                                     kScriptNames[id], msg));
    }
    return parse_version(id, reply.get());
  }

  DirectoryResult internal(std::string message) {
    ++failures_;
    spdlog::error("KV directory: {}", message);
    return {{StatusCode::kInternal, std::move(message)}, {}};
  }

  static std::string reply_text(const redisReply* r) {
    if (!r) return "no reply";
    if (r->str) return std::string(r->str, r->len);
    return fmt::format("reply type {}", r->type);
  }

  DirectoryResult parse_version(ScriptId id, const redisReply* r) {
    auto is_str = [](const redisReply* e) {
      return e->type == REDIS_REPLY_STRING || e->type == REDIS_REPLY_STATUS;
    };
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 5)
      return internal(fmt::format("the {} script answered {} instead of a 5-element array",
                                  kScriptNames[id], reply_text(r)));
    for (size_t i = 0; i < 5; ++i)
      if (!is_str(r->element[i]))
        return internal(
            fmt::format("the {} script answered a non-string in element {}", kScriptNames[id], i));
    auto s = [&](size_t i) { return std::string(r->element[i]->str, r->element[i]->len); };
    DirectoryResult out;
    out.version.epoch = s(1);
    std::string seq = s(2);
    auto [p, ec] = std::from_chars(seq.data(), seq.data() + seq.size(), out.version.seq);
    if (ec != std::errc() || p != seq.data() + seq.size())
      return internal(fmt::format("the {} script answered seq '{}'", kScriptNames[id], seq));
    out.version.owner = s(3);
    out.version.address = s(4);
    std::string st = s(0);
    if (st == "NOTFOUND")
      out.status = {StatusCode::kNotFound, "no owner for this session"};
    else if (st != "OK")
      return internal(fmt::format("the {} script answered status '{}'", kScriptNames[id], st));
    return out;
  }

  // ---- subscriber thread ----

  bool sleep_unless_stopped(std::chrono::milliseconds d) {
    std::unique_lock lock(stop_mu_);
    return !stop_cv_.wait_for(lock, d, [this] { return stop_; });
  }

  bool stopping() {
    std::lock_guard lock(stop_mu_);
    return stop_;
  }

  // Runs the callback under cb_mu_, so that replacing it waits for a delivery in progress.
  void deliver(const OwnershipChange& change) {
    if (!change.resync) ++notifications_;
    std::lock_guard lock(cb_mu_);
    if (callback_) callback_(change);
  }

  void handle_message(const redisReply* r) {
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 3) return;
    const redisReply* kind = r->element[0];
    const redisReply* payload = r->element[2];
    if (kind->type != REDIS_REPLY_STRING || std::string_view(kind->str, kind->len) != "message")
      return;
    if (payload->type != REDIS_REPLY_STRING) return;
    auto j = nlohmann::json::parse(payload->str, payload->str + payload->len, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      spdlog::warn("KV directory: ignoring a malformed change notification");
      return;
    }
    OwnershipChange c;
    c.key = j.value("key", "");
    c.version.epoch = j.value("epoch", "");
    c.version.seq = j.value("seq", uint64_t{0});
    c.version.owner = j.value("owner", "");
    c.version.address = j.value("address", "");
    deliver(c);
  }

  void subscriber_loop() {
    std::chrono::milliseconds backoff = config_.backoff_initial;
    bool announced_loss = false;
    while (!stopping()) {
      timeval tv = to_timeval(config_.connect_timeout);
      redisContext* c = redisConnectWithTimeout(config_.host.c_str(), config_.port, tv);
      ReplyPtr sub;
      if (c && !c->err) {
        timeval ctv = to_timeval(config_.command_timeout);
        redisSetTimeout(c, ctv);
        sub.reset(static_cast<redisReply*>(
            redisCommand(c, "SUBSCRIBE %b", config_.channel.data(), config_.channel.size())));
      }
      if (!sub || sub->type != REDIS_REPLY_ARRAY) {
        if (!announced_loss) {
          spdlog::warn("KV directory: change subscriber cannot reach Redis at {} ({}); retrying",
                       where(), c ? c->errstr : "no context");
          announced_loss = true;
        }
        if (c) redisFree(c);
        sleep_unless_stopped(backoff);
        backoff = std::min(backoff * 2, config_.backoff_max);
        continue;
      }
      sub.reset();
      backoff = config_.backoff_initial;
      announced_loss = false;
      deliver({{}, {}, true});
      // Read with poll() so that the stop flag is seen within 100 ms.
      while (!stopping()) {
        void* raw = nullptr;
        if (redisGetReplyFromReader(c, &raw) != REDIS_OK) break;
        if (raw) {
          ReplyPtr msg(static_cast<redisReply*>(raw));
          handle_message(msg.get());
          continue;
        }
        pollfd p{c->fd, POLLIN, 0};
        int n = ::poll(&p, 1, 100);
        if (n < 0 && errno != EINTR) break;
        if (n > 0 && redisBufferRead(c) != REDIS_OK) break;
      }
      if (!stopping()) {
        spdlog::warn("KV directory: change subscriber lost Redis at {} ({}); reconnecting", where(),
                     c->err ? c->errstr : "closed");
        announced_loss = true;
      }
      redisFree(c);
    }
  }

  RedisDirectoryConfig config_;
  std::string epoch_key_;
  std::string shas_[kNumScripts];

  std::mutex mu_;  // guards the command connection and its reconnect state
  redisContext* ctx_ = nullptr;
  bool ever_connected_ = false;
  bool in_outage_ = false;
  std::string last_error_;
  Clock::time_point next_attempt_{};
  std::chrono::milliseconds backoff_{};

  std::atomic<uint64_t> calls_{0}, failures_{0}, reconnects_{0}, script_loads_{0},
      notifications_{0};

  std::mutex cb_mu_;
  ChangeCallback callback_;

  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread subscriber_;
};

}  // namespace

std::unique_ptr<SessionDirectory> make_redis_directory(RedisDirectoryConfig config) {
  return std::make_unique<RedisDirectory>(std::move(config));
}

}  // namespace uf::kv
