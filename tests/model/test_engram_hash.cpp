// Engram hash: numpy RNG pieces against numpy's own published test vectors, then the whole chain
// (multipliers, primes, offsets, lookback/pad rules) against the reference's golden hash ids of
// the tiny-a and medium-a fixtures, prefill and decode, every position and column exactly.

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/engram_hash.h"

namespace uf::model {
namespace {

namespace fs = std::filesystem;
using numpy_rng::Pcg64;
using numpy_rng::SeedSequence;

// ---------------------------------------------------------------------------------------------
// Fixture access: a minimal safetensors reader for the I64 arrays this test needs (the model
// helper's Checkpoint is not required here, so this test only depends on the hash code).

struct I64Array {
  std::vector<int64_t> data;
  std::vector<int64_t> shape;
};

std::map<std::string, I64Array> read_i64_arrays(const fs::path& file,
                                                const std::vector<std::string>& names) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + file.string());
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);  // little-endian host assumed (x86/arm64)
  std::string header(header_len, '\0');
  in.read(header.data(), std::streamsize(header_len));
  const nlohmann::json h = nlohmann::json::parse(header);
  std::map<std::string, I64Array> out;
  for (const std::string& name : names) {
    const auto& e = h.at(name);
    if (e.at("dtype") != "I64") throw std::runtime_error(name + " is not I64");
    const uint64_t begin = e.at("data_offsets")[0], end = e.at("data_offsets")[1];
    I64Array a;
    a.shape = e.at("shape").get<std::vector<int64_t>>();
    a.data.resize((end - begin) / 8);
    in.seekg(std::streamoff(8 + header_len + begin));
    in.read(reinterpret_cast<char*>(a.data.data()), std::streamsize(end - begin));
    if (!in) throw std::runtime_error("short read of " + name + " in " + file.string());
    out[name] = std::move(a);
  }
  return out;
}

// Only the Engram fields are needed, read from the flat inference/config.json.
ModelConfig engram_config(const fs::path& dir) {
  std::ifstream in(dir / "inference" / "config.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  ModelConfig c;
  c.engram_layer_ids = j.at("engram_layer_ids").get<std::vector<int>>();
  c.engram_num_embeddings = j.at("engram_num_embeddings").get<std::vector<int64_t>>();
  c.engram_max_ngram_size = j.at("engram_max_ngram_size");
  c.engram_vocab_size = j.at("engram_vocab_size");
  c.engram_n_heads = j.at("engram_n_heads");
  c.engram_pad_id = j.at("engram_pad_id");
  c.engram_compressed_vocab_size = j.at("engram_compressed_vocab_size");
  return c;
}

fs::path fixture_dir(const std::string& name) {
  return fs::path(UF_SHARED_DIR) / "fixtures" / name;
}

// ---------------------------------------------------------------------------------------------
// numpy RNG pieces.

// numpy/random/tests/test_seed_sequence.py::test_reference_data (values from the C++ reference
// implementation of seed_seq_fe128 by the PCG author, which numpy's SeedSequence matches).
TEST(NumpyRng, SeedSequenceReferenceData) {
  const std::vector<std::vector<uint32_t>> inputs = {
      {3735928559u, 195939070u, 229505742u, 305419896u},
      {3668361503u, 4165561550u, 1661411377u, 3634257570u},
      {2766103236u, 2883057919u, 4029656435u, 862374500u},
  };
  const std::vector<std::vector<uint32_t>> outputs = {
      {3914649087u, 576849849u, 3593928901u, 2229911004u},
      {2240804226u, 3691353228u, 1365957195u, 2654016646u},
      {296367413u, 4262059219u, 13109864u, 3283683422u},
  };
  const std::vector<std::vector<uint64_t>> outputs64 = {
      {2477551240072187391ull, 9577394838764454085ull},
      {15854241394484835714ull, 11398914698975566411ull},
      {18305404959516669237ull, 14103312907920476776ull},
  };
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SeedSequence ss(inputs[i]);
    EXPECT_EQ(ss.generate_state_u32(4), outputs[i]) << "input " << i;
    EXPECT_EQ(ss.generate_state_u64(2), outputs64[i]) << "input " << i;
  }
}

