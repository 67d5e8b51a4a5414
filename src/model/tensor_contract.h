#pragma once
// The tensor contract: every tensor a checkpoint of a given ModelConfig must hold, with its
// dtype and shape (model-arch.md §3 and §6.2), and a check of a checkpoint against it.
//
// Formats: FP8 weights are F8_E4M3 [out, in] with an F8_E8M0 `.scale` [ceil(out/32),
// ceil(in/32)]; routed experts are packed MXFP4, I8 [out, in/2] with F8_E8M0 [out, in/32];
// Engram tables are F8_E4M3 [rows, head_dim] with F8_E8M0 [rows, head_dim/32]; the rest is BF16
// or F32. Vision tensors (vision.*, aligner.*, image_*) follow the reference vision.py and exist
// only when vision_n_layers > 0.

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "model/checkpoint.h"
#include "model/config.h"

namespace uf::model {

// What the tensor is for: lets reports and loaders group tensors without parsing names.
enum class TensorKind {
  kFp8Weight,    // F8_E4M3 with 32x32 block scales
  kFp8Scale,     // the F8_E8M0 `.scale` of an FP8 weight
  kFp4Weight,    // packed MXFP4 routed expert (I8)
  kFp4Scale,     // its per-32 F8_E8M0 scale
  kEngramTable,  // F8_E4M3 rows
  kEngramScale,  // its per-row per-32 F8_E8M0 scales
  kBf16,         // embeddings, norms, routers, compressor, small projections, vision
  kF32,          // mHC, gate biases, attention sinks
};

struct ExpectedTensor {
  std::string name;
  core::DType dtype;
  std::vector<int64_t> shape;
  TensorKind kind;
  uint64_t nbytes() const;
};

// In a fixed order: top level, backbone layers, DSpark stages, vision.
std::vector<ExpectedTensor> tensor_contract(const ModelConfig& c);

struct ContractReport {
  std::vector<std::string> missing;     // one line per expected tensor the checkpoint lacks
  std::vector<std::string> extra;       // one line per checkpoint tensor the contract lacks
  std::vector<std::string> mismatched;  // one line per tensor with the wrong dtype or shape
  size_t expected = 0;                  // tensors in the contract
  uint64_t expected_bytes = 0;
  bool ok() const { return missing.empty() && extra.empty() && mismatched.empty(); }
  std::vector<std::string> lines() const;  // missing, then mismatched, then extra
};

ContractReport check_contract(const ModelConfig& c, const Checkpoint& ck);
// Throws uf::core::Error naming the first few offending tensors (and how many there are).
void require_contract(const ModelConfig& c, const Checkpoint& ck);

}  // namespace uf::model
