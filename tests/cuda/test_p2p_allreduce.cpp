// PeerAllReduce (src/cuda/tp/p2p_allreduce.h), the one-shot P2P fp32 sum of the TP ranks, on 2
// GPUs and on every visible GPU (up to 8; skipped below 2). One host thread per rank, as in
// CudaBackend. Every result must be BITWISE the host's rank-order sum ((b0 + b1) + b2) + ... (the
// kernel adds in that order with __fadd_rn; there is no tolerance to state), on every rank:
//  (a) 200 back-to-back calls per rank with no host sync in between (epoch and slot reuse), sizes
//      1, 31, 5120, 8 x 5120, 57799 floats, some calls with rank-dependent buffer alignment (the
//      partition must not depend on it), with a capacity that fits them and with one that splits
//      the large ones into several kernels; every third call with the bf16 rounding in the kernel
//      (want: core::round_bf16 of the host sum); on the low-latency protocol, on push + flag, and
//      on both interleaved (a limit between the sizes);
//  (b) under CUDA graphs: 3 calls captured once per rank (the second rounded), replayed 50 times
//      with fresh inputs;
//  (c) race stress: before each call one rank (rotating) is delayed by a spin kernel of 0..60 us,
//      so the others run ahead into the next call's slot;
//  (d) CudaBackend at TP = 2 (tiny-a fixture): the P2P path gives bitwise the logits of the NCCL
//      path (prefill all rows, 3 decode steps);
//  (e) gather_rank (the vocab-split head's logits): every block in its columns, interleaved with
//      sums on the same object.
// Inputs span 2^-12 .. 2^12 in magnitude with exact zeros and both signs, so a different order
// of addition would show. Spins time out after 30 s (the kernel prints the rank, CTA, peer and
// epoch it waited for and traps) instead of hanging the test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../cpu/tiny_a.h"
#include "backend_test_util.h"
#include "core/dtypes.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda/tp/p2p_allreduce.h"
#include "cuda_test_util.h"

