#pragma once
// BLAKE3 (hash mode, with extendable output), written from the BLAKE3 specification.
// Used to check KV snapshots end to end after a UCX transfer: the owner hashes the bytes it
// publishes, the fetcher hashes what it read and compares before reusing anything.
//
// Whole chunks are hashed several at a time (4/8/16 lanes) by a SIMD kernel picked at run time
// (SSE2 baseline, AVX2, AVX-512); the portable one-chunk-at-a-time path gives the same answer.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace uf::kv {

inline constexpr size_t kBlake3OutLen = 32;
inline constexpr size_t kBlake3ChunkLen = 1024;
using Blake3Digest = std::array<uint8_t, kBlake3OutLen>;

// Which kernel hashes whole chunks. kAuto picks the widest the CPU supports.
enum class Blake3Backend { kAuto, kPortable, kSse2, kAvx2, kAvx512 };

// Forces a backend (tests and benchmarks compare them); returns the one in force before. A
// backend the CPU lacks falls back to the widest supported one.
Blake3Backend set_blake3_backend(Blake3Backend backend);
// Name of the backend that kAuto (or the forced one) resolves to, e.g. "avx2".
const char* blake3_backend_name();

// Incremental hasher: update() any number of times, then finalize() (which does not consume
// the state, so more input may follow and finalize again).
class Blake3 {
 public:
  Blake3();
  void update(const void* data, size_t len);
  void update(std::span<const uint8_t> data) { update(data.data(), data.size()); }
  // Writes out_len bytes of extendable output (the first 32 are the default hash).
  void finalize(uint8_t* out, size_t out_len) const;
  Blake3Digest finalize() const;
  void reset();

 private:
  struct ChunkState {
    std::array<uint32_t, 8> cv;
    uint64_t counter = 0;
    std::array<uint8_t, 64> block{};
    uint8_t block_len = 0;
    uint8_t blocks_compressed = 0;
  };
  void reset_chunk(uint64_t counter);
  size_t chunk_len() const;
  void chunk_update(const uint8_t* data, size_t len);
  void finish_chunk_into_tree();
  void push_chunk_cv(const std::array<uint32_t, 8>& cv, uint64_t total_chunks);

  std::array<uint32_t, 8> key_;
  ChunkState chunk_;
  // Chaining values of completed subtrees, at most one per level (54 levels cover 2^64 bytes).
  std::array<std::array<uint32_t, 8>, 54> stack_;
  uint8_t stack_len_ = 0;
};

// One-shot hash of a byte range.
Blake3Digest blake3(const void* data, size_t len);
inline Blake3Digest blake3(std::span<const uint8_t> data) {
  return blake3(data.data(), data.size());
}

// The same hash computed by up to `threads` threads (subtrees of the BLAKE3 tree hashed
// independently). Inputs below `min_parallel_bytes` are hashed on the calling thread.
Blake3Digest blake3_parallel(const void* data, size_t len, unsigned threads,
                             size_t min_parallel_bytes = size_t{4} << 20);

// Lower-case hex of a digest, and its strict inverse (64 hex digits, nothing else).
std::string to_hex(std::span<const uint8_t> bytes);
bool parse_blake3_hex(std::string_view hex, Blake3Digest& out);

}  // namespace uf::kv
