#include "model/engram_hash.h"

#include <algorithm>
#include <limits>

#include "core/error.h"

namespace uf::model {

namespace numpy_rng {
namespace {

// SeedSequence constants (numpy/random/bit_generator.pyx); all arithmetic is mod 2^32.
constexpr uint32_t kPoolSize = 4;
constexpr uint32_t kInitA = 0x43b0d7e5;
constexpr uint32_t kMultA = 0x931e8875;
constexpr uint32_t kInitB = 0x8b51f9dd;
constexpr uint32_t kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd;
constexpr uint32_t kMixMultR = 0x4973f715;
constexpr uint32_t kXShift = 16;

// The hash constant evolves with every call, so it is threaded through by reference.
uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}

uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t r = kMixMultL * x - kMixMultR * y;
  r ^= r >> kXShift;
  return r;
}

}  // namespace

SeedSequence::SeedSequence(std::span<const uint32_t> entropy) : pool_(kPoolSize, 0) {
  uint32_t hash_const = kInitA;
  for (uint32_t i = 0; i < kPoolSize; ++i) {
    pool_[i] = hashmix(i < entropy.size() ? entropy[i] : 0u, hash_const);
  }
  // Every pool word is mixed into every other, so late entropy words affect early pool words.
  for (uint32_t src = 0; src < kPoolSize; ++src) {
    for (uint32_t dst = 0; dst < kPoolSize; ++dst) {
      if (src != dst) pool_[dst] = mix(pool_[dst], hashmix(pool_[src], hash_const));
    }
  }
  for (size_t src = kPoolSize; src < entropy.size(); ++src) {
    for (uint32_t dst = 0; dst < kPoolSize; ++dst) {
      pool_[dst] = mix(pool_[dst], hashmix(entropy[src], hash_const));
    }
  }
}

SeedSequence SeedSequence::from_int(uint64_t seed) {
  std::vector<uint32_t> words;
  if (seed == 0) words.push_back(0);
  for (; seed != 0; seed >>= 32) words.push_back(uint32_t(seed & 0xffffffffu));
  return SeedSequence(words);
}

std::vector<uint32_t> SeedSequence::generate_state_u32(size_t n_words) const {
  std::vector<uint32_t> out(n_words);
  uint32_t hash_const = kInitB;
  for (size_t i = 0; i < n_words; ++i) {
    uint32_t v = pool_[i % pool_.size()];
    v ^= hash_const;
    hash_const *= kMultB;
    v *= hash_const;
    v ^= v >> kXShift;
    out[i] = v;
  }
  return out;
}

std::vector<uint64_t> SeedSequence::generate_state_u64(size_t n_words) const {
  const std::vector<uint32_t> w = generate_state_u32(2 * n_words);
  std::vector<uint64_t> out(n_words);
  for (size_t i = 0; i < n_words; ++i) out[i] = uint64_t(w[2 * i]) | (uint64_t(w[2 * i + 1]) << 32);
  return out;
}

Pcg64::Pcg64(const SeedSequence& seq) {
  // PCG64.__init__: 4 uint64 words; words 0,1 are the initial state (high, low), words 2,3 the
  // stream selector (high, low); then pcg's srandom: step, add the state, step.
  const std::vector<uint64_t> w = seq.generate_state_u64(4);
  const U128 init_state = (U128(w[0]) << 64) | w[1];
  const U128 init_seq = (U128(w[2]) << 64) | w[3];
  state_ = 0;
  inc_ = (init_seq << 1) | 1;
  step();
  state_ += init_state;
  step();
}

void Pcg64::step() {
  constexpr U128 kMult = (U128(2549297995355413924ull) << 64) | U128(4865540595714422341ull);
  state_ = state_ * kMult + inc_;
}

uint64_t Pcg64::next_u64() {
  step();  // the output is taken from the advanced state
  const uint64_t hi = uint64_t(state_ >> 64);
  const uint64_t x = hi ^ uint64_t(state_);
  const unsigned rot = unsigned(hi >> 58);
  return (x >> rot) | (x << ((64u - rot) & 63u));
}

uint32_t Pcg64::next_u32() {
  if (has_u32_) {
    has_u32_ = false;
    return u32_;
  }
  const uint64_t v = next_u64();
  has_u32_ = true;
  u32_ = uint32_t(v >> 32);
  return uint32_t(v);
}

