#include "kv/blake3.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <future>

#include "kv/blake3_internal.h"

namespace uf::kv {
namespace blake3_detail {

namespace {

inline uint32_t rotr32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

inline void g(uint32_t* v, int a, int b, int c, int d, uint32_t mx, uint32_t my) {
  v[a] = v[a] + v[b] + mx;
  v[d] = rotr32(v[d] ^ v[a], 16);
  v[c] = v[c] + v[d];
  v[b] = rotr32(v[b] ^ v[c], 12);
  v[a] = v[a] + v[b] + my;
  v[d] = rotr32(v[d] ^ v[a], 8);
  v[c] = v[c] + v[d];
  v[b] = rotr32(v[b] ^ v[c], 7);
}

std::atomic<Blake3Backend> g_forced{Blake3Backend::kAuto};

Blake3Backend resolve(Blake3Backend want) {
#if defined(UF_KV_BLAKE3_X86)
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  static const bool has_avx512 = __builtin_cpu_supports("avx512f");
  if (want == Blake3Backend::kPortable) return want;
  if (want == Blake3Backend::kAvx512 && has_avx512) return want;
  if (want == Blake3Backend::kAvx2 && has_avx2) return want;
  if (want == Blake3Backend::kSse2) return want;
  if (has_avx512) return Blake3Backend::kAvx512;
  if (has_avx2) return Blake3Backend::kAvx2;
  return Blake3Backend::kSse2;
#else
  (void)want;
  return Blake3Backend::kPortable;
#endif
}

}  // namespace

void compress(const uint32_t cv[8], const uint8_t block[64], uint8_t block_len, uint64_t counter,
              uint8_t flags, uint32_t out[16]) {
  uint32_t m[16];
  for (int i = 0; i < 16; ++i) m[i] = load32_le(block + 4 * i);
  uint32_t v[16] = {cv[0],
                    cv[1],
                    cv[2],
                    cv[3],
                    cv[4],
                    cv[5],
                    cv[6],
                    cv[7],
                    kIv[0],
                    kIv[1],
                    kIv[2],
                    kIv[3],
                    static_cast<uint32_t>(counter),
                    static_cast<uint32_t>(counter >> 32),
                    block_len,
                    flags};
#pragma GCC unroll 7
  for (int r = 0; r < kRounds; ++r) {
    const uint8_t* s = kSchedule.idx[r];
    g(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
    g(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
    g(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
    g(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
    g(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
    g(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
    g(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
    g(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; ++i) {
    out[i] = v[i] ^ v[i + 8];
    out[i + 8] = v[i + 8] ^ cv[i];
  }
}

void hash_chunks(const uint8_t* input, size_t n, const uint32_t key[8], uint64_t first_counter,
                 uint32_t* out_cvs) {
  Blake3Backend be = resolve(g_forced.load(std::memory_order_relaxed));
#if defined(UF_KV_BLAKE3_X86)
  struct Kernel {
    Blake3Backend backend;
    size_t lanes;
    void (*fn)(const uint8_t*, const uint32_t*, uint64_t, uint32_t*);
  };
  static constexpr Kernel kKernels[] = {{Blake3Backend::kAvx512, 16, hash_chunks_avx512x16},
                                        {Blake3Backend::kAvx2, 8, hash_chunks_avx2x8},
                                        {Blake3Backend::kSse2, 4, hash_chunks_sse2x4}};
  // Narrower kernels mop up what the chosen width leaves, then the portable path.
  bool reached = false;
  for (const Kernel& k : kKernels) {
    reached = reached || k.backend == be;
    if (!reached) continue;
    while (n >= k.lanes) {
      k.fn(input, key, first_counter, out_cvs);
      input += k.lanes * kChunkLen;
      first_counter += k.lanes;
      out_cvs += k.lanes * 8;
      n -= k.lanes;
    }
  }
#endif
  (void)be;
  for (; n > 0; --n) {
    uint32_t cv[8];
    std::memcpy(cv, key, sizeof(cv));
    uint32_t out[16];
    for (size_t b = 0; b < kChunkLen / kBlockLen; ++b) {
      uint8_t flags = (b == 0 ? kChunkStart : 0) | (b + 1 == kChunkLen / kBlockLen ? kChunkEnd : 0);
      compress(cv, input + b * kBlockLen, kBlockLen, first_counter, flags, out);
      std::memcpy(cv, out, sizeof(cv));
    }
    std::memcpy(out_cvs, cv, sizeof(cv));
    input += kChunkLen;
    out_cvs += 8;
    ++first_counter;
  }
}

}  // namespace blake3_detail

using namespace blake3_detail;

Blake3Backend set_blake3_backend(Blake3Backend backend) { return g_forced.exchange(backend); }

const char* blake3_backend_name() {
  switch (resolve(g_forced.load())) {
    case Blake3Backend::kAvx512:
      return "avx512";
    case Blake3Backend::kAvx2:
      return "avx2";
    case Blake3Backend::kSse2:
      return "sse2";
    default:
      return "portable";
  }
}

Blake3::Blake3() {
  std::memcpy(key_.data(), kIv, sizeof(kIv));
  reset();
}

void Blake3::reset() {
  stack_len_ = 0;
  reset_chunk(0);
}

void Blake3::reset_chunk(uint64_t counter) {
  chunk_.cv = key_;
  chunk_.counter = counter;
  chunk_.block.fill(0);
  chunk_.block_len = 0;
  chunk_.blocks_compressed = 0;
}

size_t Blake3::chunk_len() const {
  return size_t{chunk_.blocks_compressed} * kBlockLen + chunk_.block_len;
}

void Blake3::chunk_update(const uint8_t* data, size_t len) {
  while (len > 0) {
    if (chunk_.block_len == kBlockLen) {
      // A full block is compressed only once more input shows it is not the chunk's last.
      uint32_t out[16];
      uint8_t flags = chunk_.blocks_compressed == 0 ? kChunkStart : 0;
      compress(chunk_.cv.data(), chunk_.block.data(), kBlockLen, chunk_.counter, flags, out);
      std::memcpy(chunk_.cv.data(), out, 32);
      ++chunk_.blocks_compressed;
      chunk_.block.fill(0);
      chunk_.block_len = 0;
    }
    size_t take = std::min(kBlockLen - chunk_.block_len, len);
    std::memcpy(chunk_.block.data() + chunk_.block_len, data, take);
    chunk_.block_len = static_cast<uint8_t>(chunk_.block_len + take);
    data += take;
    len -= take;
  }
}

void Blake3::push_chunk_cv(const std::array<uint32_t, 8>& chunk_cv, uint64_t total_chunks) {
  // Every completed pair of equal-sized subtrees merges into its parent; the number of merges
  // is the number of trailing zero bits of the chunk count.
  std::array<uint32_t, 8> cv = chunk_cv;
  while ((total_chunks & 1) == 0) {
    uint8_t block[64];
    std::memcpy(block, stack_[--stack_len_].data(), 32);
    std::memcpy(block + 32, cv.data(), 32);
    uint32_t out[16];
    compress(key_.data(), block, kBlockLen, 0, kParent, out);
    std::memcpy(cv.data(), out, 32);
    total_chunks >>= 1;
  }
  stack_[stack_len_++] = cv;
}

void Blake3::finish_chunk_into_tree() {
  uint32_t out[16];
  uint8_t flags = (chunk_.blocks_compressed == 0 ? kChunkStart : 0) | kChunkEnd;
  compress(chunk_.cv.data(), chunk_.block.data(), chunk_.block_len, chunk_.counter, flags, out);
  std::array<uint32_t, 8> cv;
  std::memcpy(cv.data(), out, 32);
  uint64_t total = chunk_.counter + 1;
  push_chunk_cv(cv, total);
  reset_chunk(total);
}

void Blake3::update(const void* data_v, size_t len) {
  const uint8_t* data = static_cast<const uint8_t*>(data_v);
  constexpr size_t kBatch = 64;  // chunks per multi-chunk call (CVs live on the stack)
  while (len > 0) {
    if (chunk_len() == kChunkLen) finish_chunk_into_tree();
    if (chunk_len() == 0 && len > kChunkLen) {
      // Whole chunks that are certainly not the last one (at least one byte follows them).
      size_t n = std::min((len - 1) / kChunkLen, kBatch);
      uint32_t cvs[kBatch * 8];
      hash_chunks(data, n, key_.data(), chunk_.counter, cvs);
      uint64_t counter = chunk_.counter;
      for (size_t i = 0; i < n; ++i) {
        std::array<uint32_t, 8> cv;
        std::memcpy(cv.data(), cvs + 8 * i, 32);
        push_chunk_cv(cv, counter + i + 1);
      }
      reset_chunk(counter + n);
      data += n * kChunkLen;
      len -= n * kChunkLen;
      continue;
    }
    size_t take = std::min(kChunkLen - chunk_len(), len);
    chunk_update(data, take);
    data += take;
    len -= take;
  }
}

void Blake3::finalize(uint8_t* out, size_t out_len) const {
  // The node that becomes the root: the current chunk, folded with the stack from the top.
  std::array<uint32_t, 8> cv = chunk_.cv;
  std::array<uint8_t, 64> block = chunk_.block;
  uint8_t block_len = chunk_.block_len;
  uint64_t counter = chunk_.counter;
  uint8_t flags = (chunk_.blocks_compressed == 0 ? kChunkStart : 0) | kChunkEnd;
  for (int i = stack_len_; i > 0; --i) {
    uint32_t node[16];
    compress(cv.data(), block.data(), block_len, counter, flags, node);
    std::memcpy(block.data(), stack_[i - 1].data(), 32);
    std::memcpy(block.data() + 32, node, 32);
    cv = key_;
    block_len = kBlockLen;
    counter = 0;
    flags = kParent;
  }
  // Extendable output: the root compression repeated with an output block counter.
  for (uint64_t out_block = 0; out_len > 0; ++out_block) {
    uint32_t words[16];
    compress(cv.data(), block.data(), block_len, out_block, flags | kRoot, words);
    size_t take = std::min<size_t>(64, out_len);
    std::memcpy(out, words, take);  // little-endian words, as the format specifies
    out += take;
    out_len -= take;
  }
}

Blake3Digest Blake3::finalize() const {
  Blake3Digest d;
  finalize(d.data(), d.size());
  return d;
}

Blake3Digest blake3(const void* data, size_t len) {
  Blake3 h;
  h.update(data, len);
  return h.finalize();
}

namespace {

using Cv = std::array<uint32_t, 8>;

Cv parent_cv(const Cv& left, const Cv& right, uint8_t extra_flags = 0, uint32_t* out16 = nullptr) {
  uint8_t block[64];
  std::memcpy(block, left.data(), 32);
  std::memcpy(block + 32, right.data(), 32);
  uint32_t out[16];
  compress(kIv, block, kBlockLen, 0, static_cast<uint8_t>(kParent | extra_flags), out);
  if (out16) std::memcpy(out16, out, sizeof(out));
  Cv cv;
  std::memcpy(cv.data(), out, 32);
  return cv;
}

// CV of one (possibly partial, non-empty) chunk that is not the root.
Cv chunk_cv(const uint8_t* in, size_t len, uint64_t counter) {
  Cv cv;
  std::memcpy(cv.data(), kIv, 32);
  size_t blocks = (len + kBlockLen - 1) / kBlockLen;
  for (size_t b = 0; b < blocks; ++b) {
    uint8_t block[64] = {};
    size_t n = std::min(kBlockLen, len - b * kBlockLen);
    std::memcpy(block, in + b * kBlockLen, n);
    uint8_t flags = (b == 0 ? kChunkStart : 0) | (b + 1 == blocks ? kChunkEnd : 0);
    uint32_t out[16];
    compress(cv.data(), block, static_cast<uint8_t>(n), counter, flags, out);
    std::memcpy(cv.data(), out, 32);
  }
  return cv;
}

// Bytes in the left subtree of a node covering len > 1024 bytes: the largest power-of-two
// number of whole chunks that leaves at least one byte on the right.
size_t left_len(size_t len) {
  size_t full_chunks = (len - 1) / kChunkLen;
  size_t p = 1;
  while (p * 2 <= full_chunks) p *= 2;
  return p * kChunkLen;
}

// CV of the non-root subtree covering [in, in+len), whose first chunk has index `counter`.
Cv subtree_cv(const uint8_t* in, size_t len, uint64_t counter, unsigned threads, size_t min_par) {
  if (len <= kChunkLen) return chunk_cv(in, len, counter);
  if (threads <= 1 || len < min_par) {
    // Sequential: whole chunks in batches through the multi-chunk kernel, merged on a stack.
    constexpr size_t kBatch = 64;
    Cv stack[64];
    int depth = 0;
    uint64_t done = 0;                     // chunks finished in this subtree
    size_t whole = (len - 1) / kChunkLen;  // whole chunks before the last (maybe partial) one
    auto push = [&](Cv cv) {
      ++done;
      for (uint64_t t = done; (t & 1) == 0; t >>= 1) cv = parent_cv(stack[--depth], cv);
      stack[depth++] = cv;
    };
    uint32_t cvs[kBatch * 8];
    for (size_t i = 0; i < whole; i += kBatch) {
      size_t n = std::min(kBatch, whole - i);
      hash_chunks(in + i * kChunkLen, n, kIv, counter + i, cvs);
      for (size_t j = 0; j < n; ++j) {
        Cv cv;
        std::memcpy(cv.data(), cvs + 8 * j, 32);
        push(cv);
      }
    }
    Cv cv = chunk_cv(in + whole * kChunkLen, len - whole * kChunkLen, counter + whole);
    while (depth > 0) cv = parent_cv(stack[--depth], cv);
    return cv;
  }
  size_t l = left_len(len);
  auto left = std::async(std::launch::async,
                         [=] { return subtree_cv(in, l, counter, threads / 2, min_par); });
  Cv right = subtree_cv(in + l, len - l, counter + l / kChunkLen, threads - threads / 2, min_par);
  return parent_cv(left.get(), right);
}

}  // namespace

Blake3Digest blake3_parallel(const void* data, size_t len, unsigned threads,
                             size_t min_parallel_bytes) {
  if (threads <= 1 || len < min_parallel_bytes || len <= kChunkLen) return blake3(data, len);
  const uint8_t* in = static_cast<const uint8_t*>(data);
  size_t l = left_len(len);
  auto left = std::async(std::launch::async,
                         [=] { return subtree_cv(in, l, 0, threads / 2, min_parallel_bytes); });
  Cv right = subtree_cv(in + l, len - l, l / kChunkLen, threads - threads / 2, min_parallel_bytes);
  uint32_t out[16];
  parent_cv(left.get(), right, kRoot, out);
  Blake3Digest d;
  std::memcpy(d.data(), out, d.size());
  return d;
}

std::string to_hex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(bytes.size() * 2, '0');
  for (size_t i = 0; i < bytes.size(); ++i) {
    s[2 * i] = kDigits[bytes[i] >> 4];
    s[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return s;
}

bool parse_blake3_hex(std::string_view hex, Blake3Digest& out) {
  if (hex.size() != 2 * out.size()) return false;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < out.size(); ++i) {
    int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return true;
}

}  // namespace uf::kv
