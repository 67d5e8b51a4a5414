#include "cuda/weight_uploader.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "cuda/cuda_check.h"

namespace uf::cuda {

namespace {

// Pieces start on 256-byte boundaries of the staging buffer: the DMA engine moves aligned
// bursts fastest, and the padding is negligible beside a 64 MiB buffer.
constexpr size_t kPieceAlign = 256;

size_t align_up(size_t x) { return (x + kPieceAlign - 1) / kPieceAlign * kPieceAlign; }

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

WeightUploader::WeightUploader(int device, UploaderOptions opts)
    : device_(device), opts_(std::move(opts)) {
  require(opts_.buffer_bytes >= kPieceAlign, "WeightUploader: buffer_bytes %zu is below %zu",
          opts_.buffer_bytes, kPieceAlign);
  require(opts_.threads >= 1 && opts_.threads <= 64, "WeightUploader: threads %d not in [1, 64]",
          opts_.threads);
  require(opts_.buffers_per_thread >= 1 && opts_.buffers_per_thread <= 16,
          "WeightUploader: buffers_per_thread %d not in [1, 16]", opts_.buffers_per_thread);
  opts_.buffer_bytes = opts_.buffer_bytes / kPieceAlign * kPieceAlign;
  for (int i = 0; i < opts_.threads; ++i) threads_.emplace_back([this, i] { worker(i); });
}

WeightUploader::~WeightUploader() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    try {
      submit_current();
    } catch (...) {  // a destructor cannot report it; finish() would have
    }
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void WeightUploader::fail(std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!error_) error_ = e;
    for (Batch& b : queue_)
      if (b.after) cudaEventDestroy(b.after);
    queue_.clear();  // nothing more is copied once a copy has failed
  }
  work_cv_.notify_all();
  done_cv_.notify_all();
}

void WeightUploader::submit_current() {
  if (current_.pieces.empty()) return;
  UF_CUDA_CHECK(cudaEventCreateWithFlags(&current_.after, cudaEventDisableTiming));
  UF_CUDA_CHECK(cudaEventRecord(current_.after, cudaStreamLegacy));
  bytes_submitted_ += current_.bytes;
  queue_.push_back(std::move(current_));
  current_ = Batch{};
  work_cv_.notify_one();
}

void WeightUploader::enqueue(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  require(dst != nullptr && src != nullptr,
          "WeightUploader::enqueue: null %s pointer for a copy of %zu bytes",
          dst ? "source" : "destination", bytes);
  {
    std::lock_guard<std::mutex> lk(mu_);
    start_locked(bytes);
    auto* d = static_cast<uint8_t*>(dst);
    auto* s = static_cast<const uint8_t*>(src);
    // Fill the current batch to the brim: a copy that does not fit continues in the next one.
    while (bytes > 0) {
      size_t off = align_up(current_.used);
      if (off >= opts_.buffer_bytes) {
        submit_current();
        off = 0;
      }
      const size_t n = std::min(bytes, opts_.buffer_bytes - off);
      current_.pieces.push_back(Piece{d, s, n, off});
      current_.used = off + n;
      current_.bytes += n;
      d += n;
      s += n;
      bytes -= n;
      if (current_.used >= opts_.buffer_bytes) submit_current();
    }
  }
  maybe_report();
}

void WeightUploader::start_locked(uint64_t bytes) {
  if (error_) std::rethrow_exception(error_);
  if (!started_) {
    started_ = true;
    start_ = last_report_ = std::chrono::steady_clock::now();
  }
  bytes_enqueued_ += bytes;
}

void WeightUploader::enqueue_rows(void* dst, const void* src, size_t rows, size_t row_bytes,
                                  size_t src_pitch) {
  if (rows == 0 || row_bytes == 0) return;
  require(src_pitch >= row_bytes, "WeightUploader::enqueue_rows: pitch %zu below row bytes %zu",
          src_pitch, row_bytes);
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  if (src_pitch == row_bytes || rows == 1) return enqueue(dst, src, rows * row_bytes);
  if (row_bytes > opts_.buffer_bytes) {  // rows too long to pack: one copy each
    for (size_t r = 0; r < rows; ++r) enqueue(d + r * row_bytes, s + r * src_pitch, row_bytes);
    return;
  }
  require(dst != nullptr && src != nullptr, "WeightUploader::enqueue_rows: null pointer");
  {
    std::lock_guard<std::mutex> lk(mu_);
    start_locked(uint64_t(rows) * row_bytes);
    // Whole rows per batch: a batch takes as many as fit, the rest go to the next ones.
    while (rows > 0) {
      size_t off = align_up(current_.used);
      if (off + row_bytes > opts_.buffer_bytes) {
        submit_current();
        off = 0;
      }
      const size_t n = std::min(rows, (opts_.buffer_bytes - off) / row_bytes);
      current_.pieces.push_back(Piece{d, s, n * row_bytes, off, row_bytes, src_pitch});
      current_.used = off + n * row_bytes;
      current_.bytes += n * row_bytes;
      d += n * row_bytes;
      s += n * src_pitch;
      rows -= n;
    }
  }
  maybe_report();
}

