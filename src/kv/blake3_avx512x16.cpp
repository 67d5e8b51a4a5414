// BLAKE3 multi-chunk kernel, 16 lanes (compiled with the matching -m flags, see CMakeLists.txt).
#include <immintrin.h>

#include "kv/blake3_lanes.h"

namespace uf::kv::blake3_detail {

void hash_chunks_avx512x16(const uint8_t* input, const uint32_t key[8], uint64_t counter,
                           uint32_t* out_cvs) {
  typedef uint32_t V __attribute__((vector_size(64)));
  // One hardware gather per message word: lane l reads word w at l * 256 + w (in words). The
  // masked form avoids GCC 12's -Wuninitialized false positive in the unmasked intrinsic.
  auto load = [](const uint8_t* block, V* m) {
    const __m512i idx = _mm512_setr_epi32(0, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2304,
                                          2560, 2816, 3072, 3328, 3584, 3840);
    for (int w = 0; w < 16; ++w)
      m[w] = (V)_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), 0xFFFF, idx,
                                            reinterpret_cast<const int*>(block) + w, 4);
  };
  hash_chunk_lanes<V, 16>(input, key, counter, out_cvs, load);
}

}  // namespace uf::kv::blake3_detail
