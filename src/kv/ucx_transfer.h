#pragma once
// Moving KV snapshots between servers with UCX.
//
// Every server runs one UcxNode: a UCX context with two workers. The owner side (a listener on a
// TCP sockaddr plus a progress thread) answers manifest requests for published snapshots, which
// live in UCX-allocated host memory (an arena, see arena_bytes); the fetcher side connects to an
// owner (and keeps the connection), asks for the manifest of a snapshot id (active message
// request/response), checks it against the request it wants to serve, then reads the bytes with
// RMA gets into its own registered buffer and verifies their BLAKE3. Transports come from UCX_TLS
// (shared memory / TCP here, RDMA verbs where present).
//
// Snapshots are opaque byte buffers plus token ids plus a fingerprint string (see manifest.h);
// the engine decides what the bytes mean. Every wait has a deadline; a vanished owner, a timeout,
// a mismatch or a checksum failure all come back as a Status (never a hang, never an exception
// on the request path), and the server falls back to recomputing.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "kv/manifest.h"
#include "kv/status.h"

namespace uf::kv {

class UcxContext;  // the shared ucp_context (defined in ucx_transfer.cpp)

// Host memory registered with UCX (ucp_mem_map). Keeps the context alive.
class RegisteredBuffer {
 public:
  ~RegisteredBuffer();
  RegisteredBuffer(const RegisteredBuffer&) = delete;
  RegisteredBuffer& operator=(const RegisteredBuffer&) = delete;

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<uint8_t> span() { return {data_, size_}; }
  std::span<const uint8_t> span() const { return {data_, size_}; }

 private:
  friend class UcxNode;
  RegisteredBuffer() = default;
  std::shared_ptr<UcxContext> ctx_;
  // A block of the owner's arena: given back here instead of unmapped (keeps the arena alive).
  std::function<void()> release_;
  void* memh_ = nullptr;  // ucp_mem_h
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

struct UcxNodeConfig {
  std::string listen_host = "127.0.0.1";  // bind address ("0.0.0.0" for every interface)
  uint16_t listen_port = 0;               // 0: an ephemeral port
  std::string advertise_host;             // host part of address(); empty: listen_host
  // A removed snapshot stays registered this long, so that a fetch that already holds its rkey
  // can finish reading.
  std::chrono::milliseconds remove_grace{10000};
  // Bytes of published snapshots kept; publishing beyond it evicts the least recently used
  // (evicted and removed ones stay mapped for remove_grace, outside this count).
  uint64_t max_published_bytes = uint64_t{64} << 30;
  // UCX peer-failure detection (UCP_ERR_HANDLING_MODE_PEER) on every endpoint. UCX 1.13 then
  // leaves out its shared-memory transports (sysv/posix/cma), so two servers on ONE host talk
  // over TCP; between hosts (TCP, RDMA verbs) it costs nothing. Turning it off lets same-host
  // peers use shared memory; failures are then caught by the deadlines and the CM connection.
  bool peer_failure_detection = true;
  // When non-zero, allocate() carves snapshots out of one UCX-allocated arena of this size
  // (falling back to a mapping of their own when it is full). Fetchers keep their connection and
  // the unpacked rkey of an arena, so on shared memory the owner's pages stay mapped on the
  // fetcher's side between fetches (a new mapping per snapshot costs as much as the copy). Pages
  // of the arena, once touched, stay resident until the node ends: size it like
  // max_published_bytes.
  uint64_t arena_bytes = 0;
  // Keep the connection to an owner (and its rkeys) for later fetches instead of closing it. A
  // kept connection that fails before the read (owner restarted, gone or silent for
  // kKeptManifestWait) is dropped and the fetch retried once on a new connection.
  bool keep_connections = true;
  // Threads that verify BLAKE3 of a fetched snapshot (large snapshots only, see
  // blake3_parallel).
  unsigned verify_threads = 4;
  // Print each fetch endpoint's lanes (transports) to stderr, for benchmarks and debugging.
  bool print_endpoint_info = false;
};

struct FetchOptions {
  std::chrono::milliseconds timeout{10000};  // connect + manifest + read, all together
  // When non-zero, the manifest's seq must equal it (the version the directory pointed to).
  uint64_t expect_seq = 0;
  // Where to read into (e.g. a reused, already-faulted staging buffer from allocate()); used when
  // it is at least the snapshot's size, else a fresh registered buffer is allocated.
  std::shared_ptr<RegisteredBuffer> into;
  // Test only: called after the manifest checks, just before the RMA read (to stop the owner
  // mid-transfer).
  std::function<void()> test_before_read;
  // Test only: called on the fetched bytes before verification (to simulate corruption in
  // flight).
  std::function<void(std::span<uint8_t>)> test_corrupt_in_flight;
};

struct FetchResult {
  Status status;
  Manifest manifest;
  size_t common_prefix = 0;  // tokens of the snapshot the request may reuse
  // The snapshot is the first manifest.byte_size bytes (the buffer may be a larger `into`).
  std::shared_ptr<RegisteredBuffer> bytes;
  std::span<const uint8_t> data() const {
    return bytes ? bytes->span().first(manifest.byte_size) : std::span<const uint8_t>();
  }
  double manifest_seconds = 0;  // connect + request/response
  double read_seconds = 0;      // the RMA get
  double verify_seconds = 0;    // BLAKE3
};

struct UcxNodeStats {
  uint64_t published = 0;
  uint64_t published_bytes = 0;
  uint64_t evicted = 0;
  uint64_t requests_served = 0;
  uint64_t fetches_ok = 0;
  uint64_t fetches_failed = 0;
  uint64_t bytes_fetched = 0;
};

class UcxNode {
 public:
  // Starts UCX, the listener and the owner's progress thread. Throws uf::core::Error when UCX
  // cannot start (a startup failure, not a request-path one).
  explicit UcxNode(UcxNodeConfig config = {});
  ~UcxNode();
  UcxNode(const UcxNode&) = delete;
  UcxNode& operator=(const UcxNode&) = delete;

  // "host:port" other servers fetch from (what the directory stores as the owner's address).
  std::string address() const;

  // ---- owner side ----
  // Registered memory for a snapshot the engine fills in place (then publish it).
  std::shared_ptr<RegisteredBuffer> allocate(size_t bytes);
  // Publishes bytes under an id (replacing an older one of the same id). The manifest's size and
  // BLAKE3 must describe the bytes; they are checked here (size) and by every fetcher (hash).
  Status publish(const std::string& id, Manifest manifest, std::shared_ptr<RegisteredBuffer> bytes);
  // Copies bytes into registered memory and publishes them.
  Status publish_copy(const std::string& id, Manifest manifest, std::span<const uint8_t> bytes);
  bool remove(const std::string& id);
  bool has(const std::string& id) const;

  // ---- fetcher side ----
  // Fetches snapshot `id` from the owner at `address`, checks its manifest against `expect`
  // before reading, and verifies BLAKE3 after. Fetches from one node run one at a time.
  FetchResult fetch(const std::string& address, const std::string& id,
                    const ReceiverExpectations& expect, const FetchOptions& options = {});

  UcxNodeStats stats() const;
  // Names of the transports UCX uses for fetches (e.g. "posix,cma,tcp"), for logs and benches.
  std::string transports() const;

  // Test only: the owner receives requests but never answers them (a hung owner).
  void test_stall_requests(bool stall) { stall_requests_ = stall; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> stall_requests_{false};
};

}  // namespace uf::kv
