// bench_cuda_load: startup (issue benchmark 5): checkpoint shards in the official safetensors
// format, in the page cache, to device memory; and the projected time to /readyz for one rank of
// the released model under TP8 (model::make_tp_plan, rank 0) beside the 20 s target.
//
// The checkpoint written here (default 4 GB, --gb) is a random sample of rank 0's shards (each
// shard of the plan, cut into pieces of at most 64 MiB, is kept with probability budget / rank
// bytes), stored as whole tensors in their dtypes (F8_E4M3 weights, F8_E8M0 scales, I8 packed FP4
// experts, BF16, F32) with the project's writer, ~1 GiB per shard file plus the index. So the
// sample has the rank's mix of tensor sizes and its tensors-per-byte ratio, and bytes / measured
// rate projects the rank's load including per-tensor costs (cudaMalloc, one copy per tensor).
// Column-split shards are strided in the real checkpoint: the full tensors of a further sample
// of them (1/8 of the rate, names "full.*") are written too, and pass (c) gathers the rank's
// column slice of each row. Checkpoint open of the real 96,085-tensor headers is projected from
// the open time per tensor measured here.
//
// Measured (every pass maps the files afresh, so page faults are included; the data itself is in
// the page cache: written just before and read once to warm):
//   ceilings: pinned H2D cudaMemcpy, pageable H2D cudaMemcpy, page cache -> pinned memcpy with
//             1/2/4/8 threads;
//   (a) per tensor, synchronous: DeviceArena::upload_bytes per tensor (= cuda::upload_weight
//       without an UploadScope: cudaMalloc, cudaMemset, synchronous pageable cudaMemcpy);
//   (b) WeightUploader path: upload_bytes(.., &uploader) per tensor then finish(), several
//       thread / buffer settings (pinned staging allocation included in the time). CudaModel
//       loads this way (an UploadScope with the default UploaderOptions), after a TP rank has
//       placed its shards on the host (shard_model_weights: column slices copied, not timed
//       here);
//   (c) column slices through WeightUploader::enqueue_rows;
//   --cold: one more (b) pass after posix_fadvise(DONTNEED) on every shard (disk reads).
//
// Usage: bench_cuda_load [--gb 4] [--dir /tmp/uf_bench_load] [--keep] [--cold]

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifndef UF_HAVE_CUDA
int main() {
  std::printf("bench_cuda_load: built without the CUDA backend\n");
  return 0;
}
#else

#include <cuda_runtime.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <random>
#include <thread>

#include "core/dtypes.h"
#include "cuda/cuda_check.h"
#include "cuda/device_memory.h"
#include "cuda/weight_uploader.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/tp_plan.h"

namespace {

namespace fs = std::filesystem;
using namespace uf;

constexpr double kTargetSeconds = 20.0;
constexpr uint64_t kMaxPiece = uint64_t(64) << 20;
constexpr uint64_t kShardFileBytes = uint64_t(1) << 30;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Sample {
  std::string name;
  core::DType dtype;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  // Full-width column-split tensors ("full." names, pass (c) only): the rank's slice of each row.
  uint64_t slice_offset = 0;
  uint64_t slice_bytes = 0;
};

bool is_full(const std::string& name) { return name.rfind("full.", 0) == 0; }

// Cuts a [rows, ...] tensor into pieces of at most kMaxPiece bytes, each kept with probability p.
void sample_pieces(const Sample& t, double p, std::mt19937_64& rng, std::vector<Sample>& out) {
  std::uniform_real_distribution<double> u(0, 1);
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  const uint64_t row_bytes = t.bytes / uint64_t(rows);
  const int64_t per = std::max<int64_t>(1, int64_t(kMaxPiece / std::max<uint64_t>(row_bytes, 1)));
  for (int64_t r = 0, part = 0; r < rows; r += per, ++part) {
    if (u(rng) >= p) continue;
    const int64_t n = std::min(per, rows - r);
    Sample x = t;
    x.bytes = uint64_t(n) * row_bytes;
    if (rows > per) x.name += ".part" + std::to_string(part);
    if (!x.shape.empty()) x.shape[0] = n;
    out.push_back(std::move(x));
  }
}

std::vector<Sample> sample_rank(const model::TpPlan& plan, uint64_t budget, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const double p = std::min(1.0, double(budget) / double(plan.total_bytes()));
  std::vector<Sample> out;
  for (const auto& s : plan.shards) {
    if (s.nbytes == 0) continue;
    sample_pieces(Sample{s.name, s.dtype, s.shape, s.nbytes}, p, rng, out);
    if (s.mode == model::ShardMode::kSplit && s.dim == 1 && s.full_shape.size() == 2) {
      const uint64_t es = core::dtype_size(s.dtype);
      Sample full{
          "full." + s.name,       s.dtype,
          s.full_shape,           uint64_t(s.full_shape[0]) * uint64_t(s.full_shape[1]) * es,
          uint64_t(s.begin) * es, uint64_t(s.end - s.begin) * es};
      sample_pieces(full, p / 8, rng, out);
    }
  }
  return out;
}

void fill_random(std::vector<uint8_t>& v, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= v.size(); i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(&v[i], &x, 8);
  }
  for (; i < v.size(); ++i) v[i] = uint8_t(i * 131 + seed);
}

