#pragma once
// Deterministic random fills on the device (benchmarks, warm-up): checkpoint-format bytes
// generated where they live, at memory speed, instead of copied from the host.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace uf::cuda {

// Bytes uniform in [lo, hi] (hash of seed and index).
void fill_random_bytes(uint8_t* p, size_t n, uint64_t seed, int lo, int hi, cudaStream_t stream);
// E4M3 codes uniform over the 254 non-NaN codes.
void fill_random_e4m3(uint8_t* p, size_t n, uint64_t seed, cudaStream_t stream);
// bf16 values uniform in [-scale, scale].
void fill_random_bf16(uint16_t* p, size_t n, uint64_t seed, float scale, cudaStream_t stream);
// fp32 values uniform in [-scale, scale] (24 random bits).
void fill_random_f32(float* p, size_t n, uint64_t seed, float scale, cudaStream_t stream);

// Bandwidth probes: a 16-byte-vector grid-stride copy (n % 16 == 0), and a read-only pass that
// folds the data into *sink so that nothing is optimized away.
void device_copy(void* dst, const void* src, size_t n, cudaStream_t stream);
void device_read(const void* src, size_t n, unsigned* sink, cudaStream_t stream);

}  // namespace uf::cuda
