#pragma once
// Device memory owned by the CUDA backend. A DeviceArena owns every buffer it hands out and frees
// them all on destruction (weights live as long as the backend, a session's state as long as the
// session). Nothing here is on a hot path: allocation happens at load and session creation.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace uf::cuda {

class WeightUploader;

class DeviceArena {
 public:
  DeviceArena() = default;
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  DeviceArena(DeviceArena&& o) noexcept;
  DeviceArena& operator=(DeviceArena&& o) noexcept;

  // Zero-filled device memory (cudaMalloc + cudaMemset); 0 bytes gives nullptr.
  void* alloc_bytes(size_t bytes);
  template <typename T>
  T* alloc(size_t n) {
    return static_cast<T*>(alloc_bytes(n * sizeof(T)));
  }
  // A device copy of n host elements (synchronous).
  template <typename T>
  T* upload(const T* host, size_t n) {
    return static_cast<T*>(upload_bytes(host, n * sizeof(T)));
  }
  template <typename T>
  T* upload(const std::vector<T>& v) {
    return upload(v.data(), v.size());
  }
  void* upload_bytes(const void* host, size_t bytes);
  // With an uploader: allocates now (not zero-filled: the copy covers every byte) and enqueues the
  // copy; the data is on the device once uploader->finish() returns. `host` must stay valid until
  // then. A null uploader is the synchronous upload_bytes above.
  void* upload_bytes(const void* host, size_t bytes, WeightUploader* uploader);

  size_t bytes() const { return bytes_; }

 private:
  void release();
  void* alloc_raw(size_t bytes);
  std::vector<void*> blocks_;
  size_t bytes_ = 0;
};

// Synchronous copies between host vectors and device pointers (tests, snapshots, logits).
template <typename T>
std::vector<T> download(const T* device, size_t n) {
  std::vector<T> v(n);
  if (n) cudaMemcpy(v.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

}  // namespace uf::cuda
