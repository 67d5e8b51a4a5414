#pragma once
// The Engram n-gram hash (model-arch.md §4.6), bit-exact with the reference `NgramHashState`:
// table row ids per position from compressed token ids. The hash multipliers come from numpy's
// `default_rng(10007 * layer).integers(...)`, so numpy's SeedSequence, PCG64 and bounded-integer
// sampling are reimplemented here bit for bit (namespace `numpy_rng`).
//
// Everything is a deterministic function of the config and the compressed ids: the token map
// (token id -> compressed id) is built elsewhere; this file never sees raw token ids.

#include <cstdint>
#include <span>
#include <vector>

#include "model/config.h"
#include "model/engram_primes.h"

namespace uf::model {

namespace numpy_rng {

// numpy.random.SeedSequence with the default pool size 4 and no spawn key.
class SeedSequence {
 public:
  // `entropy`: the seed as numpy coerces it to uint32 words (an int becomes its 32-bit words,
  // least significant first; a list of small ints becomes one word each).
  explicit SeedSequence(std::span<const uint32_t> entropy);
  // SeedSequence(int): `seed` split into 32-bit words as numpy does (0 -> one zero word).
  static SeedSequence from_int(uint64_t seed);

  std::vector<uint32_t> generate_state_u32(size_t n_words) const;
  // generate_state(n, uint64): 2n uint32 words paired little-endian (low word first).
  std::vector<uint64_t> generate_state_u64(size_t n_words) const;
  const std::vector<uint32_t>& pool() const { return pool_; }

 private:
  std::vector<uint32_t> pool_;
};

// numpy.random.PCG64: 128-bit LCG, XSL-RR output, one buffered half for 32-bit draws.
class Pcg64 {
 public:
  explicit Pcg64(const SeedSequence& seq);  // what PCG64(seed_seq) does
  explicit Pcg64(uint64_t seed) : Pcg64(SeedSequence::from_int(seed)) {}

  uint64_t next_u64();
  uint32_t next_u32();  // low half of a fresh 64-bit draw, then its high half

 private:
  __extension__ typedef unsigned __int128 U128;
  U128 state_ = 0;
  U128 inc_ = 0;
  bool has_u32_ = false;
  uint32_t u32_ = 0;
  void step();
};

// Generator.integers(low, high, size=n, dtype=int64, endpoint=False) on a PCG64 generator
// (Lemire rejection, 32-bit draws when high-1-low fits in 32 bits, exactly as numpy).
std::vector<int64_t> integers_int64(Pcg64& gen, int64_t low, int64_t high, size_t n);

}  // namespace numpy_rng

// x % d for any 64-bit x via a precomputed 128-bit reciprocal (remainder by direct computation,
// Lemire, Kaser & Kurz 2019: exact for all 64-bit x and d > 0 with a 128-bit fraction). The hash
// does 24 modulos per position per layer; with a hardware divide each, hashing a long prompt took
// ~30% longer (240 vs 184 ms per 1M positions of the released config on the dev machine).
class FastMod64 {
 public:
  FastMod64() = default;
  explicit FastMod64(uint64_t d);
  uint64_t divisor() const { return d_; }
  uint64_t mod(uint64_t x) const {
    const U128 frac = m_ * x;  // fractional part of x / d, mod 2^128
    const U128 low = (U128(uint64_t(frac)) * d_) >> 64;
    return uint64_t((U128(uint64_t(frac >> 64)) * d_ + low) >> 64);
  }

 private:
  __extension__ typedef unsigned __int128 U128;
  uint64_t d_ = 1;
  U128 m_ = 0;
};

// Rows of each Engram layer's table: the sum of its bucket primes (what engram_num_embeddings
// must be). Same as engram_prime_sums (model/engram_primes.h, which owns the prime rule).
std::vector<int64_t> engram_table_rows(const ModelConfig& cfg);
// Hash multipliers: [engram layer][lookback 0..max_ngram-1], odd, from default_rng(10007 * layer).
std::vector<std::vector<int64_t>> engram_multipliers(const ModelConfig& cfg);

// Per-sequence decode state: the compressed ids of its last (max_ngram - 1) positions, oldest
// first (fewer near the sequence start). A plain value: copy it to snapshot, assign to restore.
struct EngramHistory {
  std::vector<int64_t> ids;
};

class EngramHasher {
 public:
  // Compressed id of a position that takes no part in any n-gram (an image-span token). It reads
  // as pad, and so does every lookback behind it.
  static constexpr int64_t kDead = -1;
  static constexpr int kMaxNgram = 16;  // lookbacks live in a fixed array: hashing never allocates

  // `pad_compressed_id`: token_map[cfg.engram_pad_id]. Checks that the prime sums equal
  // cfg.engram_num_embeddings.
  EngramHasher(const ModelConfig& cfg, int64_t pad_compressed_id);

  int n_layers() const { return int(primes_.size()); }
  int n_cols() const { return n_cols_; }  // (max_ngram - 1) * n_heads ids per layer
  int history_len() const { return max_ngram_ - 1; }
  size_t ids_per_position() const { return size_t(n_layers()) * size_t(n_cols_); }
  int64_t pad_id() const { return pad_; }
  const std::vector<std::vector<int64_t>>& primes() const { return primes_; }
  const std::vector<std::vector<int64_t>>& offsets() const { return offsets_; }
  const std::vector<std::vector<int64_t>>& multipliers() const { return multipliers_; }

  // Row ids of `tokens` (compressed ids of consecutive positions). `context`: compressed ids of
  // the positions right before tokens[0], oldest first; if it holds fewer than history_len() ids
  // the sequence starts there (prefill: empty; decode: an EngramHistory's ids). Writes
  // out[pos][layer][col] (tokens.size() * ids_per_position() values), each a row of that layer's
  // table (bucket offset included). Ids must be in [0, engram_compressed_vocab_size) or kDead.
  void hash(std::span<const int64_t> context, std::span<const int64_t> tokens,
            std::span<int64_t> out) const;
  std::vector<int64_t> hash(std::span<const int64_t> context,
                            std::span<const int64_t> tokens) const;

  EngramHistory make_history() const;  // empty, capacity reserved (advance never allocates)
  void advance(EngramHistory& history, std::span<const int64_t> tokens) const;
  // hash(history.ids, tokens, out), then advance(history, tokens): one decode/verify step.
  void hash_step(EngramHistory& history, std::span<const int64_t> tokens,
                 std::span<int64_t> out) const;

 private:
  int max_ngram_ = 0;
  int n_heads_ = 0;
  int n_cols_ = 0;
  int64_t vocab_ = 0;  // compressed vocab size
  int64_t pad_ = 0;
  std::vector<std::vector<int64_t>> primes_;
  std::vector<std::vector<int64_t>> offsets_;
  std::vector<std::vector<int64_t>> multipliers_;
  std::vector<std::vector<FastMod64>> mods_;  // one per prime
  void check_id(int64_t id, const char* what, size_t index) const;
};

}  // namespace uf::model
