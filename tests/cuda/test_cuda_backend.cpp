// The CUDA backend end to end on the tiny-a fixture model (window 8, so the rings wrap many times
// over the 41-token prompt), through the engine::Backend interface:
//  (a) spec == plain: k verify rows equal k plain single-row steps bit for bit, k = 1..max_rows;
//  (b) CUDA vs the CPU reference: prefill and decode logits within the fixture's end-to-end bounds
//      (two faithful implementations differ by at most the manifest's noise floor x 1.5, the
//      bound check-fixture applies against the reference) and argmax agreement;
//  (c) snapshot / restore: bitwise identical next-step logits, and the byte format is the CPU's
//      (a CUDA snapshot restores on the CPU backend and snapshots back to the same bytes);
//  (d) a DSpark round: finite logits close to the CPU's for the same anchor and draft tokens;
//  (e) the CED prefill shortcut close to the CPU's;
//  (f) the tensor-parallel entry-split indexer, its ranks simulated on this GPU: bitwise.
// Every comparison prints max abs / rms-rel / NaN count / first differing index.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>

#include "../cpu/tiny_a.h"
#include "backend_test_util.h"
#include "cpu/cpu_backend.h"
#include "cpu/session.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda_test_util.h"
#include "model/golden.h"

namespace uf::cuda {
namespace {

using uf::testing::tiny_a_dir;
using uf::testing::tiny_a_golden_i64;

using test::argmax;
using test::Cmp;
using test::compare;
using test::first_byte_diff;

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    UF_REQUIRE_GPU();
    map_ = tiny_a_golden_i64("engram_token_map");
    be_ = std::make_unique<CudaBackend>(tiny_a_dir(), map_);
    const auto p = tiny_a_golden_i64("prompt_ids");
    prompt_.assign(p.begin(), p.end());
    const auto d = tiny_a_golden_i64("decode_ids");
    next_.assign(d.begin(), d.end());
    V_ = be_->config().vocab_size;
    bounds_ = model::e2e_bounds(model::golden_agreement(tiny_a_dir() / "golden"), 1.5);
  }
  std::unique_ptr<engine::SessionState> prefilled(engine::Backend& be, std::vector<float>* all) {
    auto s = be.new_session(128);
    engine::PrefillOptions o;
    o.all_logits = all != nullptr;
    std::vector<float> last(static_cast<size_t>(V_));
    if (all) all->assign(prompt_.size() * size_t(V_), 0.f);
    be.prefill(*s, prompt_, o, all ? std::span<float>(*all) : std::span<float>(last));
    return s;
  }
  // The session's compressed KV and index keys live on the device as bf16 (cuda_session.h): a
  // snapshot value bf16 cannot hold is refused with a clear error, never rounded silently. The
  // snapshot goes through a CPU session (the same byte format), its first nonzero value of
  // `field` scaled by 1 + 2^-10.
  void expect_restore_refuses_inexact(std::vector<float> cpu::LayerState::*field,
                                      const char* what) {
    auto s = prefilled(*be_, nullptr);
    cpu::CpuBackend cpu_be(tiny_a_dir(), map_);
    auto cs = cpu_be.new_session(128);
    cpu_be.restore(*cs, be_->snapshot(*s));
    bool changed = false;
    for (auto& L : dynamic_cast<cpu::CpuSession&>(*cs).layers)
      for (float& x : L.*field)
        if (!changed && x != 0.f) {
          x *= 1.f + std::ldexp(1.f, -10);
          changed = true;
        }
    ASSERT_TRUE(changed) << "the session has no nonzero " << what;
    const auto bad = cpu_be.snapshot(*cs);
    auto r = be_->new_session(128);
    try {
      be_->restore(*r, bad);
      ADD_FAILURE() << "a snapshot with a " << what << " bf16 cannot hold was restored";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("not exact in bf16"), std::string::npos) << e.what();
    }
    auto cs2 = cpu_be.new_session(128);
    EXPECT_NO_THROW(cpu_be.restore(*cs2, bad));
  }
  std::vector<int64_t> map_;
  std::unique_ptr<CudaBackend> be_;
  std::vector<int32_t> prompt_, next_;
  int V_ = 0;
  model::E2eBounds bounds_;
};

