#include "cuda/tp/nccl_comm.h"

#include <dlfcn.h>

// Types and enums only: every NCCL function is called through a pointer resolved with dlsym, so
// nothing links against libnccl. Where nccl.h is absent (a CUDA toolkit without NCCL), the few
// types used are declared here with the values of NCCL 2.x's stable ABI; where it is present,
// the static_asserts below check those values against it.
#if __has_include(<nccl.h>)
#include <nccl.h>
#define UF_HAVE_NCCL_H 1
#else
extern "C" {
typedef struct ncclComm* ncclComm_t;
typedef struct {
  char internal[128];
} ncclUniqueId;
typedef enum { ncclSuccess = 0 } ncclResult_t;
typedef enum { ncclSum = 0 } ncclRedOp_t;
typedef enum { ncclUint8 = 1, ncclInt32 = 2, ncclFloat32 = 7, ncclBfloat16 = 9 } ncclDataType_t;
}
#endif

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "cuda/cuda_check.h"
#include "cuda/tp/p2p_allreduce.h"

#ifdef UF_HAVE_NCCL_H
static_assert(sizeof(ncclUniqueId) == 128 && ncclSuccess == 0 && ncclSum == 0);
static_assert(ncclUint8 == 1 && ncclInt32 == 2 && ncclFloat32 == 7 && ncclBfloat16 == 9);
#endif

namespace uf::cuda::tp {

struct NcclLib {
  void* handle = nullptr;
  std::string path;
  int version = 0;
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitAll)(ncclComm_t*, int, const int*) = nullptr;
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t) = nullptr;
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                            cudaStream_t) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;

  // Throws with the call and NCCL's own sentence for the code.
  void check(ncclResult_t r, const char* call) const {
    if (r == ncclSuccess) return;
    core::fail("NCCL call {} failed: {} (code {}, NCCL {})", call,
               GetErrorString ? GetErrorString(r) : "?", int(r), path);
  }
};

namespace {

constexpr const char* kHint =
    "set LD_LIBRARY_PATH to the folder holding libnccl.so.2 (with pip's NCCL: "
    "$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))')/lib) "
    "or UF_NCCL_LIB to its full path";

template <typename F>
void resolve(const NcclLib& lib, F& fn, const char* name) {
  dlerror();
  void* p = dlsym(lib.handle, name);
  const char* why = dlerror();
  UF_CHECK(p != nullptr, "NCCL library {} lacks the symbol {} ({}): {}", lib.path, name,
           why ? why : "null symbol", kHint);
  fn = reinterpret_cast<F>(p);
}

ncclDataType_t nccl_type(CommDType t) {
  switch (t) {
    case CommDType::kF32:
      return ncclFloat32;
    case CommDType::kBF16:
      return ncclBfloat16;
    case CommDType::kU8:
      return ncclUint8;
    case CommDType::kI32:
      return ncclInt32;
  }
  core::fail("unknown CommDType {}", int(t));
}

// Restores the calling thread's current device when a TpGroup call returns or throws.
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&dev_); }
  ~DeviceGuard() { cudaSetDevice(dev_); }

 private:
  int dev_ = 0;
};

}  // namespace

size_t comm_dtype_size(CommDType t) {
  switch (t) {
    case CommDType::kF32:
    case CommDType::kI32:
      return 4;
    case CommDType::kBF16:
      return 2;
    case CommDType::kU8:
      return 1;
  }
  return 0;
}

std::shared_ptr<const NcclLib> load_nccl(const std::string& path) {
  auto lib = std::make_shared<NcclLib>();
  lib->path = path;
  dlerror();
  lib->handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib->handle) {
    const char* why = dlerror();
    core::fail("NCCL not found (dlopen {}: {}): {}", path, why ? why : "unknown error", kHint);
  }
  resolve(*lib, lib->GetErrorString, "ncclGetErrorString");
  resolve(*lib, lib->GetVersion, "ncclGetVersion");
  resolve(*lib, lib->GetUniqueId, "ncclGetUniqueId");
  resolve(*lib, lib->CommInitAll, "ncclCommInitAll");
  resolve(*lib, lib->CommInitRank, "ncclCommInitRank");
  resolve(*lib, lib->AllReduce, "ncclAllReduce");
  resolve(*lib, lib->AllGather, "ncclAllGather");
  resolve(*lib, lib->GroupStart, "ncclGroupStart");
  resolve(*lib, lib->GroupEnd, "ncclGroupEnd");
  resolve(*lib, lib->CommDestroy, "ncclCommDestroy");
  lib->check(lib->GetVersion(&lib->version), "ncclGetVersion");
  // The enums and ncclUniqueId of nccl.h are stable across NCCL 2.x; 2.x codes from 2.9 on are
  // major*10000 + minor*100 + patch.
  UF_CHECK(lib->version >= 20900 && lib->version < 30000,
           "NCCL {} has version code {}: need NCCL 2.9 .. 2.x (the nccl.h ABI this build uses)",
           path, lib->version);
  return lib;
}

