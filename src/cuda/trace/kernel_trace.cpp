#include "cuda/trace/kernel_trace.h"

#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>

#include "core/error.h"

namespace uf::cuda {
namespace {

constexpr size_t kBufferBytes = size_t(8) << 20;

std::mutex g_mu;
std::vector<KernelRecord> g_records;
bool g_registered = false;

// Apart from uf_cuda (whose cuda_check.h lives there), so errors are raised here directly.
void check_cuda(cudaError_t e, const char* call) {
  if (e != cudaSuccess) core::fail("KernelTrace: {} failed: {}", call, cudaGetErrorString(e));
}

void check_cupti(CUptiResult r, const char* call) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  core::fail("KernelTrace: {} failed: {}", call, msg ? msg : "unknown CUPTI error");
}

// "uf::cuda::(anonymous namespace)::moe_w13_unit_kernel<true>(Params)" ->
// "moe_w13_unit_kernel<true>"
std::string short_name(const char* raw) {
  if (!raw) return "?";
  int status = 0;
  char* dem = abi::__cxa_demangle(raw, nullptr, nullptr, &status);
  std::string s = (status == 0 && dem) ? dem : raw;
  std::free(dem);
  // Cut the argument list: the first '(' at template depth 0 that is not "(anonymous".
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '<') ++depth;
    if (c == '>') --depth;
    if (c == '(' && depth == 0 && s.compare(i, 11, "(anonymous ") != 0) {
      s.resize(i);
      break;
    }
  }
  // Drop the namespaces (the last "::" at template depth 0).
  depth = 0;
  size_t cut = 0;
  for (size_t i = 0; i + 1 < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    if (s[i] == '>') --depth;
    if (depth == 0 && s[i] == ':' && s[i + 1] == ':') cut = i + 2;
  }
  return s.substr(cut);
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  // CUPTI wants 8-byte aligned buffers.
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::vector<KernelRecord> got;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL &&
        rec->kind != CUPTI_ACTIVITY_KIND_KERNEL)
      continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    KernelRecord r;
    r.name = short_name(k->name);
    r.start_ns = k->start;
    r.end_ns = k->end;
    r.stream = k->streamId;
    r.device = k->deviceId;
    r.grid = k->gridX * k->gridY * k->gridZ;
    r.block = k->blockX * k->blockY * k->blockZ;
    r.graph_node = k->graphNodeId;
    got.push_back(std::move(r));
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  g_records.insert(g_records.end(), got.begin(), got.end());
}

}  // namespace

KernelTrace::KernelTrace() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_registered) {
    check_cupti(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
                "cuptiActivityRegisterCallbacks");
    g_registered = true;
  }
}

KernelTrace::~KernelTrace() {
  if (running_) {
    try {
      stop();
    } catch (...) {
    }
  }
}

void KernelTrace::start() {
  UF_CHECK(!running_, "KernelTrace::start: already running");
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_cupti(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_records.clear();
  }
  check_cupti(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
              "cuptiActivityEnable(CONCURRENT_KERNEL)");
  running_ = true;
}

std::vector<KernelRecord> KernelTrace::stop() {
  UF_CHECK(running_, "KernelTrace::stop: not running");
  running_ = false;
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_cupti(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
              "cuptiActivityDisable(CONCURRENT_KERNEL)");
  check_cupti(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
  std::vector<KernelRecord> out;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    out.swap(g_records);
  }
  std::sort(out.begin(), out.end(),
            [](const KernelRecord& a, const KernelRecord& b) { return a.start_ns < b.start_ns; });
  return out;
}

