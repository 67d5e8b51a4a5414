#pragma once
// Internal state of a loaded Tokenizer (shared by tokenizer.cpp and its loader).

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "tokenizer/normalizer.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tokenizer.h"

namespace uf::tokenizer {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringIdMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// A byte trie over added-token contents, for leftmost-longest matching.
struct AddedTrie {
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> next;  // sorted by byte
    int32_t token = -1;  // index into Impl::added_tokens of the token ending here
  };
  std::vector<Node> nodes{Node{}};
  void insert(std::string_view s, int32_t id);
  // Longest token starting at text[pos]: returns its byte length (0 if none) and sets `id` to
  // its index in Impl::added_tokens.
  size_t longest_at(std::string_view text, size_t pos, int32_t& id) const;
  bool empty() const { return nodes.size() == 1; }
  std::array<bool, 256> first_byte{};  // bytes that can start a token
};

// Open-addressing map from a (left id, right id) pair to its merge (rank, merged id): the BPE inner
// loop's only lookup, so it is a flat table rather than a node-based std::unordered_map.
class MergeTable {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    slots_.assign(cap, Slot{});
    shift_ = 64 - __builtin_ctzll(cap);
  }
  // Keeps the first insertion of a pair (the lowest rank).
  void insert(int32_t left, int32_t right, int32_t rank, int32_t merged) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    uint64_t key = make_key(left, right);
    for (size_t i = index(key);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i].key == kEmpty) {
        slots_[i] = {key, rank, merged};
        ++size_;
        return;
      }
      if (slots_[i].key == key) return;
    }
  }
  // Rank of the pair (INT32_MAX if none); sets `merged`.
  int32_t find(int32_t left, int32_t right, int32_t& merged) const {
    if (slots_.empty()) return INT32_MAX;
    uint64_t key = make_key(left, right);
    for (size_t i = index(key);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[i];
      if (s.key == key) {
        merged = s.merged;
        return s.rank;
      }
      if (s.key == kEmpty) return INT32_MAX;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  struct Slot {
    uint64_t key = kEmpty;
    int32_t rank = 0, merged = 0;
  };
  static uint64_t make_key(int32_t l, int32_t r) {
    return (uint64_t(uint32_t(l)) << 32) | uint32_t(r);
  }
  size_t index(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ULL) >> shift_); }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    reserve(std::max<size_t>(16, old.size()));
    size_ = 0;
    for (const Slot& s : old) {
      if (s.key != kEmpty) insert(int32_t(s.key >> 32), int32_t(uint32_t(s.key)), s.rank, s.merged);
    }
  }
  std::vector<Slot> slots_;
  int shift_ = 64;
  size_t size_ = 0;
};

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false, normalized = false, lstrip = false, rstrip = false, single_word = false;
};

struct Tokenizer::Impl {
  enum class Model { kBpe, kWordLevel };
  std::string source;
  Model model = Model::kBpe;
  uint64_t cache_tag = 0;  // distinguishes tokenizers in the thread-local merge cache

  std::vector<std::string> pieces;  // id -> piece as in the file ("" for holes)
  std::vector<std::string> bytes;   // id -> the bytes it decodes to
  std::vector<uint8_t> flags;       // id -> kAdded | kSpecial
  static constexpr uint8_t kAdded = 1, kSpecial = 2;
  StringIdMap vocab;  // model vocabulary
  StringIdMap added;  // added tokens

  std::vector<AddedToken> added_tokens;
  AddedTrie trie_raw, trie_normalized;  // non-normalized tokens first, then normalized ones

  std::vector<NormalizerOp> normalizers;  // applied to text between raw added tokens

  // Pre-tokenizer: Split patterns applied in sequence, then (BPE) the byte-level mapping.
  std::vector<SplitPattern> splits;
  bool byte_level = false;  // pre-tokenizer maps bytes to the GPT-2 byte alphabet
  bool byte_level_decoder = false;

  MergeTable merges;                      // BPE
  std::array<int32_t, 256> byte_token{};  // id of the single-byte token per byte
  // WordLevel
  int32_t unk_id = -1;

  int32_t vocab_size = 0;

  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  void encode_gap(std::string_view text, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;
};

// GPT-2's byte <-> printable-character alphabet.
uint32_t byte_to_char(uint8_t b);
int byte_from_char(uint32_t cp);  // -1 if cp is not in the alphabet

}  // namespace uf::tokenizer
