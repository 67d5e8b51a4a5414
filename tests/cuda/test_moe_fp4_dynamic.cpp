// MoeFp4's persistent decode kernels with dynamic unit scheduling (MoeFp4::set_dynamic_units /
// set_dynamic_tuning; moe_fp4.cu: WorkSource): warps take a static share of the units, then claim
// batches from a device counter that the last warp to finish sets back to 0. Which warp runs a
// unit must not change any bit, so every tuning is compared with MoeFp4Prefill (an independent
// implementation of the same operations and order): bitwise, no tolerance. Each case makes
// several consecutive calls, and a CUDA graph is replayed, each with NEW inputs (routing too): a
// counter not back at 0 would skip units and leave the previous call's h / y in the workspace,
// which then differ. A small sm_count (few warps, many units each) interleaves the claims, so a
// warp's batches jump between w13 groups (publication at each batch end) and span groups.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "cuda/moe.h"
#include "cuda_test_util.h"
#include "moe_test_util.h"

namespace uf::cuda::test {
namespace {

// Restores the process-wide defaults when a test ends (pass or fail).
struct TuningGuard {
  ~TuningGuard() {
    MoeFp4::set_dynamic_units(true);
    MoeFp4::set_dynamic_tuning(50, 1, 1);
  }
};

struct Tuning {
  bool dynamic;
  int static_pct, batch_w13, batch_w2;
};
constexpr Tuning kTunings[] = {
    {false, 100, 1, 1},  // static ranges only
    {true, 50, 1, 1},    // the defaults
    {true, 0, 1, 1},     // all units claimed
    {true, 0, 3, 2},     // batches that straddle w13 groups (4 * splits units) and w2 slots
    {true, 30, 7, 5},
    {true, 99, 1, 1},  // a pool of 1%: a few claims, then mostly the finished tickets
};

void compare_dynamic(int E, int dim, int inter, int sm_count, uint64_t seed) {
  TuningGuard guard;
  std::mt19937 rng{uint32_t(seed)};
  const Experts x(E, dim, inter, seed);
  MoeFp4Prefill pre(dim, inter, kTopk, E, 8);
  MoeFp4 moe(dim, inter, kTopk, sm_count);
  moe.set_legacy(true);  // the persistent kernels at every M
  for (const Tuning& tu : kTunings) {
    MoeFp4::set_dynamic_units(tu.dynamic);
    MoeFp4::set_dynamic_tuning(tu.static_pct, tu.batch_w13, tu.batch_w2);
    for (int f16 = 0; f16 < 2; ++f16) {
      moe.set_f16(f16 == 1);
      for (int m : {1, 3, 5, 8})
        for (Entry entry : {Entry::kRun, Entry::kPartial, Entry::kExperts})
          for (int rep = 0; rep < 2; ++rep) {  // consecutive calls, fresh inputs each
            const Inputs in = random_inputs(m, dim, E, rng);
            EXPECT_TRUE(bitwise_equal(call(pre, entry, x, in, m), call(moe, entry, x, in, m), dim))
                << "dynamic " << tu.dynamic << " static " << tu.static_pct << "% batches "
                << tu.batch_w13 << " / " << tu.batch_w2 << ", " << (f16 ? "f16" : "e4m3")
                << ", dim " << dim << " inter " << inter << " sm_count " << sm_count << " m " << m
                << " " << entry_name(entry) << " call " << rep;
          }
    }
  }
}

TEST(CudaMoeFp4Dynamic, BitwiseEqualsPrefillAcrossTunings) {
  UF_REQUIRE_GPU();
  // dim 640: 20 K blocks (w13 splits of 16 + 4: units of 2 and 1 chunks, upg = 8); 2 SMs' worth
  // of CTAs: 32 w13 warps, 32 w2 warps for hundreds of units.
  compare_dynamic(10, 640, 96, 2, 401);
  // dim 2048: 4 splits of 2 chunks; inter 288: 9 w2 K blocks; the device's grid.
  compare_dynamic(16, 2048, 288, device_sm_count(), 402);
  compare_dynamic(16, 1024, 256, 3, 403);
}

TEST(CudaMoeFp4Dynamic, GraphReplaysWithNewInputs) {
  UF_REQUIRE_GPU();
  TuningGuard guard;
  MoeFp4::set_dynamic_units(true);
  MoeFp4::set_dynamic_tuning(25, 1, 1);
  const int E = 12, dim = 1024, inter = 192, m = 7;
  std::mt19937 rng{404};
  const Experts x(E, dim, inter, 405);
  MoeFp4Prefill pre(dim, inter, kTopk, E, 8);
  MoeFp4 moe(dim, inter, kTopk, 4);
  moe.set_legacy(true);
  Inputs in = random_inputs(m, dim, E, rng);
  DeviceBuffer<uint8_t> a(in.codes);
  DeviceBuffer<float> as(in.scales);
  DeviceBuffer<int> di(in.idx);
  DeviceBuffer<float> dw(in.wts);
  DeviceBuffer<float> out(size_t(m) * dim);
  const QuantActView act{a.get(), as.get(), m, dim};
  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  UF_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  moe.run(x.view(), act, di.get(), dw.get(), kLimit, out.get(), s);
  UF_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  UF_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 4; ++rep) {
    if (rep > 0) {  // new inputs in the captured buffers
      in = random_inputs(m, dim, E, rng);
      a.upload(in.codes);
      as.upload(in.scales);
      di.upload(in.idx);
      dw.upload(in.wts);
    }
    out.poison();
    UF_CUDA_CHECK(cudaGraphLaunch(exec, s));
    UF_CUDA_CHECK(cudaStreamSynchronize(s));
    EXPECT_TRUE(bitwise_equal(call(pre, Entry::kRun, x, in, m), out.download(), dim))
        << "graph replay " << rep;
  }
  UF_CUDA_CHECK(cudaGraphExecDestroy(exec));
  UF_CUDA_CHECK(cudaGraphDestroy(graph));
  UF_CUDA_CHECK(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace uf::cuda::test
