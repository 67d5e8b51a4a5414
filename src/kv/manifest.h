#pragma once
// The manifest of a KV snapshot: what a fetcher must know before it reads (and after it read)
// the bytes of another server's session. Serialised as a small little-endian binary record:
//
//   offset  size  field
//   0       8     magic "UFKVMANI"
//   8       4     format version (kManifestVersion)
//   12      4     fingerprint length F, then F bytes (compatibility fingerprint, opaque text)
//   ..      4     epoch length E, then E bytes (directory epoch the snapshot belongs to; may be 0)
//   ..      8     seq (directory seq of the owner's claim; 0 = unknown)
//   ..      8     snapshot byte size
//   ..      32    BLAKE3 of the snapshot bytes
//   ..      8     token count T, then T x int32 token ids
//
// Nothing may follow. Parsing is strict: every length is bounded by ManifestLimits and checked
// against the bytes actually present, and errors name the field and byte offset.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kv/blake3.h"
#include "kv/status.h"

namespace uf::kv {

inline constexpr uint32_t kManifestVersion = 1;

struct ManifestLimits {
  size_t max_fingerprint_bytes = 4096;
  size_t max_epoch_bytes = 64;
  uint64_t max_tokens = uint64_t{1} << 22;      // 4M tokens, above any --max-seq
  uint64_t max_byte_size = uint64_t{64} << 30;  // 64 GiB
};

struct Manifest {
  uint32_t format_version = kManifestVersion;
  // Covers model config, tokenizer, --max-seq, GPU count, KV dtype and decode-numerics choices;
  // built by the engine, compared byte for byte here.
  std::string fingerprint;
  std::string epoch;
  uint64_t seq = 0;
  uint64_t byte_size = 0;
  Blake3Digest blake3{};
  std::vector<int32_t> token_ids;
};

// Builds a manifest for the given bytes (hashes them, with up to hash_threads threads).
Manifest make_manifest(std::string fingerprint, std::span<const int32_t> token_ids,
                       std::span<const uint8_t> bytes, std::string epoch = {}, uint64_t seq = 0,
                       unsigned hash_threads = 1);

std::vector<uint8_t> serialize_manifest(const Manifest& m);
// Strict parse; on failure `out` is unspecified and the status says what and where.
Status parse_manifest(std::span<const uint8_t> data, Manifest& out,
                      const ManifestLimits& limits = {});

// A log-friendly summary (no token list).
nlohmann::json manifest_summary(const Manifest& m);

// What the receiving server knows about the request it wants to serve.
struct ReceiverExpectations {
  std::string_view fingerprint;
  std::span<const int32_t> request_tokens;
  ManifestLimits limits;
  size_t min_common_prefix = 1;  // below this, fetching is not worth it
};

struct ManifestCheck {
  Status status;
  size_t common_prefix = 0;  // leading tokens shared by the snapshot and the request
};

// Receiver-side checks before reading the bytes: version, fingerprint, size bounds, and the
// common prefix with the new request.
ManifestCheck check_manifest(const Manifest& m, const ReceiverExpectations& expect);

// After the read: size and BLAKE3 of what arrived.
Status verify_snapshot_bytes(const Manifest& m, std::span<const uint8_t> bytes,
                             unsigned hash_threads = 1);

}  // namespace uf::kv
