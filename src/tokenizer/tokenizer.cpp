#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>

#include "core/error.h"
#include "tokenizer/json_scan.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace uf::tokenizer {
namespace {

using json = nlohmann::json;

std::atomic<uint64_t> g_next_cache_tag{1};

// GPT-2 alphabet: printable Latin-1 bytes map to themselves, the other 68 bytes to U+0100.. in
// byte order.
struct ByteAlphabet {
  std::array<uint32_t, 256> to_char{};
  std::array<int16_t, 512> from_char;  // every alphabet character is below U+0200
  ByteAlphabet() {
    uint32_t extra = 256;
    from_char.fill(-1);
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      to_char[b] = printable ? uint32_t(b) : extra++;
      from_char[to_char[b]] = int16_t(b);
    }
  }
};
const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

// The bytes a byte-level piece stands for; a piece with a character outside the alphabet (an
// added token such as "<｜User｜>") stands for its own UTF-8 bytes, as HF's ByteLevel decoder does.
std::string piece_to_bytes(std::string_view piece) {
  std::string out;
  size_t i = 0;
  while (i < piece.size()) {
    int len;
    uint32_t cp = decode_utf8(piece, i, len);
    int b = byte_from_char(cp);
    if (b < 0) return std::string(piece);
    out.push_back(char(b));
    i += len;
  }
  return out;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  UF_CHECK(in.good(), "cannot open tokenizer file {}", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void load_pre_tokenizer(Tokenizer::Impl& t, const json& pt) {
  if (pt.is_null()) return;
  std::string type = pt.value("type", "");
  if (type == "Sequence") {
    for (const auto& p : pt.at("pretokenizers")) load_pre_tokenizer(t, p);
  } else if (type == "Split") {
    const auto& pattern = pt.at("pattern");
    UF_CHECK(pattern.contains("Regex"),
             "{}: Split pre-tokenizer with a String pattern is not supported", t.source);
    std::string regex = pattern.at("Regex").get<std::string>();
    auto kind = recognize_split_pattern(regex);
    UF_CHECK(kind.has_value(), "{}: unsupported pre-tokenizer regex '{}'", t.source, regex);
    UF_CHECK(pt.value("behavior", "") == "Isolated" && !pt.value("invert", false),
             "{}: Split pre-tokenizer behavior '{}' (invert {}) is not supported (only Isolated)",
             t.source, pt.value("behavior", ""), pt.value("invert", false));
    t.splits.push_back(*kind);
  } else if (type == "ByteLevel") {
    UF_CHECK(!pt.value("use_regex", true) && !pt.value("add_prefix_space", false),
             "{}: ByteLevel pre-tokenizer with use_regex or add_prefix_space is not supported",
             t.source);
    t.byte_level = true;
  } else {
    core::fail("{}: unsupported pre-tokenizer type '{}'", t.source, type);
  }
}

void load_normalizer(Tokenizer::Impl& t, const json& n) {
  if (n.is_null()) return;
  std::string type = n.value("type", "");
  if (type == "Sequence") {
    for (const auto& sub : n.at("normalizers")) load_normalizer(t, sub);
  } else if (type == "NFC") {
    t.normalizers.push_back(NormalizerOp::kNfc);
  } else if (type == "NFD") {
    t.normalizers.push_back(NormalizerOp::kNfd);
  } else if (type == "NFKC") {
    t.normalizers.push_back(NormalizerOp::kNfkc);
  } else if (type == "NFKD") {
    t.normalizers.push_back(NormalizerOp::kNfkd);
  } else if (type == "Lowercase") {
    t.normalizers.push_back(NormalizerOp::kLowercase);
  } else {
    core::fail("{}: unsupported normalizer type '{}'", t.source, type);
  }
}

void set_token(Tokenizer::Impl& t, int32_t id, const std::string& piece) {
  UF_CHECK(id >= 0 && id < (1 << 24), "{}: token id {} of '{}' is out of range", t.source, id,
           piece);
  if (size_t(id) >= t.pieces.size()) t.pieces.resize(size_t(id) + 1);
  t.pieces[size_t(id)] = piece;
}

std::shared_ptr<Tokenizer::Impl> load(std::string_view text, const std::string& source) {
  auto t = std::make_shared<Tokenizer::Impl>();
  t->source = source;
  t->cache_tag = g_next_cache_tag++;
  // The vocabulary and merges are read straight from the text; the rest goes through nlohmann.
  json_scan::Span vocab_span, merges_span;
  std::string rest;
  json_scan::split_model_tables(text, source, vocab_span, merges_span, rest);
  json j;
  try {
    j = json::parse(rest);
  } catch (const json::exception& e) {
    core::fail("{}: not valid JSON ({})", source, e.what());
  }
  try {
    load_normalizer(*t, j.value("normalizer", json()));
    load_pre_tokenizer(*t, j.value("pre_tokenizer", json()));
    const json& dec = j.value("decoder", json());
    if (!dec.is_null()) {
      UF_CHECK(dec.value("type", "") == "ByteLevel", "{}: unsupported decoder type '{}'", source,
               dec.value("type", ""));
      t->byte_level_decoder = true;
    }

    const json& model = j.at("model");
    std::string type = model.value("type", "");
    if (type == "BPE") {
      t->model = Tokenizer::Impl::Model::kBpe;
      UF_CHECK(t->byte_level,
               "{}: a BPE model without the ByteLevel pre-tokenizer is not supported", source);
      UF_CHECK(!model.contains("byte_fallback") || !model["byte_fallback"].get<bool>(),
               "{}: BPE byte_fallback is not supported", source);
    } else if (type == "WordLevel") {
      t->model = Tokenizer::Impl::Model::kWordLevel;
      UF_CHECK(!t->byte_level && t->splits.empty(),
               "{}: a WordLevel model with a pre-tokenizer is not supported", source);
    } else {
      core::fail("{}: unsupported model type '{}'", source, type);
    }
    UF_CHECK(vocab_span.found(), "{}: the model has no vocab", source);
    json_scan::read_string_int_object(
        text, vocab_span, source, [&](std::string&& piece, int64_t id) {
          UF_CHECK(id >= 0 && id < (1 << 24), "{}: token id {} of '{}' is out of range", source, id,
                   piece);
          set_token(*t, int32_t(id), piece);
          t->vocab.emplace(std::move(piece), int32_t(id));
        });
    if (type == "WordLevel") {
      if (model.contains("unk_token") && model["unk_token"].is_string()) {
        auto it = t->vocab.find(model["unk_token"].get<std::string>());
        if (it != t->vocab.end()) t->unk_id = it->second;
      }
    }
    for (const auto& a : j.at("added_tokens")) {
      AddedToken tok;
      tok.content = a.at("content").get<std::string>();
      tok.id = a.at("id").get<int32_t>();
      tok.special = a.value("special", false);
      tok.normalized = a.value("normalized", false);
      tok.lstrip = a.value("lstrip", false);
      tok.rstrip = a.value("rstrip", false);
      tok.single_word = a.value("single_word", false);
      UF_CHECK(!tok.content.empty(), "{}: added token {} is empty", source, tok.id);
      UF_CHECK(!find_invalid_utf8(tok.content), "{}: added token {} is not valid UTF-8", source,
               tok.id);
      UF_CHECK(!tok.single_word, "{}: added token '{}' uses single_word, which is not supported",
               source, tok.content);
      set_token(*t, tok.id, tok.content);
      t->added[tok.content] = tok.id;
      t->added_tokens.push_back(tok);
    }
    t->vocab_size = int32_t(t->pieces.size());
    t->flags.assign(t->pieces.size(), 0);
    for (size_t k = 0; k < t->added_tokens.size(); ++k) {
      const auto& a = t->added_tokens[k];
      t->flags[size_t(a.id)] |=
          Tokenizer::Impl::kAdded | (a.special ? Tokenizer::Impl::kSpecial : 0);
      // The trie stores the index into added_tokens (for the lstrip/rstrip flags).
      (a.normalized ? t->trie_normalized : t->trie_raw).insert(a.content, int32_t(k));
    }
    t->bytes.resize(t->pieces.size());
    for (size_t i = 0; i < t->pieces.size(); ++i) {
      t->bytes[i] = t->byte_level_decoder ? piece_to_bytes(t->pieces[i]) : t->pieces[i];
    }

    if (type == "BPE") {
      for (int b = 0; b < 256; ++b) {
        std::string ch;
        append_utf8(ch, byte_to_char(uint8_t(b)));
        auto it = t->vocab.find(ch);
        UF_CHECK(it != t->vocab.end(), "{}: the byte-level vocabulary lacks the token for byte {}",
                 source, b);
        t->byte_token[size_t(b)] = it->second;
      }
      UF_CHECK(merges_span.found(), "{}: the BPE model has no merges", source);
      t->merges.reserve(t->vocab.size());
      int32_t rank = 0;
      std::string joined;
      json_scan::read_merges(
          text, merges_span, source, [&](const std::string& left, const std::string& right) {
            joined.assign(left).append(right);
            auto l = t->vocab.find(left), r = t->vocab.find(right), lr = t->vocab.find(joined);
            UF_CHECK(l != t->vocab.end() && r != t->vocab.end() && lr != t->vocab.end(),
                     "{}: merge {} ('{}' '{}') uses a token missing from the vocabulary", source,
                     rank, left, right);
            t->merges.insert(l->second, r->second, rank, lr->second);  // first (lowest) rank wins
            ++rank;
          });
    }
  } catch (const json::exception& e) {
    core::fail("{}: malformed tokenizer.json ({})", source, e.what());
  }
  return t;
}

// ---- The per-thread merge cache: word bytes -> ids, for words up to kCacheMaxWord bytes. ----
constexpr size_t kCacheMaxWord = 64;
constexpr size_t kCacheMaxEntries = 1 << 16;  // about 10 MB per thread at most

struct MergeCache {
  uint64_t tag = 0;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
};

}  // namespace

uint32_t byte_to_char(uint8_t b) { return alphabet().to_char[b]; }
int byte_from_char(uint32_t cp) { return cp < 512 ? alphabet().from_char[cp] : -1; }

void AddedTrie::insert(std::string_view s, int32_t id) {
  int32_t node = 0;
  for (unsigned char c : s) {
    auto& next = nodes[size_t(node)].next;
    auto it = std::lower_bound(next.begin(), next.end(), c,
                               [](const auto& p, uint8_t v) { return p.first < v; });
    if (it != next.end() && it->first == c) {
      node = it->second;
    } else {
      int32_t created = int32_t(nodes.size());
      next.insert(it, {c, created});
      nodes.emplace_back();
      node = created;
    }
  }
  nodes[size_t(node)].token = id;
  first_byte[static_cast<unsigned char>(s[0])] = true;
}

size_t AddedTrie::longest_at(std::string_view text, size_t pos, int32_t& id) const {
  size_t best = 0;
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto& next = nodes[size_t(node)].next;
    auto c = static_cast<unsigned char>(text[i]);
    auto it = std::lower_bound(next.begin(), next.end(), c,
                               [](const auto& p, uint8_t v) { return p.first < v; });
    if (it == next.end() || it->first != c) break;
    node = it->second;
    if (nodes[size_t(node)].token >= 0) {
      best = i + 1 - pos;
      id = nodes[size_t(node)].token;
    }
  }
  return best;
}

