// bench_cuda_sync: what a dependency between two steps of the decode chain costs on this GPU, by
// mechanism. The decode step is ~20 PDL-launched kernels a layer whose own work is often ~1 us;
// this bench separates the price of the boundary from the work, to decide what a fused or
// persistent layer would gain. Every figure is the median CUDA-graph replay divided by the number
// of dependent steps in the graph (N = 64), in microseconds a step.
//
//   kernel chain, PDL     N kernels of G CTAs x 256 threads, each launched with programmatic
//                         stream serialization; thread 0 of CTA b reads one int the previous
//                         kernel wrote (CTA (b + 1) % G_prev, L2) and writes its own. "early":
//                         griddepcontrol.launch_dependents first (the next kernel's CTAs become
//                         resident and wait), "exit": the implicit trigger at each CTA's exit.
//   kernel chain, plain   the same launches without the PDL attribute (stream order).
//   big -> small          alternating 160-CTA and 2-CTA kernels (hc_post -> hc_pre's shape).
//   split + finish        a G-CTA kernel writing G partials, then a 1-CTA kernel summing them: the
//                         two-launch form of a split-K reduction (N pairs, figure per pair).
//   last-CTA finish       one G-CTA kernel: each CTA writes its partial, fences and takes a ticket;
//                         the last CTA sums the partials and resets the ticket (graph replays).
//   grid barrier          one kernel of G <= SM-count CTAs (co-resident), N phases separated by a
//                         counter barrier (red.release + ld.acquire spin); the same data flow.
//   flag handoff          one kernel, N phases, CTA b of phase p + 1 waits only on the flag of CTA
//                         (b + 1) % G of phase p (st.release / ld.acquire): a point-to-point edge.
//   L2 round trip         one thread chasing a pointer ring in L2 (ld.cg): ns a dependent load.
//
//   bench_cuda_sync [--reps N]

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/kernels/common.cuh"
#include "cuda_bench_util.h"

namespace {

constexpr int kSteps = 64;
constexpr int kThreads = 256;

using uf::cuda::detail::pdl_trigger;
using uf::cuda::detail::pdl_wait;

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__global__ void __launch_bounds__(kThreads)
    chain_kernel(const int* prev, int g_prev, int* cur, int early) {
  if (early) pdl_trigger();
  pdl_wait();
  if (threadIdx.x == 0) cur[blockIdx.x] = __ldcg(prev + (blockIdx.x + 1) % g_prev) + 1;
}

__global__ void __launch_bounds__(kThreads) partial_kernel(const int* prev, int* partials) {
  pdl_trigger();
  pdl_wait();
  if (threadIdx.x == 0) partials[blockIdx.x] = __ldcg(prev) + int(blockIdx.x);
}

// The block's sum of partials[0..g) into *out (thread 0 stores; the block calls it together).
__device__ void block_sum_store(const int* partials, int g, int* out) {
  __shared__ int warp_sum[kThreads / 32];
  int v = 0;
  for (int i = threadIdx.x; i < g; i += kThreads) v += __ldcg(partials + i);
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) warp_sum[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    int s = 0;
    for (int w = 0; w < kThreads / 32; ++w) s += warp_sum[w];
    *out = s;
  }
}

__global__ void __launch_bounds__(kThreads) finish_kernel(const int* partials, int g, int* out) {
  pdl_trigger();
  pdl_wait();
  block_sum_store(partials, g, out);
}

__global__ void __launch_bounds__(kThreads)
    ticket_kernel(const int* prev, int* partials, unsigned* ticket, int* out) {
  pdl_trigger();
  pdl_wait();
  __shared__ bool last;
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = __ldcg(prev) + int(blockIdx.x);
    __threadfence();
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  block_sum_store(partials, int(gridDim.x), out);
  if (threadIdx.x == 0) *ticket = 0;  // the next replay (the kernel boundary orders it)
}

// counter: zeroed by the graph before the kernel.
__global__ void __launch_bounds__(kThreads)
    barrier_kernel(int* buf, unsigned* counter, int phases) {
  const int g = gridDim.x, b = blockIdx.x;
  for (int p = 0; p < phases; ++p) {
    if (threadIdx.x == 0) {
      const int* src = buf + (p % 2) * g;
      buf[((p + 1) % 2) * g + b] = __ldcg(src + (b + 1) % g) + 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      red_release_add(counter, 1u);
      const unsigned target = unsigned(g) * unsigned(p + 1);
      while (ld_acquire(counter) < target) {
      }
    }
    __syncthreads();
  }
}

// flags[p * g + b] = the replay's epoch once CTA b has written phase p's value (bumped by the
// kernel before, so the flags need no reset).
__global__ void bump_epoch(unsigned* epoch) { *epoch += 1; }
__global__ void flag_kernel(int* vals, unsigned* flags, int phases, const unsigned* epoch_p) {
  const unsigned epoch = *epoch_p;
  const int g = gridDim.x, b = blockIdx.x;
  if (threadIdx.x != 0) return;
  int v = b;
  for (int p = 0; p < phases; ++p) {
    if (p > 0) {
      const int src = (b + 1) % g;
      while (ld_acquire(flags + (p - 1) * g + src) != epoch) {
      }
      v = __ldcg(vals + (p - 1) * g + src) + 1;
    }
    vals[p * g + b] = v;
    st_release(flags + p * g + b, epoch);
  }
}

