#pragma once
// The Engram module (model-arch.md §4.6): FP8 table rows gathered by hash id and dequantised to
// bf16, projected by wkv (FP8 GEMM with act quant) into one key per hc copy plus a shared value;
// each copy's gate is sigmoid(signed sqrt of a normalised dot product of stream and key), and the
// gated value is added into that copy. The hash ids come from model/engram_hash.h.

#include <cstdint>

#include "cpu/model_types.h"

namespace uf::cpu {

struct EngramParams {
  int hc = 0;
  int dim = 0;
  int n_cols = 0;    // ids per position for this layer ((max_ngram - 1) * n_heads)
  int head_dim = 0;  // table row width
  float norm_eps = 0;
};

// ids: [T, n_cols] table rows; X: [T, hc, dim] stream (bf16 values); out may alias X.
void engram_forward(const EngramWeights& w, const EngramParams& p, const int64_t* ids,
                    const float* X, int T, float* out);

}  // namespace uf::cpu
