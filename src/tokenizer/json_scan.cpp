#include "tokenizer/json_scan.h"

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace uf::tokenizer::json_scan {
namespace {

int hex(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Index after the JSON value starting at t[i] (structure only; strings are skipped, not decoded).
size_t skip_value(std::string_view t, size_t i, const std::string& source) {
  i = skip_ws(t, i);
  if (i >= t.size()) fail_at(source, i, "unexpected end of file");
  char c = t[i];
  if (c == '"') {
    for (++i; i < t.size(); ++i) {
      if (t[i] == '\\') {
        ++i;
      } else if (t[i] == '"') {
        return i + 1;
      }
    }
    fail_at(source, i, "unterminated string");
  }
  if (c == '{' || c == '[') {
    int depth = 0;
    for (; i < t.size(); ++i) {
      char d = t[i];
      if (d == '"') {
        i = skip_value(t, i, source) - 1;
      } else if (d == '{' || d == '[') {
        ++depth;
      } else if (d == '}' || d == ']') {
        if (--depth == 0) return i + 1;
      }
    }
    fail_at(source, i, "unterminated object or array");
  }
  while (i < t.size() && t[i] != ',' && t[i] != '}' && t[i] != ']' && t[i] != ' ' && t[i] != '\n' &&
         t[i] != '\r' && t[i] != '\t') {
    ++i;
  }
  return i;
}

// Calls fn(key, value_begin) for each member of the object at t[i]; fn returns the value's end.
template <typename Fn>
size_t for_each_member(std::string_view t, size_t i, const std::string& source, Fn&& fn) {
  i = skip_ws(t, i);
  if (i >= t.size() || t[i] != '{') fail_at(source, i, "expected an object");
  i = skip_ws(t, i + 1);
  if (i < t.size() && t[i] == '}') return i + 1;
  std::string key;
  while (true) {
    if (i >= t.size() || t[i] != '"') fail_at(source, i, "expected a string key");
    key.clear();
    i = skip_ws(t, read_string(t, i, key, source));
    if (i >= t.size() || t[i] != ':') fail_at(source, i, "expected ':'");
    i = skip_ws(t, fn(key, skip_ws(t, i + 1)));
    if (i < t.size() && t[i] == ',') {
      i = skip_ws(t, i + 1);
      continue;
    }
    if (i < t.size() && t[i] == '}') return i + 1;
    fail_at(source, i, "expected ',' or '}'");
  }
}

}  // namespace

void fail_at(const std::string& source, size_t offset, const char* what) {
  core::fail("{}: malformed tokenizer.json at byte {}: {}", source, offset, what);
}

size_t skip_ws(std::string_view t, size_t i) {
  while (i < t.size() && (t[i] == ' ' || t[i] == '\n' || t[i] == '\r' || t[i] == '\t')) ++i;
  return i;
}

size_t read_string(std::string_view t, size_t i, std::string& out, const std::string& source) {
  ++i;  // the opening quote
  while (true) {
    size_t j = i;
    while (j < t.size() && t[j] != '"' && t[j] != '\\') ++j;
    out.append(t.data() + i, j - i);
    if (j >= t.size()) fail_at(source, j, "unterminated string");
    if (t[j] == '"') return j + 1;
    // An escape.
    if (j + 1 >= t.size()) fail_at(source, j, "unterminated escape");
    char e = t[j + 1];
    i = j + 2;
    switch (e) {
      case '"':
        out.push_back('"');
        break;
      case '\\':
        out.push_back('\\');
        break;
      case '/':
        out.push_back('/');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'n':
        out.push_back('\n');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'u': {
        auto read4 = [&](size_t at) {
          if (at + 4 > t.size()) fail_at(source, at, "truncated \\u escape");
          int v = 0;
          for (size_t k = 0; k < 4; ++k) {
            int h = hex(t[at + k]);
            if (h < 0) fail_at(source, at, "bad \\u escape");
            v = v * 16 + h;
          }
          return uint32_t(v);
        };
        uint32_t cp = read4(i);
        i += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          if (i + 6 > t.size() || t[i] != '\\' || t[i + 1] != 'u')
            fail_at(source, i, "lone surrogate");
          uint32_t lo = read4(i + 2);
          if (lo < 0xDC00 || lo > 0xDFFF) fail_at(source, i, "bad surrogate pair");
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          i += 6;
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
          fail_at(source, i, "lone surrogate");
        }
        append_utf8(out, cp);
        break;
      }
      default:
        fail_at(source, j, "unknown escape");
    }
  }
}

void split_model_tables(std::string_view text, const std::string& source, Span& vocab, Span& merges,
                        std::string& rest) {
  vocab = merges = Span{};
  for_each_member(text, 0, source, [&](const std::string& key, size_t v) {
    if (key != "model") return skip_value(text, v, source);
    return for_each_member(text, v, source, [&](const std::string& k, size_t mv) {
      size_t end = skip_value(text, mv, source);
      if (k == "vocab") vocab = {mv, end};
      if (k == "merges") merges = {mv, end};
      return end;
    });
  });
  // Replace the two spans (in text order) by empty containers.
  std::pair<Span, const char*> cuts[2] = {{vocab, "{}"}, {merges, "[]"}};
  if (cuts[1].first.begin < cuts[0].first.begin) std::swap(cuts[0], cuts[1]);
  rest.clear();
  size_t pos = 0;
  for (const auto& [span, stub] : cuts) {
    if (!span.found()) continue;
    rest.append(text.substr(pos, span.begin - pos));
    rest.append(stub);
    pos = span.end;
  }
  rest.append(text.substr(pos));
}

}  // namespace uf::tokenizer::json_scan
