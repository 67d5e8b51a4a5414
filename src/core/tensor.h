#pragma once
// A non-owning view of a tensor's bytes in its storage dtype (checkpoint mmap, host buffer).

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/dtypes.h"

namespace uf::core {

struct TensorView {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t dim(int i) const { return shape.at(size_t(i < 0 ? int(shape.size()) + i : i)); }
  template <typename T>
  std::span<const T> as() const {
    return {reinterpret_cast<const T*>(data), nbytes / sizeof(T)};
  }
};

std::string shape_string(const std::vector<int64_t>& shape);  // "[32768, 1280]"

}  // namespace uf::core
