#pragma once
// A one-shot peer-to-peer fp32 all-reduce for the TP ranks of ONE process (one GPU each, every
// pair with peer access over NVLink): one kernel per call on the calling rank's stream, no NCCL.
// Every rank gets out[i] = ((b0[i] + b1[i]) + b2[i]) + ... in RANK ORDER (fp32 __fadd_rn, no
// FMA): bitwise the same on every rank, and equal to all-gather + sum_ranks_round_bf16 before its
// rounding (and to NCCL's a + b at 2 ranks), whatever the element count.
//
// Memory (rank q's, on device q, from cudaMalloc; peers write it through peer access):
//   recv[q] : [2 slots][N source ranks][cap floats]   rank s pushes its input into recv[q][.][s]
//   flags[q]: [N source ranks][G CTAs] uint64         rank s's CTA b stores its epoch there
//   epoch[q]: [G] uint64                              rank q's CTA b counts its own calls
//   ll[q]   : [2 slots][N source ranks][ll lines] of 16 bytes   the low-latency protocol's lines
//   ll_epoch[q]: [G] uint64                           its call counts (below)
// Protocol of one call on rank r (kernel of G CTAs; CTA b owns the same element range [lo_b,
// hi_b) on every rank, because every rank calls with the same n, and it only ever waits for the
// CTAs b of the other ranks: no CTA waits for another CTA of its own grid, so no co-residency
// within a GPU is needed):
//   1. thread 0 reads e = epoch[r][b] + 1 and stores it back (only this rank's CTA b touches the
//      counter, and the calls of a rank are stream ordered: plain accesses suffice). The epoch
//      lives in device memory, so a captured CUDA graph replays with fresh epochs.
//   2. push: buf[lo_b, hi_b) is stored into recv[q][e & 1][r][lo_b, hi_b) of every peer q.
//   3. signal: __syncthreads (the CTA's pushes precede), then per peer q one thread runs
//      __threadfence_system and st.release.sys flags[q][r][b] = e (cumulative release: the
//      CTA's stores, ordered before it by the barrier, are visible to whoever acquires e).
//   4. wait: per peer q one thread spins with ld.acquire.sys on its LOCAL flags[r][q][b] until
//      >= e, then __syncthreads; the data is read with ld.cg (L2, never a stale L1 line).
//      ">=" and not "==": a fast peer may already have finished this call and stored e + 1.
//   5. sum in rank order (own term from buf itself), optionally rounded to bf16, into
//      buf[lo_b, hi_b).
// Buffer reuse (why two slots are enough): call k writes slot k & 1 of the peers. A rank can
// only start call k once its call k - 1 has completed, i.e. once every peer stored its flag of
// call k - 1; a peer stores that flag inside its call k - 1, which on its stream starts only
// after its call k - 2 (the last reader of slot k & 1) has completed. So a rank at call k can
// overlap its peers' call k - 1 (slot (k - 1) & 1: the other slot) but never call k - 2. The
// flags are monotonic per (source, CTA), so they need no reset and no slot.
// The rule this needs, as for NCCL: every rank makes the same sequence of calls (same n), and
// each rank's calls on one stream (or otherwise ordered). The kernels are launched with
// programmatic dependent launch allowed: a call's CTAs may become resident while the kernel
// before it runs, but do nothing before griddepcontrol.wait returns (that kernel, the previous
// call included, has completed), so "starts" above means "passes its wait"; they never trigger
// their dependents early, so the kernel after a call starts once the call has completed.
// Sums larger than the capacity run as several calls of at most cap elements (the sum is
// elementwise, so the result is the same).
//
// A spin that exceeds the timeout (0 = wait forever, like NCCL) prints which rank, CTA, peer,
// epoch and flag value it waited for and traps (the stream then reports an error).
//
// Small sums (n <= low_latency_elems) take the LOW-LATENCY protocol instead (NCCL's "LL" idea):
// rank s stores each pair of values into peer q's ll[q][e & 1][s] (e: the rank's 64-bit count of
// its LL calls) as ONE 16-byte line {v0, e32, v1, e32}, e32 = e mod (2^32 - 1) + 1 (never the 0 of
// a line never written). Each 8-byte half is single-copy atomic, so a reader polling the line
// (ld.volatile) that sees e32 in both halves holds both values: no fence, no flag, no barrier; a
// call costs one NVLink store latency instead of a store, a system fence and a flag round trip.
// The price is twice the bytes, hence the size limit. Every CTA of the fixed grid counts every
// LL call, so all of a rank's CTAs hold the same count, and a line holds e32 only if written by
// this call: a line of slot e & 1 last written earlier holds the e32 of a call 2j calls back,
// j >= 1, equal only if 2j is a multiple of 2^32 - 1 (not a case in practice). Slot reuse: the
// push + flag argument above, applied to the subsequence of LL calls (each rank's calls are
// stream ordered). Sums are bitwise the same under both protocols (same rank order).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace uf::cuda::tp {

