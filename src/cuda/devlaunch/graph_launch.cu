// Device-side graph launch (graph_launch.h).
#include "cuda/devlaunch/graph_launch.h"

namespace uf::cuda {

namespace {

__device__ int g_launch_error = 0;

__global__ void tail_launch_kernel(cudaGraphExec_t target) {
  const cudaError_t err = cudaGraphLaunch(target, cudaStreamGraphTailLaunch);
  if (err != cudaSuccess) g_launch_error = int(err);
}

}  // namespace

cudaError_t make_device_launcher(cudaGraphExec_t target, cudaGraphExec_t* launcher) {
  *launcher = nullptr;
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaGraphCreate(&graph, 0);
  if (err != cudaSuccess) return err;
  void* args[] = {&target};
  cudaKernelNodeParams p = {};
  p.func = reinterpret_cast<void*>(tail_launch_kernel);
  p.gridDim = dim3(1);
  p.blockDim = dim3(1);
  p.kernelParams = args;
  cudaGraphNode_t node = nullptr;
  err = cudaGraphAddKernelNode(&node, graph, nullptr, 0, &p);
  if (err == cudaSuccess) err = cudaGraphInstantiate(launcher, graph, 0);
  cudaGraphDestroy(graph);
  return err;
}

cudaError_t take_device_launch_error() {
  int v = 0;
  cudaError_t err = cudaMemcpyFromSymbol(&v, g_launch_error, sizeof(v));
  if (err != cudaSuccess) return err;
  if (v != 0) {
    const int zero = 0;
    err = cudaMemcpyToSymbol(g_launch_error, &zero, sizeof(zero));
    if (err != cudaSuccess) return err;
  }
  return cudaError_t(v);
}

}  // namespace uf::cuda
