#pragma once
// Internal to the CPU model: what one forward span shares between its layers.

#include <cstdint>
#include <vector>

#include "cpu/model.h"

namespace uf::cpu {

// What one span shares between its layers (the reference's SharedAttentionRuntime, per row).
struct CpuModel::Span {
  CpuSession* s = nullptr;
  int64_t p0 = 0;
  int T = 0;
  bool prefill = false;  // prefill layout
  Hooks* hooks = nullptr;
  std::vector<int64_t> pos;                             // [T]
  std::vector<int64_t> hash_ids;                        // [T, n_engram_layers * n_cols]
  std::vector<std::vector<std::vector<int32_t>>> topk;  // [layer][row] entry ids
  std::vector<std::vector<uint8_t>> cand;               // [row] candidate pool mask
  std::vector<uint8_t> emits_any;                       // [layer] KV source produced entries
  std::vector<int> pub_start;    // [row] publisher before the row (reference keys)
  std::vector<uint8_t> kv_done;  // [layer] KV path already run (CED)

  TapInfo info(Tap t, int layer, int rows, int width) const {
    TapInfo i;
    i.tap = t;
    i.layer = layer;
    i.p0 = p0;
    i.rows = rows;
    i.width = width;
    i.prefill_layout = prefill;
    return i;
  }
};

}  // namespace uf::cpu
