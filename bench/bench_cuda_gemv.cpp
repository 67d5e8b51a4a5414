// bench_cuda_gemv: the FP8 decode GEMV (Fp8Gemv::run_fused / run_fused_group, what DeviceLinear
// runs for T <= 8) at the weights of one TP8 rank, the resident kernel (Fp8GemvPath::kAuto) beside
// the pipelined split-K kernel every plan ran before it (Fp8GemvPath::kPipelined), for M = 1, 2,
// 4, 7, 8 rows. Each figure is a CUDA graph of many launches over distinct weight copies (>= 600
// MB in all, so L2 holds none), the median replay divided by the launches: back-to-back launches
// of one shape overlap through PDL as in the model. Printed per shape: us old / new, the speedup,
// GB/s (weight + scale bytes / time) and the floor at 4.1 TB/s.
// Then a decode layer's sequence, distinct weights per layer, back to back in one graph:
// wq_a|wkv (grouped), wq_b, wo_b, shared w1|w3 (grouped), shared w2; us per layer old / new.
// Also checks that the two paths agree (relative L2 difference; different split groupings, so
// not bitwise). Usage: bench_cuda_gemv [--reps N (200)] [--layers L (40)]

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#ifndef UF_HAVE_CUDA
int main() {
  std::printf("bench_cuda_gemv: built without the CUDA backend\n");
  return 0;
}
#else

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/device_fill.h"
#include "cuda/gemv.h"
#include "cuda_bench_util.h"

using namespace uf::cuda;

namespace {

constexpr double kFloorBw = 4.1e12;  // bytes/s
constexpr int kRows[] = {1, 2, 4, 7, 8};
uint64_t g_seed = 1;

struct Shape {
  const char* name;
  int k;
  std::vector<int> ns;  // grouped weights sharing x
};

// One TP8 rank (rank_slice_config of DeepSeek-V4.1-Flash) and bench_cuda_decode's large shapes.
const Shape kShapes[] = {
    {"wq_a|wkv [1280|512,5120]", 5120, {1280, 512}},
    {"wq_b [4096,1280]", 1280, {4096}},
    {"idx wq_b [512,1280]", 1280, {512}},
    {"wo_b [5120,1024]", 1024, {5120}},
    {"sh w1|w3 [288|288,5120]", 5120, {288, 288}},
    {"sh w2 [5120,288]", 288, {5120}},
    {"4096x5120", 5120, {4096}},
    {"32768x1280", 1280, {32768}},
    {"5120x8192", 8192, {5120}},
    {"engram wkv [25600,6144]", 6144, {25600}},
};

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t n) { UF_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 16))); }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

size_t weight_bytes(int n, int k) { return size_t(n) * k + size_t((n + 31) / 32) * (k / 32); }

// One weight copy: data + scales in one allocation.
struct Weight {
  std::unique_ptr<Buf> buf;
  Fp8WeightView v;
  Weight(int n, int k) : buf(std::make_unique<Buf>(weight_bytes(n, k))) {
    uint8_t* w = buf->as<uint8_t>();
    uint8_t* s = w + size_t(n) * k;
    fill_random_e4m3(w, size_t(n) * k, g_seed++, nullptr);
    fill_random_bytes(s, size_t((n + 31) / 32) * (k / 32), g_seed++, 118, 124, nullptr);
    v = {w, s, n, k};
  }
};

// A group of weights sharing one x: its plans (both paths) and outputs.
struct Group {
  int k;
  std::vector<int> ns;
  std::vector<std::unique_ptr<Fp8Gemv> > fresh, old;
  std::vector<std::unique_ptr<Buf> > outs;
  size_t bytes = 0;
  Group(int k_, const std::vector<int>& ns_, int sms) : k(k_), ns(ns_) {
    for (int n : ns) {
      fresh.push_back(std::make_unique<Fp8Gemv>(n, k, sms));
      old.push_back(std::make_unique<Fp8Gemv>(n, k, sms, Fp8GemvPath::kPipelined));
      outs.push_back(std::make_unique<Buf>(size_t(8) * n * 4));
      bytes += weight_bytes(n, k);
    }
  }
  // ws: this copy's weights, one per n.
  void run(const Weight* ws, const float* x, int m, bool use_old, cudaStream_t s) const {
    Fp8GemvCall calls[kMaxGemvGroup];
    for (size_t i = 0; i < ns.size(); ++i)
      calls[i] = Fp8GemvCall{use_old ? old[i].get() : fresh[i].get(), ws[i].v, outs[i]->as<float>(),
                             true, nullptr};
    Fp8Gemv::run_fused_group(calls, int(ns.size()), x, k, m, s);
  }
  std::string plan() const {
    std::string r;
    for (size_t i = 0; i < ns.size(); ++i) {
      char b[160];
      std::snprintf(b, sizeof b, "%s[n=%d: new %s S=%d kbps=%d C=%d; old S=%d kbps=%d]",
                    i ? " " : "", ns[i], fresh[i]->resident() ? "resident" : "pipelined",
                    fresh[i]->splits(), fresh[i]->kb_per_split(), fresh[i]->cluster(),
                    old[i]->splits(), old[i]->kb_per_split());
      r += b;
    }
    return r;
  }
};

// fp32 x [8, k] in [-2, 2].
std::unique_ptr<Buf> make_x(int k) {
  auto x = std::make_unique<Buf>(size_t(8) * k * 4);
  fill_random_f32(x->as<float>(), size_t(8) * k, g_seed++, 2.0f, nullptr);
  return x;
}

