#include "kv/ucx_transfer.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/error.h"
#include "core/log.h"

namespace uf::kv {

class UcxContext {
 public:
  ucp_context_h ctx = nullptr;
  ~UcxContext() {
    if (ctx) ucp_cleanup(ctx);
  }
};

RegisteredBuffer::~RegisteredBuffer() {
  if (release_)
    release_();
  else if (memh_)
    ucp_mem_unmap(ctx_->ctx, static_cast<ucp_mem_h>(memh_));
}

namespace {

// UCX lists the network devices once, in ucp_init, and skips links that are not up yet: a server
// started while its interface is still coming up (container start, a fresh veth) could never use
// that interface. So wait a little for the interface that carries the listen address, and say so
// when it stays down. Names and wildcard addresses are left to UCX.
void wait_for_listen_interface(const std::string& host, std::chrono::milliseconds budget) {
  in_addr want4{};
  in6_addr want6{};
  const bool v4 = inet_pton(AF_INET, host.c_str(), &want4) == 1;
  const bool v6 = !v4 && inet_pton(AF_INET6, host.c_str(), &want6) == 1;
  if ((!v4 && !v6) || (v4 && want4.s_addr == htonl(INADDR_ANY)) ||
      (v6 && IN6_IS_ADDR_UNSPECIFIED(&want6))) {
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + budget;
  std::string name;
  for (;;) {
    bool up = false;
    ifaddrs* list = nullptr;
    if (getifaddrs(&list) == 0) {
      for (ifaddrs* i = list; i; i = i->ifa_next) {
        if (!i->ifa_addr) continue;
        const bool match =
            (v4 && i->ifa_addr->sa_family == AF_INET &&
             reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == want4.s_addr) ||
            (v6 && i->ifa_addr->sa_family == AF_INET6 &&
             std::memcmp(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr, &want6,
                         sizeof(want6)) == 0);
        if (match) {
          name = i->ifa_name;
          up = (i->ifa_flags & IFF_UP) && (i->ifa_flags & IFF_RUNNING);
        }
      }
      freeifaddrs(list);
    }
    if (up) return;
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  spdlog::warn(
      "KV listen address {} is {}: UCX lists network devices once at start, so peers may not "
      "reach this server (and it may not reach them) over that interface until it restarts",
      host, name.empty() ? "on no interface of this host" : "on interface " + name + ", not up");
}

using Clock = std::chrono::steady_clock;

// Active message ids of the manifest request/response.
constexpr unsigned kAmRequest = 17;
constexpr unsigned kAmReply = 18;
// Reply status words.
constexpr uint32_t kReplyOk = 0;
constexpr uint32_t kReplyNotFound = 1;
constexpr size_t kMaxIdBytes = 1024;
// Shared-memory reads: the unit in which mapping the owner's pages runs ahead of the copy.
constexpr size_t kReadChunk = size_t{4} << 20;
// How long a kept connection may stay silent before it is presumed stale (see fetch_on).
constexpr std::chrono::milliseconds kKeptManifestWait{2000};
// MADV_POPULATE_READ / _WRITE (Linux 5.14); older kernels answer EINVAL and the read faults as
// before.
#ifdef MADV_POPULATE_READ
constexpr int kMadvPopulateRead = MADV_POPULATE_READ;
constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kMadvPopulateRead = 22;
constexpr int kMadvPopulateWrite = 23;
#endif

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Parses "host:port" (or "[v6]:port") into a socket address.
Status resolve(const std::string& address, bool passive, sockaddr_storage& out, socklen_t& len) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size())
    return {StatusCode::kInvalid, fmt::format("UCX address '{}' is not host:port", address)};
  std::string host = address.substr(0, colon), port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || !res)
    return {StatusCode::kInvalid,
            fmt::format("cannot resolve UCX address '{}': {}", address, gai_strerror(rc))};
  std::memcpy(&out, res->ai_addr, res->ai_addrlen);
  len = res->ai_addrlen;
  freeaddrinfo(res);
  return Status::ok();
}

template <typename T>
void append(std::vector<uint8_t>& v, const T& x) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&x);
  v.insert(v.end(), p, p + sizeof(T));
}

}  // namespace

// First-fit allocator over one registered region; blocks are page aligned. Thread-safe.
struct Arena {
  std::shared_ptr<RegisteredBuffer> region;
  std::mutex mu;
  std::map<size_t, size_t> free_blocks;  // offset -> length, coalesced

  std::optional<size_t> take(size_t bytes) {
    std::lock_guard lock(mu);
    for (auto it = free_blocks.begin(); it != free_blocks.end(); ++it) {
      if (it->second < bytes) continue;
      const size_t off = it->first, len = it->second;
      free_blocks.erase(it);
      if (len > bytes) free_blocks.emplace(off + bytes, len - bytes);
      return off;
    }
    return std::nullopt;
  }

  void give_back(size_t off, size_t bytes) {
    std::lock_guard lock(mu);
    auto next = free_blocks.lower_bound(off);
    if (next != free_blocks.end() && off + bytes == next->first) {
      bytes += next->second;
      next = free_blocks.erase(next);
    }
    if (next != free_blocks.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        prev->second += bytes;
        return;
      }
    }
    free_blocks.emplace(off, bytes);
  }
};