TEST_F(CudaBackendTest, VerifyRowsEqualPlainDecodeBitwise) {
  const int M = be_->max_rows();
  ASSERT_GE(int(next_.size()), M);
  auto s0 = prefilled(*be_, nullptr);
  const auto snap = be_->snapshot(*s0);
  auto fresh = [&] {
    auto s = be_->new_session(128);
    be_->restore(*s, snap);
    return s;
  };
  std::vector<float> plain(size_t(M) * size_t(V_));
  auto sp = fresh();
  for (int i = 0; i < M; ++i) {
    be_->decode_rows(*sp, std::span<const int32_t>(&next_[size_t(i)], 1),
                     std::span<float>(plain.data() + int64_t(i) * V_, size_t(V_)));
    be_->commit(*sp, 1);
  }
  for (int k = 1; k <= M; ++k) {
    auto sv = fresh();
    std::vector<float> rows(size_t(k) * size_t(V_), NAN);
    be_->decode_rows(*sv, std::span<const int32_t>(next_.data(), size_t(k)), rows);
    for (int i = 0; i < k; ++i) {
      const Cmp c =
          compare(rows.data() + int64_t(i) * V_, plain.data() + int64_t(i) * V_, size_t(V_));
      EXPECT_EQ(c.first_diff, -1) << "k=" << k << " row " << i << ": " << c.str();
      EXPECT_EQ(c.nan, 0u) << "k=" << k << " row " << i;
    }
    // Rejecting the rows must leave the committed state as it was.
    be_->commit(*sv, 0);
    std::vector<float> again(static_cast<size_t>(V_));
    be_->decode_rows(*sv, std::span<const int32_t>(next_.data(), 1), again);
    const Cmp c = compare(again.data(), plain.data(), size_t(V_));
    EXPECT_EQ(c.first_diff, -1) << "after rejecting " << k << " rows: " << c.str();
  }
}

// Eager spans (prefill chunks of more than max_rows rows) lay their index scores out as narrow as
// their widest row, graph steps at the session scratch's width: a session's capacity (which sets
// that width) must not change a logit. Prefill in 16-row chunks (the first in the prefill layout,
// the others eager ring spans) on a 64-token session, then on a 8192-token one (the scratch widens
// for both), all rows' logits, then three decode steps on each.
TEST_F(CudaBackendTest, SessionCapacityDoesNotChangeLogits) {
  engine::PrefillOptions o;
  o.all_logits = true;
  o.chunk = 16;
  ASSERT_GT(o.chunk, be_->max_rows());
  const size_t n = prompt_.size() * size_t(V_);
  std::vector<float> narrow(n, NAN), wide(n, NAN);
  auto a = be_->new_session(64);
  be_->prefill(*a, prompt_, o, narrow);
  auto b = be_->new_session(8192);
  be_->prefill(*b, prompt_, o, wide);
  const Cmp c = compare(wide.data(), narrow.data(), n);
  EXPECT_EQ(c.first_diff, -1) << "prefill: " << c.str();
  EXPECT_EQ(c.nan, 0u);
  std::vector<float> la(static_cast<size_t>(V_)), lb(static_cast<size_t>(V_));
  for (int i = 0; i < 3; ++i) {
    const std::span<const int32_t> tok(&next_[size_t(i)], 1);
    be_->decode_rows(*a, tok, la);
    be_->decode_rows(*b, tok, lb);
    be_->commit(*a, 1);
    be_->commit(*b, 1);
    const Cmp d = compare(lb.data(), la.data(), size_t(V_));
    EXPECT_EQ(d.first_diff, -1) << "decode step " << i << ": " << d.str();
  }
}

// CudaModelOptions::max_seq sizes the index scratch at construction: the server's sessions (of
// that capacity) then decode on the graphs captured at construction, with no capture while
// requests run. Without it, the first such session drops them and its steps capture them again.
TEST_F(CudaBackendTest, MaxSeqOptionKeepsTheConstructionGraphs) {
  const int64_t cap = 8192;
  auto steps = [&](CudaBackend& be) {
    auto s = be.new_session(cap);
    std::vector<float> logits(static_cast<size_t>(V_));
    be.prefill(*s, prompt_, engine::PrefillOptions{}, logits);
    for (int i = 0; i < 3; ++i) {
      be.decode_rows(*s, std::span<const int32_t>(&next_[size_t(i)], 1), logits);
      be.commit(*s, 1);
    }
  };
  CudaModelOptions mo;
  mo.max_seq = cap;
  CudaBackend sized(tiny_a_dir(), map_, mo);
  const int64_t built = sized.model().graph_captures_total();
  ASSERT_GT(built, 0) << "no graph captured at construction";
  steps(sized);
  EXPECT_EQ(sized.model().graph_captures_total(), built)
      << "a session of the announced capacity recaptured the step graphs";
  CudaBackend unsized(tiny_a_dir(), map_);  // the fixture's own: no max_seq
  const int64_t before = unsized.model().graph_captures_total();
  steps(unsized);
  EXPECT_GT(unsized.model().graph_captures_total(), before)
      << "a wider session did not recapture (is the scratch sized by another path now?)";
}

