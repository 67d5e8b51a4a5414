// KV snapshot transfer between two UCX nodes over loopback, and BLAKE3 throughput.
//
// Sizes are the KV of 10k, 100k and 1M tokens at 890 B/token (FP4 compressed KV) and
// 1,650 B/token (FP8). For each it reports the RMA read alone (the number comparable with
// ucx_perftest), the read into a fresh buffer (page faults included), and the whole fetch
// (connect + manifest + read + BLAKE3 verify), in GB/s (1e9 bytes/s).
//
// Usage: bench_kv_transfer [--iters N] [--max-bytes B] [--blake3-only] [--no-peer-detection]
//                          [--print-ep] [--no-arena]
//   --no-arena: every snapshot in a mapping of its own (UcxNodeConfig::arena_bytes = 0) rather
//   than in the owner's arena.
//   --no-peer-detection: endpoints without UCX peer-failure detection, which UCX 1.13 needs to
//   use shared memory between two nodes of one host (see UcxNodeConfig).
//   UCX_TLS selects transports exactly as for any UCX program (e.g. UCX_TLS=sm,tcp or tcp).
//
// Comparing with ucx_perftest on the same transport and sizes (two processes, loopback):
//   ucx_perftest -t ucp_get -s <bytes> -n 10 -p 13337 &            # server
//   ucx_perftest 127.0.0.1 -t ucp_get -s <bytes> -n 10 -p 13337    # client, prints MB/s
//   (prefix both with the same UCX_TLS=... as this bench; sizes below are printed in bytes).
// ucx_perftest reuses one registered, already-touched buffer and maps the peer's buffer once for
// all its iterations; compare its bandwidth with the "read warm" column here (best of the
// iterations: the fetcher's kept connection and the arena's rkey keep the owner's pages mapped).
// "read first" is the first read of each snapshot: on shared memory it also maps the owner's
// pages (overlapped with the copy, see read_remote in src/kv/ucx_transfer.cpp), a cost perftest
// never pays; with --no-arena every read pays it.
//
// "read fresh" reads into a new UcxNode::allocate() buffer (its pages are mapped by allocate,
// outside the timed read); "fetch e2e" is the whole warm-buffer fetch: connect, manifest, read,
// BLAKE3.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kv/blake3.h"
#include "kv/manifest.h"
#include "kv/ucx_transfer.h"

namespace {

using Clock = std::chrono::steady_clock;
using uf::kv::Blake3Backend;

double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

void fill_random(uint8_t* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x = rng();
    std::memcpy(p + i, &x, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
}

void bench_blake3() {
  std::vector<uint8_t> buf(256u << 20);
  fill_random(buf.data(), buf.size(), 1);
  std::printf("BLAKE3, one thread, %zu MiB input:\n", buf.size() >> 20);
  for (Blake3Backend be : {Blake3Backend::kPortable, Blake3Backend::kSse2, Blake3Backend::kAvx2,
                           Blake3Backend::kAvx512}) {
    Blake3Backend prev = uf::kv::set_blake3_backend(be);
    double best = 1e30;
    for (int i = 0; i < 3; ++i) {
      double t0 = now_s();
      benchmark::DoNotOptimize(uf::kv::blake3(buf.data(), buf.size()));
      best = std::min(best, now_s() - t0);
    }
    std::printf("  %-9s %6.2f GB/s\n", uf::kv::blake3_backend_name(), buf.size() / best / 1e9);
    uf::kv::set_blake3_backend(prev);
  }
  for (unsigned threads : {2u, 4u, 8u}) {
    double best = 1e30;
    for (int i = 0; i < 3; ++i) {
      double t0 = now_s();
      benchmark::DoNotOptimize(uf::kv::blake3_parallel(buf.data(), buf.size(), threads));
      best = std::min(best, now_s() - t0);
    }
    std::printf("  %-9s %6.2f GB/s (%u threads, %s)\n", "parallel", buf.size() / best / 1e9,
                threads, uf::kv::blake3_backend_name());
  }
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 5;
  uint64_t max_bytes = uint64_t{4} << 30;
  bool blake3_only = false;
  bool no_arena = false;
  uf::kv::UcxNodeConfig cfg;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc)
      iters = std::atoi(argv[++i]);
    else if (a == "--max-bytes" && i + 1 < argc)
      max_bytes = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--blake3-only")
      blake3_only = true;
    else if (a == "--no-peer-detection")
      cfg.peer_failure_detection = false;
    else if (a == "--print-ep")
      cfg.print_endpoint_info = true;
    else if (a == "--no-arena")
      no_arena = true;
    else {
      std::fprintf(stderr,
                   "usage: %s [--iters N] [--max-bytes B] [--blake3-only] "
                   "[--no-peer-detection] [--print-ep] [--no-arena]\n",
                   argv[0]);
      return 2;
    }
  }
  bench_blake3();
  if (blake3_only) return 0;
  cfg.verify_threads = 8;

