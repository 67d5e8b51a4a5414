#include "tokenizer/pretokenizer.h"

namespace uf::tokenizer {
namespace {

// The DeepSeek-V3 pattern, alternatives tried in order at each position:
//   A1 [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+
//   A2 [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
//   A3  ?[\p{P}\p{S}]+[\r\n]*
//   A4 \s*[\r\n]+
//   A5 \s+(?!\S)
//   A6 \s+
constexpr std::string_view kDeepSeekWordsRegex =
    "[!\"#$%&'()*+,\\-./"
    ":;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";
constexpr std::string_view kDigitsRegex = "\\p{N}{1,3}";
constexpr std::string_view kCjkRegex = "[一-龥぀-ゟ゠-ヿ]+";

struct Cursor {
  std::string_view s;
  // Properties and length of the character at i (i < s.size()).
  uint8_t props(size_t i, int& len) const {
    auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      len = 1;
      return char_props(c);
    }
    return char_props(decode_utf8(s, i, len));
  }
  // Advances over characters whose properties intersect `mask`.
  size_t run(size_t i, uint8_t mask) const {
    int len;
    while (i < s.size() && (props(i, len) & mask)) i += len;
    return i;
  }
};

bool is_ascii_punct(unsigned char c) {
  return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
         (c >= 0x7B && c <= 0x7E);
}
bool is_ascii_letter(unsigned char c) { return (c | 0x20) >= 'a' && (c | 0x20) <= 'z'; }
bool is_crlf(unsigned char c) { return c == '\r' || c == '\n'; }

size_t match_words(std::string_view s, size_t pos) {
  Cursor cur{s};
  auto c = static_cast<unsigned char>(s[pos]);
  int len;
  uint8_t p = cur.props(pos, len);
  size_t next = pos + len;

  // A1
  if (is_ascii_punct(c) && next < s.size() &&
      is_ascii_letter(static_cast<unsigned char>(s[next]))) {
    size_t e = next;
    while (e < s.size() && is_ascii_letter(static_cast<unsigned char>(s[e]))) ++e;
    return e;
  }
  // A2: first with the optional leading character, then without it.
  if (!is_crlf(c) && !(p & (kPropL | kPropP | kPropS)) && next < s.size()) {
    int len2;
    if (cur.props(next, len2) & (kPropL | kPropM)) return cur.run(next, kPropL | kPropM);
  }
  if (p & (kPropL | kPropM)) return cur.run(pos, kPropL | kPropM);
  // A3: the optional space, then at least one P/S, then CR/LF.
  {
    size_t q = pos;
    if (c == ' ' && next < s.size()) {
      int len2;
      if (cur.props(next, len2) & (kPropP | kPropS)) q = next;
    }
    int lq;
    if (cur.props(q, lq) & (kPropP | kPropS)) {
      size_t e = cur.run(q, kPropP | kPropS);
      while (e < s.size() && is_crlf(static_cast<unsigned char>(s[e]))) ++e;
      return e;
    }
  }
  if (!(p & kPropSpace)) return 0;
  size_t ws_end = cur.run(pos, kPropSpace);
  // A4: greedy \s* backs off to the last CR/LF of the run; [\r\n]+ then takes exactly it.
  for (size_t k = ws_end; k > pos; --k) {
    if (is_crlf(static_cast<unsigned char>(s[k - 1]))) return k;
  }
  // A5: the whole run if it ends the text, else the run minus its last character (needs >= 2).
  if (ws_end == s.size()) return ws_end;
  size_t last = ws_end - 1;
  while ((static_cast<unsigned char>(s[last]) & 0xC0) == 0x80) --last;
  if (last > pos) return last;
  // A6
  return ws_end;
}

}  // namespace

std::optional<SplitPattern> recognize_split_pattern(std::string_view regex) {
  if (regex == kDigitsRegex) return SplitPattern::kDigits1To3;
  if (regex == kCjkRegex) return SplitPattern::kCjkRun;
  if (regex == kDeepSeekWordsRegex) return SplitPattern::kDeepSeekWords;
  return std::nullopt;
}

size_t match_at(SplitPattern pattern, std::string_view text, size_t pos) {
  switch (pattern) {
    case SplitPattern::kDigits1To3: {
      Cursor cur{text};
      size_t e = pos;
      int len;
      for (int n = 0; n < 3 && e < text.size() && (cur.props(e, len) & kPropN); ++n) e += len;
      return e == pos ? 0 : e;
    }
    case SplitPattern::kCjkRun: {
      size_t e = Cursor{text}.run(pos, kPropCjk);
      return e == pos ? 0 : e;
    }
    case SplitPattern::kDeepSeekWords:
      return match_words(text, pos);
  }
  return 0;
}

}  // namespace uf::tokenizer