struct UcxNode::Impl {
  UcxNode* self = nullptr;
  UcxNodeConfig config;
  std::shared_ptr<UcxContext> ctx;
  ucp_worker_h owner_worker = nullptr;
  ucp_worker_h fetch_worker = nullptr;
  ucp_listener_h listener = nullptr;
  int owner_efd = -1;
  int fetch_efd = -1;
  std::string address;
  std::thread owner_thread;
  std::atomic<bool> stop{false};

  // ---- registry (any thread) ----
  struct Entry {
    std::string id;
    Manifest manifest;
    std::vector<uint8_t> manifest_wire;
    std::shared_ptr<RegisteredBuffer> buffer;
    std::vector<uint8_t> rkey;
    std::list<std::string>::iterator lru_it;
  };
  mutable std::mutex reg_mu;
  std::unordered_map<std::string, std::shared_ptr<Entry>> entries;
  std::list<std::string> lru;  // front: most recently published or fetched
  uint64_t bytes_published = 0;
  std::vector<std::pair<Clock::time_point, std::shared_ptr<Entry>>> graveyard;

  // ---- owner thread only ----
  struct PendingRequest {
    ucp_ep_h reply_ep;
    uint64_t request_id;
    std::string id;
  };
  std::vector<ucp_conn_request_h> pending_conns;
  std::vector<PendingRequest> pending_requests;
  std::unordered_set<ucp_ep_h> server_eps;
  std::vector<ucp_ep_h> failed_eps;
  std::vector<void*> closing;  // ep close requests in flight (owner worker)

  // ---- fetcher (under fetch_mu) ----
  std::mutex fetch_mu;
  uint64_t next_request_id = 1;
  uint64_t awaited_request = 0;
  bool reply_ready = false;
  std::vector<uint8_t> reply;
  bool fetch_ep_failed = false;  // the endpoint of the fetch in progress (current_ep) failed
  ucs_status_t fetch_ep_status = UCS_OK;
  ucp_ep_h current_ep = nullptr;
  std::vector<void*> fetch_closing;       // fetch ep close requests in flight
  std::unordered_set<ucp_ep_h> dead_eps;  // kept endpoints that failed while idle
  // Kept connections to owners (keep_connections), by address, with the last rkey unpacked on
  // each (its packed bytes: an owner's arena keeps one rkey for all its snapshots).
  struct Peer {
    ucp_ep_h ep = nullptr;
    std::vector<uint8_t> rkey_bytes;
    ucp_rkey_h rkey = nullptr;
    // Remote ranges [begin, end) of this rkey already read on shared memory: their pages are
    // mapped here, so reading them again needs no populate pass (which competes with the copy
    // for memory bandwidth).
    std::map<uint64_t, uint64_t> mapped;
    bool is_mapped(uint64_t b, uint64_t e) const {
      auto it = mapped.upper_bound(b);
      if (it == mapped.begin()) return false;
      --it;
      return it->first <= b && e <= it->second;
    }
    void add_mapped(uint64_t b, uint64_t e) {
      auto it = mapped.upper_bound(b);
      if (it != mapped.begin() && std::prev(it)->second >= b) {
        --it;
        b = it->first;
        e = std::max(e, it->second);
        it = mapped.erase(it);
      }
      while (it != mapped.end() && it->first <= e) {
        e = std::max(e, it->second);
        it = mapped.erase(it);
      }
      mapped.emplace(b, e);
    }
  };
  std::unordered_map<std::string, Peer> peers;
  std::shared_ptr<Arena> arena;

  std::atomic<uint64_t> published{0}, evicted{0}, served{0}, fetch_ok{0}, fetch_failed{0},
      bytes_fetched{0};

  // ---------------------------------------------------------------- setup / teardown

