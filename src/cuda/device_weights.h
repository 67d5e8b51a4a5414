#pragma once
// A model::Weight (model/weights.h) copied to the device in its checkpoint format: same format,
// logical shape and scale layout, data and scale pointers on the device.

#include <cstdint>

#include "cuda/device_memory.h"
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

// Copies w to the device (an empty weight stays empty).
DeviceWeight upload_weight(const model::Weight& w, DeviceArena& arena);

}  // namespace uf::cuda
