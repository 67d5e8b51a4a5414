#pragma once
// The model-level types the CPU backend uses unqualified: weight views in checkpoint formats and
// RoPE tables (both live in model/ because the CUDA backend shares them).

#include "model/rope.h"
#include "model/weights.h"

namespace uf::cpu {

using model::AttentionWeights;
using model::EngramWeights;
using model::ExpertWeights;
using model::LayerWeights;
using model::ModelWeights;
using model::MoeWeights;
using model::Rope;
using model::Weight;
using model::WFormat;

}  // namespace uf::cpu