  void start() {
    wait_for_listen_interface(config.listen_host, std::chrono::seconds(5));
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;  // buffers are mapped and unmapped from any thread
    ctx = std::make_shared<UcxContext>();
    ucs_status_t st = ucp_init(&params, nullptr, &ctx->ctx);
    UF_CHECK(st == UCS_OK, "UCX could not start (ucp_init: {}); check UCX_TLS and ucx_info -d",
             ucs_status_string(st));
    start_arena();
    owner_worker = make_worker("owner");
    fetch_worker = make_worker("fetch");
    st = ucp_worker_get_efd(owner_worker, &owner_efd);
    UF_CHECK(st == UCS_OK, "UCX owner worker has no event fd ({})", ucs_status_string(st));
    st = ucp_worker_get_efd(fetch_worker, &fetch_efd);
    UF_CHECK(st == UCS_OK, "UCX fetch worker has no event fd ({})", ucs_status_string(st));

    set_am_handler(owner_worker, kAmRequest, &on_request, 0);
    set_am_handler(fetch_worker, kAmReply, &on_reply, UCP_AM_FLAG_WHOLE_MSG);

    sockaddr_storage ss{};
    socklen_t len = 0;
    Status s = resolve(fmt::format("{}:{}", config.listen_host, config.listen_port), true, ss, len);
    UF_CHECK(s.is_ok(), "UCX listener: {}", s.message());
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    lp.sockaddr.addrlen = len;
    lp.conn_handler.cb = &on_conn;
    lp.conn_handler.arg = this;
    st = ucp_listener_create(owner_worker, &lp, &listener);
    UF_CHECK(st == UCS_OK, "UCX cannot listen on {}:{} ({})", config.listen_host,
             config.listen_port, ucs_status_string(st));
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    st = ucp_listener_query(listener, &attr);
    UF_CHECK(st == UCS_OK, "UCX listener query failed ({})", ucs_status_string(st));
    uint16_t port = attr.sockaddr.ss_family == AF_INET6
                        ? ntohs(reinterpret_cast<sockaddr_in6*>(&attr.sockaddr)->sin6_port)
                        : ntohs(reinterpret_cast<sockaddr_in*>(&attr.sockaddr)->sin_port);
    std::string host = config.advertise_host.empty() ? config.listen_host : config.advertise_host;
    address = host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port)
                                                  : fmt::format("{}:{}", host, port);
    owner_thread = std::thread([this] { owner_loop(); });
  }

  ucp_err_handling_mode_t err_mode() const {
    return config.peer_failure_detection ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  }

  ucp_worker_h make_worker(const char* what) {
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    ucp_worker_h w = nullptr;
    ucs_status_t st = ucp_worker_create(ctx->ctx, &wp, &w);
    UF_CHECK(st == UCS_OK, "UCX {} worker could not be created ({})", what, ucs_status_string(st));
    return w;
  }

  void set_am_handler(ucp_worker_h w, unsigned id, ucp_am_recv_callback_t cb, uint32_t flags) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.cb = cb;
    hp.arg = this;
    hp.flags = flags;
    ucs_status_t st = ucp_worker_set_am_recv_handler(w, &hp);
    UF_CHECK(st == UCS_OK, "UCX active message handler {} failed ({})", id, ucs_status_string(st));
  }

  void shutdown() {
    if (owner_thread.joinable()) {
      stop = true;
      ucp_worker_signal(owner_worker);
      owner_thread.join();
    }
    if (listener) {
      for (ucp_conn_request_h c : pending_conns) ucp_listener_reject(listener, c);
      ucp_listener_destroy(listener);
    }
    pending_conns.clear();
    listener = nullptr;
    if (owner_worker) {
      for (ucp_ep_h ep : server_eps) start_close(ep, true);
      server_eps.clear();
      drain_closing(owner_worker, Clock::now() + std::chrono::seconds(1));
    }
    {
      std::lock_guard lock(reg_mu);
      entries.clear();
      lru.clear();
      graveyard.clear();
    }
    if (fetch_worker) {
      while (!peers.empty()) drop_peer(peers.begin()->first, true);
      arena.reset();
      ucp_worker_destroy(fetch_worker);
    }
    if (owner_worker) ucp_worker_destroy(owner_worker);
    fetch_worker = owner_worker = nullptr;
  }

  // Close requests of each worker go to that worker's own list (`closing` for the owner thread,
  // `fetch_closing` for fetches): the two threads never share one.
  void start_close(ucp_ep_h ep, bool force) { start_close(ep, force, closing); }
  void start_close(ucp_ep_h ep, bool force, std::vector<void*>& list) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    if (r && !UCS_PTR_IS_ERR(r)) list.push_back(r);
  }

  void drain_closing(ucp_worker_h w, Clock::time_point deadline) {
    drain_closing(w, deadline, closing);
  }
  static void drain_closing(ucp_worker_h w, Clock::time_point deadline,
                            std::vector<void*>& closing) {
    while (!closing.empty() && Clock::now() < deadline) {
      ucp_worker_progress(w);
      std::erase_if(closing, [](void* r) {
        if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
        ucp_request_free(r);
        return true;
      });
    }
    for (void* r : closing) ucp_request_free(r);  // released when UCX completes them
    closing.clear();
  }

  // ---------------------------------------------------------------- owner side

  static void on_conn(ucp_conn_request_h req, void* arg) {
    static_cast<Impl*>(arg)->pending_conns.push_back(req);
  }

  static void on_server_ep_error(void* arg, ucp_ep_h ep, ucs_status_t) {
    static_cast<Impl*>(arg)->failed_eps.push_back(ep);
  }

  static ucs_status_t on_request(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param) {
    Impl* self = static_cast<Impl*>(arg);
    // Eager data (no RNDV flag) is readable inside the callback; FLAG_DATA only says it may be
    // kept beyond it.
    if (header_length != sizeof(uint64_t) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
        !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || length > kMaxIdBytes)
      return UCS_OK;  // not ours or malformed: drop
    if (self->self->stall_requests_) return UCS_OK;
    uint64_t rid;
    std::memcpy(&rid, header, sizeof(rid));
    self->pending_requests.push_back(
        {param->reply_ep, rid, std::string(static_cast<const char*>(data), length)});
    return UCS_OK;
  }

  void owner_loop() {
    while (!stop) {
      while (ucp_worker_progress(owner_worker) != 0) {
      }
      if (handle_owner_work()) continue;
      ucs_status_t st = ucp_worker_arm(owner_worker);
      if (st == UCS_ERR_BUSY) continue;
      pollfd p{owner_efd, POLLIN, 0};
      ::poll(&p, 1, 20);  // the timeout also paces the graveyard sweep
    }
  }

  bool handle_owner_work() {
    bool did = false;
    for (ucp_conn_request_h c : std::exchange(pending_conns, {})) {
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.conn_request = c;
      ep.err_mode = err_mode();
      ep.err_handler.cb = &on_server_ep_error;
      ep.err_handler.arg = this;
      ucp_ep_h h = nullptr;
      if (ucp_ep_create(owner_worker, &ep, &h) == UCS_OK) server_eps.insert(h);
      did = true;
    }
    for (PendingRequest& r : std::exchange(pending_requests, {})) {
      answer(r);
      did = true;
    }
    for (ucp_ep_h ep : std::exchange(failed_eps, {})) {
      if (server_eps.erase(ep)) start_close(ep, true);
      did = true;
    }
    std::erase_if(closing, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      ucp_request_free(r);
      return true;
    });
    std::lock_guard lock(reg_mu);
    Clock::time_point now = Clock::now();
    std::erase_if(graveyard, [now](const auto& g) { return g.first <= now; });
    return did;
  }

  // Header and payload must stay valid until the send completes (it may not complete inline).
  struct SendCtx {
    uint64_t header = 0;
    std::vector<uint8_t> payload;
  };

  static void on_send_done(void* request, ucs_status_t, void* user_data) {
    delete static_cast<SendCtx*>(user_data);
    ucp_request_free(request);
  }

  void answer(const PendingRequest& r) {
    auto* sc = new SendCtx;
    sc->header = r.request_id;
    std::shared_ptr<Entry> e;
    {
      std::lock_guard lock(reg_mu);
      auto it = entries.find(r.id);
      if (it != entries.end()) {
        e = it->second;
        lru.splice(lru.begin(), lru, e->lru_it);
      }
    }
    if (e) {
      ++served;
      append(sc->payload, kReplyOk);
      append(sc->payload, reinterpret_cast<uint64_t>(e->buffer->data()));
      append(sc->payload, static_cast<uint64_t>(e->rkey.size()));
      sc->payload.insert(sc->payload.end(), e->rkey.begin(), e->rkey.end());
      append(sc->payload, static_cast<uint64_t>(e->manifest_wire.size()));
      sc->payload.insert(sc->payload.end(), e->manifest_wire.begin(), e->manifest_wire.end());
    } else {
      append(sc->payload, kReplyNotFound);
      std::string msg = fmt::format("snapshot '{}' is not published here", r.id);
      sc->payload.insert(sc->payload.end(), msg.begin(), msg.end());
    }
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_EAGER;
    p.cb.send = &on_send_done;
    p.user_data = sc;
    ucs_status_ptr_t s = ucp_am_send_nbx(r.reply_ep, kAmReply, &sc->header, sizeof(uint64_t),
                                         sc->payload.data(), sc->payload.size(), &p);
    if (s == nullptr || UCS_PTR_IS_ERR(s)) delete sc;  // done inline, or failed: no callback
  }

  // ---------------------------------------------------------------- fetcher side

  static void on_fetch_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
    Impl* self = static_cast<Impl*>(arg);
    if (ep != self->current_ep) {
      self->dead_eps.insert(ep);
      return;
    }
    self->fetch_ep_failed = true;
    self->fetch_ep_status = status;
  }

  void drop_peer(const std::string& where, bool force) {
    auto it = peers.find(where);
    if (it == peers.end()) return;
    // Endpoint first: a get still in flight must not outlive the rkey or the buffer.
    dead_eps.erase(it->second.ep);
    start_close(it->second.ep, force, fetch_closing);
    drain_closing(fetch_worker, Clock::now() + std::chrono::milliseconds(500), fetch_closing);
    if (it->second.rkey) ucp_rkey_destroy(it->second.rkey);
    peers.erase(it);
  }

  static ucs_status_t on_reply(void* arg, const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param) {
    Impl* self = static_cast<Impl*>(arg);
    if (header_length != sizeof(uint64_t) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))
      return UCS_OK;
    uint64_t rid;
    std::memcpy(&rid, header, sizeof(rid));
    if (rid != self->awaited_request) return UCS_OK;  // a late answer to a fetch that gave up
    const uint8_t* d = static_cast<const uint8_t*>(data);
    self->reply.assign(d, d + length);
    self->reply_ready = true;
    return UCS_OK;
  }

  // Progresses the fetch worker until `done` holds, the endpoint fails or the deadline passes.
  template <typename Done>
  Status progress_until(Done done, Clock::time_point deadline, const char* what,
                        const std::string& where) {
    int idle = 0;
    while (!done()) {
      if (fetch_ep_failed)
        return {StatusCode::kUnavailable,
                fmt::format("UCX connection to the owner at {} failed while {} ({})", where, what,
                            ucs_status_string(fetch_ep_status))};
      if (Clock::now() >= deadline)
        return {StatusCode::kTimeout,
                fmt::format("UCX fetch from {} timed out while {}", where, what)};
      if (ucp_worker_progress(fetch_worker) != 0) {
        idle = 0;
      } else if (++idle < 256) {
        std::this_thread::yield();
      } else {
        // Nothing moving (a slow or hung owner): sleep on the worker's event fd instead of
        // burning a core until the deadline.
        idle = 0;
        if (ucp_worker_arm(fetch_worker) == UCS_OK) {
          pollfd p{fetch_efd, POLLIN, 0};
          ::poll(&p, 1, 1);
        }
      }
    }
    return Status::ok();
  }

  // Waits for an nbx request with no callback; frees it in every case.
  Status wait_request(ucs_status_ptr_t req, Clock::time_point deadline, const char* what,
                      const std::string& where) {
    if (req == nullptr) return Status::ok();
    if (UCS_PTR_IS_ERR(req))
      return {StatusCode::kUnavailable, fmt::format("UCX {} with {} failed: {}", what, where,
                                                    ucs_status_string(UCS_PTR_STATUS(req)))};
    ucs_status_t st = UCS_INPROGRESS;
    Status s =
        progress_until([&] { return (st = ucp_request_check_status(req)) != UCS_INPROGRESS; },
                       deadline, what, where);
    ucp_request_free(req);  // if still running, UCX releases it once the endpoint is closed
    if (!s.is_ok()) return s;
    if (st != UCS_OK)
      return {StatusCode::kUnavailable,
              fmt::format("UCX {} with {} failed: {}", what, where, ucs_status_string(st))};
    return Status::ok();
  }

  void close_fetch_ep(ucp_ep_h ep, bool force) {
    if (!ep) return;
    start_close(ep, force || fetch_ep_failed, fetch_closing);
    drain_closing(fetch_worker, Clock::now() + std::chrono::milliseconds(500), fetch_closing);
  }

  // A registered buffer of its own (one ucp_mem_map), pages mapped.
  std::shared_ptr<RegisteredBuffer> map_buffer(size_t bytes) {
    auto b = map_buffer_unpopulated(bytes);
    if (!b || bytes == 0) return b;
    // Every allocation is written right away (the engine's snapshot, a fetched one): map its
    // pages in one call rather than trapping once per 4 KiB inside the copy or the get, which
    // costs about as much as the copy itself. Best effort (older kernels: EINVAL, faults as
    // before).
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t begin = reinterpret_cast<uintptr_t>(b->data_) & ~(page - 1);
    ::madvise(reinterpret_cast<void*>(begin), reinterpret_cast<uintptr_t>(b->data_) + bytes - begin,
              kMadvPopulateWrite);
    return b;
  }

  std::shared_ptr<RegisteredBuffer> map_buffer_unpopulated(size_t bytes) {
    auto b = std::shared_ptr<RegisteredBuffer>(new RegisteredBuffer());
    b->ctx_ = ctx;
    if (bytes == 0) return b;
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = nullptr;
    mp.length = bytes;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    ucp_mem_h memh = nullptr;
    if (ucp_mem_map(ctx->ctx, &mp, &memh) != UCS_OK) return nullptr;
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    if (ucp_mem_query(memh, &attr) != UCS_OK || attr.length < bytes) {
      ucp_mem_unmap(ctx->ctx, memh);
      return nullptr;
    }
    b->memh_ = memh;
    b->data_ = static_cast<uint8_t*>(attr.address);
    b->size_ = bytes;
    return b;
  }

  // Shared-memory transports (sysv, posix) read a snapshot through a fresh mapping of the
  // owner's segment; the first touch of every page would trap once per 4 KiB inside the get and
  // cost more than the copy itself. MADV_POPULATE_READ maps a range in one call instead, and a
  // helper thread runs it ahead of the gets, chunk by chunk, so that mapping and copying overlap.
  // ucp_rkey_ptr succeeds only where the rkey is directly addressable (shared memory); for TCP /
  // RDMA this is one plain get. Populating is best effort: errors just leave the faults in.
  Status read_remote(ucp_ep_h h, ucp_rkey_h rkey, uint64_t remote_addr, RegisteredBuffer& into,
                     size_t bytes, bool already_mapped, Clock::time_point deadline,
                     const std::string& where) {
    ucp_request_param_t gp{};
    gp.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    gp.memh = static_cast<ucp_mem_h>(into.memh_);
    void* local = nullptr;
    if (already_mapped || ucp_rkey_ptr(rkey, remote_addr, &local) != UCS_OK || !local)
      return wait_request(ucp_get_nbx(h, into.data(), bytes, remote_addr, rkey, &gp), deadline,
                          "reading the snapshot", where);
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t base = reinterpret_cast<uintptr_t>(local);
    auto populate = [&](size_t from, size_t to) {
      const uintptr_t begin = (base + from) & ~(page - 1);
      ::madvise(reinterpret_cast<void*>(begin), base + to - begin, kMadvPopulateRead);
    };
    if (bytes < 2 * kReadChunk) {
      populate(0, bytes);
      return wait_request(ucp_get_nbx(h, into.data(), bytes, remote_addr, rkey, &gp), deadline,
                          "reading the snapshot", where);
    }
    std::atomic<size_t> mapped{0};  // bytes from the start that are populated
    std::atomic<bool> quit{false};
    std::thread ahead([&] {
      for (size_t off = 0; off < bytes && !quit.load(std::memory_order_relaxed);
           off += kReadChunk) {
        const size_t end = std::min(bytes, off + kReadChunk);
        populate(off, end);
        mapped.store(end, std::memory_order_release);
      }
    });
    Status s = Status::ok();
    for (size_t off = 0; off < bytes && s.is_ok(); off += kReadChunk) {
      const size_t end = std::min(bytes, off + kReadChunk);
      // Never waits long: populating a chunk is quicker than copying one.
      while (mapped.load(std::memory_order_acquire) < end && Clock::now() < deadline)
        std::this_thread::yield();
      s = wait_request(ucp_get_nbx(h, into.data() + off, end - off, remote_addr + off, rkey, &gp),
                       deadline, "reading the snapshot", where);
    }
    quit = true;
    ahead.join();
    return s;
  }

  // Owner side: a block of the arena when one is configured and has room, else a buffer of its
  // own.
  std::shared_ptr<RegisteredBuffer> allocate(size_t bytes) {
    if (!arena || bytes == 0) return map_buffer(bytes);
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t rounded = (bytes + page - 1) / page * page;
    std::optional<size_t> off = arena->take(rounded);
    if (!off) return map_buffer(bytes);
    auto b = std::shared_ptr<RegisteredBuffer>(new RegisteredBuffer());
    b->ctx_ = ctx;
    b->memh_ = arena->region->memh_;
    b->data_ = arena->region->data() + *off;
    b->size_ = bytes;
    b->release_ = [a = arena, at = *off, rounded] { a->give_back(at, rounded); };
    ::madvise(b->data_, rounded, kMadvPopulateWrite);  // see map_buffer
    return b;
  }

  void start_arena() {
    if (config.arena_bytes == 0) return;
    auto region = map_buffer_unpopulated(config.arena_bytes);
    if (!region) {
      // Not fatal: every snapshot then gets a mapping of its own, as without an arena.
      spdlog::warn(
          "UCX could not allocate a KV snapshot arena of {} bytes; snapshots get "
          "mappings of their own (slower reads on shared memory)",
          config.arena_bytes);
      return;
    }
    arena = std::make_shared<Arena>();
    arena->region = std::move(region);
    arena->free_blocks.emplace(0, config.arena_bytes);
  }

  FetchResult fetch(const std::string& where, const std::string& id,
                    const ReceiverExpectations& expect, const FetchOptions& opt) {
    FetchResult res;
    std::lock_guard lock(fetch_mu);
    Clock::time_point t0 = Clock::now();
    Clock::time_point deadline = t0 + opt.timeout;
    auto fail = [&](Status s) {
      res.status = std::move(s);
      res.bytes.reset();
      ++fetch_failed;
      core::log_event({{"event", "kv_transfer"},
                       {"direction", "fetch"},
                       {"owner", where},
                       {"id", id},
                       {"status", status_code_name(res.status.code())},
                       {"error", res.status.message()},
                       {"seconds", seconds_since(t0)}});
      return res;
    };
    if (id.size() > kMaxIdBytes)
      return fail(
          {StatusCode::kInvalid, fmt::format("snapshot id of {} bytes is too long", id.size())});
    sockaddr_storage ss{};
    socklen_t len = 0;
    if (Status s = resolve(where, false, ss, len); !s.is_ok()) return fail(s);
    if (auto it = peers.find(where); it != peers.end() && dead_eps.count(it->second.ep))
      drop_peer(where, true);

    Status s;
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto it = peers.find(where);
      const bool kept = it != peers.end();
      Peer local;
      if (!kept) {
        ucp_ep_params_t ep{};
        ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
        ep.sockaddr.addrlen = len;
        ep.err_mode = err_mode();
        ep.err_handler.cb = &on_fetch_ep_error;
        ep.err_handler.arg = this;
        ucs_status_t st = ucp_ep_create(fetch_worker, &ep, &local.ep);
        if (st != UCS_OK)
          return fail(
              {StatusCode::kUnavailable, fmt::format("cannot connect to the KV owner at {} ({})",
                                                     where, ucs_status_string(st))});
      }
      Peer& peer = kept ? it->second : local;
      current_ep = peer.ep;
      fetch_ep_failed = false;
      fetch_ep_status = UCS_OK;
      bool read_started = false;
      s = fetch_on(peer, kept, where, id, expect, opt, deadline, res, read_started);
      current_ep = nullptr;
      // Only a broken or silent connection is closed; answers (not found, mismatch) keep it.
      const bool broken =
          !s.is_ok() && (read_started || s.code() == StatusCode::kUnavailable ||
                         s.code() == StatusCode::kTimeout || s.code() == StatusCode::kCorrupt);
      if (kept) {
        if (broken) drop_peer(where, true);
      } else if (config.keep_connections && !broken) {
        peers.emplace(where, std::move(local));
      } else {
        close_fetch_ep(local.ep, broken);
        if (local.rkey) ucp_rkey_destroy(local.rkey);
      }
      // A kept connection may predate a restart of the owner: retry once on a new one, unless
      // the read itself had started (then the error is about this transfer).
      if (s.is_ok() || !kept || !broken || read_started || Clock::now() >= deadline) break;
      res = FetchResult{};
    }
    if (!s.is_ok()) return fail(s);

    if (opt.test_corrupt_in_flight && res.bytes)
      opt.test_corrupt_in_flight(res.bytes->span().first(res.manifest.byte_size));
    Clock::time_point tv = Clock::now();
    s = verify_snapshot_bytes(res.manifest, res.data(), config.verify_threads);
    res.verify_seconds = seconds_since(tv);
    if (!s.is_ok()) return fail(s);
    ++fetch_ok;
    bytes_fetched += res.manifest.byte_size;
    double total = seconds_since(t0);
    core::log_event(
        {{"event", "kv_transfer"},
         {"direction", "fetch"},
         {"owner", where},
         {"id", id},
         {"status", "OK"},
         {"bytes", res.manifest.byte_size},
         {"tokens", res.manifest.token_ids.size()},
         {"reuse_tokens", res.common_prefix},
         {"seconds", total},
         {"read_gbps",
          res.read_seconds > 0 ? res.manifest.byte_size / res.read_seconds / 1e9 : 0.0}});
    return res;
  }

  // One fetch on `peer.ep`; leaves the unpacked rkey in `peer` (the caller keeps or destroys it
  // with the endpoint). `read_started`: the RMA get was issued.
  Status fetch_on(Peer& peer, bool kept, const std::string& where, const std::string& id,
                  const ReceiverExpectations& expect, const FetchOptions& opt,
                  Clock::time_point deadline, FetchResult& res, bool& read_started) {
    Clock::time_point t0 = Clock::now();
    ucp_ep_h h = peer.ep;
    // 1. Manifest request / response. A kept connection to an owner that went away may never
    // answer (no peer-failure detection): give it less time, the caller then reconnects.
    const Clock::time_point manifest_deadline =
        kept ? std::min(deadline, t0 + kKeptManifestWait) : deadline;
    awaited_request = next_request_id++;
    reply_ready = false;
    reply.clear();
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    uint64_t rid = awaited_request;
    UF_KV_TRY(
        wait_request(ucp_am_send_nbx(h, kAmRequest, &rid, sizeof(rid), id.data(), id.size(), &p),
                     manifest_deadline, "sending the manifest request", where));
    UF_KV_TRY(progress_until([&] { return reply_ready; }, manifest_deadline,
                             "waiting for the manifest", where));
    awaited_request = 0;
    res.manifest_seconds = seconds_since(t0);

    // 2. Parse: status, remote address, rkey, manifest.
    size_t off = 0;
    auto take = [&](void* dst, size_t n) {
      if (reply.size() - off < n) return false;
      std::memcpy(dst, reply.data() + off, n);
      off += n;
      return true;
    };
    uint32_t status_word = 0;
    if (!take(&status_word, 4))
      return {StatusCode::kCorrupt, fmt::format("empty manifest reply from {}", where)};
    if (status_word == kReplyNotFound)
      return {StatusCode::kNotFound, fmt::format("the owner at {} answered: {}", where,
                                                 std::string(reply.begin() + 4, reply.end()))};
    uint64_t remote_addr = 0, rkey_len = 0, manifest_len = 0;
    if (status_word != kReplyOk || !take(&remote_addr, 8) || !take(&rkey_len, 8) ||
        rkey_len > reply.size() - off)
      return {StatusCode::kCorrupt, fmt::format("malformed manifest reply from {}", where)};
    const std::span<const uint8_t> rkey_buf(reply.data() + off, rkey_len);
    off += rkey_len;
    if (!take(&manifest_len, 8) || manifest_len != reply.size() - off)
      return {StatusCode::kCorrupt, fmt::format("malformed manifest reply from {}", where)};
    UF_KV_TRY(parse_manifest(std::span<const uint8_t>(reply.data() + off, manifest_len),
                             res.manifest, expect.limits));

    // 3. Receiver-side checks before reading anything big.
    ManifestCheck check = check_manifest(res.manifest, expect);
    if (!check.status.is_ok()) return check.status;
    res.common_prefix = check.common_prefix;
    if (opt.expect_seq != 0 && res.manifest.seq != opt.expect_seq)
      return {StatusCode::kStale,
              fmt::format("the owner at {} holds seq {} of the session, the directory said {}",
                          where, res.manifest.seq, opt.expect_seq)};

    // 4. One RMA get into registered memory of our own. The rkey of the previous fetch from this
    // owner is reused when the owner sent the same one (its arena): the mapping stays.
    if (opt.into && opt.into->size() >= res.manifest.byte_size &&
        (opt.into->memh_ || res.manifest.byte_size == 0))
      res.bytes = opt.into;
    else
      res.bytes = map_buffer(res.manifest.byte_size);
    if (!res.bytes)
      return {StatusCode::kInternal,
              fmt::format("cannot register {} bytes for a KV snapshot", res.manifest.byte_size)};
    if (res.manifest.byte_size == 0) return Status::ok();
    if (!peer.rkey || !std::equal(rkey_buf.begin(), rkey_buf.end(), peer.rkey_bytes.begin(),
                                  peer.rkey_bytes.end())) {
      if (peer.rkey) ucp_rkey_destroy(peer.rkey);
      peer.rkey = nullptr;
      peer.mapped.clear();
      peer.rkey_bytes.assign(rkey_buf.begin(), rkey_buf.end());
      ucs_status_t st = ucp_ep_rkey_unpack(h, rkey_buf.data(), &peer.rkey);
      if (st != UCS_OK) {
        peer.rkey = nullptr;
        return {StatusCode::kCorrupt,
                fmt::format("cannot unpack the rkey from {} ({})", where, ucs_status_string(st))};
      }
    }
    if (config.print_endpoint_info) ucp_ep_print_info(h, stderr);
    if (opt.test_before_read) opt.test_before_read();
    Clock::time_point tr = Clock::now();
    read_started = true;
    const uint64_t end = remote_addr + res.manifest.byte_size;
    Status s = read_remote(h, peer.rkey, remote_addr, *res.bytes, res.manifest.byte_size,
                           peer.is_mapped(remote_addr, end), deadline, where);
    res.read_seconds = seconds_since(tr);
    if (s.is_ok()) peer.add_mapped(remote_addr, end);
    return s;
  }
};

