#pragma once
// KernelTrace: the device's own start / end times of every kernel a stretch of host code runs,
// CUDA-graph nodes included, through the CUPTI activity API (concurrent-kernel records).
//
// Why: ncu times each kernel alone (serialised, caches flushed), so its durations add up to more
// than a graph replay takes and say nothing about the gaps between dependent kernels, which is
// where a latency-bound decode step loses its time. A trace of one replay shows both: how long
// each kernel ran inside the graph, and how long the device had no kernel running at all.
//
// Use (benchmarks only; one trace at a time in a process):
//   KernelTrace tr;            // registers the CUPTI buffers
//   tr.start();                // after warm-up: the graphs are captured, the caches warm
//   run_the_step();
//   auto recs = tr.stop();     // synchronises the device and drains the records
//   std::cout << summarize_trace(recs, 30);
// The records cost the kernels a few hundred nanoseconds each (timestamps), so a traced call is
// slightly slower than an untimed one; compare traced figures with traced figures.

#include <cstdint>
#include <string>
#include <vector>

namespace uf::cuda {

struct KernelRecord {
  std::string name;  // demangled where CUPTI gives a mangled name, without the argument list
  uint64_t start_ns = 0, end_ns = 0;
  uint32_t stream = 0;
  uint32_t device = 0;      // CUDA device ordinal (a TP process traces every rank's GPU at once)
  int grid = 0, block = 0;  // CTAs (x*y*z) and threads per CTA
  uint64_t graph_node = 0;  // 0 outside a graph
};

class KernelTrace {
 public:
  KernelTrace();
  ~KernelTrace();
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  void start();
  // Synchronises the device, flushes CUPTI and returns the records sorted by start time.
  std::vector<KernelRecord> stop();

 private:
  bool running_ = false;
};

// A readable table: span (first start to last end), busy time (the union of kernel intervals),
// idle time (span - busy: no kernel on the device), and per kernel name the count, total, mean
// and share of the span, the top `top` names by total.
std::string summarize_trace(const std::vector<KernelRecord>& recs, int top);
// Per record (in recs' order), its "advance": in order of end time, how far it moved the latest
// end of the records before it forward (from the first start). Under PDL a kernel starts (and
// waits) while its predecessor runs, so its duration overstates its cost; the advances add up to
// the span and charge each kernel the time the chain waited for it.
std::vector<double> trace_advances_us(const std::vector<KernelRecord>& recs);
// One line per record: start and end in us from the first start, stream, grid, block, name.
std::string trace_records_text(const std::vector<KernelRecord>& recs);

}  // namespace uf::cuda