const NcclLib& nccl() {
  static std::shared_ptr<const NcclLib> lib;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (!lib) {
    const char* env = std::getenv("UF_NCCL_LIB");
    lib = load_nccl(env && *env ? env : "libnccl.so.2");
    spdlog::info("NCCL {} loaded from {}", nccl_version_string(*lib), lib->path);
  }
  return *lib;
}

std::string nccl_version_string(const NcclLib& lib) {
  const int v = lib.version;
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

void require_nvls_off() {
  const char* v = std::getenv("NCCL_NVLS_ENABLE");
  if (v == nullptr) {
    // Before the first communicator: NCCL reads its environment at init.
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    return;
  }
  UF_CHECK(std::strcmp(v, "0") == 0,
           "NCCL_NVLS_ENABLE is set to '{}': NVLink multicast must stay off on these machines; "
           "unset it or set it to 0",
           v);
}

std::unique_ptr<TpGroup> TpGroup::create(int n, std::vector<int> devices) {
  UF_CHECK(n >= 1, "TpGroup: {} ranks requested; need at least 1", n);
  if (n > 1) require_nvls_off();
  int n_dev = 0;
  const cudaError_t err = cudaGetDeviceCount(&n_dev);
  UF_CHECK(err == cudaSuccess, "TpGroup: cannot count CUDA devices ({}): no GPU or driver?",
           cudaGetErrorString(err));
  UF_CHECK(n <= n_dev, "TpGroup: {} ranks requested but this machine has {} CUDA device(s)", n,
           n_dev);
  if (devices.empty())
    for (int i = 0; i < n; ++i) devices.push_back(i);
  UF_CHECK(int(devices.size()) == n, "TpGroup: {} ranks but {} devices given", n, devices.size());
  std::set<int> seen;
  for (int d : devices) {
    UF_CHECK(d >= 0 && d < n_dev, "TpGroup: device {} is outside 0..{}", d, n_dev - 1);
    UF_CHECK(seen.insert(d).second, "TpGroup: device {} is given twice", d);
  }
  std::unique_ptr<TpGroup> g(new TpGroup());
  g->devices_ = devices;
  g->barrier_ = std::make_unique<std::barrier<>>(n);
  if (n == 1) return g;
  g->lib_ = &nccl();
  DeviceGuard guard;
  g->comms_.assign(size_t(n), nullptr);
  g->lib_->check(g->lib_->CommInitAll(g->comms_.data(), n, devices.data()), "ncclCommInitAll");
  spdlog::info("TpGroup: {} ranks on NCCL {} (NVLS off)", n, nccl_version_string(*g->lib_));
  return g;
}

void TpGroup::host_barrier() { barrier_->arrive_and_wait(); }

TpGroup::~TpGroup() {
  p2p_.reset();
  for (ncclComm* c : comms_)
    if (c) lib_->CommDestroy(c);  // no throw from a destructor; errors here are not actionable
}

void TpGroup::attach_peer_all_reduce(std::unique_ptr<PeerAllReduce> p) {
  if (p) {
    UF_CHECK(p->size() == size(), "TpGroup: a peer all-reduce of {} ranks for a group of {}",
             p->size(), size());
    for (int r = 0; r < size(); ++r)
      UF_CHECK(p->device(r) == device(r),
               "TpGroup: the peer all-reduce puts rank {} on device {}, the group on device {}", r,
               p->device(r), device(r));
  }
  p2p_ = std::move(p);
}

cudaStream_t TpGroup::stream_of(const std::vector<cudaStream_t>& streams, int rank) const {
  return streams.empty() ? cudaStream_t(nullptr) : streams[size_t(rank)];
}

void TpGroup::check_args(size_t n_bufs, size_t n_bufs2, const std::vector<cudaStream_t>& streams,
                         const char* what) const {
  const size_t n = devices_.size();
  UF_CHECK(n_bufs == n && n_bufs2 == n, "TpGroup::{}: {} / {} buffers for {} ranks", what, n_bufs,
           n_bufs2, n);
  UF_CHECK(streams.empty() || streams.size() == n, "TpGroup::{}: {} streams for {} ranks", what,
           streams.size(), n);
}

void TpGroup::all_reduce_sum(const std::vector<void*>& bufs, size_t count, CommDType dtype,
                             const std::vector<cudaStream_t>& streams) {
  check_args(bufs.size(), bufs.size(), streams, "all_reduce_sum");
  UF_CHECK(dtype == CommDType::kF32 || dtype == CommDType::kBF16,
           "TpGroup::all_reduce_sum: only fp32 and bf16 sums are supported");
  if (size() == 1 || count == 0) return;
  DeviceGuard guard;
  lib_->check(lib_->GroupStart(), "ncclGroupStart");
  for (int r = 0; r < size(); ++r) {
    UF_CUDA_CHECK(cudaSetDevice(devices_[size_t(r)]));
    const ncclResult_t res =
        lib_->AllReduce(bufs[size_t(r)], bufs[size_t(r)], count, nccl_type(dtype), ncclSum,
                        comms_[size_t(r)], stream_of(streams, r));
    if (res != ncclSuccess) {
      lib_->GroupEnd();
      lib_->check(res, "ncclAllReduce");
    }
  }
  lib_->check(lib_->GroupEnd(), "ncclGroupEnd (all-reduce)");
}

void TpGroup::all_reduce_sum_rank(int rank, void* buf, size_t count, CommDType dtype,
                                  cudaStream_t stream) {
  UF_CHECK(rank >= 0 && rank < size(), "TpGroup::all_reduce_sum_rank: rank {} outside 0..{}", rank,
           size() - 1);
  UF_CHECK(dtype == CommDType::kF32 || dtype == CommDType::kBF16,
           "TpGroup::all_reduce_sum_rank: only fp32 and bf16 sums are supported");
  if (size() == 1 || count == 0) return;
  DeviceGuard guard;
  UF_CUDA_CHECK(cudaSetDevice(devices_[size_t(rank)]));
  lib_->check(
      lib_->AllReduce(buf, buf, count, nccl_type(dtype), ncclSum, comms_[size_t(rank)], stream),
      "ncclAllReduce (per rank)");
}

void TpGroup::all_gather_rank(int rank, const void* send, void* recv, size_t count, CommDType dtype,
                              cudaStream_t stream) {
  UF_CHECK(rank >= 0 && rank < size(), "TpGroup::all_gather_rank: rank {} outside 0..{}", rank,
           size() - 1);
  if (count == 0) return;
  DeviceGuard guard;
  UF_CUDA_CHECK(cudaSetDevice(devices_[size_t(rank)]));
  if (size() == 1) {
    if (send != recv)
      UF_CUDA_CHECK(cudaMemcpyAsync(recv, send, count * comm_dtype_size(dtype),
                                    cudaMemcpyDeviceToDevice, stream));
    return;
  }
  lib_->check(lib_->AllGather(send, recv, count, nccl_type(dtype), comms_[size_t(rank)], stream),
              "ncclAllGather (per rank)");
}

void TpGroup::all_reduce_sum_f32(const std::vector<float*>& bufs, size_t count,
                                 const std::vector<cudaStream_t>& streams) {
  all_reduce_sum(std::vector<void*>(bufs.begin(), bufs.end()), count, CommDType::kF32, streams);
}

void TpGroup::all_reduce_sum_bf16(const std::vector<void*>& bufs, size_t count,
                                  const std::vector<cudaStream_t>& streams) {
  all_reduce_sum(bufs, count, CommDType::kBF16, streams);
}

void TpGroup::all_gather(const std::vector<const void*>& send, const std::vector<void*>& recv,
                         size_t count, CommDType dtype, const std::vector<cudaStream_t>& streams) {
  check_args(send.size(), recv.size(), streams, "all_gather");
  if (count == 0) return;
  DeviceGuard guard;
  if (size() == 1) {
    if (send[0] != recv[0]) {
      UF_CUDA_CHECK(cudaSetDevice(devices_[0]));
      UF_CUDA_CHECK(cudaMemcpyAsync(recv[0], send[0], count * comm_dtype_size(dtype),
                                    cudaMemcpyDeviceToDevice, stream_of(streams, 0)));
    }
    return;
  }
  lib_->check(lib_->GroupStart(), "ncclGroupStart");
  for (int r = 0; r < size(); ++r) {
    UF_CUDA_CHECK(cudaSetDevice(devices_[size_t(r)]));
    const ncclResult_t res =
        lib_->AllGather(send[size_t(r)], recv[size_t(r)], count, nccl_type(dtype),
                        comms_[size_t(r)], stream_of(streams, r));
    if (res != ncclSuccess) {
      lib_->GroupEnd();
      lib_->check(res, "ncclAllGather");
    }
  }
  lib_->check(lib_->GroupEnd(), "ncclGroupEnd (all-gather)");
}

}  // namespace uf::cuda::tp