// numpy/random/tests/data/pcg64-testset-1.csv (seed 0xdeadbeaf) and -2.csv (seed 0): raw
// PCG64(seed).random_raw() outputs, which go through SeedSequence(int seed).
TEST(NumpyRng, Pcg64RawOutputs) {
  const std::vector<uint64_t> seed_deadbeaf = {
      0x60d24054e17a0698ull, 0xd5e79d89856e4f12ull, 0xd254972fe64bd782ull, 0xf1e3072a53c72571ull,
      0xd7c1d7393d4115c9ull, 0x77b75928b763e1e2ull, 0xee6dee05190f7909ull, 0x15f7b1c51d7fa319ull,
      0x27e44105f26ac2d7ull, 0x0cc0d88b29e5b415ull, 0xe07b1a90c685e361ull};
  Pcg64 a(0xdeadbeafull);
  for (size_t i = 0; i < seed_deadbeaf.size(); ++i) EXPECT_EQ(a.next_u64(), seed_deadbeaf[i]) << i;
  for (size_t i = seed_deadbeaf.size(); i < 998; ++i) a.next_u64();
  EXPECT_EQ(a.next_u64(), 0xcda423e5ad43b290ull);  // row 998
  EXPECT_EQ(a.next_u64(), 0xa5cb380b8de10d10ull);  // row 999

  const std::vector<uint64_t> seed_zero = {0xa30febcfd9c2825full, 0x4510bdf882d9d721ull,
                                           0x0a7d3da94ecde8b8ull, 0x043b27b61342f01dull,
                                           0xd0327a782cde513bull, 0xe9aa5979a6401c4eull};
  Pcg64 b(0);
  for (size_t i = 0; i < seed_zero.size(); ++i) EXPECT_EQ(b.next_u64(), seed_zero[i]) << i;
}

// next_uint32 hands out the low half of a 64-bit draw, then keeps the high half for the next call.
TEST(NumpyRng, Pcg64Next32Buffering) {
  Pcg64 g(0xdeadbeafull);
  EXPECT_EQ(g.next_u32(), 0xe17a0698u);
  EXPECT_EQ(g.next_u32(), 0x60d24054u);
  EXPECT_EQ(g.next_u32(), 0x856e4f12u);
  // A 64-bit draw leaves the buffered high half of draw 1 in place (numpy's pcg64_next64 does
  // not touch has_uint32), so the next 32-bit call still returns it.
  EXPECT_EQ(g.next_u64(), 0xd254972fe64bd782ull);
  EXPECT_EQ(g.next_u32(), 0xd5e79d89u);
  EXPECT_EQ(g.next_u32(), 0x53c72571u);
}

// Range dispatch as numpy's random_bounded_uint64_fill: a range that fits in 32 bits uses 32-bit
// Lemire on next_uint32, larger ones 64-bit Lemire on next_uint64, a single value draws nothing.
TEST(NumpyRng, IntegersRangeDispatch) {
  {
    Pcg64 g(0xdeadbeafull);
    const auto v = numpy_rng::integers_int64(g, 5, 15, 2);
    // 10 * u32 >> 32 with the first two 32-bit halves; their leftovers are far above the
    // rejection threshold (2^32 mod 10 = 6), so no redraw happens.
    EXPECT_EQ(v[0], 5 + int64_t((uint64_t(0xe17a0698u) * 10) >> 32));
    EXPECT_EQ(v[1], 5 + int64_t((uint64_t(0x60d24054u) * 10) >> 32));
    EXPECT_EQ(g.next_u64(), 0xd5e79d89856e4f12ull);  // both halves of draw 0 were used
  }
  {
    Pcg64 g(0xdeadbeafull);
    const int64_t high = int64_t(1) << 40;
    const auto v = numpy_rng::integers_int64(g, 0, high, 1);
    __extension__ typedef unsigned __int128 U128;
    EXPECT_EQ(v[0], int64_t((U128(0x60d24054e17a0698ull) * uint64_t(high)) >> 64));
    EXPECT_EQ(g.next_u64(), 0xd5e79d89856e4f12ull);
  }
  {
    Pcg64 g(0xdeadbeafull);
    EXPECT_EQ(numpy_rng::integers_int64(g, 7, 8, 3), (std::vector<int64_t>{7, 7, 7}));
    EXPECT_EQ(g.next_u64(), 0x60d24054e17a0698ull);  // untouched
  }
}