std::vector<double> trace_advances_us(const std::vector<KernelRecord>& recs) {
  std::vector<double> adv(recs.size(), 0.0);
  if (recs.empty()) return adv;
  std::vector<size_t> by_end(recs.size());
  uint64_t last = recs.front().start_ns;
  for (size_t i = 0; i < recs.size(); ++i) {
    by_end[i] = i;
    last = std::min(last, recs[i].start_ns);
  }
  std::sort(by_end.begin(), by_end.end(),
            [&](size_t a, size_t b) { return recs[a].end_ns < recs[b].end_ns; });
  for (size_t i : by_end) {
    const uint64_t e = recs[i].end_ns;
    adv[i] = double(e > last ? e - last : 0) * 1e-3;
    last = std::max(last, e);
  }
  return adv;
}

std::string summarize_trace(const std::vector<KernelRecord>& recs, int top) {
  if (recs.empty()) return "trace: no kernel records\n";
  uint64_t t0 = recs.front().start_ns, t1 = 0;
  for (const auto& r : recs) {
    t0 = std::min(t0, r.start_ns);
    t1 = std::max(t1, r.end_ns);
  }
  // Busy: the union of the intervals (records are sorted by start).
  uint64_t busy = 0, cur_s = recs.front().start_ns, cur_e = recs.front().end_ns;
  for (const auto& r : recs) {
    if (r.start_ns > cur_e) {
      busy += cur_e - cur_s;
      cur_s = r.start_ns;
      cur_e = r.end_ns;
    } else {
      cur_e = std::max(cur_e, r.end_ns);
    }
  }
  busy += cur_e - cur_s;
  // Per kernel name: calls, duration, advance (trace_advances_us), and the grid of its last call.
  const std::vector<double> adv = trace_advances_us(recs);
  struct Agg {
    int n = 0;
    double dur = 0, adv = 0;
    int grid = 0;
    uint64_t last_end = 0;
  };
  std::map<std::string, Agg> agg;
  for (size_t i = 0; i < recs.size(); ++i) {
    const auto& r = recs[i];
    auto& a = agg[r.name];
    ++a.n;
    a.dur += double(r.end_ns - r.start_ns) * 1e-3;
    a.adv += adv[i];
    if (r.end_ns >= a.last_end) {
      a.last_end = r.end_ns;
      a.grid = r.grid;
    }
  }
  std::vector<std::pair<std::string, Agg>> v(agg.begin(), agg.end());
  std::sort(v.begin(), v.end(),
            [](const auto& a, const auto& b) { return a.second.adv > b.second.adv; });
  const double span = double(t1 - t0) * 1e-3;
  std::string s = fmt::format(
      "trace: {} kernels, span {:.1f} us, busy {:.1f} us, idle {:.1f} us (no kernel running)\n"
      "{:>9} {:>6} {:>9} {:>8} {:>9} {:>6} {:>6}  kernel\n",
      recs.size(), span, double(busy) * 1e-3, span - double(busy) * 1e-3, "advance", "share",
      "calls", "adv/call", "dur/call", "grid", "");
  for (int i = 0; i < int(v.size()) && i < top; ++i) {
    const auto& [name, a] = v[size_t(i)];
    s += fmt::format("{:>9.1f} {:>5.1f}% {:>9d} {:>8.2f} {:>9.2f} {:>6d}  {}\n", a.adv,
                     100.0 * a.adv / span, a.n, a.adv / a.n, a.dur / a.n, a.grid, name);
  }
  return s;
}

std::string trace_records_text(const std::vector<KernelRecord>& recs) {
  std::string s = fmt::format("{:>10} {:>10} {:>6} {:>6} {:>5}  kernel\n", "start us", "end us",
                              "stream", "grid", "block");
  if (recs.empty()) return s;
  uint64_t t0 = recs.front().start_ns;
  for (const auto& r : recs) t0 = std::min(t0, r.start_ns);
  for (const auto& r : recs)
    s += fmt::format("{:>10.2f} {:>10.2f} {:>6} {:>6} {:>5}  {}\n", double(r.start_ns - t0) * 1e-3,
                     double(r.end_ns - t0) * 1e-3, r.stream, r.grid, r.block, r.name);
  return s;
}

}  // namespace uf::cuda
