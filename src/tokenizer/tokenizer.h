#pragma once
// A Hugging Face `tokenizer.json` tokenizer: byte-level BPE (DeepSeek-V3/V4.1) and WordLevel (the
// tiny test fixtures). Added/special tokens are matched before the model runs, as HF does.
//
// UTF-8 rule: encode() REJECTS invalid UTF-8 input with a uf::core::Error naming the byte offset
// (requests are validated, never silently altered). decode() replaces byte sequences that do not
// form valid UTF-8 with U+FFFD (one per maximal invalid subpart, like HF's from_utf8_lossy);
// decode_bytes() returns the raw bytes for callers (the streaming detokenizer) that assemble
// characters across tokens themselves.
//
// Thread safety: a loaded Tokenizer is immutable; all const methods may be called concurrently.
// Copies are cheap (shared state).

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace uf::tokenizer {

class Tokenizer {
 public:
  // Loads `tokenizer.json`; errors name the file and the offending field.
  static Tokenizer from_file(const std::filesystem::path& path);
  // Same, from the JSON text; `source` names it in errors.
  static Tokenizer from_json(std::string_view json_text, const std::string& source = "<memory>");

  // Encodes UTF-8 text. Added tokens (special or not) that appear in the text become their ids.
  // Throws uf::core::Error on invalid UTF-8 or text longer than max_input_bytes().
  std::vector<int32_t> encode(std::string_view text) const;
  // Appends to `out` instead (the chat encoder builds prompts piece by piece).
  void encode_append(std::string_view text, std::vector<int32_t>& out) const;

  // Decodes ids to text (lossy, see the UTF-8 rule above). Ids out of range throw.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // The raw bytes the ids stand for (may be invalid or partial UTF-8).
  std::string decode_bytes(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // Appends one token's raw bytes to `out`.
  void append_token_bytes(int32_t id, std::string& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;  // vocab or added token
  // Like token_to_id, but throws an Error naming the token and the tokenizer file.
  int32_t require_token_id(std::string_view token) const;
  // The piece as stored in the file (byte-level pieces in their mapped form, e.g. "Ġthe").
  std::string id_to_piece(int32_t id) const;
  bool is_special(int32_t id) const;  // an added token flagged "special"
  bool is_added(int32_t id) const;    // any added token
  // True when decode() joins tokens with spaces (a file without a decoder, e.g. the WordLevel
  // fixtures), false for byte-level decoding, where token bytes concatenate.
  bool joins_with_spaces() const;
  // One past the largest id (vocab and added tokens).
  int32_t vocab_size() const;
  const std::string& source() const;

  // Inputs larger than this are rejected by encode() (bounded memory for requests).
  static constexpr size_t max_input_bytes() { return size_t(64) << 20; }

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Validates UTF-8; returns the byte offset of the first invalid sequence, or nullopt.
std::optional<size_t> find_invalid_utf8(std::string_view text);
// Replaces invalid sequences with U+FFFD (maximal-subpart rule, as Rust's from_utf8_lossy).
std::string utf8_lossy(std::string_view bytes);

}  // namespace uf::tokenizer
