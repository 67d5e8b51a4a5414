#include "tokenizer/unicode.h"

#include <unicode/uchar.h>

#include <memory>

namespace uf::tokenizer {
namespace {

constexpr uint32_t kMaxCp = 0x110000;

uint8_t compute_props(uint32_t cp) {
  uint32_t mask = U_GET_GC_MASK(UChar32(cp));
  uint8_t p = 0;
  if (mask & U_GC_L_MASK) p |= kPropL;
  if (mask & U_GC_M_MASK) p |= kPropM;
  if (mask & U_GC_N_MASK) p |= kPropN;
  if (mask & U_GC_P_MASK) p |= kPropP;
  if (mask & U_GC_S_MASK) p |= kPropS;
  if (u_hasBinaryProperty(UChar32(cp), UCHAR_WHITE_SPACE)) p |= kPropSpace;
  if ((cp >= 0x4E00 && cp <= 0x9FA5) || (cp >= 0x3040 && cp <= 0x309F) ||
      (cp >= 0x30A0 && cp <= 0x30FF)) {
    p |= kPropCjk;
  }
  return p;
}

const uint8_t* props_table() {
  static const std::unique_ptr<uint8_t[]> table = [] {
    auto t = std::make_unique<uint8_t[]>(kMaxCp);
    for (uint32_t cp = 0; cp < kMaxCp; ++cp) t[cp] = compute_props(cp);
    return t;
  }();
  return table.get();
}

}  // namespace

uint8_t char_props(uint32_t cp) {
  static const uint8_t* table = props_table();
  return cp < kMaxCp ? table[cp] : 0;
}

size_t incomplete_utf8_suffix(std::string_view bytes) {
  size_t n = bytes.size();
  for (size_t k = 1; k <= 3 && k <= n; ++k) {
    auto lead = static_cast<unsigned char>(bytes[n - k]);
    if ((lead & 0xC0) == 0x80) continue;  // a continuation byte: the lead is further back
    int need = lead >= 0xC2 && lead <= 0xDF   ? 2
               : lead >= 0xE0 && lead <= 0xEF ? 3
               : lead >= 0xF0 && lead <= 0xF4 ? 4
                                              : 0;
    if (need <= int(k)) return 0;  // complete, or not a lead byte at all
    if (k >= 2) {
      // The second byte has a narrower range after E0, ED, F0 and F4 (no overlongs/surrogates).
      auto b = static_cast<unsigned char>(bytes[n - k + 1]);
      unsigned char lo = 0x80, hi = 0xBF;
      if (lead == 0xE0) lo = 0xA0;
      if (lead == 0xED) hi = 0x9F;
      if (lead == 0xF0) lo = 0x90;
      if (lead == 0xF4) hi = 0x8F;
      if (b < lo || b > hi) return 0;
    }
    return k;
  }
  return 0;
}

}  // namespace uf::tokenizer