namespace {

bool is_ws_byte(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

// Splits `text` on the tokens of `trie` (leftmost-longest), calling gap(text) for the text between
// them and tok(id) for each token. lstrip/rstrip tokens absorb adjacent whitespace.
template <typename Gap, typename Tok>
void split_added(const Tokenizer::Impl& t, const AddedTrie& trie, std::string_view text, Gap&& gap,
                 Tok&& tok) {
  if (trie.empty()) {
    if (!text.empty()) gap(text);
    return;
  }
  size_t start = 0, pos = 0;
  while (pos < text.size()) {
    if (!trie.first_byte[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    int32_t id = -1;
    size_t len = trie.longest_at(text, pos, id);
    if (len == 0) {
      ++pos;
      continue;
    }
    const AddedToken* info = &t.added_tokens[size_t(id)];
    size_t gap_end = pos, next = pos + len;
    if (info && info->lstrip) {
      while (gap_end > start && is_ws_byte(static_cast<unsigned char>(text[gap_end - 1])))
        --gap_end;
    }
    if (info && info->rstrip) {
      while (next < text.size() && is_ws_byte(static_cast<unsigned char>(text[next]))) ++next;
    }
    if (gap_end > start) gap(text.substr(start, gap_end - start));
    tok(info->id);
    start = pos = next;
  }
  if (start < text.size()) gap(text.substr(start));
}

}  // namespace

void Tokenizer::Impl::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  split_added(
      *this, trie_raw, text,
      [&](std::string_view g) {
        // Tokens flagged "normalized" are matched in the normalized text, as HF does.
        std::string normalized;
        if (!normalizers.empty()) {
          normalized = apply_normalizers(normalizers, g);
          g = normalized;
        }
        split_added(
            *this, trie_normalized, g, [&](std::string_view g2) { encode_gap(g2, out); },
            [&](int32_t id) { out.push_back(id); });
      },
      [&](int32_t id) { out.push_back(id); });
}

void Tokenizer::Impl::encode_gap(std::string_view text, std::vector<int32_t>& out) const {
  // Apply the Split patterns in sequence: each one re-splits every piece of the previous one.
  auto apply = [&](auto&& self, size_t level, std::string_view piece) -> void {
    if (level == splits.size()) {
      encode_piece(piece, out);
      return;
    }
    split_isolated(splits[level], piece, [&](std::string_view sub) { self(self, level + 1, sub); });
  };
  apply(apply, 0, text);
}

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (model == Model::kWordLevel) {
    auto it = vocab.find(piece);
    if (it != vocab.end()) {
      out.push_back(it->second);
    } else {
      UF_CHECK(unk_id >= 0, "{}: word '{}' is not in the WordLevel vocabulary and there is no unk",
               source, piece);
      out.push_back(unk_id);
    }
    return;
  }
  if (piece.size() > kCacheMaxWord) {
    bpe(piece, out);
    return;
  }
  thread_local MergeCache cache;
  if (cache.tag != cache_tag) {
    cache.map.clear();
    cache.tag = cache_tag;
  }
  auto it = cache.map.find(piece);
  if (it != cache.map.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  size_t before = out.size();
  bpe(piece, out);
  if (cache.map.size() >= kCacheMaxEntries) cache.map.clear();
  cache.map.emplace(std::string(piece), std::vector<int32_t>(out.begin() + before, out.end()));
}

void Tokenizer::Impl::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t n = piece.size();
  auto rank_of = [&](int32_t a, int32_t b, int32_t& merged) { return merges.find(a, b, merged); };
  if (n <= 48) {
    // Short words: rescan for the lowest-rank adjacent pair (leftmost on ties).
    int32_t sym[48];
    size_t m = n;
    for (size_t i = 0; i < n; ++i) sym[i] = byte_token[static_cast<unsigned char>(piece[i])];
    int32_t rank[48], merged[48];
    for (size_t i = 0; i + 1 < m; ++i) rank[i] = rank_of(sym[i], sym[i + 1], merged[i]);
    while (m > 1) {
      size_t best = 0;
      for (size_t i = 1; i + 1 < m; ++i) {
        if (rank[i] < rank[best]) best = i;
      }
      if (rank[best] == INT32_MAX) break;
      sym[best] = merged[best];
      for (size_t i = best + 1; i + 1 < m; ++i) {
        sym[i] = sym[i + 1];
        rank[i] = rank[i + 1];
        merged[i] = merged[i + 1];
      }
      --m;
      if (best > 0) rank[best - 1] = rank_of(sym[best - 1], sym[best], merged[best - 1]);
      if (best + 1 < m) rank[best] = rank_of(sym[best], sym[best + 1], merged[best]);
    }
    out.insert(out.end(), sym, sym + m);
    return;
  }
  // Long words: linked symbols and a heap ordered by (rank, position), as HF's BPE.
  struct Sym {
    int32_t id, prev, next;
  };
  std::vector<Sym> s(n);
  for (size_t i = 0; i < n; ++i) {
    s[i] = {byte_token[static_cast<unsigned char>(piece[i])], int32_t(i) - 1,
            i + 1 < n ? int32_t(i + 1) : -1};
  }
  struct Cand {
    int32_t rank, pos, left, right, merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int32_t pos) {
    if (pos < 0 || s[size_t(pos)].next < 0) return;
    int32_t nx = s[size_t(pos)].next, merged = 0;
    int32_t r = rank_of(s[size_t(pos)].id, s[size_t(nx)].id, merged);
    if (r != INT32_MAX) heap.push({r, pos, s[size_t(pos)].id, s[size_t(nx)].id, merged});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(int32_t(i));
  std::vector<bool> dead(n, false);
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    Sym& a = s[size_t(c.pos)];
    if (dead[size_t(c.pos)] || a.id != c.left || a.next < 0 || s[size_t(a.next)].id != c.right) {
      continue;
    }
    int32_t b = a.next;
    a.id = c.merged;
    a.next = s[size_t(b)].next;
    if (a.next >= 0) s[size_t(a.next)].prev = c.pos;
    dead[size_t(b)] = true;
    push(a.prev);
    push(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = s[size_t(i)].next) out.push_back(s[size_t(i)].id);
}

// ---- Tokenizer ----

Tokenizer Tokenizer::from_file(const std::filesystem::path& path) {
  return Tokenizer(load(read_file(path), path.string()));
}

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& source) {
  return Tokenizer(load(json_text, source));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode_append(text, out);
  return out;
}

void Tokenizer::encode_append(std::string_view text, std::vector<int32_t>& out) const {
  UF_CHECK(text.size() <= max_input_bytes(),
           "text to tokenize is {} bytes, more than the limit of {} bytes", text.size(),
           max_input_bytes());
  if (auto bad = find_invalid_utf8(text)) {
    core::fail("text to tokenize is not valid UTF-8: invalid byte 0x{:02X} at byte offset {}",
               static_cast<unsigned char>(text[*bad]), *bad);
  }
  impl_->encode_text(text, out);
}

void Tokenizer::append_token_bytes(int32_t id, std::string& out) const {
  UF_CHECK(id >= 0 && id < impl_->vocab_size, "token id {} is out of range [0, {}) for {}", id,
           impl_->vocab_size, impl_->source);
  out += impl_->bytes[size_t(id)];
}

std::string Tokenizer::decode_bytes(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string out;
  bool first = true;
  for (int32_t id : ids) {
    UF_CHECK(id >= 0 && id < impl_->vocab_size, "token id {} is out of range [0, {}) for {}", id,
             impl_->vocab_size, impl_->source);
    if (skip_special_tokens && (impl_->flags[size_t(id)] & Impl::kSpecial)) continue;
    // Without a decoder HF joins the tokens with spaces.
    if (!impl_->byte_level_decoder && !first) out.push_back(' ');
    out += impl_->bytes[size_t(id)];
    first = false;
  }
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return utf8_lossy(decode_bytes(ids, skip_special_tokens));
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added.find(token); it != impl_->added.end()) return it->second;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

int32_t Tokenizer::require_token_id(std::string_view token) const {
  auto id = token_to_id(token);
  UF_CHECK(id.has_value(),
           "the tokenizer {} has no token '{}', which the DeepSeek-V4.1 format needs",
           impl_->source, token);
  return *id;
}

std::string Tokenizer::id_to_piece(int32_t id) const {
  UF_CHECK(id >= 0 && id < impl_->vocab_size, "token id {} is out of range [0, {}) for {}", id,
           impl_->vocab_size, impl_->source);
  return impl_->pieces[size_t(id)];
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < impl_->vocab_size && (impl_->flags[size_t(id)] & Impl::kSpecial);
}
bool Tokenizer::is_added(int32_t id) const {
  return id >= 0 && id < impl_->vocab_size && (impl_->flags[size_t(id)] & Impl::kAdded);
}
bool Tokenizer::joins_with_spaces() const { return !impl_->byte_level_decoder; }
int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
const std::string& Tokenizer::source() const { return impl_->source; }

}  // namespace uf::tokenizer
