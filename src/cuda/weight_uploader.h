#pragma once
// Bulk host-to-device copies for loading weights. A plain cudaMemcpy from the mmap'd checkpoint
// is pageable: the driver bounces it through its own small staging buffer, one tensor at a time,
// with the page faults of the mapping on the same thread. WeightUploader instead packs the
// enqueued copies into large pinned staging buffers filled by several host threads (their memcpy
// also faults the page cache in, in parallel) and DMAs each buffer with cudaMemcpyAsync while the
// next one fills. Each thread owns `buffers_per_thread` buffers and one stream; an event per
// buffer says when its DMA is done so the buffer can be refilled.
//
//   WeightUploader up(device, {});
//   up.enqueue(dst, src, bytes);  // any number; returns at once
//   up.finish();                  // every enqueued copy is on the device when it returns
//
// Sources must stay valid and unchanged until finish() returns (the checkpoint's mapping does);
// destinations must not be read before then. Small copies share a staging buffer (one DMA per
// piece from its offset), large ones are split into buffer-sized pieces. Device work issued on the
// legacy default stream before an enqueue() (e.g. DeviceArena::alloc's zero fill) is ordered
// before that copy; the calling thread's current device must be `device`.

#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace uf::cuda {

struct UploadProgress {
  uint64_t bytes_done = 0;      // copies known to be on the device
  uint64_t bytes_enqueued = 0;  // everything enqueued so far (the total once finish() is called)
  double seconds = 0;           // since the first enqueue
};

struct UploaderOptions {
  size_t buffer_bytes = size_t(64) << 20;  // one pinned staging buffer
  int threads = 4;                         // host copy threads (one stream each)
  int buffers_per_thread = 2;              // double buffering: fill one while the other DMAs
  // Called on the thread that calls enqueue()/finish(), at most every progress_interval_s, and
  // once at the end of finish() with bytes_done == bytes_enqueued. Progress only ever grows.
  std::function<void(const UploadProgress&)> on_progress;
  double progress_interval_s = 5.0;
};

struct UploadStats {
  uint64_t bytes = 0;
  double seconds = 0;  // first enqueue to the end of finish()
  double gb_per_s() const { return seconds > 0 ? double(bytes) / seconds * 1e-9 : 0; }
};

class WeightUploader {
 public:
  explicit WeightUploader(int device, UploaderOptions opts = {});
  ~WeightUploader();  // waits for copies in flight; errors there are dropped (call finish())
  WeightUploader(const WeightUploader&) = delete;
  WeightUploader& operator=(const WeightUploader&) = delete;

  // Copies `bytes` from host `src` to device `dst` (asynchronously; 0 bytes does nothing).
  void enqueue(void* dst, const void* src, size_t bytes);
  // Gathers `rows` rows of `row_bytes` bytes, `src_pitch` bytes apart on the host, into
  // rows * row_bytes contiguous bytes at `dst` (a column slice of a row-major tensor, as a
  // tensor-parallel rank reads a column-split shard). The gather happens in the copy threads.
  void enqueue_rows(void* dst, const void* src, size_t rows, size_t row_bytes, size_t src_pitch);
  // Waits until every enqueued copy is on the device; rethrows the first error of a copy thread.
  // The uploader can be used again afterwards (stats restart).
  UploadStats finish();
  UploadProgress progress() const;
  const UploaderOptions& options() const { return opts_; }

 private:
  struct Piece {
    void* dst;
    const void* src;
    size_t bytes;
    size_t offset;         // in the staging buffer
    size_t row_bytes = 0;  // 0: contiguous; else bytes / row_bytes rows, src_pitch apart
    size_t src_pitch = 0;
  };
  struct Batch {
    std::vector<Piece> pieces;
    size_t used = 0;  // staging bytes used (pieces plus alignment)
    uint64_t bytes = 0;
    // Recorded on the legacy default stream when the batch is submitted; the copy stream waits
    // for it, so device work the caller issued before enqueue() (the zero fill of
    // DeviceArena::alloc, a cudaMemset) lands before the copy, without blocking the host.
    cudaEvent_t after = nullptr;
  };

  void submit_current();  // under mu_
  void start_locked(uint64_t bytes);
  void worker(int index);
  void maybe_report();
  void fail(std::exception_ptr e);

  int device_;
  UploaderOptions opts_;
  std::vector<std::thread> threads_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // workers wait for batches
  std::condition_variable done_cv_;  // finish() waits for bytes_done_
  std::deque<Batch> queue_;
  Batch current_;  // being filled by enqueue()
  bool stop_ = false;
  std::exception_ptr error_;
  uint64_t bytes_enqueued_ = 0;
  uint64_t bytes_submitted_ = 0;
  uint64_t bytes_done_ = 0;
  bool started_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_report_;
  uint64_t last_reported_done_ = 0;
};

}  // namespace uf::cuda