namespace {

// numpy's bounded_lemire_uint64: a value in [0, rng] (rng < 2^64 - 1).
uint64_t lemire_u64(Pcg64& gen, uint64_t rng) {
  __extension__ typedef unsigned __int128 U128;
  const uint64_t rng_excl = rng + 1;
  U128 m = U128(gen.next_u64()) * rng_excl;
  uint64_t leftover = uint64_t(m);
  if (leftover < rng_excl) {
    const uint64_t threshold = (std::numeric_limits<uint64_t>::max() - rng) % rng_excl;
    while (leftover < threshold) {
      m = U128(gen.next_u64()) * rng_excl;
      leftover = uint64_t(m);
    }
  }
  return uint64_t(m >> 64);
}

// numpy's buffered_bounded_lemire_uint32: a value in [0, rng] (rng < 2^32 - 1) from 32-bit draws.
uint32_t lemire_u32(Pcg64& gen, uint32_t rng) {
  const uint32_t rng_excl = rng + 1;
  uint64_t m = uint64_t(gen.next_u32()) * rng_excl;
  uint32_t leftover = uint32_t(m);
  if (leftover < rng_excl) {
    const uint32_t threshold = (std::numeric_limits<uint32_t>::max() - rng) % rng_excl;
    while (leftover < threshold) {
      m = uint64_t(gen.next_u32()) * rng_excl;
      leftover = uint32_t(m);
    }
  }
  return uint32_t(m >> 32);
}

}  // namespace

std::vector<int64_t> integers_int64(Pcg64& gen, int64_t low, int64_t high, size_t n) {
  UF_CHECK(low < high, "integers_int64: empty range [{}, {})", low, high);
  // random_bounded_uint64_fill with use_masked=False over the closed range [low, high - 1].
  const uint64_t rng = uint64_t(high - 1) - uint64_t(low);
  const uint64_t off = uint64_t(low);
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t v;
    if (rng == 0) {
      v = 0;  // no draw at all
    } else if (rng <= 0xffffffffull) {
      v = rng == 0xffffffffull ? gen.next_u32() : lemire_u32(gen, uint32_t(rng));
    } else if (rng == std::numeric_limits<uint64_t>::max()) {
      v = gen.next_u64();
    } else {
      v = lemire_u64(gen, rng);
    }
    out[i] = int64_t(off + v);
  }
  return out;
}

}  // namespace numpy_rng

namespace {

void check_engram_config(const ModelConfig& cfg) {
  UF_CHECK(cfg.engram_max_ngram_size >= 2,
           "Engram config: engram_max_ngram_size is {}, the hash needs at least 2",
           cfg.engram_max_ngram_size);
  UF_CHECK(cfg.engram_n_heads >= 1, "Engram config: engram_n_heads is {}, need at least 1",
           cfg.engram_n_heads);
  UF_CHECK(cfg.engram_compressed_vocab_size >= 1,
           "Engram config: engram_compressed_vocab_size is {}, need at least 1",
           cfg.engram_compressed_vocab_size);
  UF_CHECK(cfg.engram_vocab_size >= 0, "Engram config: engram_vocab_size is negative ({})",
           cfg.engram_vocab_size);
  for (int layer : cfg.engram_layer_ids) {
    UF_CHECK(layer >= 0, "Engram config: engram_layer_ids holds a negative layer ({})", layer);
  }
}

}  // namespace

FastMod64::FastMod64(uint64_t d) : d_(d) {
  UF_CHECK(d != 0, "FastMod64: modulo by zero");
  // m = floor((2^128 - 1) / d) + 1, which wraps to 0 for d = 1 (and x % 1 = 0 still comes out).
  m_ = ~U128(0) / d + 1;
}

std::vector<int64_t> engram_table_rows(const ModelConfig& cfg) { return engram_prime_sums(cfg); }

std::vector<std::vector<int64_t>> engram_multipliers(const ModelConfig& cfg) {
  check_engram_config(cfg);
  // Bounded so that compressed_id * multiplier cannot overflow int64.
  const int64_t bound = std::max<int64_t>(
      1, (std::numeric_limits<int64_t>::max() / cfg.engram_compressed_vocab_size) / 2);
  std::vector<std::vector<int64_t>> out;
  for (int layer : cfg.engram_layer_ids) {
    numpy_rng::Pcg64 gen(uint64_t(10007) * uint64_t(layer));
    std::vector<int64_t> v =
        numpy_rng::integers_int64(gen, 0, bound, size_t(cfg.engram_max_ngram_size));
    for (int64_t& x : v) x = 2 * x + 1;
    out.push_back(std::move(v));
  }
  return out;
}

