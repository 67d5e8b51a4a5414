#pragma once
// A random checkpoint of the full DeepSeek-V4.1-Flash architecture at tiny dimensions, in the
// released layout: config.json + inference/config.json + tokenizer.json + 3 safetensors shards +
// index, with the released on-disk formats (FP8 E4M3 + E8M0 32x32 scales, MXFP4 experts, FP8
// Engram tables, BF16, F32). Deterministic per seed.
//
// Weights follow the recipe of the tiny-a fixture (its README §2): Gaussian * fan_in^-0.5 * a
// per-projection gain, norm weights around per-norm means (10% spread), other 1-D parameters
// 0.5 * N(0,1), gate biases 0.1 * N(0,1), embedding RMS 1.0, reduced residual-branch gains. The
// gains and means were measured on tiny-a's own checkpoint. Like tiny-a, one encoder layer
// (n_layers/2 - 1) and the second DSpark stage are "clamp layers": ffn_norm ~6 so the SwiGLU
// clamps fire, with w2 scaled down so that the stream stays residual-dominated.

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "model/config.h"

namespace uf::model {

// tiny-a's dimensions and role pattern (8 layers: SWA, SWA+Engram, Full+Engram (ratio 2), Reuse,
// Full+candidate source (ratio 1), Reuse, Reindex, Reuse; 3 DSpark stages) with the real
// vocabulary (129,280) and V4.1 token ids. `engram_compressed_vocab_size` is the class count of
// the Engram token map of the tokenizer that ships with the model.
ModelConfig tiny_model_config(int engram_compressed_vocab_size);

// Writes config.json, inference/config.json and the checkpoint for `cfg` (any valid config; the
// tensors are exactly the tensor contract's). Creates `dir` if needed; overwrites files in it.
void write_random_checkpoint(const std::filesystem::path& dir, const ModelConfig& cfg,
                             uint64_t seed);

// DeepSeek-V3's tokenizer.json with V4.1's special tokens at their V4.1 ids (model-arch.md §7):
// <｜System｜> 128799 (also the DSpark noise id), <｜User｜> 128803, <｜Assistant｜> 128804,
// <think> 128821, </think> 128822, <｜deepseek_image｜> 129264; BOS/EOS/pad stay 0/1/2. The other
// V4.1 specials have no published id and take free ids of the added-token range:
// ｜DSML｜ 128815, <｜latest_reminder｜> 128816, <｜action｜> 128817, <｜query｜> 128818,
// <｜authority｜> 128819, <｜domain｜> 128820, <｜title｜> 128823, <｜read_url｜> 128824. Every
// other id up to `vocab_size` - 1 becomes a <｜place▁holder▁no▁N｜> token, so the id space is
// contiguous and matches the model's vocabulary.
nlohmann::json make_v41_tokenizer_json(const nlohmann::json& v3_tokenizer, int vocab_size);
void write_v41_tokenizer(const std::filesystem::path& v3_tokenizer_json,
                         const std::filesystem::path& out_file, int vocab_size);

}  // namespace uf::model