void WeightUploader::maybe_report() {
  if (!opts_.on_progress) return;
  UploadProgress p;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!started_) return;
    const auto now = std::chrono::steady_clock::now();
    if (std::chrono::duration<double>(now - last_report_).count() < opts_.progress_interval_s)
      return;
    last_report_ = now;
    p.bytes_done = std::max(bytes_done_, last_reported_done_);
    last_reported_done_ = p.bytes_done;
    p.bytes_enqueued = bytes_enqueued_;
    p.seconds = seconds_since(start_);
  }
  opts_.on_progress(p);
}

UploadProgress WeightUploader::progress() const {
  std::lock_guard<std::mutex> lk(mu_);
  UploadProgress p;
  p.bytes_done = bytes_done_;
  p.bytes_enqueued = bytes_enqueued_;
  p.seconds = started_ ? seconds_since(start_) : 0;
  return p;
}

UploadStats WeightUploader::finish() {
  // Wake up at least every progress interval (capped so a long interval still lets a caller see
  // completion promptly) to report.
  const auto tick = std::chrono::duration<double>(
      opts_.on_progress ? std::clamp(opts_.progress_interval_s, 0.001, 1.0) : 1.0);
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      submit_current();
      done_cv_.wait_for(lk, tick, [&] { return error_ || bytes_done_ == bytes_submitted_; });
      if (error_) std::rethrow_exception(error_);
      if (bytes_done_ == bytes_submitted_) break;
    }
    maybe_report();
  }
  UploadStats stats;
  UploadProgress last;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats.bytes = bytes_enqueued_;
    stats.seconds = started_ ? seconds_since(start_) : 0;
    last.bytes_done = last.bytes_enqueued = bytes_enqueued_;
    last.seconds = stats.seconds;
    started_ = false;
    bytes_enqueued_ = bytes_submitted_ = bytes_done_ = last_reported_done_ = 0;
  }
  if (opts_.on_progress && stats.bytes > 0) opts_.on_progress(last);
  return stats;
}

void WeightUploader::worker(int /*index*/) {
  struct Slot {
    uint8_t* host = nullptr;
    cudaEvent_t done = nullptr;
    uint64_t pending = 0;  // bytes whose DMA from this buffer may still be running
  };
  std::vector<Slot> slots(size_t(opts_.buffers_per_thread));
  cudaStream_t stream = nullptr;
  // Waits for a buffer's DMA and counts its bytes as done.
  auto retire = [&](Slot& s) {
    if (s.pending == 0) return;
    UF_CUDA_CHECK(cudaEventSynchronize(s.done));
    {
      std::lock_guard<std::mutex> lk(mu_);
      bytes_done_ += s.pending;
    }
    s.pending = 0;
    done_cv_.notify_all();
  };
  try {
    UF_CUDA_CHECK(cudaSetDevice(device_));
    UF_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (Slot& s : slots) {
      const cudaError_t err = cudaHostAlloc(reinterpret_cast<void**>(&s.host), opts_.buffer_bytes,
                                            cudaHostAllocDefault);
      require(err == cudaSuccess, "WeightUploader: pinned staging buffer of %zu bytes failed (%s)",
              opts_.buffer_bytes, cudaGetErrorString(err));
      UF_CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    }
    size_t next = 0;
    for (;;) {
      Batch b;
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (queue_.empty() && !stop_) {
          // Idle: account for the DMAs in flight first, so finish() sees them complete.
          lk.unlock();
          for (Slot& s : slots) retire(s);
          lk.lock();
          work_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        }
        if (queue_.empty()) break;  // stopping, nothing left
        b = std::move(queue_.front());
        queue_.pop_front();
      }
      Slot& s = slots[next];
      next = (next + 1) % slots.size();
      retire(s);
      if (b.after) {
        const cudaError_t err = cudaStreamWaitEvent(stream, b.after, 0);
        cudaEventDestroy(b.after);
        UF_CUDA_CHECK(err);
      }
      for (const Piece& p : b.pieces) {
        if (p.row_bytes == 0) {
          std::memcpy(s.host + p.offset, p.src, p.bytes);
          continue;
        }
        const auto* src = static_cast<const uint8_t*>(p.src);
        for (size_t o = 0; o < p.bytes; o += p.row_bytes, src += p.src_pitch)
          std::memcpy(s.host + p.offset + o, src, p.row_bytes);
      }
      for (const Piece& p : b.pieces)
        UF_CUDA_CHECK(
            cudaMemcpyAsync(p.dst, s.host + p.offset, p.bytes, cudaMemcpyHostToDevice, stream));
      UF_CUDA_CHECK(cudaEventRecord(s.done, stream));
      s.pending = b.bytes;
    }
    for (Slot& s : slots) retire(s);
  } catch (...) {
    fail(std::current_exception());
  }
  // The buffers may only be freed once nothing reads them any more.
  if (stream) cudaStreamSynchronize(stream);
  for (Slot& s : slots) {
    if (s.done) cudaEventDestroy(s.done);
    if (s.host) cudaFreeHost(s.host);
  }
  if (stream) cudaStreamDestroy(stream);
}

}  // namespace uf::cuda
