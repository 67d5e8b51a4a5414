#pragma once
// A model::Weight (model/weights.h) copied to the device in its checkpoint format: same format,
// logical shape and scale layout, data and scale pointers on the device.

#include <cstdint>
#include <functional>
#include <vector>

#include "cuda/device_memory.h"
#include "cuda/weight_uploader.h"
#include "model/weights.h"

namespace uf::cuda {

struct DeviceWeight {
  model::WFormat format = model::WFormat::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  const uint8_t* data = nullptr;   // device
  const uint8_t* scale = nullptr;  // device; FP8 / FP4 only (layout as model::Weight)
  bool row_scale = false;
  bool empty() const { return data == nullptr; }
};

// Bytes of a weight's data and scale arrays in its format.
size_t weight_data_bytes(const model::Weight& w);
size_t weight_scale_bytes(const model::Weight& w);
// The same data bytes for a weight already on the device.
size_t weight_data_bytes(const DeviceWeight& w);

// Copies w to the device (an empty weight stays empty): synchronously, or through the current
// thread's UploadScope when one is alive.
DeviceWeight upload_weight(const model::Weight& w, DeviceArena& arena);
// The same through a WeightUploader: the device memory is allocated now and the copies enqueued;
// the weight may be used once uploader->finish() has returned (null: the synchronous call above).
DeviceWeight upload_weight(const model::Weight& w, DeviceArena& arena, WeightUploader* uploader);

// Bulk loading without threading an uploader through every constructor: while an UploadScope
// lives, upload_weight(w, arena) and copy_to_device() on this thread enqueue on its uploader;
// finish() (or the destructor) waits for every copy. Weights must not be used before that.
class UploadScope {
 public:
  explicit UploadScope(int device, UploaderOptions opts = {});
  ~UploadScope();
  UploadScope(const UploadScope&) = delete;
  UploadScope& operator=(const UploadScope&) = delete;
  UploadStats finish();
  WeightUploader& uploader() { return up_; }
  static WeightUploader* current();  // the innermost live scope's uploader on this thread, or null
  // Work that needs the copies enqueued so far on the device (e.g. a derived copy of a weight):
  // with a live scope on this thread, run by the innermost one right after its finish() returns
  // (in order of registration; the destructor runs what is left after draining the copies, and
  // drops its errors as the uploader's destructor does); without one (the copies were
  // synchronous), run now. Either way the device is synchronised once after the work (one
  // cudaDeviceSynchronize for all of a scope's), so device work it enqueues on any stream is
  // done when finish() / after_upload returns: the work itself need not synchronise.
  static void after_upload(std::function<void()> fn);

 private:
  void run_after_upload();
  WeightUploader up_;
  WeightUploader* prev_;
  UploadScope* prev_scope_;
  std::vector<std::function<void()>> after_;
};

// Host-to-device copy: enqueued on the current UploadScope, else a synchronous cudaMemcpy.
void copy_to_device(void* dst, const void* src, size_t bytes);

}  // namespace uf::cuda
