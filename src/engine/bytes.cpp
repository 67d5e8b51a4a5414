#include "engine/bytes.h"

#include "core/error.h"

namespace uf::engine {

void ByteReader::need(size_t n, const char* what) {
  UF_CHECK(n <= in_.size() - pos_,
           "session snapshot is truncated: reading {} needs {} bytes at offset {} of {}", what, n,
           pos_, in_.size());
}

}  // namespace uf::engine