namespace detail {
struct P2pArgs;  // p2p_allreduce.cu
}

class PeerAllReduce {
 public:
  static constexpr int kMaxRanks = 8;
  // CTAs a kernel (the backend reads UF_P2P_CTAS to try others). 64, not 16 (session 13, two
  // TP8-shaped ranks on 2 H200s, same run): a 7-row forward's 91 collectives 464 -> 361 us at 8k
  // and 1675 -> 1028 us at 1M (the index-score sums of T x 250k floats are bound by how many SMs
  // store over NVLink at once), a 512-row prefill chunk at 1M 268 -> 226 ms; the low-latency sums
  // do not mind the idle CTAs.
  static constexpr int kDefaultCtas = 64;
  // Sums of up to this many floats take the low-latency protocol: a decode step's T x dim sums
  // (<= 8 x 5120) and the index scores of contexts up to ~32k tokens; 16 MB a GPU at 8 ranks.
  static constexpr size_t kDefaultLowLatencyElems = size_t(1) << 16;

  // True when every ordered pair of `devices` has peer access (cudaDeviceCanAccessPeer); else
  // false with `why` naming the first pair that has none.
  static bool supported(const std::vector<int>& devices, std::string* why = nullptr);
  // Enables peer access between every pair (already-enabled pairs are fine) and allocates each
  // rank's buffers for sums of up to max_elems floats per kernel (rounded up to a multiple of 4;
  // more per call are split). Throws uf::core::Error naming the pair when a device cannot access
  // a peer, on 2 > devices > kMaxRanks, or when ctas exceeds a device's SM count.
  // Synchronous (allocation and zeroing done on return).
  // low_latency_elems: sums (of one kernel) up to this many floats take the low-latency protocol
  // (rounded up to even; 0 = never).
  PeerAllReduce(std::vector<int> devices, size_t max_elems, int ctas = kDefaultCtas,
                double timeout_s = 0, size_t low_latency_elems = kDefaultLowLatencyElems);
  ~PeerAllReduce();
  PeerAllReduce(const PeerAllReduce&) = delete;
  PeerAllReduce& operator=(const PeerAllReduce&) = delete;

  int size() const { return int(devices_.size()); }
  int device(int rank) const { return devices_.at(size_t(rank)); }
  size_t max_elems() const { return cap_; }
  size_t low_latency_elems() const { return 2 * ll_lines_; }
  int ctas() const { return ctas_; }
  size_t bytes_per_rank() const;

  // Rank `rank`'s part of an in-place sum: buf (n floats on device(rank)) becomes the rank-order
  // sum of every rank's buf. Enqueued on `stream` (of device(rank)); does not synchronize; may be
  // captured in a CUDA graph. Each rank calls it (from any thread) with the same n, in the same
  // order as the others. The calling thread's current device is restored on return.
  // round_bf16: the sum is rounded to bf16 (round to nearest even, as core::round_bf16 and the
  // round_bf16 op) before it is stored, saving the caller's rounding kernel.
  void sum_rank(int rank, float* buf, size_t n, cudaStream_t stream, bool round_bf16 = false);

  // Rank `rank`'s part of an all-gather by column blocks: every rank passes src [rows, width]
  // (contiguous), and every rank's dst row t receives rank q's row t at columns
  // [q * width, (q + 1) * width) (dst row stride dst_stride >= size() * width; other columns
  // untouched). The same exchange as sum_rank (one kernel per cap / width rows, the same slots,
  // flags and epochs, so sums and gathers may be interleaved freely as long as every rank makes
  // the same sequence of calls with the same shapes). Used for the vocab-split head's logits.
  void gather_rank(int rank, const float* src, size_t rows, size_t width, float* dst,
                   size_t dst_stride, cudaStream_t stream);

 private:
  detail::P2pArgs args(int rank) const;  // the kernels' view of rank `rank`
  std::vector<int> devices_;
  size_t cap_ = 0;
  int ctas_ = 0;
  unsigned long long timeout_ns_ = 0;
  std::vector<float*> recv_;          // per rank: [2][N][cap]
  std::vector<uint64_t*> flags_;      // per rank: [N][ctas]
  std::vector<uint64_t*> epochs_;     // per rank: [ctas]
  size_t ll_lines_ = 0;               // low-latency capacity, 16-byte lines (2 floats each)
  std::vector<void*> ll_;             // per rank: [2][N][ll_lines_] lines (uint4)
  std::vector<uint64_t*> ll_epochs_;  // per rank: [ctas]
  std::vector<void*> allocations_;    // per rank: one cudaMalloc holding the three
};

// For tests and benches: a one-thread kernel on `stream` (of the current device) that spins for
// `ns` nanoseconds (%globaltimer), to make one rank late.
void delay_stream_ns(cudaStream_t stream, unsigned long long ns);

}  // namespace uf::cuda::tp
