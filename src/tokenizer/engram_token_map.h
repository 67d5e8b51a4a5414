#pragma once
// The Engram compressed-token map (model-arch.md §4.6, reference inference/engram.py
// build_compressed_token_map): every token id -> a class id; tokens whose decoded text normalizes
// alike share a class. Class ids are assigned in order of first appearance by token id.
// Normalization: NFKC -> NFD -> strip marks -> lowercase -> [ \t\r\n]+ to " " -> a text that is
// exactly " " is kept (sentinel) -> strip White_Space at both ends. An empty result keys by the
// decoded text; a decoded text containing U+FFFD keys by the raw vocabulary piece.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace uf::tokenizer {

struct EngramTokenMap {
  std::vector<int32_t> map;  // size tokenizer.vocab_size()
  int32_t num_classes = 0;
};

// Builds the map. When `expected_classes` is given, a different class count throws an Error that
// names both counts (every hash multiplier depends on it, so a mismatch would silently rehash).
EngramTokenMap build_engram_token_map(const Tokenizer& tokenizer,
                                      std::optional<int64_t> expected_classes = std::nullopt);

// The normalizer alone (exposed for tests).
std::string engram_normalize(std::string_view text);

}  // namespace uf::tokenizer
