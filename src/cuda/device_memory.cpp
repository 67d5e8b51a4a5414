#include "cuda/device_memory.h"

#include <utility>

#include "cuda/cuda_check.h"
#include "cuda/weight_uploader.h"

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

void* DeviceArena::alloc_raw(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  require(err == cudaSuccess, "device allocation of %zu bytes failed (%s); %zu bytes held", bytes,
          cudaGetErrorString(err), bytes_);
  blocks_.push_back(p);
  bytes_ += bytes;
  return p;
}

void* DeviceArena::alloc_bytes(size_t bytes) {
  void* p = alloc_raw(bytes);
  if (p) UF_CUDA_CHECK(cudaMemset(p, 0, bytes));
  return p;
}

void* DeviceArena::upload_bytes(const void* host, size_t bytes) {
  void* p = alloc_bytes(bytes);
  if (bytes) UF_CUDA_CHECK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
  return p;
}

void* DeviceArena::upload_bytes(const void* host, size_t bytes, WeightUploader* uploader) {
  if (uploader == nullptr) return upload_bytes(host, bytes);
  // No zero fill: a cudaMemset on the legacy stream is not ordered with the uploader's
  // non-blocking streams and could land after the copy.
  void* p = alloc_raw(bytes);
  if (bytes) uploader->enqueue(p, host, bytes);
  return p;
}

}  // namespace uf::cuda