EngramHasher::EngramHasher(const ModelConfig& cfg, int64_t pad_compressed_id)
    : max_ngram_(cfg.engram_max_ngram_size),
      n_heads_(cfg.engram_n_heads),
      vocab_(cfg.engram_compressed_vocab_size),
      pad_(pad_compressed_id),
      primes_(engram_primes(cfg)),
      multipliers_(engram_multipliers(cfg)) {
  n_cols_ = (max_ngram_ - 1) * n_heads_;
  UF_CHECK(max_ngram_ <= kMaxNgram, "EngramHasher: engram_max_ngram_size {} is above {}",
           max_ngram_, kMaxNgram);
  UF_CHECK(pad_ >= 0 && pad_ < vocab_,
           "EngramHasher: pad compressed id {} is outside the compressed vocab [0, {})", pad_,
           vocab_);
  UF_CHECK(cfg.engram_num_embeddings.size() == primes_.size(),
           "Engram config: engram_num_embeddings has {} entries but engram_layer_ids has {}",
           cfg.engram_num_embeddings.size(), primes_.size());
  for (size_t l = 0; l < primes_.size(); ++l) {
    std::vector<int64_t> offs(primes_[l].size());
    int64_t sum = 0;
    for (size_t c = 0; c < primes_[l].size(); ++c) {
      offs[c] = sum;
      sum += primes_[l][c];
    }
    std::vector<FastMod64> mods;
    for (int64_t p : primes_[l]) mods.emplace_back(uint64_t(p));
    mods_.push_back(std::move(mods));
    UF_CHECK(sum == cfg.engram_num_embeddings[l],
             "Engram config: engram_num_embeddings[{}] (layer {}) is {}, but its hash buckets "
             "need exactly {} rows",
             l, cfg.engram_layer_ids[l], cfg.engram_num_embeddings[l], sum);
    offsets_.push_back(std::move(offs));
  }
}

void EngramHasher::check_id(int64_t id, const char* what, size_t index) const {
  UF_CHECK(id == kDead || (id >= 0 && id < vocab_),
           "EngramHasher: {}[{}] = {} is not a compressed id (vocab {}) nor kDead", what, index, id,
           vocab_);
}

void EngramHasher::hash(std::span<const int64_t> context, std::span<const int64_t> tokens,
                        std::span<int64_t> out) const {
  UF_CHECK(out.size() == tokens.size() * ids_per_position(),
           "EngramHasher: output holds {} ids, {} positions need {}", out.size(), tokens.size(),
           tokens.size() * ids_per_position());
  const size_t keep = std::min(context.size(), size_t(history_len()));
  context = context.subspan(context.size() - keep);
  for (size_t i = 0; i < context.size(); ++i) check_id(context[i], "context", i);
  for (size_t i = 0; i < tokens.size(); ++i) check_id(tokens[i], "tokens", i);

  const int n_layers = this->n_layers();
  const int64_t ctx = int64_t(context.size());
  uint64_t lookback[kMaxNgram];
  int64_t* dst = out.data();
  for (size_t i = 0; i < tokens.size(); ++i) {
    // t_sh = id at position i - sh; before the known start or behind a dead token: pad.
    bool blocked = false;
    for (int sh = 0; sh < max_ngram_; ++sh) {
      const int64_t j = int64_t(i) - sh;
      int64_t id = kDead;
      if (j >= 0) {
        id = tokens[size_t(j)];
      } else if (j + ctx >= 0) {
        id = context[size_t(j + ctx)];
      }
      blocked = blocked || id == kDead;
      lookback[sh] = uint64_t(blocked ? pad_ : id);
    }
    for (int l = 0; l < n_layers; ++l) {
      const int64_t* mult = multipliers_[size_t(l)].data();
      const FastMod64* mod = mods_[size_t(l)].data();
      const int64_t* off = offsets_[size_t(l)].data();
      // ids < vocab and multipliers < int64max / vocab: products and their XOR stay below 2^63,
      // so unsigned arithmetic equals the reference's int64 ops (and its floor modulo).
      uint64_t rolling = lookback[0] * uint64_t(mult[0]);
      for (int n = 1; n < max_ngram_; ++n) {
        rolling ^= lookback[n] * uint64_t(mult[n]);
        const int c0 = (n - 1) * n_heads_;
        for (int h = 0; h < n_heads_; ++h) {
          *dst++ = int64_t(mod[c0 + h].mod(rolling)) + off[c0 + h];
        }
      }
    }
  }
}

std::vector<int64_t> EngramHasher::hash(std::span<const int64_t> context,
                                        std::span<const int64_t> tokens) const {
  std::vector<int64_t> out(tokens.size() * ids_per_position());
  hash(context, tokens, out);
  return out;
}

EngramHistory EngramHasher::make_history() const {
  EngramHistory h;
  h.ids.reserve(size_t(history_len()));
  return h;
}

void EngramHasher::advance(EngramHistory& history, std::span<const int64_t> tokens) const {
  const size_t cap = size_t(history_len());
  std::vector<int64_t>& ids = history.ids;
  if (tokens.size() >= cap) {
    ids.assign(tokens.end() - std::ptrdiff_t(cap), tokens.end());
    return;
  }
  const size_t drop = ids.size() + tokens.size() > cap ? ids.size() + tokens.size() - cap : 0;
  ids.erase(ids.begin(), ids.begin() + std::ptrdiff_t(std::min(drop, ids.size())));
  ids.insert(ids.end(), tokens.begin(), tokens.end());
}

void EngramHasher::hash_step(EngramHistory& history, std::span<const int64_t> tokens,
                             std::span<int64_t> out) const {
  hash(history.ids, tokens, out);
  advance(history, tokens);
}

}  // namespace uf::model