namespace uf::cuda {
namespace {

using tp::PeerAllReduce;

constexpr double kTimeoutS = 30;
const std::vector<size_t> kSizes = {1, 31, 5120, 8 * 5120, 57799};

using test::gpu_count;

// The rank counts to test: 2, and every visible GPU (<= 8) when that is more.
std::vector<int> rank_counts() {
  const int g = std::min(gpu_count(), PeerAllReduce::kMaxRanks);
  std::vector<int> v;
  if (g >= 2) v.push_back(2);
  if (g > 2) v.push_back(g);
  return v;
}

#define UF_REQUIRE_TWO_GPUS()                                                                \
  UF_REQUIRE_GPU();                                                                          \
  if (gpu_count() < 2)                                                                       \
    GTEST_SKIP() << "the P2P all-reduce needs 2 GPUs, " << gpu_count() << " visible";        \
  {                                                                                          \
    std::string why_;                                                                        \
    std::vector<int> devs_{0, 1};                                                            \
    if (!PeerAllReduce::supported(devs_, &why_)) GTEST_SKIP() << "no peer access: " << why_; \
  }

std::vector<int> first_devices(int n) {
  std::vector<int> d;
  for (int i = 0; i < n; ++i) d.push_back(i);
  return d;
}

float random_input(std::mt19937& rng) {
  const uint32_t k = rng();
  if (k % 17 == 0) return (k & 0x100) ? -0.0f : 0.0f;
  std::uniform_real_distribution<float> m(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-12, 12);
  return ((k & 1) ? -1.0f : 1.0f) * std::ldexp(m(rng), ex(rng));
}

// Runs f(rank) on one thread per rank (its device current) and reports each thread's error.
template <typename F>
void on_ranks(int n, F&& f) {
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        UF_CUDA_CHECK(cudaSetDevice(r));
        f(r);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r)
    EXPECT_TRUE(errors[size_t(r)].empty()) << "rank " << r << ": " << errors[size_t(r)];
}

// One call's inputs on every rank and the expected sum.
struct Call {
  size_t n = 0;
  bool round = false;                  // sum_rank(..., round_bf16 = true)
  std::vector<std::vector<float>> in;  // [rank][n]
  std::vector<float> want;             // rank-order sum
};

Call make_call(int ranks, size_t n, bool round, std::mt19937& rng) {
  Call c;
  c.n = n;
  c.round = round;
  c.in.assign(size_t(ranks), std::vector<float>(n));
  for (auto& v : c.in)
    for (auto& x : v) x = random_input(rng);
  c.want.resize(n);
  for (size_t i = 0; i < n; ++i) {
    float acc = c.in[0][i];
    for (int q = 1; q < ranks; ++q) acc = acc + c.in[size_t(q)][i];
    c.want[i] = round ? core::round_bf16(acc) : acc;
  }
  return c;
}

// Compares rank `rank`'s result of call `k` with the expected sum; describes the first bad
// element with every rank's input there.
void check_result(const std::string& what, int rank, size_t k, const Call& c,
                  const std::vector<float>& got) {
  size_t bad = 0, nan = 0, first = SIZE_MAX;
  for (size_t i = 0; i < c.n; ++i) {
    if (std::isnan(got[i])) ++nan;
    if (!test::bits_equal(got[i], c.want[i])) {
      ++bad;
      if (first == SIZE_MAX) first = i;
    }
  }
  if (bad == 0) return;
  std::ostringstream os;
  os.precision(9);
  os << what << ": rank " << rank << ", call " << k << " (n = " << c.n
     << (c.round ? ", bf16-rounded" : "") << "): " << bad
     << " elements differ from the rank-order sum (" << nan << " NaN); first at " << first
     << ": got " << got[first] << ", want " << c.want[first] << ", inputs";
  for (size_t q = 0; q < c.in.size(); ++q) os << " [" << q << "] " << c.in[q][first];
  ADD_FAILURE() << os.str();
}

// (a) and (c): `calls` calls per rank enqueued back to back (inputs uploaded first, results
// checked after one sync); call k has size kSizes[k % 5], and every 7th call puts odd ranks'
// buffers one float off 16-byte alignment. delay_us > 0: before call k, rank k % N first runs a
// spin kernel of (k * 37) % (delay_us + 1) us.
// ll: the low-latency protocol's limit (0: every call on push + flag; the default: every size here
// at capacity 1 << 16; 8192: the two protocols interleaved).
void run_back_to_back(int ranks, size_t cap, int calls, int delay_us, const std::string& what,
                      size_t ll = PeerAllReduce::kDefaultLowLatencyElems) {
  PeerAllReduce p2p(first_devices(ranks), cap, PeerAllReduce::kDefaultCtas, kTimeoutS, ll);
  std::mt19937 rng(1234u + unsigned(ranks) * 7u + unsigned(cap));
  std::vector<Call> cs;
  std::vector<size_t> offset;  // start of call k in each rank's buffer (before misalignment)
  size_t total = 0;
  for (int k = 0; k < calls; ++k) {
    cs.push_back(make_call(ranks, kSizes[size_t(k) % kSizes.size()], k % 3 == 1, rng));
    offset.push_back(total);
    total += (cs.back().n + 4 + 63) / 64 * 64;  // room for the 1-float shift, 256-byte aligned
  }
  auto shift = [](int rank, int k) { return (k % 7 == 3 && rank % 2 == 1) ? size_t(1) : 0; };
  on_ranks(ranks, [&](int r) {
    test::DeviceBuffer<float> buf(total);
    buf.poison();
    for (int k = 0; k < calls; ++k)
      UF_CUDA_CHECK(cudaMemcpy(buf.get() + offset[size_t(k)] + shift(r, k),
                               cs[size_t(k)].in[size_t(r)].data(), cs[size_t(k)].n * sizeof(float),
                               cudaMemcpyHostToDevice));
    // A pageable cudaMemcpy may return before its DMA lands; the calls run on another stream.
    UF_CUDA_CHECK(cudaDeviceSynchronize());
    cudaStream_t s = nullptr;
    UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (int k = 0; k < calls; ++k) {
      if (delay_us > 0 && k % ranks == r)
        tp::delay_stream_ns(s, 1000ull * unsigned((k * 37) % (delay_us + 1)));
      p2p.sum_rank(r, buf.get() + offset[size_t(k)] + shift(r, k), cs[size_t(k)].n, s,
                   cs[size_t(k)].round);
    }
    const cudaError_t err = cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("stream sync after the calls: ") +
                               cudaGetErrorString(err));
    const auto all = buf.download();
    for (int k = 0; k < calls; ++k) {
      const auto* p = all.data() + offset[size_t(k)] + shift(r, k);
      check_result(what + " (" + std::to_string(ranks) + " ranks, capacity " + std::to_string(cap) +
                       ", low-latency limit " + std::to_string(ll) + ")",
                   r, size_t(k), cs[size_t(k)], std::vector<float>(p, p + cs[size_t(k)].n));
    }
  });
}

