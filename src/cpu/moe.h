#pragma once
// Mixture of experts (model-arch.md §4.5): router scores in fp32 (sqrtsoftplus, softmax or
// sigmoid), the selection bias used for choosing only, top-k, normalisation (+1e-20) and routed
// scaling; SwiGLU experts with the clamps (up to +-limit, gate to <= limit), the routing weight
// applied before w2 (so it affects w2's activation quantisation); the shared expert added last.
// Per token, routed outputs are summed in fp32 in ascending expert order, as the reference does.

#include <cstdint>
#include <string>

#include "cpu/model_types.h"

namespace uf::cpu {

struct MoeParams {
  int n_experts = 0;
  int top_k = 0;
  std::string score_func;
  float gate_temp = 1;
  float route_scale = 1;
  float swiglu_limit = 0;  // 0 = no clamps
  bool norm_topk_prob = true;
};

// Router for T tokens: gate_i [T, top_k] (in selection order, best first), gate_w [T, top_k].
void moe_route(const MoeWeights& w, const MoeParams& p, const float* x, int T, int32_t* gate_i,
               float* gate_w);

// One SwiGLU expert on n rows: y = bf16(w2(bf16(weight * silu(min(g,l)) * clamp(u,-l,l)))).
// row_weight may be null (shared expert).
void expert_forward(const ExpertWeights& e, float swiglu_limit, const float* x, int n, int dim,
                    int inter, const float* row_weight, float* y);

// y[T, dim] (bf16 values) = routed + shared. gate_i / gate_w are filled as by moe_route.
void moe_forward(const MoeWeights& w, const MoeParams& p, const float* x, int T, int dim, int inter,
                 float* y, int32_t* gate_i, float* gate_w);

}  // namespace uf::cpu