// Relative L2 difference of the two paths' outputs of group g on copy 0 at m = 8.
double path_diff(const Group& g, const Weight* ws, const float* x, cudaStream_t s) {
  double d2 = 0, r2 = 0;
  for (int use_old = 0; use_old < 2; ++use_old) g.run(ws, x, 8, use_old != 0, s);  // warm
  std::vector<std::vector<float> > a(g.ns.size()), b(g.ns.size());
  for (int use_old = 0; use_old < 2; ++use_old) {
    g.run(ws, x, 8, use_old != 0, s);
    UF_CUDA_CHECK(cudaStreamSynchronize(s));
    for (size_t i = 0; i < g.ns.size(); ++i) {
      auto& v = use_old ? b[i] : a[i];
      v.resize(size_t(8) * g.ns[i]);
      UF_CUDA_CHECK(cudaMemcpy(v.data(), g.outs[i]->p, v.size() * 4, cudaMemcpyDeviceToHost));
    }
  }
  for (size_t i = 0; i < g.ns.size(); ++i)
    for (size_t j = 0; j < a[i].size(); ++j) {
      d2 += double(a[i][j] - b[i][j]) * double(a[i][j] - b[i][j]);
      r2 += double(b[i][j]) * double(b[i][j]);
    }
  return std::sqrt(d2 / std::max(r2, 1e-300));
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 200, layers = 40;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    if (!std::strcmp(argv[i], "--layers") && i + 1 < argc)
      layers = std::max(1, std::atoi(argv[++i]));
  }
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs, L2 %d MB; floor at %.1f TB/s; %d replays a figure\n", prop.name,
              sms, prop.l2CacheSize >> 20, kFloorBw / 1e12, reps);
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  std::printf("\n%-26s %2s %9s %9s %7s %8s %8s %8s\n", "shape (run_fused_group)", "M", "old us",
              "new us", "speedup", "old GB/s", "new GB/s", "floor us");
  for (const Shape& sh : kShapes) {
    Group g(sh.k, sh.ns, sms);
    const int copies = int(std::max<size_t>(2, ((size_t(600) << 20) + g.bytes - 1) / g.bytes));
    std::vector<std::vector<Weight> > ws(copies);
    for (auto& c : ws)
      for (int n : sh.ns) c.emplace_back(n, sh.k);
    auto x = make_x(sh.k);
    UF_CUDA_CHECK(cudaDeviceSynchronize());  // the fills ran on the legacy stream
    const double diff = path_diff(g, ws[0].data(), x->as<float>(), s);
    std::printf("%s: %s, %d copies, %.2f MB each; old vs new rel. L2 diff %.2e\n", sh.name,
                g.plan().c_str(), copies, g.bytes / 1e6, diff);
    const double floor_us = g.bytes / kFloorBw * 1e6;
    for (int m : kRows) {
      float us[2];
      for (int use_old = 1; use_old >= 0; --use_old) {
        cudaGraphExec_t exec = uf::bench::capture_graph(s, [&] {
          for (auto& c : ws) g.run(c.data(), x->as<float>(), m, use_old != 0, s);
        });
        us[use_old] = uf::bench::median_replay_us(exec, s, reps) / copies;
        UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
      }
      std::printf("%-26s %2d %9.2f %9.2f %6.2fx %8.0f %8.0f %8.2f\n", sh.name, m, us[1], us[0],
                  us[1] / us[0], g.bytes / (us[1] * 1e-6) / 1e9, g.bytes / (us[0] * 1e-6) / 1e9,
                  floor_us);
    }
  }

  // ---- A decode layer's GEMVs back to back, distinct weights per layer ----
  {
    const Shape seq[] = {kShapes[0], kShapes[1], kShapes[3], kShapes[4], kShapes[5]};
    std::vector<std::unique_ptr<Group> > gs;
    std::vector<std::unique_ptr<Buf> > xs;
    size_t layer_bytes = 0;
    for (const Shape& sh : seq) {
      gs.push_back(std::make_unique<Group>(sh.k, sh.ns, sms));
      xs.push_back(make_x(sh.k));
      layer_bytes += gs.back()->bytes;
    }
    std::vector<std::vector<std::vector<Weight> > > w(layers);  // [layer][gemv][weight]
    for (auto& l : w)
      for (const Shape& sh : seq) {
        l.emplace_back();
        for (int n : sh.ns) l.back().emplace_back(n, sh.k);
      }
    UF_CUDA_CHECK(cudaDeviceSynchronize());
    const double floor_us = layer_bytes / kFloorBw * 1e6;
    std::printf(
        "\nlayer sequence (wq_a|wkv, wq_b, wo_b, sh w1|w3, sh w2; %d layers, %.2f MB a layer):\n"
        "%2s %12s %12s %7s %12s %8s\n",
        layers, layer_bytes / 1e6, "M", "old us/layer", "new us/layer", "speedup", "floor us",
        "new GB/s");
    for (int m : kRows) {
      float us[2];
      for (int use_old = 1; use_old >= 0; --use_old) {
        cudaGraphExec_t exec = uf::bench::capture_graph(s, [&] {
          for (auto& l : w)
            for (size_t i = 0; i < gs.size(); ++i)
              gs[i]->run(l[i].data(), xs[i]->as<float>(), m, use_old != 0, s);
        });
        us[use_old] = uf::bench::median_replay_us(exec, s, reps) / layers;
        UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
      }
      std::printf("%2d %12.2f %12.2f %6.2fx %12.2f %8.0f\n", m, us[1], us[0], us[1] / us[0],
                  floor_us, layer_bytes / (us[0] * 1e-6) / 1e9);
    }
  }
  UF_CUDA_CHECK(cudaStreamDestroy(s));
  return 0;
}

#endif  // UF_HAVE_CUDA