TEST(PeerAllReduce, BackToBackCallsEqualRankOrderSum) {
  UF_REQUIRE_TWO_GPUS();
  for (int n : rank_counts()) {
    SCOPED_TRACE("ranks " + std::to_string(n));
    // One kernel per call (the capacity holds the largest size): low latency, push + flag, both.
    run_back_to_back(n, 1 << 16, 200, 0, "one kernel per call");
    run_back_to_back(n, 1 << 16, 200, 0, "one kernel per call, push + flag", 0);
    run_back_to_back(n, 1 << 16, 200, 0, "one kernel per call, both protocols", 8192);
    // The large sizes split into kernels of 16384 floats (3 and 4 kernels).
    run_back_to_back(n, 16384, 200, 0, "chunked calls");
    run_back_to_back(n, 16384, 200, 0, "chunked calls, push + flag", 0);
  }
}

TEST(PeerAllReduce, DelayedRankRaceStress) {
  UF_REQUIRE_TWO_GPUS();
  for (int n : rank_counts()) {
    SCOPED_TRACE("ranks " + std::to_string(n));
    run_back_to_back(n, 1 << 16, 200, 60, "one rank delayed");
    run_back_to_back(n, 1 << 16, 200, 60, "one rank delayed, both protocols", 8192);
    run_back_to_back(n, 16384, 100, 60, "one rank delayed, chunked");
  }
}

// (b) Each rank captures 3 calls (sizes 5120, 57799, 31) on its own stream once and replays the
// graph 50 times; before each replay its inputs are uploaded, after it the results are checked.
TEST(PeerAllReduce, CudaGraphReplaysEqualRankOrderSum) {
  UF_REQUIRE_TWO_GPUS();
  const std::vector<size_t> sizes = {5120, 57799, 31};
  constexpr int kReplays = 50;
  for (int n : rank_counts()) {
    SCOPED_TRACE("ranks " + std::to_string(n));
    PeerAllReduce p2p(first_devices(n), 1 << 16, PeerAllReduce::kDefaultCtas, kTimeoutS);
    std::mt19937 rng(99u + unsigned(n));
    std::vector<std::vector<Call>> rounds(kReplays);  // [replay][call]
    for (auto& r : rounds)
      for (size_t j = 0; j < sizes.size(); ++j) r.push_back(make_call(n, sizes[j], j == 1, rng));
    on_ranks(n, [&](int r) {
      std::vector<std::unique_ptr<test::DeviceBuffer<float>>> bufs;
      for (size_t sz : sizes) bufs.push_back(std::make_unique<test::DeviceBuffer<float>>(sz));
      cudaStream_t s = nullptr;
      UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      // Thread-local capture: the other ranks' threads capture at the same time.
      cudaGraph_t graph = nullptr;
      UF_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (size_t j = 0; j < sizes.size(); ++j)
        p2p.sum_rank(r, bufs[j]->get(), sizes[j], s, /*round_bf16=*/j == 1);
      UF_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
      cudaGraphExec_t exec = nullptr;
      UF_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int k = 0; k < kReplays; ++k) {
        for (size_t j = 0; j < sizes.size(); ++j) {
          UF_CUDA_CHECK(cudaMemsetAsync(bufs[j]->get(), 0xFF, sizes[j] * sizeof(float), s));
          UF_CUDA_CHECK(cudaMemcpyAsync(bufs[j]->get(), rounds[size_t(k)][j].in[size_t(r)].data(),
                                        sizes[j] * sizeof(float), cudaMemcpyHostToDevice, s));
        }
        UF_CUDA_CHECK(cudaGraphLaunch(exec, s));
        const cudaError_t err = cudaStreamSynchronize(s);
        if (err != cudaSuccess)
          throw std::runtime_error("replay " + std::to_string(k) + ": " + cudaGetErrorString(err));
        for (size_t j = 0; j < sizes.size(); ++j)
          check_result(std::to_string(n) + " ranks, graph replay " + std::to_string(k), r, j,
                       rounds[size_t(k)][j], bufs[j]->download());
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(s);
    });
  }
}