UcxNode::UcxNode(UcxNodeConfig config) : impl_(std::make_unique<Impl>()) {
  impl_->self = this;
  impl_->config = std::move(config);
  try {
    impl_->start();
  } catch (...) {
    impl_->shutdown();
    throw;
  }
}

UcxNode::~UcxNode() { impl_->shutdown(); }

std::string UcxNode::address() const { return impl_->address; }

std::shared_ptr<RegisteredBuffer> UcxNode::allocate(size_t bytes) { return impl_->allocate(bytes); }

Status UcxNode::publish(const std::string& id, Manifest manifest,
                        std::shared_ptr<RegisteredBuffer> bytes) {
  if (!bytes || bytes->size() != manifest.byte_size)
    return {StatusCode::kInvalid,
            fmt::format("snapshot '{}': manifest says {} bytes, buffer has {}", id,
                        manifest.byte_size, bytes ? bytes->size() : 0)};
  if (id.size() > kMaxIdBytes)
    return {StatusCode::kInvalid, fmt::format("snapshot id of {} bytes is too long", id.size())};
  auto e = std::make_shared<Impl::Entry>();
  e->id = id;
  e->manifest_wire = serialize_manifest(manifest);
  e->manifest = std::move(manifest);
  if (bytes->memh_) {
    void* rkey = nullptr;
    size_t rkey_len = 0;
    ucs_status_t st =
        ucp_rkey_pack(impl_->ctx->ctx, static_cast<ucp_mem_h>(bytes->memh_), &rkey, &rkey_len);
    if (st != UCS_OK)
      return {StatusCode::kInternal,
              fmt::format("cannot pack the rkey of snapshot '{}' ({})", id, ucs_status_string(st))};
    e->rkey.assign(static_cast<uint8_t*>(rkey), static_cast<uint8_t*>(rkey) + rkey_len);
    ucp_rkey_buffer_release(rkey);
  }
  e->buffer = std::move(bytes);
  uint64_t size = e->buffer->size();
  std::lock_guard lock(impl_->reg_mu);
  auto grave = Clock::now() + impl_->config.remove_grace;
  auto drop = [&](const std::string& victim) {
    auto it = impl_->entries.find(victim);
    impl_->bytes_published -= it->second->buffer->size();
    impl_->lru.erase(it->second->lru_it);
    impl_->graveyard.emplace_back(grave, it->second);
    impl_->entries.erase(it);
  };
  if (impl_->entries.count(id)) drop(id);
  while (!impl_->lru.empty() && impl_->bytes_published + size > impl_->config.max_published_bytes) {
    drop(impl_->lru.back());
    ++impl_->evicted;
  }
  impl_->lru.push_front(id);
  e->lru_it = impl_->lru.begin();
  impl_->entries[id] = std::move(e);
  impl_->bytes_published += size;
  ++impl_->published;
  return Status::ok();
}

