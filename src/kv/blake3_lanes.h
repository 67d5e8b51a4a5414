#pragma once
// The multi-chunk BLAKE3 kernel, written once with GCC/Clang vector extensions: lane l of every
// vector holds the state of chunk l. Each ISA file includes this with its own compiler flags and
// vector width; everything here has internal linkage so no instruction set leaks across files.

#include "kv/blake3_internal.h"

namespace {

using uf::kv::blake3_detail::kChunkEnd;
using uf::kv::blake3_detail::kChunkStart;
using uf::kv::blake3_detail::kIv;
using uf::kv::blake3_detail::kRounds;
using uf::kv::blake3_detail::kSchedule;
using uf::kv::blake3_detail::load32_le;

template <int n, typename V>
inline V rotr(V x) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // AVX2 has no vector rotate: byte-aligned rotations are one byte shuffle instead of three ops.
  if constexpr ((n == 16 || n == 8) && sizeof(V) == 32) {
    typedef uint8_t B __attribute__((vector_size(32)));
    B mask;
    for (int i = 0; i < 32; ++i) mask[i] = static_cast<uint8_t>((i & ~3) + (((i & 3) + n / 8) & 3));
    return (V)__builtin_shuffle((B)x, mask);
  }
#endif
  return (x >> n) | (x << (32 - n));
}

template <typename V>
inline void g(V* v, int a, int b, int c, int d, V mx, V my) {
  v[a] = v[a] + v[b] + mx;
  v[d] = rotr<16>(v[d] ^ v[a]);
  v[c] = v[c] + v[d];
  v[b] = rotr<12>(v[b] ^ v[c]);
  v[a] = v[a] + v[b] + my;
  v[d] = rotr<8>(v[d] ^ v[a]);
  v[c] = v[c] + v[d];
  v[b] = rotr<7>(v[b] ^ v[c]);
}

// Hashes N consecutive whole chunks (counters counter .. counter+N-1), none of them the root.
// The portable message load: word w of lane l, one element at a time.
template <typename V, int N>
struct ScalarLoader {
  void operator()(const uint8_t* block, V* m) const {
    for (int w = 0; w < 16; ++w)
      for (int l = 0; l < N; ++l) m[w][l] = load32_le(block + l * 1024 + w * 4);
  }
};

// Load(block, m) fills m[0..15] with the 16 message words of this block in every lane (lane l's
// block starts at block + l * 1024).
template <typename V, int N, typename Load = ScalarLoader<V, N>>
inline void hash_chunk_lanes(const uint8_t* input, const uint32_t key[8], uint64_t counter,
                             uint32_t* out_cvs, Load load = {}) {
  V h[8];
  for (int i = 0; i < 8; ++i) h[i] = V{} + key[i];
  V ctr_lo{}, ctr_hi{};
  for (int l = 0; l < N; ++l) {
    uint64_t c = counter + static_cast<uint64_t>(l);
    ctr_lo[l] = static_cast<uint32_t>(c);
    ctr_hi[l] = static_cast<uint32_t>(c >> 32);
  }
  for (int b = 0; b < 16; ++b) {
    V m[16];
    load(input + b * 64, m);
    uint32_t flags = (b == 0 ? kChunkStart : 0u) | (b == 15 ? kChunkEnd : 0u);
    V v[16] = {h[0],   h[1],   h[2],         h[3],         h[4],         h[5],
               h[6],   h[7],   V{} + kIv[0], V{} + kIv[1], V{} + kIv[2], V{} + kIv[3],
               ctr_lo, ctr_hi, V{} + 64u,    V{} + flags};
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
    for (int i = 0; i < 8; ++i) h[i] = v[i] ^ v[i + 8];
  }
  for (int l = 0; l < N; ++l)
    for (int i = 0; i < 8; ++i) out_cvs[l * 8 + i] = h[i][l];
}

}  // namespace