// (e) gather_rank: every rank's [rows, width] block lands in its columns of every rank's
// [rows, stride] destination (other columns untouched), interleaved with sums on the same
// object (they share the epochs and slots), for widths that allow float4 and odd ones, with a
// capacity that fits the whole call and one that splits it into kernels of whole rows. Bitwise
// copies: no tolerance.
TEST(PeerAllReduce, GatherRankPlacesEveryBlockAndInterleavesWithSums) {
  UF_REQUIRE_TWO_GPUS();
  struct Shape {
    size_t rows, width, pad;  // stride = ranks * width + pad
  };
  const std::vector<Shape> shapes = {{7, 16160, 0}, {3, 37, 5}, {8, 512, 4}, {1, 1, 0}};
  for (int n : rank_counts()) {
    for (size_t cap : {size_t(1) << 18, size_t(40000)}) {
      SCOPED_TRACE("ranks " + std::to_string(n) + ", capacity " + std::to_string(cap));
      PeerAllReduce p2p(first_devices(n), cap, PeerAllReduce::kDefaultCtas, kTimeoutS);
      std::mt19937 rng(555u + unsigned(n) + unsigned(cap));
      std::vector<std::vector<std::vector<float>>> src(shapes.size());  // [shape][rank]
      for (size_t k = 0; k < shapes.size(); ++k)
        for (int r = 0; r < n; ++r) {
          std::vector<float> v(shapes[k].rows * shapes[k].width);
          for (auto& x : v) x = random_input(rng);
          src[k].push_back(std::move(v));
        }
      const Call sum = make_call(n, 5120, true, rng);
      on_ranks(n, [&](int r) {
        cudaStream_t s = nullptr;
        UF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        std::vector<std::unique_ptr<test::DeviceBuffer<float>>> in, out;
        for (size_t k = 0; k < shapes.size(); ++k) {
          const Shape& sh = shapes[k];
          in.push_back(std::make_unique<test::DeviceBuffer<float>>(src[k][size_t(r)]));
          out.push_back(
              std::make_unique<test::DeviceBuffer<float>>(sh.rows * (n * sh.width + sh.pad)));
          out.back()->poison();
        }
        test::DeviceBuffer<float> sbuf(sum.in[size_t(r)]);
        UF_CUDA_CHECK(cudaDeviceSynchronize());
        for (size_t k = 0; k < shapes.size(); ++k) {
          const Shape& sh = shapes[k];
          p2p.gather_rank(r, in[k]->get(), sh.rows, sh.width, out[k]->get(), n * sh.width + sh.pad,
                          s);
          if (k == 1) p2p.sum_rank(r, sbuf.get(), sum.n, s, /*round_bf16=*/true);
        }
        const cudaError_t err = cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
        if (err != cudaSuccess) throw std::runtime_error(cudaGetErrorString(err));
        check_result("sum between gathers", r, 0, sum, sbuf.download());
        for (size_t k = 0; k < shapes.size(); ++k) {
          const Shape& sh = shapes[k];
          const size_t stride = n * sh.width + sh.pad;
          const auto got = out[k]->download();
          size_t bad = 0, first = SIZE_MAX;
          for (size_t t = 0; t < sh.rows; ++t)
            for (size_t c = 0; c < stride; ++c) {
              const float g = got[t * stride + c];
              const bool ok =
                  c < n * sh.width
                      ? test::bits_equal(g, src[k][c / sh.width][t * sh.width + c % sh.width])
                      : std::isnan(g);  // padding keeps its poison
              if (!ok && bad++ == 0) first = t * stride + c;
            }
          EXPECT_EQ(bad, 0u) << "rank " << r << ", gather of [" << sh.rows << ", " << sh.width
                             << "] x " << n << " ranks, stride " << stride << ": first bad at "
                             << first;
        }
      });
    }
  }
}

