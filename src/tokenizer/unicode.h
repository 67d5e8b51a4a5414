#pragma once
// UTF-8 decoding and the Unicode character properties the pre-tokenizer regexes use, from ICU,
// cached in a flat per-code-point table so the hot loop does one byte load per character.

#include <cstdint>
#include <string_view>

namespace uf::tokenizer {

// Property bits (a character may carry several).
enum CharProp : uint8_t {
  kPropL = 1 << 0,      // \p{L}  letters
  kPropM = 1 << 1,      // \p{M}  marks
  kPropN = 1 << 2,      // \p{N}  numbers
  kPropP = 1 << 3,      // \p{P}  punctuation
  kPropS = 1 << 4,      // \p{S}  symbols
  kPropSpace = 1 << 5,  // \s as Oniguruma (HF tokenizers) defines it: Unicode White_Space
  kPropCjk = 1 << 6,    // [一-龥぀-ゟ゠-ヿ] of the DeepSeek pre-tokenizer
};

// Properties of code point `cp` (0 for cp > 0x10FFFF).
uint8_t char_props(uint32_t cp);

// Decodes the character at `s[i]` of VALID UTF-8; returns the code point and sets `len`.
inline uint32_t decode_utf8(std::string_view s, size_t i, int& len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  unsigned char c = p[0];
  if (c < 0x80) {
    len = 1;
    return c;
  }
  if (c < 0xE0) {
    len = 2;
    return (uint32_t(c & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (c < 0xF0) {
    len = 3;
    return (uint32_t(c & 0x0F) << 12) | (uint32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  len = 4;
  return (uint32_t(c & 0x07) << 18) | (uint32_t(p[1] & 0x3F) << 12) | (uint32_t(p[2] & 0x3F) << 6) |
         (p[3] & 0x3F);
}

// Length of the character whose lead byte is `c` (valid UTF-8 assumed).
inline int utf8_len(unsigned char c) { return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; }

// Appends the UTF-8 encoding of `cp` to `out`.
template <typename String>
void append_utf8(String& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

// Length of the trailing bytes of `bytes` that form a proper prefix of a valid UTF-8 character
// (so more bytes could still complete it); 0 if there is none. The streaming detokenizer holds
// these bytes back.
size_t incomplete_utf8_suffix(std::string_view bytes);

}  // namespace uf::tokenizer
