#pragma once
// Little helpers to serialise session state (snapshot/restore) as a flat byte string. Every read
// is bounds-checked and names what it was reading, so a truncated snapshot is a clear error.

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace uf::engine {

class ByteWriter {
 public:
  template <typename T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    put<uint64_t>(v.size());
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    out_.insert(out_.end(), p, p + v.size() * sizeof(T));
  }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  std::vector<uint8_t> out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> in) : in_(in) {}
  template <typename T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  template <typename T>
  void get_vec(std::vector<T>& v, const char* what) {
    const auto n = get<uint64_t>(what);
    need(n * sizeof(T), what);
    v.resize(n);
    std::memcpy(v.data(), in_.data() + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  void need(size_t n, const char* what);
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
};

}  // namespace uf::engine
