#pragma once
// Internals shared by the BLAKE3 hasher and its multi-chunk kernels (not a public header).

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace uf::kv::blake3_detail {

// The initialisation vector (the same constants as SHA-256's).
inline constexpr uint32_t kIv[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                                    0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};

// Domain flags of the compression function.
inline constexpr uint8_t kChunkStart = 1;
inline constexpr uint8_t kChunkEnd = 2;
inline constexpr uint8_t kParent = 4;
inline constexpr uint8_t kRoot = 8;

inline constexpr size_t kBlockLen = 64;
inline constexpr size_t kChunkLen = 1024;
inline constexpr int kRounds = 7;

// Message word order for each of the 7 rounds: round r uses the permutation applied r times
// (so no data is shuffled at run time).
struct Schedule {
  uint8_t idx[kRounds][16];
};
inline constexpr Schedule make_schedule() {
  constexpr uint8_t kPerm[16] = {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8};
  Schedule s{};
  for (int i = 0; i < 16; ++i) s.idx[0][i] = static_cast<uint8_t>(i);
  for (int r = 1; r < kRounds; ++r)
    for (int i = 0; i < 16; ++i) s.idx[r][i] = s.idx[r - 1][kPerm[i]];
  return s;
}
inline constexpr Schedule kSchedule = make_schedule();

inline uint32_t load32_le(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);  // x86 and ARM Linux are little-endian, as the format is
  return v;
}

// The compression function; out receives all 16 output words (the first 8 are the new CV).
void compress(const uint32_t cv[8], const uint8_t block[64], uint8_t block_len, uint64_t counter,
              uint8_t flags, uint32_t out[16]);

// Hashes n whole chunks laid out back to back; chunk i gets counter first_counter + i. Writes
// 8 chaining-value words per chunk to out_cvs. None of the chunks may be the root.
void hash_chunks(const uint8_t* input, size_t n, const uint32_t key[8], uint64_t first_counter,
                 uint32_t* out_cvs);

// Lane kernels (defined in per-ISA files); each hashes exactly its lane count of chunks.
void hash_chunks_sse2x4(const uint8_t* input, const uint32_t key[8], uint64_t counter,
                        uint32_t* out_cvs);
void hash_chunks_avx2x8(const uint8_t* input, const uint32_t key[8], uint64_t counter,
                        uint32_t* out_cvs);
void hash_chunks_avx512x16(const uint8_t* input, const uint32_t key[8], uint64_t counter,
                           uint32_t* out_cvs);

}  // namespace uf::kv::blake3_detail