// ---------------------------------------------------------------------------------------------
// Primes and table sizes.

// The reciprocal modulo must equal % everywhere, not only on the fixtures' small values: edge
// divisors and numerators plus a deterministic pseudo-random sweep (splitmix64 sequence).
TEST(EngramHash, FastModMatchesDivision) {
  const uint64_t kMax = std::numeric_limits<uint64_t>::max();
  std::vector<uint64_t> divisors = {
      1,        2,   3, 7, 16000057, 384006168, (1ull << 32) - 1, 1ull << 32, (1ull << 63) + 1,
      kMax - 1, kMax};
  std::vector<uint64_t> xs = {
      0, 1, 2, 16000056, 16000057, 16000058, (1ull << 63) - 1, 1ull << 63, kMax - 1, kMax};
  uint64_t s = 12345;
  auto next = [&s] {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (int i = 0; i < 200; ++i) {
    const uint64_t d = next();
    divisors.push_back(d >> (d % 64));  // divisors of every magnitude
    xs.push_back(next());
  }
  for (uint64_t d : divisors) {
    if (d == 0) continue;
    const FastMod64 fm(d);
    for (uint64_t x : xs) ASSERT_EQ(fm.mod(x), x % d) << x << " % " << d;
    for (int i = 0; i < 200; ++i) {
      const uint64_t x = next();
      ASSERT_EQ(fm.mod(x), x % d) << x << " % " << d;
    }
  }
}

TEST(EngramHash, TableRowsMatchConfigs) {
  for (const char* name : {"tiny-a", "medium-a"}) {
    const ModelConfig c = engram_config(fixture_dir(name));
    EXPECT_EQ(engram_table_rows(c), c.engram_num_embeddings) << name;
  }
  // The released model (model-arch.md §2): 2 layers, 4-grams, 8 heads, primes above 16e6.
  ModelConfig r;
  r.engram_layer_ids = {1, 14};
  r.engram_max_ngram_size = 4;
  r.engram_n_heads = 8;
  r.engram_vocab_size = 16000000;
  r.engram_compressed_vocab_size = 99092;
  EXPECT_EQ(engram_table_rows(r), (std::vector<int64_t>{384006168, 384016682}));
}

TEST(EngramHash, MultipliersOddAndBounded) {
  const ModelConfig c = engram_config(fixture_dir("tiny-a"));
  const auto m = engram_multipliers(c);
  ASSERT_EQ(m.size(), 2u);
  const int64_t limit = std::numeric_limits<int64_t>::max() / c.engram_compressed_vocab_size;
  for (const auto& layer : m) {
    ASSERT_EQ(layer.size(), 4u);
    for (int64_t v : layer) {
      EXPECT_EQ(v % 2, 1);
      EXPECT_GT(v, 0);
      EXPECT_LT(v, limit);  // compressed id * multiplier cannot overflow int64
    }
  }
  EXPECT_NE(m[0], m[1]);  // per-layer seeds
}

TEST(EngramHash, RejectsWrongTableSize) {
  ModelConfig c = engram_config(fixture_dir("tiny-a"));
  c.engram_num_embeddings[1] += 1;
  EXPECT_THROW(EngramHasher(c, 0), core::Error);
}

// ---------------------------------------------------------------------------------------------
// Golden hash ids.

struct Golden {
  ModelConfig cfg;
  std::vector<int64_t> token_map, prompt, decode, prefill_ids, decode_ids;
  std::vector<int64_t> compressed(const std::vector<int64_t>& tokens) const {
    std::vector<int64_t> out;
    for (int64_t t : tokens) out.push_back(token_map.at(size_t(t)));
    return out;
  }
};

Golden load_golden(const std::string& name) {
  Golden g;
  g.cfg = engram_config(fixture_dir(name));
  auto a = read_i64_arrays(fixture_dir(name) / "golden" / "reference.safetensors",
                           {"engram_token_map", "prompt_ids", "decode_ids",
                            "prefill_engram_hash_ids", "decode_engram_hash_ids"});
  g.token_map = a["engram_token_map"].data;
  g.prompt = a["prompt_ids"].data;
  g.decode = a["decode_ids"].data;
  g.prefill_ids = a["prefill_engram_hash_ids"].data;
  g.decode_ids = a["decode_engram_hash_ids"].data;
  const auto& ps = a["prefill_engram_hash_ids"].shape;
  EXPECT_EQ(ps, (std::vector<int64_t>{int64_t(g.prompt.size()),
                                      int64_t(g.cfg.engram_layer_ids.size()), 24}));
  // The ids in inputs.json are the ones stored beside the goldens.
  std::ifstream in(fixture_dir(name) / "golden" / "inputs.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j.at("prompt_ids").get<std::vector<int64_t>>(), g.prompt);
  EXPECT_EQ(j.at("decode_ids").get<std::vector<int64_t>>(), g.decode);
  return g;
}

// Reports the first mismatching (position, layer, column) rather than a wall of numbers.
void expect_ids_equal(const std::vector<int64_t>& got, const std::vector<int64_t>& want,
                      size_t per_pos, size_t n_cols, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      ADD_FAILURE() << what << ": position " << i / per_pos << " layer " << (i % per_pos) / n_cols
                    << " column " << i % n_cols << ": got " << got[i] << ", want " << want[i];
      return;
    }
  }
}

