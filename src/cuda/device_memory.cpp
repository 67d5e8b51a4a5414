#include "cuda/device_memory.h"

#include <utility>

#include "cuda/cuda_check.h"

namespace uf::cuda {

DeviceArena::~DeviceArena() { release(); }

DeviceArena::DeviceArena(DeviceArena&& o) noexcept
    : blocks_(std::move(o.blocks_)), bytes_(std::exchange(o.bytes_, 0)) {
  o.blocks_.clear();
}

DeviceArena& DeviceArena::operator=(DeviceArena&& o) noexcept {
  if (this != &o) {
    release();
    blocks_ = std::move(o.blocks_);
    o.blocks_.clear();
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void DeviceArena::release() {
  for (void* p : blocks_) cudaFree(p);
  blocks_.clear();
  bytes_ = 0;
}

void* DeviceArena::alloc_bytes(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  require(err == cudaSuccess, "device allocation of %zu bytes failed (%s); %zu bytes held", bytes,
          cudaGetErrorString(err), bytes_);
  UF_CUDA_CHECK(cudaMemset(p, 0, bytes));
  blocks_.push_back(p);
  bytes_ += bytes;
  return p;
}

void* DeviceArena::upload_bytes(const void* host, size_t bytes) {
  void* p = alloc_bytes(bytes);
  if (bytes) UF_CUDA_CHECK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
  return p;
}

}  // namespace uf::cuda
