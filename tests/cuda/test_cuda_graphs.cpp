// The CUDA-graph span program (cuda/backend/cuda_ring_span.cpp) on the tiny-a fixture model:
//  (a) graph replay == the same launches run eagerly, bitwise, for decode steps and verify rows
//      of every row count, across two sessions (one graph serves every session and position:
//      session pointers and positions are read from device memory at replay);
//  (b) chunked prefill (chunks after the first run the ring layout through the program, eagerly
//      since they exceed max_rows) against the CPU backend's chunked prefill, within the
//      fixture's end-to-end bounds (chunks of 5 rows replay graphs, chunks of 16 run eagerly);
//  (c) at TP = 2 (two GPUs), graph replay with the captured NCCL collectives == eager, bitwise;
//  (d) graph branches (CudaModelOptions::graph_branches: the compressor, the indexer and the
//      shared expert on side streams) == one stream, bitwise, replayed and at TP = 2;
//  (e) the Reindex layers on the candidate pool's lists (CudaModelOptions::candidate_lists) ==
//      every visible entry scored and masked, bitwise, at TP 1 and 2;
//  (f) step graphs launched from the device == launched from the host, bitwise, at TP 1 and 2.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "../cpu/tiny_a.h"
#include "backend_test_util.h"
#include "cpu/cpu_backend.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda_test_util.h"
#include "model/golden.h"

