// The tensor-parallel sharding plan: every tensor is covered exactly once by the ranks' slices
// (or held whole by each rank), scales follow their weights, tp = 1 is the identity, and
// configs that do not divide fail naming what does not divide.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>

#include "core/error.h"
#include "model/config.h"
#include "model/tensor_contract.h"
#include "model/tp_plan.h"

namespace fs = std::filesystem;
using uf::model::ModelConfig;
using uf::model::ShardMode;
using uf::model::TensorKind;
using uf::model::TensorShard;
using uf::model::TpOptions;
using uf::model::TpPlan;

namespace {

const fs::path kTinyA = fs::path(UF_SHARED_DIR) / "fixtures" / "tiny-a";

// The linear a weight or scale belongs to.
std::string linear_of(const std::string& n) {
  for (const std::string suf : {".weight", ".scale"})
    if (n.size() > suf.size() && n.compare(n.size() - suf.size(), suf.size(), suf) == 0)
      return n.substr(0, n.size() - suf.size());
  return n;
}

// All ranks' plans of one config, checked against the contract.
void check_cover(const ModelConfig& c, int tp, const TpOptions& o = {}) {
  SCOPED_TRACE("tp = " + std::to_string(tp));
  const auto contract = uf::model::tensor_contract(c);
  std::vector<TpPlan> plans;
  for (int r = 0; r < tp; ++r) plans.push_back(uf::model::make_tp_plan(c, tp, r, o));
  uint64_t contract_bytes = 0, split_bytes = 0, repl_bytes = 0, plan_bytes = 0;
  size_t n_split = 0;
  for (size_t i = 0; i < contract.size(); ++i) {
    const auto& e = contract[i];
    contract_bytes += e.nbytes();
    const TensorShard& s0 = plans[0].shards.at(i);
    ASSERT_EQ(s0.name, e.name);
    uint64_t sum = 0;
    int64_t next = 0;  // ranks' slices must tile [0, extent) in rank order
    for (int r = 0; r < tp; ++r) {
      const TensorShard& s = plans[size_t(r)].shards.at(i);
      ASSERT_EQ(s.name, e.name);
      ASSERT_EQ(s.mode, s0.mode) << e.name;
      ASSERT_EQ(s.full_shape, e.shape) << e.name;
      sum += s.nbytes;
      if (s.mode == ShardMode::kReplicated) {
        ASSERT_EQ(s.shape, e.shape) << e.name;
        ASSERT_EQ(s.nbytes, e.nbytes()) << e.name;
        continue;
      }
      ASSERT_EQ(s.dim, s0.dim) << e.name;
      ASSERT_EQ(s.begin, next) << e.name << " rank " << r;
      ASSERT_LE(s.begin, s.end) << e.name;
      next = s.end;
      for (size_t d = 0; d < e.shape.size(); ++d)
        ASSERT_EQ(s.shape[d], int(d) == s.dim ? s.end - s.begin : e.shape[d]) << e.name;
      // Blocked kinds split at 32-feature boundaries (except the last slice of an uneven one).
      const bool blocked =
          e.kind == TensorKind::kFp8Weight || e.kind == TensorKind::kFp8Scale ||
          ((e.kind == TensorKind::kFp4Weight || e.kind == TensorKind::kFp4Scale) && s.dim == 1);
      if (blocked) {
        ASSERT_EQ(s.feat_begin % 32, 0) << e.name << " rank " << r;
      }
    }
    if (s0.mode == ShardMode::kReplicated) {
      ASSERT_EQ(sum, uint64_t(tp) * e.nbytes()) << e.name;
      repl_bytes += e.nbytes();
    } else {
      ++n_split;
      ASSERT_EQ(next, e.shape[size_t(s0.dim)]) << e.name << ": slices do not reach the end";
      ASSERT_EQ(sum, e.nbytes()) << e.name;
      split_bytes += e.nbytes();
    }
    plan_bytes += sum;
  }
  EXPECT_EQ(split_bytes + repl_bytes, contract_bytes);
  EXPECT_EQ(plan_bytes, split_bytes + uint64_t(tp) * repl_bytes);
  EXPECT_GT(n_split, 0u);

  // Scales follow their weights: same mode, dim and logical feature range on every rank.
  for (const auto& p : plans) {
    std::map<std::string, const TensorShard*> weights;
    for (const auto& s : p.shards)
      if (s.kind == TensorKind::kFp8Weight || s.kind == TensorKind::kFp4Weight ||
          s.kind == TensorKind::kEngramTable)
        weights[linear_of(s.name)] = &s;
    size_t scales = 0;
    for (const auto& s : p.shards) {
      if (s.kind != TensorKind::kFp8Scale && s.kind != TensorKind::kFp4Scale &&
          s.kind != TensorKind::kEngramScale)
        continue;
      ++scales;
      const auto it = weights.find(linear_of(s.name));
      ASSERT_NE(it, weights.end()) << "scale without weight: " << s.name;
      const TensorShard& w = *it->second;
      ASSERT_EQ(s.mode, w.mode) << s.name;
      ASSERT_EQ(s.collective, w.collective) << s.name;
      if (s.mode == ShardMode::kSplit) {
        ASSERT_EQ(s.dim, w.dim) << s.name;
        ASSERT_EQ(s.feat_begin, w.feat_begin) << s.name << " rank " << p.rank;
        ASSERT_EQ(s.feat_end, w.feat_end) << s.name << " rank " << p.rank;
      }
    }
    EXPECT_GT(scales, 0u);
  }
}

const TensorShard& find(const TpPlan& p, const std::string& name) {
  for (const auto& s : p.shards)
    if (s.name == name) return s;
  throw std::runtime_error("not in plan: " + name);
}

std::string error_of(const ModelConfig& c, int tp) {
  try {
    uf::model::validate_tp(c, tp);
  } catch (const uf::core::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(TpPlan, ReleasedCoversEveryTensorOnce) {
  const auto c = ModelConfig::deepseek_v41_flash();
  for (int tp : {1, 2, 4, 8}) check_cover(c, tp);
  TpOptions o;
  o.split_wq_a = true;
  o.split_head = false;
  o.split_engram_tables = false;
  check_cover(c, 8, o);
}

TEST(TpPlan, TinyACoversEveryTensorOnce) {
  const auto c = ModelConfig::load(kTinyA);
  for (int tp : {1, 2}) check_cover(c, tp);
}

TEST(TpPlan, TpOneIsTheIdentity) {
  for (const auto& c : {ModelConfig::deepseek_v41_flash(), ModelConfig::load(kTinyA)}) {
    const auto contract = uf::model::tensor_contract(c);
    const auto p = uf::model::make_tp_plan(c, 1, 0);
    ASSERT_EQ(p.shards.size(), contract.size());
    uint64_t total = 0;
    for (size_t i = 0; i < contract.size(); ++i) {
      EXPECT_EQ(p.shards[i].shape, contract[i].shape) << contract[i].name;
      EXPECT_EQ(p.shards[i].nbytes, contract[i].nbytes()) << contract[i].name;
      total += contract[i].nbytes();
    }
    EXPECT_EQ(p.total_bytes(), total);
  }
}

// The TP8 plan of bench/bench_cuda_decode.cpp, tensor by tensor, on rank 3.
TEST(TpPlan, ReleasedTp8MatchesBenchPlan) {
  const auto c = ModelConfig::deepseek_v41_flash();
  const auto p = uf::model::make_tp_plan(c, 8, 3);
  auto shape = [&](const std::string& n) { return find(p, n).shape; };
  using V = std::vector<int64_t>;
  EXPECT_EQ(shape("layers.0.attn.wq_a.weight"), (V{1280, 5120}));
  EXPECT_EQ(shape("layers.0.attn.wq_b.weight"), (V{4096, 1280}));
  EXPECT_EQ(shape("layers.0.attn.wq_b.scale"), (V{128, 40}));
  EXPECT_EQ(find(p, "layers.0.attn.wq_b.weight").begin, 3 * 4096);
  EXPECT_EQ(shape("layers.0.attn.wkv.weight"), (V{512, 5120}));
  EXPECT_EQ(shape("layers.0.attn.wo_a.weight"), (V{1024, 4096}));
  EXPECT_EQ(find(p, "layers.0.attn.wo_a.weight").begin, 3 * 1024);
  EXPECT_EQ(shape("layers.0.attn.wo_b.weight"), (V{5120, 1024}));
  EXPECT_EQ(shape("layers.0.attn.wo_b.scale"), (V{160, 32}));
  EXPECT_EQ(shape("layers.0.attn.attn_sink"), (V{8}));
  EXPECT_EQ(shape("layers.2.attn.indexer.wq_b.weight"), (V{512, 1280}));
  EXPECT_EQ(shape("layers.2.attn.indexer.weights_proj.weight"), (V{4, 5120}));
  EXPECT_EQ(shape("layers.2.attn.indexer.wk.weight"), (V{128, 512}));
  EXPECT_EQ(shape("layers.0.ffn.shared_experts.w1.weight"), (V{288, 5120}));
  EXPECT_EQ(shape("layers.0.ffn.shared_experts.w2.weight"), (V{5120, 288}));
  EXPECT_EQ(shape("layers.0.ffn.shared_experts.w2.scale"), (V{160, 9}));
  EXPECT_EQ(shape("layers.0.ffn.experts.383.w1.weight"), (V{288, 2560}));
  EXPECT_EQ(shape("layers.0.ffn.experts.383.w1.scale"), (V{288, 160}));
  EXPECT_EQ(shape("layers.0.ffn.experts.0.w2.weight"), (V{5120, 144}));
  EXPECT_EQ(shape("layers.0.ffn.experts.0.w2.scale"), (V{5120, 9}));
  EXPECT_EQ(find(p, "layers.0.ffn.experts.0.w2.weight").begin, 3 * 144);
  EXPECT_EQ(find(p, "layers.0.ffn.experts.0.w2.scale").begin, 3 * 9);
  EXPECT_EQ(shape("layers.1.engram.wkv.weight"), (V{3200, 6144}));
  EXPECT_EQ(shape("head.weight"), (V{16160, 5120}));
  EXPECT_EQ(shape("embed.weight"), (V{129280, 5120}));
  // 384016682 rows over 8: chunk 48002086, rank 3 holds [144006258, 192008344).
  EXPECT_EQ(find(p, "layers.14.engram.embed.weight").begin, 144006258);
  EXPECT_EQ(shape("layers.14.engram.embed.scale"), (V{48002086, 8}));
}

// split_index_heads off (the CUDA backend's entry-split indexer): the indexer's wq_b and
// weights_proj are whole on every rank, the cover still holds, and an index head count the ranks
// do not divide is no longer an error.
TEST(TpPlan, ReplicatedIndexerKeepsWholeIndexWeights) {
  const auto c = ModelConfig::deepseek_v41_flash();
  TpOptions o;
  o.split_index_heads = false;
  check_cover(c, 8, o);
  const auto p = uf::model::make_tp_plan(c, 8, 3, o);
  using V = std::vector<int64_t>;
  EXPECT_EQ(find(p, "layers.2.attn.indexer.wq_b.weight").shape, (V{4096, 1280}));
  EXPECT_EQ(find(p, "layers.2.attn.indexer.wq_b.weight").mode, ShardMode::kReplicated);
  EXPECT_EQ(find(p, "layers.2.attn.indexer.weights_proj.weight").shape, (V{32, 5120}));
  EXPECT_EQ(find(p, "layers.0.attn.wq_b.weight").shape, (V{4096, 1280}));  // heads still split
  auto odd = c;
  odd.index_n_heads = 12;
  EXPECT_NO_THROW(uf::model::validate_tp(odd, 8, o));
}

// The entry split's ranges: ceil(positions / n) rounded up to the alignment, rank r at r * len
// (the last range may run past the row: its positions are clamped by the row's width); a full-width
// row's alignment is a candidate block of 8 in whole 16-byte groups of its maxima: lcm(4, 32).
TEST(TpPlan, EntrySplitRanges) {
  const auto c = ModelConfig::deepseek_v41_flash();
  EXPECT_EQ(uf::model::index_split_align(c), 32);
  const auto r1 = uf::model::rank_position_range(8257, 2, 1, 32);
  EXPECT_EQ(r1.len, 4160);  // 4129 rounded up to 32
  EXPECT_EQ(r1.begin, 4160);
  EXPECT_EQ(uf::model::rank_position_range(0, 8, 0, 4).len, 4);  // never empty
  EXPECT_EQ(uf::model::rank_position_range(16384, 8, 7, 4).begin, 7 * 2048);
  EXPECT_THROW(uf::model::rank_position_range(100, 2, 2, 4), uf::core::Error);
  EXPECT_THROW(uf::model::rank_position_range(100, 2, 0, 6), uf::core::Error);
}

TEST(TpPlan, UndividedConfigsFailNamingTheCause) {
  const auto tiny = ModelConfig::load(kTinyA);  // 4 heads, 2 output groups
  const std::string e4 = error_of(tiny, 4);
  EXPECT_NE(e4.find("o_groups = 2"), std::string::npos) << e4;
  EXPECT_NE(e4.find("attn.wo_a"), std::string::npos) << e4;
  EXPECT_THROW(uf::model::make_tp_plan(tiny, 4, 0), uf::core::Error);
  EXPECT_NE(error_of(tiny, 8).find("n_heads = 4"), std::string::npos) << error_of(tiny, 8);
  EXPECT_NE(error_of(tiny, 3).find("n_heads"), std::string::npos);

  const auto rel = ModelConfig::deepseek_v41_flash();
  EXPECT_NE(error_of(rel, 16).find("o_groups = 8"), std::string::npos) << error_of(rel, 16);
  EXPECT_NE(error_of(rel, 0).find("at least 1"), std::string::npos);
  auto c = rel;
  c.moe_inter_dim = 2304 + 32;  // 2336 / 8 = 292: not whole 32-blocks
  EXPECT_NE(error_of(c, 8).find("moe_inter_dim"), std::string::npos) << error_of(c, 8);
  c = rel;
  c.index_n_heads = 12;  // 12 % 8
  EXPECT_NE(error_of(c, 8).find("index_n_heads = 12"), std::string::npos) << error_of(c, 8);
  c = rel;
  c.vocab_size = 129281;
  EXPECT_NE(error_of(c, 8).find("vocab_size"), std::string::npos) << error_of(c, 8);
  EXPECT_THROW(uf::model::make_tp_plan(rel, 8, 8), uf::core::Error);
}

// copy_shard on tiny-a-shaped tensors: the ranks' shards of a row split and of a column split
// (FP4 packed bytes, FP8 weight and scale), laid back together, give the original bytes.
TEST(TpPlan, CopyShardReassemblesTheTensor) {
  const auto c = ModelConfig::load(kTinyA);
  const int tp = 2;
  std::vector<TpPlan> plans;
  for (int r = 0; r < tp; ++r) plans.push_back(uf::model::make_tp_plan(c, tp, r));
  size_t checked = 0;
  for (const std::string name :
       {"layers.0.attn.wq_b.weight", "layers.0.attn.wq_b.scale", "layers.0.attn.wo_b.weight",
        "layers.0.attn.wo_b.scale", "layers.0.ffn.experts.1.w2.weight",
        "layers.0.ffn.experts.1.w2.scale", "layers.0.ffn.experts.1.w1.weight",
        "layers.0.attn.attn_sink", "layers.0.attn.wkv.weight"}) {
    SCOPED_TRACE(name);
    const TensorShard& s0 = find(plans[0], name);
    const uint64_t total = [&] {
      uint64_t n = uf::core::dtype_size(s0.dtype);
      for (int64_t d : s0.full_shape) n *= uint64_t(d);
      return n;
    }();
    std::vector<uint8_t> full(total);
    for (size_t i = 0; i < full.size(); ++i) full[i] = uint8_t(i * 131 + i / 256);
    const int64_t rows = s0.full_shape[0];
    const uint64_t row_bytes = total / uint64_t(rows);
    std::vector<uint8_t> back(total, 0);
    for (const auto& p : plans) {
      const TensorShard& s = find(p, name);
      std::vector<uint8_t> part(s.nbytes);
      uf::model::copy_shard(s, full.data(), part.data());
      // A row range (or the whole tensor) is a view with the same bytes; a column slice is not.
      const uint8_t* view = uf::model::shard_view(s, full.data());
      EXPECT_EQ(uf::model::shard_contiguous(s), view != nullptr);
      if (s.mode == ShardMode::kReplicated || s.dim == 0) {
        ASSERT_NE(view, nullptr);
        EXPECT_TRUE(std::equal(part.begin(), part.end(), view));
      } else {
        EXPECT_EQ(view, nullptr);
      }
      if (s.mode == ShardMode::kReplicated) {
        ASSERT_EQ(part, full);
        back = part;
      } else if (s.dim == 0) {
        std::copy(part.begin(), part.end(), back.begin() + s.begin * int64_t(row_bytes));
      } else {
        const uint64_t esz = uf::core::dtype_size(s.dtype);
        const uint64_t w = uint64_t(s.end - s.begin) * esz;
        for (int64_t r = 0; r < rows; ++r)
          std::copy(part.begin() + int64_t(uint64_t(r) * w),
                    part.begin() + int64_t(uint64_t(r + 1) * w),
                    back.begin() + int64_t(uint64_t(r) * row_bytes + uint64_t(s.begin) * esz));
      }
    }
    EXPECT_EQ(back, full);
    ++checked;
  }
  EXPECT_EQ(checked, 9u);
  // One cols case by hand: wo_b [256, 128] over 2 ranks, rank 1 row 3 starts at col 64.
  const TensorShard& wo_b = find(plans[1], "layers.0.attn.wo_b.weight");
  ASSERT_EQ(wo_b.shape, (std::vector<int64_t>{256, 64}));
  std::vector<uint8_t> full(256 * 128);
  for (size_t i = 0; i < full.size(); ++i) full[i] = uint8_t(i % 251);
  std::vector<uint8_t> part(wo_b.nbytes);
  uf::model::copy_shard(wo_b, full.data(), part.data());
  EXPECT_EQ(part[3 * 64 + 5], full[3 * 128 + 64 + 5]);
}