__global__ void chase_kernel(const int* ring, int hops, int* out) {
  int i = 0;
  for (int h = 0; h < hops; ++h) i = __ldcg(ring + i);
  *out = i;
}

template <typename Kernel, typename... Args>
void launch(bool pdl, Kernel kernel, int grid, cudaStream_t s, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  UF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 50;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);

  cudaDeviceProp prop;
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs; figures: us per dependent step (graph of %d steps)\n", prop.name,
              sms, kSteps);

  cudaStream_t s;
  UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int kMaxG = 1024;
  int *bufs, *partials, *out;
  unsigned *ticket, *counter, *flags, *epoch;
  UF_CUDA_CHECK(cudaMalloc(&bufs, size_t(kSteps + 1) * kMaxG * sizeof(int)));
  UF_CUDA_CHECK(cudaMalloc(&partials, kMaxG * sizeof(int)));
  UF_CUDA_CHECK(cudaMalloc(&out, sizeof(int)));
  UF_CUDA_CHECK(cudaMalloc(&ticket, sizeof(unsigned)));
  UF_CUDA_CHECK(cudaMalloc(&counter, sizeof(unsigned)));
  UF_CUDA_CHECK(cudaMalloc(&flags, size_t(kSteps) * kMaxG * sizeof(unsigned)));
  UF_CUDA_CHECK(cudaMalloc(&epoch, sizeof(unsigned)));
  UF_CUDA_CHECK(cudaMemset(bufs, 0, size_t(kSteps + 1) * kMaxG * sizeof(int)));
  UF_CUDA_CHECK(cudaMemset(ticket, 0, sizeof(unsigned)));
  UF_CUDA_CHECK(cudaMemset(flags, 0, size_t(kSteps) * kMaxG * sizeof(unsigned)));
  UF_CUDA_CHECK(cudaMemset(epoch, 0, sizeof(unsigned)));

  auto per_step = [&](auto&& body) { return uf::bench::time_graph_us(s, reps, body) / kSteps; };
  auto chain = [&](bool pdl, int early, int g_a, int g_b) {
    return per_step([&] {
      for (int i = 0; i < kSteps; ++i) {
        const int g = i % 2 ? g_b : g_a, g_prev = i % 2 ? g_a : g_b;
        launch(pdl, chain_kernel, g, s, (const int*)(bufs + size_t(i) * kMaxG), g_prev,
               bufs + size_t(i + 1) * kMaxG, early);
      }
    });
  };

  std::printf("\n%-34s %8s %8s %8s %8s\n", "mechanism", "G=1", "G=8", "G=132", "G=264");
  const int gs[4] = {1, 8, sms, 2 * sms};
  auto row = [&](const char* name, auto&& fig) {
    std::printf("%-34s", name);
    for (int g : gs) std::printf(" %8.2f", fig(g));
    std::printf("\n");
  };
  row("kernel chain, PDL, early trigger", [&](int g) { return chain(true, 1, g, g); });
  row("kernel chain, PDL, trigger at exit", [&](int g) { return chain(true, 0, g, g); });
  row("kernel chain, plain stream order", [&](int g) { return chain(false, 0, g, g); });
  row("split + finish (per pair), PDL", [&](int g) {
    return per_step([&] {
      for (int i = 0; i < kSteps; ++i) {
        launch(true, partial_kernel, g, s, (const int*)out, partials);
        launch(true, finish_kernel, 1, s, (const int*)partials, g, out);
      }
    });
  });
  row("last-CTA finish (one kernel), PDL", [&](int g) {
    return per_step([&] {
      for (int i = 0; i < kSteps; ++i)
        launch(true, ticket_kernel, g, s, (const int*)out, partials, ticket, out);
    });
  });
  row("grid barrier (G <= SMs)", [&](int g) {
    if (g > sms) return 0.f;
    return per_step([&] {
      UF_CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof(unsigned), s));
      launch(false, barrier_kernel, g, s, bufs, counter, kSteps);
    });
  });
  row("flag handoff (G <= SMs)", [&](int g) {
    if (g > sms) return 0.f;
    return per_step([&] {
      launch(false, bump_epoch, 1, s, epoch);
      launch(false, flag_kernel, g, s, bufs, flags, kSteps, (const unsigned*)epoch);
    });
  });
  std::printf("%-34s %8.2f   (160 -> 2 -> 160 ...)\n", "big -> small -> big, PDL early",
              chain(true, 1, 160, 2));

  // L2 round trip: a ring of 64 Ki ints with stride 33 (within L2, not in L1: ld.cg).
  {
    const int n = 1 << 16, hops = 4096;
    std::vector<int> ring(n);
    for (int i = 0; i < n; ++i) ring[i] = (i + 33 * 32) % n;
    int* d_ring;
    UF_CUDA_CHECK(cudaMalloc(&d_ring, n * sizeof(int)));
    UF_CUDA_CHECK(cudaMemcpy(d_ring, ring.data(), n * sizeof(int), cudaMemcpyHostToDevice));
    const float us =
        uf::bench::time_graph_us(s, reps, [&] { chase_kernel<<<1, 1, 0, s>>>(d_ring, hops, out); });
    std::printf("%-34s %8.1f ns a dependent load\n", "L2 round trip (ld.cg chase)",
                us * 1000.f / hops);
    UF_CUDA_CHECK(cudaFree(d_ring));
  }
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  return 0;
}