namespace uf::cuda {
namespace {

using uf::testing::tiny_a_dir;
using uf::testing::tiny_a_golden_i64;

using test::Cmp;
using test::compare;

class CudaGraphTest : public ::testing::Test {
 protected:
  void SetUp() override {
    UF_REQUIRE_GPU();
    map_ = tiny_a_golden_i64("engram_token_map");
    const auto p = tiny_a_golden_i64("prompt_ids");
    prompt_.assign(p.begin(), p.end());
    const auto d = tiny_a_golden_i64("decode_ids");
    next_.assign(d.begin(), d.end());
  }
  std::unique_ptr<CudaBackend> backend(bool graphs, int tp = 1, bool branches = false,
                                       bool lists = true) {
    CudaModelOptions o;
    o.cuda_graphs = graphs;
    o.tp = tp;
    o.graph_branches = branches;
    o.candidate_lists = lists;
    return std::make_unique<CudaBackend>(tiny_a_dir(), map_, o);
  }
  // Prefill of `prompt` (chunk tokens per chunk; 0 = one chunk), then, per step, a verify of k
  // rows (k cycling 1..max_rows) of which ceil(k/2) are committed; every logits row recorded.
  std::vector<float> run(engine::Backend& be, std::span<const int32_t> prompt, int chunk, int steps,
                         int M) {
    const int V = be.config().vocab_size;
    auto s = be.new_session(256);
    engine::PrefillOptions po;
    po.chunk = chunk;
    std::vector<float> out(static_cast<size_t>(V));
    be.prefill(*s, prompt, po, out);
    size_t cursor = 0;
    for (int i = 0; i < steps; ++i) {
      const int k = 1 + i % M;
      std::vector<int32_t> toks(static_cast<size_t>(k));
      for (int j = 0; j < k; ++j) toks[size_t(j)] = next_[(cursor + size_t(j)) % next_.size()];
      std::vector<float> rows(size_t(k) * size_t(V), NAN);
      be.decode_rows(*s, toks, rows);
      const int keep = (k + 1) / 2;
      be.commit(*s, keep);
      cursor += size_t(keep);
      out.insert(out.end(), rows.begin(), rows.end());
    }
    return out;
  }
  // The same prefill and verify steps on two backends: the same logits bit for bit, no NaN.
  void expect_same_logits(engine::Backend& a, engine::Backend& b, int tp) {
    const int steps = 2 * engine::kMaxVerifyRows;
    const auto x = run(a, prompt_, 0, steps, engine::kMaxVerifyRows);
    const auto y = run(b, prompt_, 0, steps, engine::kMaxVerifyRows);
    ASSERT_EQ(x.size(), y.size());
    const Cmp c = compare(y.data(), x.data(), x.size());
    EXPECT_EQ(c.first_diff, -1) << "tp " << tp << ": " << c.str();
    EXPECT_EQ(c.nan, 0u);
  }
  static int gpus() {
    int n = 0;
    UF_CUDA_CHECK(cudaGetDeviceCount(&n));
    return n;
  }
  std::vector<int64_t> map_;
  std::vector<int32_t> prompt_, next_;
};

TEST_F(CudaGraphTest, GraphReplayEqualsEagerBitwise) {
  auto eager = backend(false);
  auto graph = backend(true);
  const int steps = 3 * eager->max_rows();
  // Two sessions with different prompts (the second one shorter): the graphs captured for the
  // first replay against the second's rings and positions.
  const std::span<const int32_t> p1(prompt_), p2(prompt_.data(), prompt_.size() / 2);
  for (const auto& p : {p1, p2}) {
    const auto a = run(*eager, p, 0, steps, eager->max_rows());
    const auto b = run(*graph, p, 0, steps, eager->max_rows());
    ASSERT_EQ(a.size(), b.size());
    const Cmp c = compare(b.data(), a.data(), a.size());
    EXPECT_EQ(c.first_diff, -1) << "prompt of " << p.size() << ": " << c.str();
    EXPECT_EQ(c.nan, 0u);
  }
}

TEST_F(CudaGraphTest, GraphBranchesEqualOneStreamBitwise) {
  for (int tp : {1, 2})
    if (tp <= gpus()) expect_same_logits(*backend(true, tp, false), *backend(true, tp, true), tp);
}

// The Reindex layers scored on the candidate pool's lists against every visible entry + the mask
// (CudaModelOptions::candidate_lists): the same logits bit for bit, prefill and verify steps, at
// TP 1 and 2 (tiny-a: a pool of 3 blocks of 4 entries, top-8, so the pool restricts the choice).
TEST_F(CudaGraphTest, CandidateListsEqualMaskBitwise) {
  for (int tp : {1, 2})
    if (tp <= gpus())
      expect_same_logits(*backend(true, tp, true, false), *backend(true, tp, true, true), tp);
}

// Under TP every rank replays its own graphs with the NCCL collectives captured in them; the
// replay must give the eager TP run's logits bit for bit (the collectives are the same calls).
TEST_F(CudaGraphTest, TensorParallelGraphReplayEqualsEagerBitwise) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2)
    GTEST_SKIP() << "TP = 2 needs 2 GPUs, " << gpus << " visible";
  const auto a =
      run(*backend(false, 2), prompt_, 0, 2 * engine::kMaxVerifyRows, engine::kMaxVerifyRows);
  const auto b =
      run(*backend(true, 2), prompt_, 0, 2 * engine::kMaxVerifyRows, engine::kMaxVerifyRows);
  ASSERT_EQ(a.size(), b.size());
  const Cmp c = compare(b.data(), a.data(), a.size());
  EXPECT_EQ(c.first_diff, -1) << c.str();
  EXPECT_EQ(c.nan, 0u);
}

TEST_F(CudaGraphTest, ChunkedPrefillMatchesCpu) {
  cpu::CpuBackend cpu_be(tiny_a_dir(), map_);
  auto be = backend(true);
  const auto bounds = model::e2e_bounds(model::golden_agreement(tiny_a_dir() / "golden"), 1.5);
  const int V = be->config().vocab_size;
  for (int chunk : {5, 16}) {
    const int M = be->max_rows();
    const auto g = run(*be, prompt_, chunk, 2 * M, M);
    const auto c = run(cpu_be, prompt_, chunk, 2 * M, M);
    ASSERT_EQ(g.size(), c.size());
    const size_t rows = g.size() / size_t(V);
    for (size_t r = 0; r < rows; ++r) {
      const Cmp d = compare(g.data() + r * size_t(V), c.data() + r * size_t(V), size_t(V));
      EXPECT_EQ(d.nan, 0u) << "chunk " << chunk << " row " << r;
      EXPECT_LT(d.rms_rel, bounds.decode.rms)
          << "chunk " << chunk << " row " << r << ": " << d.str();
    }
  }
}

}  // namespace
}  // namespace uf::cuda
