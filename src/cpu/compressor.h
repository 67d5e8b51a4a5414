#pragma once
// The ratio-r compressor's pooling (model-arch.md §4.4.3): per channel, a softmax over the r
// tokens' gate scores weights their kv rows, all in fp32, with no positional bias and no overlap.

namespace uf::cpu {

// kv[t], score[t]: the r pre-pool rows (hd values, fp32) of one group, oldest first.
// out[hd] = sum_t kv[t] * softmax_t(score[t]) (fp32).
void compress_pool(const float* const* kv, const float* const* score, int ratio, int hd,
                   float* out);

}  // namespace uf::cpu
