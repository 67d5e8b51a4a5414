#include "model/rope.h"

#include <algorithm>
#include <cmath>

#include "core/dtypes.h"
#include "core/error.h"

namespace uf::model {

Rope::Rope(int rope_dim, double base, int original_seq_len, double factor, double beta_fast,
           double beta_slow)
    : dim_(rope_dim), freqs_(size_t(rope_dim / 2)) {
  UF_CHECK(rope_dim > 0 && rope_dim % 2 == 0 && rope_dim <= 512,
           "rope: {} rotated channels; expected an even count up to 512", rope_dim);
  for (int i = 0; i < rope_dim / 2; ++i) {
    const float e = float(2 * i) / float(rope_dim);  // arange(0, dim, 2) / dim in fp32
    freqs_[size_t(i)] = 1.0f / float(std::pow(base, double(e)));
  }
  if (original_seq_len > 0) {
    auto corrected = [&](double rotations) {
      return rope_dim * std::log(original_seq_len / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    const double low = std::max(std::floor(corrected(beta_fast)), 0.0);
    const double high = std::min(std::ceil(corrected(beta_slow)), double(rope_dim - 1));
    const float denom = float(std::max(high - low, 1e-3));
    for (int i = 0; i < rope_dim / 2; ++i) {
      const float ramp = std::clamp((float(i) - float(low)) / denom, 0.0f, 1.0f);
      const float smooth = 1.0f - ramp;
      const float f = freqs_[size_t(i)];
      freqs_[size_t(i)] = f / float(factor) * (1.0f - smooth) + f * smooth;
    }
  }
}

Rope Rope::for_layer(const ModelConfig& cfg, int layer) {
  const auto& r = cfg.role(layer);
  if (r.compress_ratio > 0)
    return Rope(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor,
                cfg.beta_fast, cfg.beta_slow);
  return Rope(cfg.rope_head_dim, cfg.rope_theta, 0, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow);
}

void Rope::cos_sin(int64_t pos, int i, float& c, float& s) const {
  const float angle = float(pos) * freqs_[size_t(i)];
  c = float(std::cos(double(angle)));
  s = float(std::sin(double(angle)));
}

void Rope::apply_many(float* v, int count, int n, int64_t pos, bool inverse) const {
  float cs[256], sn[256];
  const int half = dim_ / 2;
  for (int i = 0; i < half; ++i) {
    cos_sin(pos, i, cs[i], sn[i]);
    if (inverse) sn[i] = -sn[i];
  }
  for (int h = 0; h < count; ++h) {
    float* t = v + int64_t(h) * n + (n - dim_);
    for (int i = 0; i < half; ++i) {
      const float a = t[2 * i], b = t[2 * i + 1];
      t[2 * i] = core::round_bf16(a * cs[i] - b * sn[i]);
      t[2 * i + 1] = core::round_bf16(a * sn[i] + b * cs[i]);
    }
  }
}

}  // namespace uf::model