// CudaModelOptions::index_split_simulated_ranks: the entry-split indexer of tensor parallelism
// (cuda_index_split.cpp), its ranks run in turn on this GPU: every selection is the unsplit
// indexer's, so prefill (all rows), decode and verify logits are bitwise the default backend's.
// A 300-token prompt gives index rows of 150 / 300 entries against the fixture's top-8 and a
// pool of 3 blocks of 4, so the ranges, the merge and the pool's blocks all matter. With
// index_split_min_work = 50000 (rows x positions) the prefill's 300 x 300 layers split while its
// 300 x 150 ones, its 300 x 12 pool lists and every decode and verify call score whole rows: the
// two mix within a forward.
TEST_F(CudaBackendTest, IndexSplitSimulatedRanksIsBitwise) {
  std::vector<int32_t> prompt = prompt_;
  std::mt19937 rng(5);
  while (prompt.size() < 300) prompt.push_back(int32_t(rng() % uint32_t(V_)));
  auto run = [&](CudaBackend& be) {
    auto s = be.new_session(512);
    engine::PrefillOptions po;
    po.all_logits = true;
    std::vector<float> out(prompt.size() * size_t(V_), NAN);
    be.prefill(*s, prompt, po, out);
    std::vector<float> x(static_cast<size_t>(V_));
    for (int i = 0; i < 3; ++i) {
      be.decode_rows(*s, std::span<const int32_t>(&next_[size_t(i)], 1), x);
      be.commit(*s, 1);
      out.insert(out.end(), x.begin(), x.end());
    }
    const int k = std::min(be.max_rows(), int(next_.size()));
    std::vector<float> rows(size_t(k) * size_t(V_), NAN);
    be.decode_rows(*s, std::span<const int32_t>(next_.data(), size_t(k)), rows);
    out.insert(out.end(), rows.begin(), rows.end());
    return out;
  };
  const auto want = run(*be_);
  for (const auto& [n, min_work] : {std::pair{2, 0}, {3, 0}, {8, 0}, {3, 50000}}) {
    SCOPED_TRACE(::testing::Message()
                 << n << " simulated ranks, split from " << min_work << " rows x positions");
    CudaModelOptions mo;
    mo.index_split_simulated_ranks = n;
    mo.index_split_min_work = min_work;
    CudaBackend split(tiny_a_dir(), map_, mo);
    ASSERT_EQ(split.model().index_split_ranks(), n);
    ASSERT_EQ(be_->model().index_split_ranks(), 0);
    const auto got = run(split);
    ASSERT_EQ(got.size(), want.size());
    const Cmp c = compare(got.data(), want.data(), want.size());
    EXPECT_EQ(c.first_diff, -1) << c.str();
    EXPECT_EQ(c.nan, 0u);
  }
}

