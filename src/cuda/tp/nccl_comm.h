#pragma once
// Tensor-parallel collectives for one process driving N local GPUs (one communicator per device,
// ncclCommInitAll). NCCL is loaded at run time with dlopen("libnccl.so.2") so that a single-GPU
// build and the TP = 1 path need no NCCL at all, and the GPU machine's NCCL (e.g. the one of its
// Python `nvidia-nccl` package) can be used through LD_LIBRARY_PATH, or UF_NCCL_LIB = full path.
//
// NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE is set to 0 before the first communicator
// when unset, and a group refuses to start when it is set to anything else.
//
// Every collective is enqueued on each rank's stream (in one ncclGroupStart/End), so it orders
// with the kernels around it and can be captured in a CUDA graph; nothing here synchronizes.

#include <cuda_runtime.h>

#include <barrier>
#include <memory>
#include <string>
#include <vector>

struct ncclComm;  // nccl.h: typedef struct ncclComm* ncclComm_t

namespace uf::cuda::tp {

class PeerAllReduce;  // p2p_allreduce.h

enum class CommDType { kF32, kBF16, kU8, kI32 };
size_t comm_dtype_size(CommDType t);

// The NCCL entry points this wrapper uses, resolved with dlsym. Loading throws uf::core::Error
// ("NCCL not found: set LD_LIBRARY_PATH ...") when the library or a symbol is missing.
struct NcclLib;
// The process-wide library (loaded once, never unloaded): UF_NCCL_LIB if set, else
// libnccl.so.2 from the loader's search path.
const NcclLib& nccl();
// Loads the library at `path` (a fresh handle; for tests and diagnostics).
std::shared_ptr<const NcclLib> load_nccl(const std::string& path);
// "2.28.9": the loaded library's version (loads it).
std::string nccl_version_string(const NcclLib& lib);
// Sets NCCL_NVLS_ENABLE=0 if unset; throws if it is set to anything other than 0.
void require_nvls_off();

class TpGroup {
 public:
  // A group of n ranks on `devices` (default 0..n-1): rank r drives devices[r]. n = 1 loads no
  // NCCL and its collectives are no-ops (all-gather: a copy when the buffers differ). Throws
  // when n < 1, when n exceeds the device count, on repeated devices, or when NCCL is needed
  // and missing.
  static std::unique_ptr<TpGroup> create(int n, std::vector<int> devices = {});
  ~TpGroup();
  TpGroup(const TpGroup&) = delete;
  TpGroup& operator=(const TpGroup&) = delete;

  int size() const { return int(devices_.size()); }
  int device(int rank) const { return devices_.at(size_t(rank)); }

  // In place: bufs[r] (count elements on device(r)) becomes the sum over all ranks, on
  // streams[r] (empty: each device's default stream). dtype: kF32 or kBF16. NCCL sums bf16 in
  // bf16 steps (one rounding per reduction step), fp32 in fp32; with 2 ranks both are exactly
  // round(a + b).
  void all_reduce_sum(const std::vector<void*>& bufs, size_t count, CommDType dtype,
                      const std::vector<cudaStream_t>& streams = {});
  void all_reduce_sum_f32(const std::vector<float*>& bufs, size_t count,
                          const std::vector<cudaStream_t>& streams = {});
  // bufs hold bf16 values (uint16_t / __nv_bfloat16).
  void all_reduce_sum_bf16(const std::vector<void*>& bufs, size_t count,
                           const std::vector<cudaStream_t>& streams = {});
  // recv[r] (n * count elements on device(r)) receives every rank's send (count elements) in
  // rank order: rank q's slice at offset q * count. send[r] may be recv[r] + r * count (in place).
  void all_gather(const std::vector<const void*>& send, const std::vector<void*>& recv,
                  size_t count, CommDType dtype, const std::vector<cudaStream_t>& streams = {});

  // Per-rank entry: rank `rank`'s part of an in-place sum, enqueued on `stream` (of
  // device(rank)). Each rank calls it from its own thread, all ranks in the same collective
  // order (one thread per communicator: no group calls needed). n = 1: a no-op.
  void all_reduce_sum_rank(int rank, void* buf, size_t count, CommDType dtype, cudaStream_t stream);
  // Per-rank all-gather (same threading rule): recv (n * count elements on device(rank)) gets
  // every rank's send in rank order. n = 1: a copy when send != recv.
  void all_gather_rank(int rank, const void* send, void* recv, size_t count, CommDType dtype,
                       cudaStream_t stream);

  // The one-shot peer-to-peer fp32 sum over the same devices (p2p_allreduce.h), when the owner
  // attached one (CudaBackend does where every pair of GPUs has peer access); null otherwise.
  // Its buffers are freed with the group, after every rank's model.
  void attach_peer_all_reduce(std::unique_ptr<PeerAllReduce> p);
  PeerAllReduce* peer_all_reduce() const { return p2p_.get(); }

  // Host barrier of the ranks' threads: returns once every rank has called it (n = 1: at once).
  // Why (a precaution, as NCCL documents for cudaFree during its collectives): freeing device or
  // pinned memory (cudaFree, cudaFreeHost, a graph's destruction) may wait for the work of every
  // device that maps it, peers included, so a rank that frees while a peer's collective waits
  // for this rank's next call could deadlock both. A rank allocates and frees in a phase of its
  // own, and crosses this barrier before its first collective.
  void host_barrier();

 private:
  TpGroup() = default;
  cudaStream_t stream_of(const std::vector<cudaStream_t>& streams, int rank) const;
  void check_args(size_t n_bufs, size_t n_bufs2, const std::vector<cudaStream_t>& streams,
                  const char* what) const;

  std::vector<int> devices_;
  std::vector<ncclComm*> comms_;  // empty for n = 1
  const NcclLib* lib_ = nullptr;
  std::unique_ptr<PeerAllReduce> p2p_;
  std::unique_ptr<std::barrier<>> barrier_;
};

}  // namespace uf::cuda::tp
