#pragma once
// The tokenizer.json normalizers this engine supports (applied to the text between added tokens
// before pre-tokenization): NFC, NFD, NFKC, NFKD, Lowercase, and Sequences of them. DeepSeek's
// files declare an empty Sequence. Any other normalizer is a load error naming it.

#include <unicode/unistr.h>

#include <string>
#include <string_view>
#include <vector>

namespace uf::tokenizer {

enum class NormalizerOp { kNfc, kNfd, kNfkc, kNfkd, kLowercase };

// Applies the ops in order. Lowercase maps each character on its own (full mapping, no context),
// as HF's Lowercase normalizer (Rust char::to_lowercase) does.
std::string apply_normalizers(const std::vector<NormalizerOp>& ops, std::string_view text);

// Lowercases one character at a time with the full (unconditional) mapping, as Rust's
// char::to_lowercase does: no context-dependent rules such as the final sigma. Shared by the
// Lowercase normalizer and the Engram token map.
icu::UnicodeString lowercase_chars(const icu::UnicodeString& s);

}  // namespace uf::tokenizer
