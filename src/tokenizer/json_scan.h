#pragma once
// A small JSON scanner for the two big members of a tokenizer.json, model.vocab (an object of
// ~130k string -> id pairs) and model.merges (~130k strings or pairs). Building nlohmann's DOM for
// them dominates the load time, so they are cut out of the text and read directly; the rest of
// the file (added tokens, pre-tokenizer, ...) still goes through nlohmann.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace uf::tokenizer::json_scan {

struct Span {
  size_t begin = 0, end = 0;  // [begin, end) of a JSON value in the text; empty if absent
  bool found() const { return end > begin; }
};

// Finds model.vocab and model.merges; `rest` receives the text with them replaced by {} and [].
// Throws uf::core::Error (naming `source`) on malformed JSON structure.
void split_model_tables(std::string_view text, const std::string& source, Span& vocab, Span& merges,
                        std::string& rest);

// Reads an object of string -> integer. Calls fn(std::string&& key, int64_t value).
template <typename Fn>
void read_string_int_object(std::string_view text, Span span, const std::string& source, Fn&& fn);

// Reads an array whose elements are "a b" strings or ["a", "b"] arrays; fn(left, right).
template <typename Fn>
void read_merges(std::string_view text, Span span, const std::string& source, Fn&& fn);

// ---- implementation details shared with the templates ----
size_t skip_ws(std::string_view t, size_t i);
// Parses the JSON string starting at t[i] == '"' into `out`; returns the index after it.
size_t read_string(std::string_view t, size_t i, std::string& out, const std::string& source);
[[noreturn]] void fail_at(const std::string& source, size_t offset, const char* what);

template <typename Fn>
void read_string_int_object(std::string_view t, Span span, const std::string& source, Fn&& fn) {
  size_t i = skip_ws(t, span.begin);
  if (i >= span.end || t[i] != '{') fail_at(source, i, "expected an object");
  i = skip_ws(t, i + 1);
  std::string key;
  if (i < span.end && t[i] == '}') return;
  while (true) {
    if (i >= span.end || t[i] != '"') fail_at(source, i, "expected a string key");
    i = skip_ws(t, read_string(t, i, key, source));
    if (i >= span.end || t[i] != ':') fail_at(source, i, "expected ':'");
    i = skip_ws(t, i + 1);
    bool neg = i < span.end && t[i] == '-';
    if (neg) ++i;
    if (i >= span.end || t[i] < '0' || t[i] > '9') fail_at(source, i, "expected an integer id");
    int64_t v = 0;
    while (i < span.end && t[i] >= '0' && t[i] <= '9' && v < (int64_t(1) << 40))
      v = v * 10 + (t[i++] - '0');
    fn(std::move(key), neg ? -v : v);
    key.clear();
    i = skip_ws(t, i);
    if (i < span.end && t[i] == ',') {
      i = skip_ws(t, i + 1);
      continue;
    }
    if (i < span.end && t[i] == '}') return;
    fail_at(source, i, "expected ',' or '}'");
  }
}

template <typename Fn>
void read_merges(std::string_view t, Span span, const std::string& source, Fn&& fn) {
  size_t i = skip_ws(t, span.begin);
  if (i >= span.end || t[i] != '[') fail_at(source, i, "expected an array of merges");
  i = skip_ws(t, i + 1);
  if (i < span.end && t[i] == ']') return;
  std::string a, b;
  while (true) {
    a.clear();
    b.clear();
    if (i < span.end && t[i] == '"') {
      i = read_string(t, i, a, source);
      size_t sp = a.find(' ');
      if (sp == std::string::npos) fail_at(source, i, "a merge string has no space");
      b = a.substr(sp + 1);
      a.resize(sp);
    } else if (i < span.end && t[i] == '[') {
      i = skip_ws(t, i + 1);
      if (i >= span.end || t[i] != '"') fail_at(source, i, "expected a merge pair of strings");
      i = skip_ws(t, read_string(t, i, a, source));
      if (i >= span.end || t[i] != ',') fail_at(source, i, "expected ',' in a merge pair");
      i = skip_ws(t, i + 1);
      if (i >= span.end || t[i] != '"') fail_at(source, i, "expected a merge pair of strings");
      i = skip_ws(t, read_string(t, i, b, source));
      if (i >= span.end || t[i] != ']') fail_at(source, i, "expected ']' after a merge pair");
      ++i;
    } else {
      fail_at(source, i, "expected a merge string or pair");
    }
    fn(a, b);
    i = skip_ws(t, i);
    if (i < span.end && t[i] == ',') {
      i = skip_ws(t, i + 1);
      continue;
    }
    if (i < span.end && t[i] == ']') return;
    fail_at(source, i, "expected ',' or ']'");
  }
}

}  // namespace uf::tokenizer::json_scan
