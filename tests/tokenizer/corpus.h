#pragma once
// Builds the comparison corpus from local files (documentation, man pages, gettext catalogs in
// many languages, locale data, C headers) plus generated text (emoji sequences, whitespace runs,
// numbers in several scripts, mixed-script noise, embedded special tokens). Deterministic.

#include <string>
#include <vector>

namespace uf::tokenizer::testing {

// Documents of valid UTF-8, totalling at least `min_bytes` when the local sources allow it.
std::vector<std::string> build_corpus(size_t min_bytes);

}  // namespace uf::tokenizer::testing