// Writes the sample as shard files of ~1 GiB (generated and written by one thread each, up to 8
// at a time) plus the index; returns the shard paths.
std::vector<fs::path> write_checkpoint(const fs::path& dir, const std::vector<Sample>& sample) {
  fs::create_directories(dir);
  std::vector<std::vector<size_t> > groups(1);
  uint64_t group_bytes = 0, total = 0;
  for (size_t i = 0; i < sample.size(); ++i) {
    if (group_bytes >= kShardFileBytes) groups.emplace_back(), group_bytes = 0;
    groups.back().push_back(i);
    group_bytes += sample[i].bytes;
    total += sample[i].bytes;
  }
  std::vector<fs::path> files(groups.size());
  std::map<std::string, std::string> weight_map;
  for (size_t g = 0; g < groups.size(); ++g) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu.safetensors", g + 1);
    files[g] = dir / name;
    for (size_t i : groups[g]) weight_map[sample[i].name] = name;
  }
  std::atomic<size_t> next{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&] {
      for (size_t g; (g = next.fetch_add(1)) < groups.size();) {
        std::vector<model::TensorData> tensors;
        for (size_t i : groups[g]) {
          model::TensorData d{sample[i].name, sample[i].dtype, sample[i].shape, {}};
          d.bytes.resize(sample[i].bytes);
          fill_random(d.bytes, i + 1);
          tensors.push_back(std::move(d));
        }
        model::write_safetensors(files[g], tensors);
      }
    });
  for (auto& t : ts) t.join();
  model::write_safetensors_index(dir, weight_map, total);
  return files;
}

struct Span {
  const uint8_t* p;
  size_t n;
};

// The tensors of passes (a) and (b): everything but the full-width copies.
std::vector<Span> spans_of(const model::Checkpoint& ck) {
  std::vector<Span> v;
  for (const auto& [name, e] : ck.tensors())
    if (!is_full(name)) v.push_back({e.view.data, e.view.nbytes});
  return v;
}

double gbs(uint64_t bytes, double s) { return s > 0 ? double(bytes) / s * 1e-9 : 0; }

// Page cache -> pinned memory with `threads` threads, each into its own 64 MiB pinned buffer.
double memcpy_to_pinned(const fs::path& dir, int threads, uint64_t& bytes) {
  const model::Checkpoint ck = model::Checkpoint::open(dir);
  const size_t chunk = size_t(64) << 20;
  std::vector<Span> pieces;
  for (const auto& [name, e] : ck.tensors())
    for (size_t o = 0; o < e.view.nbytes; o += chunk)
      pieces.push_back({e.view.data + o, std::min(e.view.nbytes - o, chunk)});
  std::vector<void*> bufs(static_cast<size_t>(threads));
  for (auto& b : bufs) UF_CUDA_CHECK(cudaHostAlloc(&b, chunk, cudaHostAllocDefault));
  std::atomic<size_t> next{0};
  const double t0 = now_s();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      for (size_t i; (i = next.fetch_add(1)) < pieces.size();)
        std::memcpy(bufs[size_t(t)], pieces[i].p, pieces[i].n);
    });
  for (auto& t : ts) t.join();
  const double sec = now_s() - t0;
  for (auto b : bufs) cudaFreeHost(b);
  bytes = 0;
  for (const Span& s : pieces) bytes += s.n;
  return sec;
}

