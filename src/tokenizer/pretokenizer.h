#pragma once
// The Split pre-tokenizers a tokenizer.json may declare, with the exact semantics of the
// Oniguruma regexes Hugging Face tokenizers runs (leftmost match, ordered alternation, greedy
// quantifiers with backtracking), hand-written over ICU character properties instead of a regex
// engine. Only patterns listed in recognize_split_pattern() are supported; any other pattern is a
// load error naming it, never a silent approximation.
// \s is Oniguruma's (Unicode White_Space: includes U+0085, excludes U+FEFF). JavaScript's \s is
// the other way round, so transformers.js ports differ from HF on those two characters.

#include <optional>
#include <string_view>

#include "tokenizer/unicode.h"

namespace uf::tokenizer {

enum class SplitPattern {
  kDigits1To3,     // \p{N}{1,3}
  kCjkRun,         // [一-龥぀-ゟ゠-ヿ]+
  kDeepSeekWords,  // the DeepSeek-V3 word/punctuation/whitespace alternation (see .cpp)
};

std::optional<SplitPattern> recognize_split_pattern(std::string_view regex);

// End of the match starting exactly at `pos` of `text`, or 0 when the pattern does not match
// there (no supported pattern matches the empty string, so a match always ends after `pos`).
size_t match_at(SplitPattern pattern, std::string_view text, size_t pos);

// Split with behaviour "Isolated": every match and every maximal run of unmatched text between
// matches becomes one piece, in order. `fn(std::string_view piece)` is called for each.
template <typename Fn>
void split_isolated(SplitPattern pattern, std::string_view text, Fn&& fn) {
  size_t gap = 0, pos = 0;
  while (pos < text.size()) {
    size_t end = match_at(pattern, text, pos);
    if (end == 0) {
      pos += utf8_len(static_cast<unsigned char>(text[pos]));
      continue;
    }
    if (gap < pos) fn(text.substr(gap, pos - gap));
    fn(text.substr(pos, end - pos));
    pos = gap = end;
  }
  if (gap < text.size()) fn(text.substr(gap));
}

}  // namespace uf::tokenizer
