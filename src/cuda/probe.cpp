#include "cuda/probe.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <mutex>

#include "core/error.h"
#include "cuda/cuda_check.h"

namespace uf::cuda::probe {
namespace {

struct State {
  std::mutex mu;
  std::vector<AttachFn> units;
  Record* records = nullptr;
  unsigned* count = nullptr;
  int capacity = 0;
};
State& state() {
  static State s;
  return s;
}

const char* tag_name(uint32_t tag) {
  switch (tag) {
    case kTagGemvResident:
      return "fp8_gemv_resident";
    case kTagRouter2:
      return "moe_router2";
    case kTagMixPreNorm:
      return "hc_mix_pre_norm";
    case kTagAttnScores:
      return "sparse_attn_scores";
    case kTagDenseMmaResident:
      return "dense_mma_resident";
    case kTagMoeW13:
      return "moe_w13";
    case kTagMoeW2:
      return "moe_w2";
    case kTagMixFinish:
      return "hc_mix_finish";
    case kTagW13Unit:
      return "moe_w13_unit";
    case kTagW2Unit:
      return "moe_w2_unit";
    case kTagAttnPv:
      return "sparse_attn_pv";
    case kTagAttnMerge:
      return "sparse_attn_merge";
    case kTagRouterLast:
      return "moe_router2_last";
    case kTagAttnChunk:
      return "sparse_attn_chunk_mma";
    case kTagSelectRound:
      return "select_round";
    case kTagSelectMask:
      return "select_round_mask";
    default:
      return "?";
  }
}

}  // namespace

bool enabled() {
#if defined(UF_PROBE) && UF_PROBE
  return true;
#else
  return false;
#endif
}

int register_unit(AttachFn fn) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.units.push_back(fn);
  return int(s.units.size());
}

void begin(int capacity) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  UF_CHECK(capacity > 0, "probe::begin: capacity {} must be positive", capacity);
  if (capacity > s.capacity) {
    cudaFree(s.records);
    cudaFree(s.count);
    UF_CUDA_CHECK(cudaMalloc(&s.records, sizeof(Record) * size_t(capacity)));
    UF_CUDA_CHECK(cudaMalloc(&s.count, sizeof(unsigned)));
    s.capacity = capacity;
  }
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  UF_CUDA_CHECK(cudaMemset(s.records, 0, sizeof(Record) * size_t(s.capacity)));
  UF_CUDA_CHECK(cudaMemset(s.count, 0, sizeof(unsigned)));
  for (AttachFn fn : s.units) fn(s.records, s.count, s.capacity);
  UF_CUDA_CHECK(cudaDeviceSynchronize());
}

std::vector<Record> end() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  if (s.records == nullptr) return {};
  unsigned n = 0;
  UF_CUDA_CHECK(cudaMemcpy(&n, s.count, sizeof(unsigned), cudaMemcpyDeviceToHost));
  n = std::min<unsigned>(n, unsigned(s.capacity));
  std::vector<Record> out(n);
  UF_CUDA_CHECK(cudaMemcpy(out.data(), s.records, sizeof(Record) * n, cudaMemcpyDeviceToHost));
  for (AttachFn fn : s.units) fn(nullptr, nullptr, 0);  // detach: later kernels stamp nothing
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  std::stable_sort(out.begin(), out.end(),
                   [](const Record& a, const Record& b) { return a.t[0] < b.t[0]; });
  return out;
}

std::string probe_text(const std::vector<Record>& recs) {
  std::string s;
  if (recs.empty()) return s;
  uint64_t t0 = recs[0].t[0];
  for (const Record& r : recs)
    if (r.t[0] != 0) t0 = std::min(t0, r.t[0]);
  char buf[64];
  for (const Record& r : recs) {
    std::snprintf(buf, sizeof buf, "%-20s %5u %4u", tag_name(r.tag), r.block, r.sm);
    s += buf;
    for (int i = 0; i < kMaxPoints; ++i) {
      if (r.t[i] == 0) {
        s += "        -";
        continue;
      }
      std::snprintf(buf, sizeof buf, " %8.2f", double(int64_t(r.t[i] - t0)) / 1000.0);
      s += buf;
    }
    s += '\n';
  }
  return s;
}

}  // namespace uf::cuda::probe
