#pragma once
// The sampling values a request gets for the parameters it leaves out. As vLLM and SGLang do, the
// model directory's generation_config.json (Hugging Face's file) supplies them: its
// "temperature", "top_p" and "top_k"; other keys ("do_sample" included, as vLLM ignores it) do
// not matter. Without the file, OpenAI's defaults hold: temperature 1, top_p 1, no top-k.
// DeepSeek recommends temperature 1.0 and top_p 0.95 for this model.

#include <string>

#include "server/generation_engine.h"

namespace uf::server {

// The defaults in `path` (a generation_config.json), keys it lacks keeping OpenAI's. Throws
// core::Error naming the file and the key when the file cannot be read or parsed, is not a JSON
// object, or holds a value of the wrong type or range: temperature in [0, 2], top_p in (0, 1],
// top_k an integer >= -1 (-1 and 0: off). null counts as absent.
SamplingParams load_sampling_defaults(const std::string& path);

// "temperature 1, top_p 0.95, top_k off", for the log.
std::string describe_sampling(const SamplingParams& p);

}  // namespace uf::server
