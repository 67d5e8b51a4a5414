#include "tokenizer/engram_token_map.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>

#include <unordered_map>

#include "core/error.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/unicode.h"

namespace uf::tokenizer {
namespace {

constexpr UChar32 kSentinel = 0xE000;  // a private-use character, as the reference uses

const icu::Normalizer2& normalizer(bool nfkc) {
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* n =
      nfkc ? icu::Normalizer2::getNFKCInstance(err) : icu::Normalizer2::getNFDInstance(err);
  UF_CHECK(U_SUCCESS(err) && n, "ICU normalizer data is unavailable ({})", u_errorName(err));
  return *n;
}

icu::UnicodeString normalize(const icu::Normalizer2& n, const icu::UnicodeString& s) {
  UErrorCode err = U_ZERO_ERROR;
  icu::UnicodeString out = n.normalize(s, err);
  UF_CHECK(U_SUCCESS(err), "ICU normalization failed ({})", u_errorName(err));
  return out;
}

}  // namespace

std::string engram_normalize(std::string_view text) {
  icu::UnicodeString s =
      icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), int32_t(text.size())));
  s = normalize(normalizer(true), s);   // NFKC
  s = normalize(normalizer(false), s);  // NFD
  // Strip accents: drop every character of general category Mark.
  icu::UnicodeString stripped;
  for (int32_t i = 0; i < s.length();) {
    UChar32 c = s.char32At(i);
    i += U16_LENGTH(c);
    if (!(U_GET_GC_MASK(c) & U_GC_M_MASK)) stripped.append(c);
  }
  s = lowercase_chars(stripped);
  // [ \t\r\n]+ -> " "
  icu::UnicodeString collapsed;
  bool in_run = false;
  for (int32_t i = 0; i < s.length(); ++i) {
    UChar c = s.charAt(i);
    bool ws = c == ' ' || c == '\t' || c == '\r' || c == '\n';
    if (!ws) {
      collapsed.append(c);
    } else if (!in_run) {
      collapsed.append(UChar(' '));
    }
    in_run = ws;
  }
  s = collapsed;
  // A text that is exactly one space survives the strip through a sentinel.
  if (s.length() == 1 && s.charAt(0) == ' ') s = icu::UnicodeString(kSentinel);
  // Strip White_Space at both ends.
  int32_t begin = 0, end = s.length();
  while (begin < end) {
    UChar32 c = s.char32At(begin);
    if (!u_hasBinaryProperty(c, UCHAR_WHITE_SPACE)) break;
    begin += U16_LENGTH(c);
  }
  while (end > begin) {
    UChar32 c = s.char32At(end - 1);
    if (!u_hasBinaryProperty(c, UCHAR_WHITE_SPACE)) break;
    end -= U16_LENGTH(c);
  }
  icu::UnicodeString result(s, begin, end - begin);
  result.findAndReplace(icu::UnicodeString(kSentinel), icu::UnicodeString(UChar(' ')));
  std::string out;
  result.toUTF8String(out);
  return out;
}

EngramTokenMap build_engram_token_map(const Tokenizer& tokenizer,
                                      std::optional<int64_t> expected_classes) {
  EngramTokenMap result;
  const int32_t n = tokenizer.vocab_size();
  result.map.resize(size_t(n));
  std::unordered_map<std::string, int32_t> key_to_class;
  key_to_class.reserve(size_t(n));
  for (int32_t id = 0; id < n; ++id) {
    std::string text = tokenizer.decode(std::span<const int32_t>(&id, 1), false);
    std::string key;
    if (text.find("\xEF\xBF\xBD") != std::string::npos) {
      key = tokenizer.id_to_piece(id);  // a partial UTF-8 byte token: keyed by its raw piece
    } else {
      key = engram_normalize(text);
      if (key.empty()) key = text;
    }
    auto [it, inserted] = key_to_class.emplace(std::move(key), int32_t(key_to_class.size()));
    result.map[size_t(id)] = it->second;
  }
  result.num_classes = int32_t(key_to_class.size());
  if (expected_classes) {
    UF_CHECK(result.num_classes == *expected_classes,
             "the Engram token map built from {} has {} classes, but the model config says "
             "engram_compressed_vocab_size = {}; the tokenizer does not belong to this model",
             tokenizer.source(), result.num_classes, *expected_classes);
  }
  return result;
}

}  // namespace uf::tokenizer
