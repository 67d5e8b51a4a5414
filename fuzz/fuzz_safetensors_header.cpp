// libFuzzer target: parse_safetensors_header must never crash, hang or leak on any input; it
// either returns entries that tile the data section or throws uf::core::Error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "core/error.h"
#include "model/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The first 2 bytes pick the data-section size, so offset checks see both fits and misfits.
  if (size < 2) return 0;
  const uint64_t data_size = uint64_t(data[0]) | (uint64_t(data[1]) << 8);
  const std::string_view header(reinterpret_cast<const char*>(data + 2), size - 2);
  try {
    const auto entries = uf::model::parse_safetensors_header(header, data_size, "fuzz");
    uint64_t total = 0;
    for (const auto& e : entries) {
      // What the parser promises on success.
      if (e.end < e.begin || e.end > data_size || e.view.nbytes != e.end - e.begin) std::abort();
      total += e.end - e.begin;
    }
    if (total != data_size) std::abort();
  } catch (const uf::core::Error&) {
  }
  return 0;
}
