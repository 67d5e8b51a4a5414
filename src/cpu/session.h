#pragma once
// Per-session state of the CPU backend (design.md §4). Everything that a rejected verify row could
// touch is keyed by position, so rejection needs no undo:
//  - window KV rings hold window + max_rows slots tagged with their position: a verify step writes
//    at most max_rows positions past the committed end, which only evicts positions no query can
//    see again;
//  - the ratio-r compressors keep their pre-pool rows in rings of r + max_rows tagged slots, so
//    the committed partial group survives any rejected row;
//  - compressed KV and index keys are indexed by entry; an entry past the committed end is
//    rewritten before any query can see it.
// Commit only appends tokens, advances the length and writes the DSpark rings.

#include <cstdint>
#include <span>
#include <vector>

#include "engine/backend.h"

namespace uf::cpu {

// A ring of `slots` vectors of `width` floats, each slot tagged with the position it holds.
struct PosRing {
  int slots = 0;
  int width = 0;
  std::vector<float> data;
  std::vector<int64_t> pos;

  void init(int n_slots, int w);
  float* put(int64_t p);
  const float* get(int64_t p) const;  // nullptr if the slot holds another position
};

struct LayerState {
  PosRing window;            // window KV (FP8 QDQ values); DSpark stages: main_kv ring
  PosRing raw_kv, raw_gate;  // ratio > 1 KV sources: pre-pool compressor rows (fp32)
  std::vector<float> ckv;    // KV sources: compressed KV entries [n, head_dim] (FP4 QDQ)
  std::vector<float> ikeys;  // KV sources with an indexer: index keys [n, index_head_dim]
};

class CpuSession : public engine::SessionState {
 public:
  int64_t length() const override { return len; }
  int64_t max_seq() const override { return cap; }
  const std::vector<int32_t>& tokens() const override { return toks; }

  int64_t len = 0;
  int64_t cap = 0;
  std::vector<int32_t> toks;
  std::vector<LayerState> layers;  // backbone layers then DSpark stages
  int publisher = -1;  // reference stale-key mode: the owner whose index keys were published last

  // The last decode_rows call, until commit.
  int pending_rows = 0;
  std::vector<int32_t> pending_tokens;
  std::vector<float> pending_main_hidden;  // [rows, taps * dim]
  std::vector<int> pending_publisher;      // publisher after each row
};

}  // namespace uf::cpu
