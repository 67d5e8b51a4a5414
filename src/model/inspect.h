#pragma once
// `ultrafast inspect`: a human-readable summary of a checkpoint folder (config, layer roles,
// tensors by dtype, tensor-contract result). Kept in the library so tests can call it.

#include <filesystem>
#include <ostream>

#include "model/checkpoint.h"
#include "model/config.h"

namespace uf::model {

void print_config_summary(const ModelConfig& c, std::ostream& out);
void print_layer_roles(const ModelConfig& c, std::ostream& out);
void print_tensor_stats(const Checkpoint& ck, std::ostream& out);

// Loads the config and checkpoint (a load error propagates as uf::core::Error naming the file
// and tensor), prints everything and returns 0 if the checkpoint satisfies the tensor contract,
// 1 otherwise (every offending tensor is printed).
int inspect_model(const std::filesystem::path& dir, std::ostream& out);

}  // namespace uf::model
