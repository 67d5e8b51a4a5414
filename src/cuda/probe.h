#pragma once
// Phase probes: device timestamps taken INSIDE chosen kernels, to see where a kernel's time goes
// in the decode chain (how long after its launch the PDL wait returned, when its weights landed,
// when its reduction finished). Investigation builds only: the probe points compile to nothing
// unless the CUDA sources are built with -DUF_PROBE=1 (cmake -DUF_PROBE=ON); enabled() says which.
//
// A probed kernel opens one record per probed CTA (thread 0 of its first and last CTA), stamps
// %globaltimer (ns, the same clock in every SM) at numbered points, and closes it. The host:
//   probe::begin(4096);   // before the stretch of work to look at (zeroes the buffer)
//   run_the_step();
//   auto recs = probe::end();   // synchronises, returns the records in the order they opened
// Kernels put their points' meaning next to their probe marks; probe_text() prints the records.

#include <cstdint>
#include <string>
#include <vector>

namespace uf::cuda::probe {

constexpr int kMaxPoints = 12;

// Tags: one per probed kernel (probe_text names them).
enum Tag : uint32_t {
  kTagGemvResident = 1,
  kTagRouter2 = 2,
  kTagMixPreNorm = 3,
  kTagAttnScores = 4,
  kTagDenseMmaResident = 6,
  kTagMoeW13 = 7,
  kTagMoeW2 = 8,
  kTagMixFinish = 9,
  kTagW13Unit = 10,
  kTagW2Unit = 11,
  kTagAttnPv = 12,
  kTagAttnMerge = 13,
  kTagRouterLast = 14,  // moe_router2's last CTA (the routing), its own record
  kTagAttnChunk = 15,
  kTagSelectRound = 16,  // the indexer's top-k selection rounds (ops/indexer.cu)
  kTagSelectMask = 17,   // its candidate-block selection rounds
};

struct Record {
  uint64_t t[kMaxPoints];  // %globaltimer at each point, 0 where the kernel took no stamp
  uint32_t tag;            // the kernel's probe tag (kernels/probe.cuh, kTag*)
  uint32_t block;          // blockIdx.x of the probed CTA
  uint32_t sm;             // %smid
  uint32_t pad;
};

bool enabled();
void begin(int capacity);
std::vector<Record> end();
// One line per record: the tag's name, block, SM, and each point in us after the first record's
// point 0.
std::string probe_text(const std::vector<Record>& recs);

// Internal: each instrumented translation unit registers a function that points its device-side
// buffer at the host's (kernels/probe.cuh does this).
using AttachFn = void (*)(void* records, unsigned* count, int capacity);
int register_unit(AttachFn fn);

}  // namespace uf::cuda::probe
