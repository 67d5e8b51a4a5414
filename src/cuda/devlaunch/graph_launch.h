// Device-side graph launch (CUDA 12+): the host launches a one-node "launcher" graph whose kernel
// launches the step graph from the device (tail launch), so the host pays for one node, not for
// the step graph's ~1,000 kernel nodes and their branches.
//
// Why: `cudaGraphLaunch` of a decode step's graph cost the host 39-57 us on the H200 (bench-host,
// session 6), over the 20 us budget between two steps. Measured (session 7, H200): the launch call
// fell from 32 to 18 us, but the device ran the step 40-120 us longer, so it is off by default
// (CudaModelOptions::device_graph_launch).
// The step graph must be instantiated with cudaGraphInstantiateFlagDeviceLaunch and uploaded
// (cudaGraphUpload) before its first device launch; graphs that cannot (node kinds a device graph
// does not allow) keep the host launch (CudaModel::launch_program falls back).
// Ordering: a tail-launched graph runs after its launcher completes, and later work in the
// launcher's stream waits for it (the launcher's execution includes its tail launch).
// This file is compiled apart (uf_cuda_devlaunch, relocatable device code + cudadevrt): the
// device runtime's cudaGraphLaunch needs them, the rest of uf_cuda does not.
#pragma once

#include <cuda_runtime.h>

namespace uf::cuda {

// A host-launchable graph of one kernel that tail-launches `target` (a device-launchable,
// uploaded executable graph). The caller owns the result (cudaGraphExecDestroy).
cudaError_t make_device_launcher(cudaGraphExec_t target, cudaGraphExec_t* launcher);

// The error of the last device-side launch that failed on this device (cudaSuccess if none),
// and reset. Valid after the launcher's stream is synchronised.
cudaError_t take_device_launch_error();

}  // namespace uf::cuda