// Construction errors name what is wrong (no GPU needed for the rank-count check).
TEST(PeerAllReduce, RejectsBadArguments) {
  EXPECT_THROW(PeerAllReduce({0}, 1024), std::exception);
  EXPECT_THROW(PeerAllReduce({0, 0}, 1024), std::exception);
  EXPECT_THROW(PeerAllReduce({0, 1, 2, 3, 4, 5, 6, 7, 8}, 1024), std::exception);
}

// (d) The backend's default TP = 2 path (P2P) against NCCL: bitwise equal logits.
TEST(PeerAllReduce, BackendP2pEqualsNcclAtTp2) {
  UF_REQUIRE_TWO_GPUS();
  const auto map = uf::testing::tiny_a_golden_i64("engram_token_map");
  const auto p = uf::testing::tiny_a_golden_i64("prompt_ids");
  const auto d = uf::testing::tiny_a_golden_i64("decode_ids");
  const std::vector<int32_t> prompt(p.begin(), p.end()), next(d.begin(), d.end());
  CudaModelOptions o;
  o.tp = 2;
  o.tp_p2p_allreduce = true;
  auto a = std::make_unique<CudaBackend>(uf::testing::tiny_a_dir(), map, o);
  o.tp_p2p_allreduce = false;
  auto b = std::make_unique<CudaBackend>(uf::testing::tiny_a_dir(), map, o);
  const int V = a->config().vocab_size;
  auto prefilled = [&](CudaBackend& be, std::vector<float>& all) {
    auto s = be.new_session(128);
    engine::PrefillOptions po;
    po.all_logits = true;
    all.assign(prompt.size() * size_t(V), NAN);
    be.prefill(*s, prompt, po, std::span<float>(all));
    return s;
  };
  std::vector<float> la, lb;
  auto sa = prefilled(*a, la);
  auto sb = prefilled(*b, lb);
  const test::Cmp pc = test::compare(la.data(), lb.data(), la.size());
  EXPECT_EQ(pc.first_diff, -1) << "prefill, P2P vs NCCL: " << pc.str();
  std::vector<float> x(static_cast<size_t>(V)), y(static_cast<size_t>(V));
  for (int k = 0; k < 3 && k < int(next.size()); ++k) {
    const std::span<const int32_t> tok(&next[size_t(k)], 1);
    a->decode_rows(*sa, tok, x);
    a->commit(*sa, 1);
    b->decode_rows(*sb, tok, y);
    b->commit(*sb, 1);
    const test::Cmp dc = test::compare(x.data(), y.data(), size_t(V));
    EXPECT_EQ(dc.first_diff, -1) << "decode step " << k << ", P2P vs NCCL: " << dc.str();
  }
}

}  // namespace
}  // namespace uf::cuda
