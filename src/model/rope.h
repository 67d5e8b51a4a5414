#pragma once
// Rotary embedding on the last rope_dim channels of a vector, adjacent pairs (2i, 2i+1) taken as
// complex numbers. Frequencies follow the reference's precompute_freqs_cis in fp32, with YaRN
// (linear ramp between beta_fast and beta_slow, frequencies divided by `factor` beyond it) when
// original_seq_len > 0. The angle is fp32(pos) * freq in fp32, as torch.outer computes it.

#include <cstdint>
#include <vector>

#include "model/config.h"

namespace uf::model {

class Rope {
 public:
  Rope() = default;
  // rope_dim: rotated channels; base: theta; original_seq_len 0 disables YaRN.
  Rope(int rope_dim, double base, int original_seq_len, double factor, double beta_fast,
       double beta_slow);
  // The table a layer uses: YaRN with compress_rope_theta if its compress ratio is > 0, else
  // plain rope_theta (model-arch.md §4.3).
  static Rope for_layer(const ModelConfig& cfg, int layer);

  int dim() const { return dim_; }
  const std::vector<float>& freqs() const { return freqs_; }
  // cos/sin of position `pos` for pair i.
  void cos_sin(int64_t pos, int i, float& c, float& s) const;
  // Rotates the last dim() channels of v[0..n) in place (inverse: the conjugate rotation), then
  // rounds them to bf16 (the reference copies the fp32 result back into a bf16 tensor).
  void apply(float* v, int n, int64_t pos, bool inverse = false) const {
    apply_many(v, 1, n, pos, inverse);
  }
  // The same on `count` consecutive vectors of n channels (heads at one position).
  void apply_many(float* v, int count, int n, int64_t pos, bool inverse = false) const;

 private:
  int dim_ = 0;
  std::vector<float> freqs_;
};

}  // namespace uf::model