TEST_F(CudaBackendTest, MatchesCpuBackend) {
  cpu::CpuBackend cpu_be(tiny_a_dir(), map_);
  std::vector<float> gl, cl;
  auto gs = prefilled(*be_, &gl);
  auto cs = prefilled(cpu_be, &cl);
  const int S = int(prompt_.size());
  const Cmp pc = compare(gl.data(), cl.data(), gl.size());
  int agree = 0;
  for (int t = 0; t < S; ++t)
    agree += argmax(gl.data() + int64_t(t) * V_, V_) == argmax(cl.data() + int64_t(t) * V_, V_);
  EXPECT_EQ(pc.nan, 0u) << "prefill: " << pc.str();
  EXPECT_LT(pc.maxabs, bounds_.prefill.maxabs) << "prefill: " << pc.str();
  EXPECT_LT(pc.rms_rel, bounds_.prefill.rms) << "prefill: " << pc.str();
  EXPECT_GE(double(agree) / S, 0.85) << agree << "/" << S << " prefill rows agree on argmax";
  std::printf("prefill CUDA vs CPU: %s, argmax %d/%d\n", pc.str().c_str(), agree, S);

  std::vector<float> g(static_cast<size_t>(V_)), c(static_cast<size_t>(V_));
  // The reference's decode logits (owner keys, the backends' default), for the diagnostics line:
  // since the CPU backend sums the mHC mixes in the reference's order (cpu/mhc.cpp), both
  // backends follow tiny-a's golden decode (9 of 9 argmaxes each), and each other to ~1e-7.
  const model::Golden ref(tiny_a_dir() / "golden" / "reference_ownerkeys.safetensors");
  const std::vector<float>& rl = ref.f32("decode_logits");
  int dagree = 0, cuda_ref = 0, cpu_ref = 0;
  const int N = int(next_.size());
  ASSERT_GE(rl.size(), size_t(N) * size_t(V_));
  for (int k = 0; k < N; ++k) {
    const std::span<const int32_t> tok(&next_[size_t(k)], 1);
    be_->decode_rows(*gs, tok, g);
    be_->commit(*gs, 1);
    cpu_be.decode_rows(*cs, tok, c);
    cpu_be.commit(*cs, 1);
    const Cmp dc = compare(g.data(), c.data(), size_t(V_));
    EXPECT_EQ(dc.nan, 0u) << "decode step " << k << ": " << dc.str();
    EXPECT_LT(dc.maxabs, bounds_.decode.maxabs) << "decode step " << k << ": " << dc.str();
    EXPECT_LT(dc.rms_rel, bounds_.decode.rms) << "decode step " << k << ": " << dc.str();
    dagree += argmax(g.data(), V_) == argmax(c.data(), V_);
    const int want = argmax(rl.data() + int64_t(k) * V_, V_);
    cuda_ref += argmax(g.data(), V_) == want;
    cpu_ref += argmax(c.data(), V_) == want;
    std::printf("decode step %d CUDA vs CPU: %s\n", k, dc.str().c_str());
  }
  std::printf("decode argmax: CUDA vs CPU %d/%d, CUDA vs reference %d/%d, CPU vs reference %d/%d\n",
              dagree, N, cuda_ref, N, cpu_ref, N);
  EXPECT_GE(double(dagree) / N, 0.85)
      << dagree << "/" << N << " decode steps agree on argmax with the CPU backend (CUDA vs the "
      << "reference " << cuda_ref << ", CPU vs the reference " << cpu_ref << ")";
  EXPECT_EQ(gs->length(), cs->length());
  EXPECT_EQ(gs->tokens(), cs->tokens());
}

TEST_F(CudaBackendTest, SnapshotRestoreRoundTrip) {
  auto s = prefilled(*be_, nullptr);
  std::vector<float> lg(static_cast<size_t>(V_));
  for (int k = 0; k < 2; ++k) {
    be_->decode_rows(*s, std::span<const int32_t>(&next_[size_t(k)], 1), lg);
    be_->commit(*s, 1);
  }
  const auto snap = be_->snapshot(*s);
  auto r = be_->new_session(128);
  be_->restore(*r, snap);
  const auto again = be_->snapshot(*r);
  EXPECT_EQ(first_byte_diff(again, snap), -1) << "restore then snapshot must give the same bytes ("
                                              << again.size() << " vs " << snap.size() << ")";
  std::vector<float> a(static_cast<size_t>(V_)), b(static_cast<size_t>(V_));
  be_->decode_rows(*s, std::span<const int32_t>(&next_[2], 1), a);
  be_->decode_rows(*r, std::span<const int32_t>(&next_[2], 1), b);
  const Cmp c = compare(b.data(), a.data(), size_t(V_));
  EXPECT_EQ(c.first_diff, -1) << c.str();
  EXPECT_EQ(c.nan, 0u);
  // The byte format is the CPU backend's.
  cpu::CpuBackend cpu_be(tiny_a_dir(), map_);
  auto cs = cpu_be.new_session(128);
  cpu_be.restore(*cs, snap);
  const auto via_cpu = cpu_be.snapshot(*cs);
  EXPECT_EQ(first_byte_diff(via_cpu, snap), -1)
      << "a CUDA snapshot must round-trip through the CPU (" << via_cpu.size() << " vs "
      << snap.size() << " bytes)";
}