class GoldenHash : public ::testing::TestWithParam<const char*> {};

TEST_P(GoldenHash, PrefillAndDecodeMatchReference) {
  const Golden g = load_golden(GetParam());
  const EngramHasher hasher(g.cfg, g.token_map.at(size_t(g.cfg.engram_pad_id)));
  ASSERT_EQ(hasher.n_cols(), 24);
  const size_t per_pos = hasher.ids_per_position();

  const std::vector<int64_t> prompt = g.compressed(g.prompt);
  expect_ids_equal(hasher.hash({}, prompt), g.prefill_ids, per_pos, 24, "prefill");

  // Decode one token at a time through the history state, as the engine does.
  EngramHistory history = hasher.make_history();
  hasher.advance(history, prompt);
  EXPECT_EQ(history.ids.size(), size_t(hasher.history_len()));
  const std::vector<int64_t> dec = g.compressed(g.decode);
  std::vector<int64_t> got(dec.size() * per_pos);
  for (size_t k = 0; k < dec.size(); ++k) {
    hasher.hash_step(history, std::span(dec).subspan(k, 1),
                     std::span(got).subspan(k * per_pos, per_pos));
  }
  expect_ids_equal(got, g.decode_ids, per_pos, 24, "decode");

  // A multi-token step (speculative verify) from the prefill history gives the same ids.
  EngramHistory h2 = hasher.make_history();
  hasher.advance(h2, prompt);
  std::vector<int64_t> got2(dec.size() * per_pos);
  hasher.hash_step(h2, dec, got2);
  expect_ids_equal(got2, g.decode_ids, per_pos, 24, "multi-token decode");
  EXPECT_EQ(h2.ids, history.ids);
}

