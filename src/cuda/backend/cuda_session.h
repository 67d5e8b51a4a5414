#pragma once
// Per-session state of the CUDA backend: the device twin of cpu::CpuSession (cpu/session.h), with
// the same rules (everything a rejected verify row could touch is keyed by position, so rejection
// needs no undo). The values live in device memory (the same QDQ values as the CPU: fp32, the
// index keys as their exact bf16); the position tag of every ring slot lives on the host, where
// the slot lists are built. Capacity is fixed at creation: every buffer comes from the session's
// own DeviceArena.

#include <cstdint>
#include <utility>
#include <vector>

#include "cuda/device_memory.h"
#include "engine/backend.h"

namespace uf::cuda {

// A ring of `slots` device rows of `width` floats; tags on the host (cpu::PosRing's twin).
struct DeviceRing {
  int slots = 0;
  int width = 0;
  float* data = nullptr;     // device [slots, width]
  std::vector<int64_t> pos;  // host [slots], -1 = empty (write through put / set_tags)
  // The newest run of consecutive positions known to be tagged, (run_end - run_len, run_end]: a
  // shortcut for first_missing (every step checks a whole window per layer). put() keeps it true
  // (it only grows by the next position; anything else restarts it at the put position, which
  // may forget tagged positions but never claims an untagged one); set_tags() clears it.
  int64_t run_end = -1;
  int run_len = 0;

  void init(int n_slots, int w, DeviceArena& arena) {
    slots = n_slots;
    width = w;
    data = arena.alloc<float>(size_t(n_slots) * size_t(w));
    set_tags(std::vector<int64_t>(size_t(n_slots), -1));
  }
  void set_tags(std::vector<int64_t> tags) {
    pos = std::move(tags);
    run_end = -1;
    run_len = 0;
  }
  // The slot of position p, tagged with p (the caller writes the row).
  float* put(int64_t p) {
    const size_t s = size_t(p % slots);
    pos[s] = p;
    if (run_len > 0 && p == run_end + 1) {
      run_end = p;  // the slot held run_end + 1 - slots: the run's oldest only when it is full
      run_len = run_len < slots ? run_len + 1 : slots;
    } else if (!(run_len > 0 && p <= run_end && p > run_end - run_len)) {
      run_end = p;  // a gap or an older position (its slot may have held a run position)
      run_len = 1;
    }  // else: a run position tagged again, nothing changes
    return data + s * size_t(width);
  }
  // nullptr if the slot holds another position.
  const float* get(int64_t p) const {
    if (p < 0 || slots == 0) return nullptr;
    const size_t s = size_t(p % slots);
    return pos[s] == p ? data + s * size_t(width) : nullptr;
  }
  // The first position of [begin, end) (begin >= 0) the ring does not hold, or -1 when it holds
  // all: get() over the range with one division instead of one per position (every span checks a
  // whole window per layer on the host, between two steps).
  int64_t first_missing(int64_t begin, int64_t end) const {
    if (begin >= end) return -1;
    if (slots == 0) return begin;
    if (run_len > 0 && begin > run_end - run_len && end - 1 <= run_end) return -1;
    size_t s = size_t(begin % slots);
    for (int64_t q = begin; q < end; ++q) {
      if (pos[s] != q) return q;
      if (++s == size_t(slots)) s = 0;
    }
    return -1;
  }
};

struct CudaLayerState {
  DeviceRing window;            // window KV (FP8 QDQ values); DSpark stages: main_kv ring
  DeviceRing raw_kv, raw_gate;  // ratio > 1 KV sources: pre-pool compressor rows (fp32)
  // KV sources: compressed entries [ckv_cap, head_dim] (FP4 QDQ values) as bf16 bits, exact as
  // the index keys below: half the bytes the attention gathers for its top-k slots.
  uint16_t* ckv = nullptr;
  // KV sources with an indexer: [ckv_cap, index_head_dim] as bf16 bits. The keys are FP4 QDQ
  // values, exact in bf16 (core/quant.h), so this holds the CPU's fp32 keys at half the bytes
  // that the indexer streams every step (at 1M tokens: every visible key of 4 layers a step).
  uint16_t* ikeys = nullptr;
  int64_t ckv_cap = 0;  // entries allocated
  // Entries ever written (the CPU vectors' sizes: its snapshot writes that many).
  int64_t ckv_n = 0;
  int64_t ikeys_n = 0;
};

class CudaSession : public engine::SessionState {
 public:
  int64_t length() const override { return len; }
  int64_t max_seq() const override { return cap; }
  const std::vector<int32_t>& tokens() const override { return toks; }

  int64_t len = 0;
  int64_t cap = 0;
  int64_t alloc_cap = 0;  // capacity the device buffers were sized for
  std::vector<int32_t> toks;
  std::vector<CudaLayerState> layers;  // backbone layers then DSpark stages
  int publisher = -1;                  // kept for the snapshot format (owner keys ignore it)

  // The last decode_rows call, until commit. Main hidden rows stay on the device.
  int pending_rows = 0;
  std::vector<int32_t> pending_tokens;
  float* pending_main_hidden = nullptr;  // device [max_rows, taps * dim]
  std::vector<int> pending_publisher;

  DeviceArena arena;  // owns every device buffer above
};

}  // namespace uf::cuda
