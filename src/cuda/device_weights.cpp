#include "cuda/device_weights.h"

#include <spdlog/spdlog.h>

#include <exception>
#include <utility>

#include "cuda/cuda_check.h"

namespace uf::cuda {

using model::WFormat;

namespace {
size_t data_bytes(WFormat format, int64_t rows, int64_t cols) {
  const size_t n = size_t(rows) * size_t(cols);
  switch (format) {
    case WFormat::kF32:
      return 4 * n;
    case WFormat::kBF16:
      return 2 * n;
    case WFormat::kFP8:
      return n;
    case WFormat::kFP4:
      return n / 2;
  }
  return 0;
}
}  // namespace

size_t weight_data_bytes(const model::Weight& w) { return data_bytes(w.format, w.rows, w.cols); }
size_t weight_data_bytes(const DeviceWeight& w) { return data_bytes(w.format, w.rows, w.cols); }

size_t weight_scale_bytes(const model::Weight& w) {
  switch (w.format) {
    case WFormat::kFP8:
      return w.row_scale ? size_t(w.rows) * size_t((w.cols + 31) / 32)
                         : size_t((w.rows + 31) / 32) * size_t((w.cols + 31) / 32);
    case WFormat::kFP4:
      return size_t(w.rows) * size_t(w.cols / 32);
    default:
      return 0;
  }
}

namespace {
thread_local WeightUploader* t_scope_uploader = nullptr;
thread_local UploadScope* t_scope = nullptr;
}  // namespace

UploadScope::UploadScope(int device, UploaderOptions opts)
    : up_(device, std::move(opts)), prev_(t_scope_uploader), prev_scope_(t_scope) {
  t_scope_uploader = &up_;
  t_scope = this;
}

UploadScope::~UploadScope() {
  t_scope_uploader = prev_;
  t_scope = prev_scope_;
  if (after_.empty()) return;  // up_'s destructor drains the copies
  try {
    up_.finish();
    run_after_upload();
  } catch (const std::exception& e) {
    spdlog::error("UploadScope: the work after the upload failed: {}", e.what());
  }
}

UploadStats UploadScope::finish() {
  const UploadStats s = up_.finish();
  run_after_upload();
  return s;
}

void UploadScope::after_upload(std::function<void()> fn) {
  if (t_scope) {
    t_scope->after_.push_back(std::move(fn));
  } else {
    fn();
    UF_CUDA_CHECK(cudaDeviceSynchronize());  // its device work is done before any stream reads
  }
}

void UploadScope::run_after_upload() {
  std::vector<std::function<void()>> work;
  work.swap(after_);
  for (auto& fn : work) fn();
  // One synchronisation for all of it (the work enqueues on the default stream; the model's
  // streams do not wait for that stream by themselves).
  if (!work.empty()) UF_CUDA_CHECK(cudaDeviceSynchronize());
}

WeightUploader* UploadScope::current() { return t_scope_uploader; }

void copy_to_device(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  if (WeightUploader* up = UploadScope::current())
    up->enqueue(dst, src, bytes);
  else
    UF_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

DeviceWeight upload_weight(const model::Weight& w, DeviceArena& arena) {
  return upload_weight(w, arena, UploadScope::current());
}

DeviceWeight upload_weight(const model::Weight& w, DeviceArena& arena, WeightUploader* uploader) {
  DeviceWeight d;
  d.format = w.format;
  d.rows = w.rows;
  d.cols = w.cols;
  d.row_scale = w.row_scale;
  if (w.empty()) return d;
  d.data = static_cast<const uint8_t*>(arena.upload_bytes(w.data, weight_data_bytes(w), uploader));
  if (w.scale)
    d.scale =
        static_cast<const uint8_t*>(arena.upload_bytes(w.scale, weight_scale_bytes(w), uploader));
  return d;
}

}  // namespace uf::cuda