double h2d_gbs(bool pinned) {
  const size_t n = size_t(256) << 20;
  void* host = nullptr;
  if (pinned)
    UF_CUDA_CHECK(cudaHostAlloc(&host, n, cudaHostAllocDefault));
  else
    host = std::malloc(n);
  std::memset(host, 1, n);
  void* dev = nullptr;
  UF_CUDA_CHECK(cudaMalloc(&dev, n));
  UF_CUDA_CHECK(cudaMemcpy(dev, host, n, cudaMemcpyHostToDevice));  // warm-up
  const int reps = 8;
  const double t0 = now_s();
  for (int i = 0; i < reps; ++i) UF_CUDA_CHECK(cudaMemcpy(dev, host, n, cudaMemcpyHostToDevice));
  const double sec = now_s() - t0;
  cudaFree(dev);
  if (pinned)
    cudaFreeHost(host);
  else
    std::free(host);
  return gbs(uint64_t(n) * reps, sec);
}

// Spot-checks the first and last 4 KiB of every 50th copy against the host.
bool verify(const std::vector<Span>& host, const std::vector<const void*>& dev) {
  std::vector<uint8_t> buf(4096);
  for (size_t i = 0; i < host.size(); i += 50) {
    const size_t n = std::min<size_t>(4096, host[i].n);
    if (n == 0) continue;
    for (size_t off : {size_t(0), host[i].n - n}) {
      UF_CUDA_CHECK(cudaMemcpy(buf.data(), static_cast<const uint8_t*>(dev[i]) + off, n,
                               cudaMemcpyDeviceToHost));
      if (std::memcmp(buf.data(), host[i].p + off, n) != 0) {
        std::printf("  MISMATCH in copy %zu at offset %zu\n", i, off);
        return false;
      }
    }
  }
  return true;
}

struct PathResult {
  double open_s = 0, upload_s = 0;
  uint64_t bytes = 0;
  size_t tensors = 0;
  bool ok = true;
};

// (a) the current synchronous path, or (b) through an uploader when opts is given.
PathResult load(const fs::path& dir, const cuda::UploaderOptions* opts) {
  PathResult r;
  double t0 = now_s();
  const model::Checkpoint ck = model::Checkpoint::open(dir);
  r.open_s = now_s() - t0;
  const std::vector<Span> spans = spans_of(ck);
  std::vector<const void*> dev;
  cuda::DeviceArena arena;
  t0 = now_s();
  if (opts) {
    cuda::WeightUploader up(0, *opts);
    for (const Span& s : spans) dev.push_back(arena.upload_bytes(s.p, s.n, &up));
    up.finish();
  } else {
    for (const Span& s : spans) dev.push_back(arena.upload_bytes(s.p, s.n));
  }
  UF_CUDA_CHECK(cudaDeviceSynchronize());
  r.upload_s = now_s() - t0;
  for (const Span& s : spans) r.bytes += s.n;
  r.tensors = spans.size();
  r.ok = verify(spans, dev);
  return r;
}

// (c) the rank's column slices of the full-width column-split tensors, gathered by enqueue_rows.
PathResult load_columns(const fs::path& dir, const std::vector<Sample>& sample,
                        const cuda::UploaderOptions& opts) {
  PathResult r;
  const model::Checkpoint ck = model::Checkpoint::open(dir);
  std::vector<Span> first_rows;  // spot check: row 0 of each slice
  std::vector<const void*> dev;
  const double t0 = now_s();
  {
    cuda::WeightUploader up(0, opts);
    for (const Sample& x : sample) {
      if (!is_full(x.name)) continue;
      const auto& v = ck.get(x.name);
      const size_t rows = size_t(v.shape[0]), pitch = v.nbytes / rows;
      void* p = nullptr;
      UF_CUDA_CHECK(cudaMalloc(&p, rows * x.slice_bytes));
      up.enqueue_rows(p, v.data + x.slice_offset, rows, x.slice_bytes, pitch);
      first_rows.push_back({v.data + x.slice_offset, size_t(x.slice_bytes)});
      dev.push_back(p);
      r.bytes += rows * x.slice_bytes;
      ++r.tensors;
    }
    up.finish();
  }
  r.upload_s = now_s() - t0;
  r.ok = verify(first_rows, dev);
  for (const void* p : dev) cudaFree(const_cast<void*>(p));
  return r;
}