// The session stores index keys as bf16 (cuda_session.h): a snapshot key it cannot hold exactly
// is refused with a clear error, never rounded; the CPU backend takes the same bytes.
TEST_F(CudaBackendTest, RestoreRefusesIndexKeysBf16CannotHold) {
  if (be_->config().index_source_layers.empty()) GTEST_SKIP() << "no indexer";
  expect_restore_refuses_inexact(&cpu::LayerState::ikeys, "index key");
}

TEST_F(CudaBackendTest, RestoreRefusesCompressedKvBf16CannotHold) {
  expect_restore_refuses_inexact(&cpu::LayerState::ckv, "compressed KV value");
}

TEST_F(CudaBackendTest, DraftCloseToCpu) {
  if (be_->config().n_mtp_layers == 0 || be_->config().dspark_block_size == 0)
    GTEST_SKIP() << "no DSpark stages";
  cpu::CpuBackend cpu_be(tiny_a_dir(), map_);
  auto gs = prefilled(*be_, nullptr);
  auto cs = prefilled(cpu_be, nullptr);
  std::vector<float> lg(static_cast<size_t>(V_));
  be_->decode_rows(*gs, std::span<const int32_t>(&next_[0], 1), lg);
  be_->commit(*gs, 1);
  cpu_be.decode_rows(*cs, std::span<const int32_t>(&next_[0], 1), lg);
  cpu_be.commit(*cs, 1);
  // The same tokens drive both Markov chains, whatever the logits say.
  auto fixed = [&](int slot, std::span<const float>) {
    return next_[size_t(slot + 2) % next_.size()];
  };
  const auto g = be_->draft(*gs, next_[1], fixed);
  const auto c = cpu_be.draft(*cs, next_[1], fixed);
  ASSERT_EQ(g.tokens, c.tokens);
  ASSERT_EQ(g.logits.size(), c.logits.size());
  ASSERT_EQ(g.confidence.size(), c.confidence.size());
  const Cmp lc = compare(g.logits.data(), c.logits.data(), g.logits.size());
  EXPECT_EQ(lc.nan, 0u) << lc.str();
  EXPECT_LT(lc.maxabs, bounds_.dspark.maxabs) << "draft logits: " << lc.str();
  EXPECT_LT(lc.rms_rel, bounds_.dspark.rms) << "draft logits: " << lc.str();
  // The Markov bias is an fp32 lookup-and-GEMV of the same tokens: summation order only.
  const Cmp bc = compare(g.markov_bias.data(), c.markov_bias.data(), g.markov_bias.size());
  EXPECT_LT(bc.maxabs, 1e-4) << "markov bias: " << bc.str();
  const Cmp cc = compare(g.confidence.data(), c.confidence.data(), g.confidence.size());
  EXPECT_EQ(cc.nan, 0u);
  EXPECT_LT(cc.maxabs, bounds_.dspark.maxabs) << "confidence: " << cc.str();
  std::printf("draft CUDA vs CPU: logits %s; bias maxabs %g; confidence maxabs %g\n",
              lc.str().c_str(), bc.maxabs, cc.maxabs);
}

// The CED prefill shortcut: the same shortcut on both backends, so within the prefill bounds.
TEST_F(CudaBackendTest, CedShortcutCloseToCpu) {
  cpu::CpuBackend cpu_be(tiny_a_dir(), map_);
  engine::PrefillOptions o;
  o.ced_shortcut = true;
  std::vector<float> g(static_cast<size_t>(V_)), c(static_cast<size_t>(V_));
  auto gs = be_->new_session(128);
  auto cs = cpu_be.new_session(128);
  be_->prefill(*gs, prompt_, o, g);
  cpu_be.prefill(*cs, prompt_, o, c);
  const Cmp cc = compare(g.data(), c.data(), size_t(V_));
  EXPECT_EQ(cc.nan, 0u) << cc.str();
  EXPECT_LT(cc.maxabs, bounds_.prefill.maxabs) << "CED last logits: " << cc.str();
  EXPECT_LT(cc.rms_rel, bounds_.prefill.rms) << "CED last logits: " << cc.str();
  EXPECT_EQ(gs->length(), cs->length());
  // Decoding on from the CED state.
  be_->decode_rows(*gs, std::span<const int32_t>(&next_[0], 1), g);
  cpu_be.decode_rows(*cs, std::span<const int32_t>(&next_[0], 1), c);
  const Cmp dc = compare(g.data(), c.data(), size_t(V_));
  EXPECT_EQ(dc.nan, 0u) << dc.str();
  EXPECT_LT(dc.rms_rel, bounds_.decode.rms) << "decode after CED: " << dc.str();
  std::printf("CED CUDA vs CPU: %s; next step %s\n", cc.str().c_str(), dc.str().c_str());
}

