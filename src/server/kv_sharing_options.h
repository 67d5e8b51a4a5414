#pragma once
// Options of multi-server KV sharing for ModelEngine (see docs/operations.md): where the session
// directory lives (Redis, or in-process for one server), the UCX listener other servers fetch
// snapshots from, this server's id, and the compatibility fingerprint that decides whether a
// snapshot written by another server may be restored here.

#include <cstdint>
#include <filesystem>
#include <string>

namespace uf::server {

struct KvSharingOptions {
  // Empty redis_host: the in-process directory (one server; nothing is shared).
  std::string redis_host;
  int redis_port = 6379;
  std::string listen_host = "127.0.0.1";  // UCX listener
  uint16_t listen_port = 0;               // 0: an ephemeral port
  std::string advertise_host;             // what peers connect to; empty: listen_host
  std::string server_id;                  // unique per server (default: hostname:http-port)
  std::string fingerprint;                // see kv_fingerprint()
  int fetch_timeout_ms = 10000;           // connect + manifest + read of one remote snapshot
  // Registered host memory for snapshots published to other servers (LRU beyond it); 0: the
  // same as the host cache's capacity.
  uint64_t max_published_bytes = 0;
  // Test only (env UF_TEST_CORRUPT_KV_FETCH=1): flip one byte of every fetched snapshot before
  // its BLAKE3 verification, to exercise the corrupt-transfer path end to end.
  bool test_corrupt_fetch = false;
};

struct KvFingerprintInputs {
  std::filesystem::path model_dir;  // config.json and inference/config.json are hashed
  std::filesystem::path tokenizer;  // tokenizer.json, hashed
  int64_t max_seq = 0;
  int gpu_count = 0;     // 0 for the CPU
  std::string kv_dtype;  // how the backend stores KV ("f32", "bf16", ...)
  std::string numerics;  // the backend's decode numerics (backend name for now)
};

// A readable fingerprint: "uf-kv1;model=<hex>;tok=<hex>;max_seq=N;gpus=N;kv=..;numerics=..".
// Two servers may share snapshots only when their fingerprints are equal byte for byte. Throws
// uf::core::Error when a file cannot be read.
std::string kv_fingerprint(const KvFingerprintInputs& in);

}  // namespace uf::server