void drop_from_page_cache(const std::vector<fs::path>& files) {
  for (const auto& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

}  // namespace

int main(int argc, char** argv) {
  double gb = 4;
  fs::path dir = "/tmp/uf_bench_load";
  bool keep = false, cold = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--gb") && i + 1 < argc) gb = std::atof(argv[++i]);
    if (!std::strcmp(argv[i], "--dir") && i + 1 < argc) dir = argv[++i];
    if (!std::strcmp(argv[i], "--keep")) keep = true;
    if (!std::strcmp(argv[i], "--cold")) cold = true;
  }
  gb = std::clamp(gb, 0.1, 16.0);

  const auto plan = model::make_tp_plan(model::ModelConfig::deepseek_v41_flash(), 8, 0);
  const uint64_t rank_bytes = plan.total_bytes();
  size_t rank_tensors = 0, col_split = 0;
  uint64_t col_split_bytes = 0;
  for (const auto& s : plan.shards) {
    rank_tensors += s.nbytes > 0;
    if (s.mode == model::ShardMode::kSplit && s.dim == 1) ++col_split, col_split_bytes += s.nbytes;
  }
  std::printf(
      "rank 0 of TP8 (released config): %.2f GB in %zu tensors (column-split, strided in the "
      "checkpoint: %zu tensors, %.2f GB)\n",
      rank_bytes * 1e-9, rank_tensors, col_split, col_split_bytes * 1e-9);

  const auto sample = sample_rank(plan, uint64_t(gb * 1e9), 1234);
  double t0 = now_s();
  fs::remove_all(dir);
  const auto files = write_checkpoint(dir, sample);
  uint64_t written = 0;
  for (const auto& s : sample) written += s.bytes;
  std::printf("wrote %.2f GB in %zu tensors, %zu shard files, to %s in %.1f s\n", written * 1e-9,
              sample.size(), files.size(), dir.c_str(), now_s() - t0);

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    const double t1 = now_s();
    const auto ck = model::Checkpoint::open(dir);
    std::printf("no CUDA device: checkpoint reopened (%zu tensors, %.2f GB) in %.3f s; done\n",
                ck.size(), ck.total_bytes() * 1e-9, now_s() - t1);
    if (!keep) fs::remove_all(dir);
    return 0;
  }
  cudaDeviceProp prop{};
  UF_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  UF_CUDA_CHECK(cudaFree(nullptr));  // context creation outside every timing
  std::printf("device: %s; host threads: %u\n", prop.name, std::thread::hardware_concurrency());

  uint64_t bytes = 0;
  const double first = memcpy_to_pinned(dir, 8, bytes);
  std::printf("first read (8 threads, warms the page cache): %.2f GB/s\n", gbs(bytes, first));

  std::printf("\nceilings:\n");
  std::printf("  H2D cudaMemcpy pinned    %6.2f GB/s\n", h2d_gbs(true));
  std::printf("  H2D cudaMemcpy pageable  %6.2f GB/s\n", h2d_gbs(false));
  for (int t : {1, 2, 4, 8}) {
    const double s = memcpy_to_pinned(dir, t, bytes);
    std::printf("  page cache -> pinned memcpy, %d thread(s): %6.2f GB/s\n", t, gbs(bytes, s));
  }

  std::printf("\n%-44s %7s %8s %8s %9s %s\n", "path", "open s", "upload s", "GB/s", "rank0 s",
              "(projected: rank bytes / GB/s, target 20 s)");
  auto row = [&](const char* name, const PathResult& r) {
    const double rate = gbs(r.bytes, r.upload_s);
    const double proj = rank_bytes * 1e-9 / rate;
    std::printf("%-44s %7.3f %8.3f %8.2f %9.1f %s%s\n", name, r.open_s, r.upload_s, rate, proj,
                proj <= kTargetSeconds ? "under target" : "OVER target",
                r.ok ? "" : "  DATA MISMATCH");
    return rate;
  };
  const PathResult a = load(dir, nullptr);
  const double rate_a = row("(a) upload_weight per tensor (sync, pageable)", a);
  struct Variant {
    int threads;
    size_t mib;
    int bufs;
  };
  double best = 0, rate_model = 0;
  const cuda::UploaderOptions model_opts;  // what CudaModel's UploadScope uses
  for (const Variant v : {Variant{2, 64, 2}, Variant{4, 64, 2}, Variant{8, 32, 2},
                          Variant{8, 64, 2}, Variant{12, 32, 3}}) {
    cuda::UploaderOptions o;
    o.threads = v.threads;
    o.buffer_bytes = v.mib << 20;
    o.buffers_per_thread = v.bufs;
    char name[96];
    std::snprintf(name, sizeof name, "(b) WeightUploader %d thr x %d x %zu MiB", v.threads, v.bufs,
                  v.mib);
    const double rate = row(name, load(dir, &o));
    best = std::max(best, rate);
    if (o.threads == model_opts.threads && o.buffer_bytes == model_opts.buffer_bytes &&
        o.buffers_per_thread == model_opts.buffers_per_thread)
      rate_model = rate;
  }

  double rate_c = 0;
  {
    cuda::UploaderOptions o;
    o.threads = 8;
    const PathResult c = load_columns(dir, sample, o);
    rate_c = gbs(c.bytes, c.upload_s);
    std::printf("%-44s %7s %8.3f %8.2f %9.1f (%zu tensors, %.2f GB of slices; rank: %.2f GB)%s\n",
                "(c) column slices, enqueue_rows, 8 thr", "-", c.upload_s, rate_c,
                rate_c > 0 ? col_split_bytes * 1e-9 / rate_c : 0.0, c.tensors, c.bytes * 1e-9,
                col_split_bytes * 1e-9, c.ok ? "" : "  DATA MISMATCH");
  }
  if (cold) {
    drop_from_page_cache(files);
    cuda::UploaderOptions o;
    o.threads = 8;
    row("(b) WeightUploader 8 thr, COLD (fadvise)", load(dir, &o));
  }

  // Open time per tensor, scaled to the real checkpoint's 96,085 tensors (every rank parses every
  // shard's header).
  const double open_real = a.open_s / double(std::max<size_t>(a.tensors, 1)) * 96085.0;
  const double up_b = double(rank_bytes - col_split_bytes) * 1e-9 / best +
                      (rate_c > 0 ? col_split_bytes * 1e-9 / rate_c : 0);
  const double up_model = rate_model > 0 ? rank_bytes * 1e-9 / rate_model : 0;
  std::printf(
      "\nprojection for rank 0 (%.1f GB): checkpoint open ~%.2f s (scaled to 96,085 tensors)\n"
      "  upload on the model's path (UploadScope, the default uploader: %d thr x %d x %zu MiB) at "
      "%.1f GB/s: %.1f s\n"
      "  for comparison: (a) every byte at its rate %.1f s; the best (b) + (c) column slices "
      "(contiguous at %.1f GB/s, column-split at %.1f GB/s) %.1f s\n"
      "  => /readyz ~%.1f s on the model's path; target %.0f s (model build, graph capture, "
      "warm-up and a TP rank's host shard placement not included)\n",
      rank_bytes * 1e-9, open_real, model_opts.threads, model_opts.buffers_per_thread,
      model_opts.buffer_bytes >> 20, rate_model, up_model, rank_bytes * 1e-9 / rate_a, best, rate_c,
      up_b, open_real + up_model, kTargetSeconds);
  if (!keep) fs::remove_all(dir);
  return 0;
}

#endif  // UF_HAVE_CUDA