// CED on a prompt longer than the span capacity: the encoder runs in chunks (the first in the
// prefill layout, the rest through the ring-layout span program), the decoder on the last chunk's
// tail. Against the CPU's one-span CED within the prefill bounds (chunking changes fp32 orders,
// as chunked prefill does), then a decode step within the decode bounds; with the prefill on the
// tensor cores (the default) and bitwise the decode kernels (prefill_gemm_bf16 = false).
// The long prompt is the golden prompt followed by seeded pseudo-random ids, not the golden
// prompt repeated: a periodic prompt repeats its compressed blocks, whose index scores then tie
// to fp32 noise, and two indexers that sum in different orders select different blocks on those
// near-ties (with the repeated prompt this comparison read rms-rel 0.062 against the bound 0.066,
// and 0.098 after a change of the prefill mixes' summation order alone, session 16).
TEST_F(CudaBackendTest, ChunkedCedShortcutCloseToCpu) {
  cpu::CpuBackend cpu_be(tiny_a_dir(), map_);
  std::vector<int32_t> long_prompt(prompt_);
  std::mt19937 rng(1616);
  std::uniform_int_distribution<int32_t> token(0, V_ - 1);
  while (long_prompt.size() < 150) long_prompt.push_back(token(rng));
  struct Case {
    int max_chunk;
    std::span<const int32_t> prompt;
    bool tensor_cores;
  };
  // 41 tokens in chunks of 12: 12 + 12 + 9 encoder-only, then 8 (the window) with the decoder.
  for (const Case& k :
       {Case{12, prompt_, true}, Case{32, long_prompt, true}, Case{64, long_prompt, true},
        Case{12, prompt_, false}, Case{64, long_prompt, false}}) {
    SCOPED_TRACE("max_chunk " + std::to_string(k.max_chunk) + ", prompt of " +
                 std::to_string(k.prompt.size()) +
                 (k.tensor_cores ? ", prefill on the tensor cores" : ", prefill bitwise decode"));
    CudaModelOptions mo;
    mo.max_chunk = k.max_chunk;
    mo.prefill_gemm_bf16 = k.tensor_cores;
    CudaBackend chunked(tiny_a_dir(), map_, mo);
    engine::PrefillOptions o;
    o.ced_shortcut = true;
    std::vector<float> g(static_cast<size_t>(V_)), c(static_cast<size_t>(V_));
    auto gs = chunked.new_session(256);
    auto cs = cpu_be.new_session(256);
    chunked.prefill(*gs, k.prompt, o, g);
    cpu_be.prefill(*cs, k.prompt, o, c);
    const Cmp cc = compare(g.data(), c.data(), size_t(V_));
    EXPECT_EQ(cc.nan, 0u) << cc.str();
    EXPECT_LT(cc.maxabs, bounds_.prefill.maxabs) << "chunked CED last logits: " << cc.str();
    EXPECT_LT(cc.rms_rel, bounds_.prefill.rms) << "chunked CED last logits: " << cc.str();
    ASSERT_EQ(gs->length(), cs->length());
    for (int i = 0; i < 3; ++i) {
      chunked.decode_rows(*gs, std::span<const int32_t>(&next_[size_t(i)], 1), g);
      cpu_be.decode_rows(*cs, std::span<const int32_t>(&next_[size_t(i)], 1), c);
      chunked.commit(*gs, 1);
      cpu_be.commit(*cs, 1);
      const Cmp dc = compare(g.data(), c.data(), size_t(V_));
      EXPECT_EQ(dc.nan, 0u) << dc.str();
      EXPECT_LT(dc.rms_rel, bounds_.decode.rms) << "decode step " << i << ": " << dc.str();
      if (i == 0)
        std::printf("chunked CED (max_chunk %d, %zu tokens, %s) CUDA vs CPU: %s; next %s\n",
                    k.max_chunk, k.prompt.size(), k.tensor_cores ? "tensor cores" : "bitwise",
                    cc.str().c_str(), dc.str().c_str());
    }
  }
}

}  // namespace
}  // namespace uf::cuda
