#pragma once
// Engram on the device: the device twin of cpu/engram.h (model-arch.md §4.6).
//
// Tensor parallelism: the released tables are ~98 GB each, so a TP rank holds a contiguous slice
// of table rows (model/tp_plan.h: chunk = ceil(rows / N), uneven allowed). Each rank gathers the
// rows it owns and zeros for the others; the caller's `reduce` sums the gathered rows over the
// ranks. Exactly one rank contributes each value and the others add +0, so the sum is the value
// itself (bf16-exact): the result equals one GPU's bit for bit (up to the sign of an exact zero).

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "cuda/ops/linear.h"
#include "model/weights.h"

namespace uf::cuda {

struct EngramShape {
  int hc = 0;
  int dim = 0;
  int n_cols = 0;    // table rows per position for this layer
  int head_dim = 0;  // table row width
  float norm_eps = 0;
  // The table slice this object holds: global rows [row_begin, row_begin + table rows) of a
  // table of rows_total rows (0: the whole table, rows_total = the weight's rows).
  int64_t row_begin = 0;
  int64_t rows_total = 0;
};

class DeviceEngram {
 public:
  DeviceEngram(const model::EngramWeights& w, const EngramShape& shape, DeviceArena& arena);
  ~DeviceEngram();
  DeviceEngram(DeviceEngram&&) noexcept;
  DeviceEngram& operator=(DeviceEngram&&) noexcept;

  // Sums `count` gathered floats over the tensor-parallel ranks, in place, on `stream`.
  using RowReduce = std::function<void(float* values, size_t count)>;

  // cpu::engram_forward: ids [T, n_cols] (device int64 global table rows), X [T, hc, dim]; out
  // may alias X. An id outside the (global) table yields NaN outputs for that row (the CPU
  // throws; a kernel cannot). A row-split table needs `reduce` (every rank calls apply with the
  // same ids); a whole table must not get one.
  void apply(const int64_t* ids, const float* X, int T, float* out, cudaStream_t stream,
             const RowReduce& reduce = {}) const;

  // Gathered floats per row that `reduce` sums: n_cols * head_dim.
  int64_t gathered_floats_per_row() const;
  bool split() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace uf::cuda