  uf::kv::UcxNode fetcher(cfg);
  // The owner's arena holds the largest snapshot; each is removed (at once: no grace) before the
  // next, so they all start at the arena's first byte.
  cfg.remove_grace = std::chrono::milliseconds(0);
  if (!no_arena) cfg.arena_bytes = std::min<uint64_t>(max_bytes, uint64_t{1650} * 1000000);
  uf::kv::UcxNode owner(cfg);
  const char* tls = std::getenv("UCX_TLS");
  std::printf(
      "\nKV transfer over loopback, UCX_TLS=%s, peer failure detection %s, %d iterations "
      "(best), %s:\n",
      tls ? tls : "(default)", cfg.peer_failure_detection ? "on" : "off", iters,
      no_arena ? "a mapping per snapshot" : "snapshots in the owner's arena");
  std::printf("  %-22s %14s %12s %12s %12s %12s %12s\n", "snapshot", "bytes", "read first",
              "read warm", "read fresh", "fetch e2e", "verify");
  const std::string fp = "bench;kv";
  for (size_t tokens : {size_t{10000}, size_t{100000}, size_t{1000000}}) {
    for (size_t per_token : {size_t{890}, size_t{1650}}) {
      uint64_t bytes = uint64_t{tokens} * per_token;
      if (bytes > max_bytes) continue;
      std::vector<int32_t> toks(tokens);
      for (size_t i = 0; i < tokens; ++i) toks[i] = static_cast<int32_t>(i % 129280);
      auto src = owner.allocate(bytes);
      if (!src) {
        std::printf("  cannot register %llu bytes\n", static_cast<unsigned long long>(bytes));
        continue;
      }
      fill_random(src->data(), bytes, bytes);
      uf::kv::Manifest m = uf::kv::make_manifest(fp, toks, src->span());
      if (!owner.publish("snap", m, src).is_ok()) return 1;
      uf::kv::ReceiverExpectations ex;
      ex.fingerprint = fp;
      ex.request_tokens = toks;
      auto warm = fetcher.allocate(bytes);
      if (warm) std::memset(warm->data(), 0, bytes);  // fault the pages in once
      double first = 0, best_warm = 1e30, best_fresh = 1e30, best_e2e = 1e30, best_verify = 1e30;
      for (int it = 0; it < iters; ++it) {
        uf::kv::FetchOptions opt;
        opt.timeout = std::chrono::seconds(60);
        opt.into = warm;
        double t0 = now_s();
        uf::kv::FetchResult r = fetcher.fetch(owner.address(), "snap", ex, opt);
        double e2e = now_s() - t0;
        if (!r.status.is_ok()) {
          std::printf("  fetch failed: %s\n", r.status.to_string().c_str());
          return 1;
        }
        if (it == 0) first = r.read_seconds;
        best_warm = std::min(best_warm, r.read_seconds);
        best_e2e = std::min(best_e2e, e2e);
        best_verify = std::min(best_verify, r.verify_seconds);
        uf::kv::FetchOptions fresh_opt;
        fresh_opt.timeout = std::chrono::seconds(60);
        uf::kv::FetchResult f = fetcher.fetch(owner.address(), "snap", ex, fresh_opt);
        if (f.status.is_ok()) best_fresh = std::min(best_fresh, f.read_seconds);
      }
      char label[64];
      std::snprintf(label, sizeof(label), "%zuk tok x %zu B", tokens / 1000, per_token);
      std::printf("  %-22s %14llu %7.2f GB/s %7.2f GB/s %7.2f GB/s %7.2f GB/s %7.2f GB/s\n", label,
                  static_cast<unsigned long long>(bytes), bytes / first / 1e9,
                  bytes / best_warm / 1e9, bytes / best_fresh / 1e9, bytes / best_e2e / 1e9,
                  bytes / best_verify / 1e9);
      owner.remove("snap");
    }
  }
  return 0;
}
