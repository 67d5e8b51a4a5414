// BLAKE3 multi-chunk kernel, 4 lanes (compiled with the matching -m flags, see CMakeLists.txt).
#include "kv/blake3_lanes.h"

namespace uf::kv::blake3_detail {

void hash_chunks_sse2x4(const uint8_t* input, const uint32_t key[8], uint64_t counter,
                        uint32_t* out_cvs) {
  typedef uint32_t V __attribute__((vector_size(16)));
  hash_chunk_lanes<V, 4>(input, key, counter, out_cvs);
}

}  // namespace uf::kv::blake3_detail
