#include "tokenizer/normalizer.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>

#include "core/error.h"

namespace uf::tokenizer {
namespace {

const icu::Normalizer2& instance(NormalizerOp op) {
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  switch (op) {
    case NormalizerOp::kNfc:
      n = icu::Normalizer2::getNFCInstance(err);
      break;
    case NormalizerOp::kNfd:
      n = icu::Normalizer2::getNFDInstance(err);
      break;
    case NormalizerOp::kNfkc:
      n = icu::Normalizer2::getNFKCInstance(err);
      break;
    case NormalizerOp::kNfkd:
      n = icu::Normalizer2::getNFKDInstance(err);
      break;
    case NormalizerOp::kLowercase:
      break;
  }
  UF_CHECK(U_SUCCESS(err) && n, "ICU normalizer data is unavailable ({})", u_errorName(err));
  return *n;
}

}  // namespace

icu::UnicodeString lowercase_chars(const icu::UnicodeString& s) {
  icu::UnicodeString out;
  for (int32_t i = 0; i < s.length();) {
    UChar32 c = s.char32At(i);
    i += U16_LENGTH(c);
    UChar in[2], buf[8];
    int32_t in_len = 0;
    U16_APPEND_UNSAFE(in, in_len, c);
    UErrorCode err = U_ZERO_ERROR;
    int32_t n = u_strToLower(buf, 8, in, in_len, "", &err);
    if (U_SUCCESS(err)) {
      out.append(buf, n);
    } else {
      out.append(u_tolower(c));
    }
  }
  return out;
}

std::string apply_normalizers(const std::vector<NormalizerOp>& ops, std::string_view text) {
  if (ops.empty()) return std::string(text);
  icu::UnicodeString s =
      icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), int32_t(text.size())));
  for (NormalizerOp op : ops) {
    if (op == NormalizerOp::kLowercase) {
      s = lowercase_chars(s);
    } else {
      UErrorCode err = U_ZERO_ERROR;
      icu::UnicodeString out = instance(op).normalize(s, err);
      UF_CHECK(U_SUCCESS(err), "ICU normalization failed ({})", u_errorName(err));
      s = out;
    }
  }
  std::string out;
  s.toUTF8String(out);
  return out;
}

}  // namespace uf::tokenizer