// Chunked prefill: any split with the history carried across gives the one-chunk ids.
TEST_P(GoldenHash, ChunkedPrefillMatchesReference) {
  const Golden g = load_golden(GetParam());
  const EngramHasher hasher(g.cfg, g.token_map.at(size_t(g.cfg.engram_pad_id)));
  const size_t per_pos = hasher.ids_per_position();
  const std::vector<int64_t> prompt = g.compressed(g.prompt);
  for (size_t chunk : {size_t(1), size_t(2), size_t(3), size_t(5), size_t(17)}) {
    EngramHistory h = hasher.make_history();
    std::vector<int64_t> got(prompt.size() * per_pos);
    for (size_t s = 0; s < prompt.size(); s += chunk) {
      const size_t n = std::min(chunk, prompt.size() - s);
      hasher.hash_step(h, std::span(prompt).subspan(s, n),
                       std::span(got).subspan(s * per_pos, n * per_pos));
    }
    expect_ids_equal(got, g.prefill_ids, per_pos, 24, "chunk " + std::to_string(chunk));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenHash, ::testing::Values("tiny-a", "medium-a"));

// ---------------------------------------------------------------------------------------------
// Dead (image) positions: pad in their own slot and for every earlier lookback.

TEST(EngramHash, DeadPositionsBlockLookback) {
  const ModelConfig c = engram_config(fixture_dir("tiny-a"));
  const int64_t pad = 7;
  const EngramHasher hasher(c, pad);
  const size_t per = hasher.ids_per_position();
  const int64_t D = EngramHasher::kDead;
  const std::vector<int64_t> seq = {11, 12, D, 13, 14, 15, 16};
  const auto ids = hasher.hash({}, seq);
  auto row = [&](const std::vector<int64_t>& v, size_t p) {
    return std::vector<int64_t>(v.begin() + std::ptrdiff_t(p * per),
                                v.begin() + std::ptrdiff_t((p + 1) * per));
  };
  // The dead slot hashes as pad with nothing before it.
  EXPECT_EQ(row(ids, 2), row(hasher.hash({}, std::vector<int64_t>{pad}), 0));
  // After it, the n-grams see only what follows the dead slot, as at a sequence start.
  const auto fresh = hasher.hash({}, std::vector<int64_t>{13, 14, 15, 16});
  for (size_t p = 3; p < seq.size(); ++p) EXPECT_EQ(row(ids, p), row(fresh, p - 3)) << p;
  // Before it, nothing changes.
  const auto head = hasher.hash({}, std::vector<int64_t>{11, 12});
  EXPECT_EQ(row(ids, 1), row(head, 1));
  // A dead id in the decode history blocks as well.
  EXPECT_EQ(row(hasher.hash(std::vector<int64_t>{11, 12, D}, std::vector<int64_t>{13}), 0),
            row(fresh, 0));
  // A pad id is not dead: a real pad token keeps the lookback open.
  EXPECT_NE(row(hasher.hash({}, std::vector<int64_t>{11, pad, 13}), 2),
            row(hasher.hash({}, std::vector<int64_t>{13}), 0));
}

TEST(EngramHash, RejectsIdsOutsideCompressedVocab) {
  const ModelConfig c = engram_config(fixture_dir("tiny-a"));
  const EngramHasher hasher(c, 0);
  EXPECT_THROW(hasher.hash({}, std::vector<int64_t>{c.engram_compressed_vocab_size}), core::Error);
  EXPECT_THROW(hasher.hash(std::vector<int64_t>{-2}, std::vector<int64_t>{1}), core::Error);
  std::vector<int64_t> small(3);
  EXPECT_THROW(hasher.hash({}, std::vector<int64_t>{1}, small), core::Error);
}

TEST(EngramHash, HistoryKeepsLastIds) {
  const ModelConfig c = engram_config(fixture_dir("tiny-a"));
  const EngramHasher hasher(c, 0);
  EngramHistory h = hasher.make_history();
  hasher.advance(h, std::vector<int64_t>{1});
  EXPECT_EQ(h.ids, (std::vector<int64_t>{1}));
  hasher.advance(h, std::vector<int64_t>{2, 3});
  EXPECT_EQ(h.ids, (std::vector<int64_t>{1, 2, 3}));
  const EngramHistory snapshot = h;
  hasher.advance(h, std::vector<int64_t>{4});
  EXPECT_EQ(h.ids, (std::vector<int64_t>{2, 3, 4}));
  hasher.advance(h, std::vector<int64_t>{5, 6, 7, 8});
  EXPECT_EQ(h.ids, (std::vector<int64_t>{6, 7, 8}));
  EXPECT_EQ(snapshot.ids, (std::vector<int64_t>{1, 2, 3}));
}

}  // namespace
}  // namespace uf::model
