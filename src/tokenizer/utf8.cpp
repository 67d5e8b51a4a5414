// UTF-8 validation and lossy conversion (the rule stated in tokenizer.h).
#include <optional>
#include <string>
#include <string_view>

#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace uf::tokenizer {
namespace {

// Length of the valid character at s[i], or 0 if the bytes there are not valid UTF-8; `bad` is
// then the length of the maximal invalid subpart (what one U+FFFD replaces, per Unicode §3.9).
int valid_char_len(std::string_view s, size_t i, int& bad) {
  auto at = [&](size_t k) -> int { return k < s.size() ? static_cast<unsigned char>(s[k]) : -1; };
  int c = at(i);
  bad = 1;
  if (c < 0x80) return 1;
  int need;
  int lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  int b = at(i + 1);
  if (b < lo || b > hi) return 0;
  for (int k = 2; k < need; ++k) {
    bad = k;
    b = at(i + k);
    if (b < 0x80 || b > 0xBF) return 0;
  }
  return need;
}

}  // namespace

std::optional<size_t> find_invalid_utf8(std::string_view text) {
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, text.data() + i, 8);
      if (w & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= n) break;
    if (static_cast<unsigned char>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    int bad;
    int len = valid_char_len(text, i, bad);
    if (len == 0) return i;
    i += len;
  }
  return std::nullopt;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    int bad;
    int len = valid_char_len(bytes, i, bad);
    if (len > 0) {
      out.append(bytes.substr(i, len));
      i += len;
    } else {
      out.append("\xEF\xBF\xBD");
      i += bad;
    }
  }
  return out;
}

}  // namespace uf::tokenizer