Status UcxNode::publish_copy(const std::string& id, Manifest manifest,
                             std::span<const uint8_t> bytes) {
  auto buf = allocate(bytes.size());
  if (!buf)
    return {StatusCode::kInternal,
            fmt::format("cannot register {} bytes for snapshot '{}'", bytes.size(), id)};
  if (!bytes.empty()) std::memcpy(buf->data(), bytes.data(), bytes.size());
  return publish(id, std::move(manifest), std::move(buf));
}

bool UcxNode::remove(const std::string& id) {
  std::lock_guard lock(impl_->reg_mu);
  auto it = impl_->entries.find(id);
  if (it == impl_->entries.end()) return false;
  impl_->bytes_published -= it->second->buffer->size();
  impl_->lru.erase(it->second->lru_it);
  impl_->graveyard.emplace_back(Clock::now() + impl_->config.remove_grace, it->second);
  impl_->entries.erase(it);
  return true;
}

bool UcxNode::has(const std::string& id) const {
  std::lock_guard lock(impl_->reg_mu);
  return impl_->entries.count(id) != 0;
}

FetchResult UcxNode::fetch(const std::string& address, const std::string& id,
                           const ReceiverExpectations& expect, const FetchOptions& options) {
  return impl_->fetch(address, id, expect, options);
}

UcxNodeStats UcxNode::stats() const {
  UcxNodeStats s;
  {
    std::lock_guard lock(impl_->reg_mu);
    s.published = impl_->entries.size();
    s.published_bytes = impl_->bytes_published;
  }
  s.evicted = impl_->evicted;
  s.requests_served = impl_->served;
  s.fetches_ok = impl_->fetch_ok;
  s.fetches_failed = impl_->fetch_failed;
  s.bytes_fetched = impl_->bytes_fetched;
  return s;
}

std::string UcxNode::transports() const {
  const char* tls = std::getenv("UCX_TLS");
  return tls ? tls : "UCX default (UCX_TLS unset)";
}

}  // namespace uf::kv
