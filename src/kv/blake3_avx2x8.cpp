// BLAKE3 multi-chunk kernel, 8 lanes (compiled with the matching -m flags, see CMakeLists.txt).
#include <immintrin.h>

#include "kv/blake3_lanes.h"

namespace uf::kv::blake3_detail {

void hash_chunks_avx2x8(const uint8_t* input, const uint32_t key[8], uint64_t counter,
                        uint32_t* out_cvs) {
  typedef uint32_t V __attribute__((vector_size(32)));
  // One hardware gather per message word: lane l reads word w at l * 256 + w (in words).
  auto load = [](const uint8_t* block, V* m) {
    const __m256i idx = _mm256_setr_epi32(0, 256, 512, 768, 1024, 1280, 1536, 1792);
    for (int w = 0; w < 16; ++w)
      m[w] = (V)_mm256_i32gather_epi32(reinterpret_cast<const int*>(block) + w, idx, 4);
  };
  hash_chunk_lanes<V, 8>(input, key, counter, out_cvs, load);
}

}  // namespace uf::kv::blake3_detail
