#include "model/engram_primes.h"

#include <set>

#include "model/config.h"

namespace uf::model {

namespace {
uint64_t mul_mod(uint64_t a, uint64_t b, uint64_t m) {
  return uint64_t((unsigned __int128)a * b % m);
}
uint64_t pow_mod(uint64_t a, uint64_t e, uint64_t m) {
  uint64_t r = 1;
  for (a %= m; e; e >>= 1, a = mul_mod(a, a, m))
    if (e & 1) r = mul_mod(r, a, m);
  return r;
}
}  // namespace

// Deterministic Miller-Rabin: these bases are exact for every 64-bit n.
bool is_prime_u64(uint64_t n) {
  if (n < 2) return false;
  for (uint64_t p : {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37}) {
    if (n % p == 0) return n == p;
  }
  uint64_t d = n - 1;
  int s = 0;
  while ((d & 1) == 0) d >>= 1, ++s;
  for (uint64_t a : {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37}) {
    uint64_t x = pow_mod(a, d, n);
    if (x == 1 || x == n - 1) continue;
    bool composite = true;
    for (int i = 1; i < s && composite; ++i) {
      x = mul_mod(x, x, n);
      if (x == n - 1) composite = false;
    }
    if (composite) return false;
  }
  return true;
}

std::vector<std::vector<int64_t>> engram_primes(int n_layers, int max_ngram_size, int n_heads,
                                                int64_t vocab_size) {
  std::set<int64_t> seen;
  std::vector<std::vector<int64_t>> out;
  for (int l = 0; l < n_layers; ++l) {
    std::vector<int64_t> layer;
    for (int n = 0; n < max_ngram_size - 1; ++n) {
      int64_t current = vocab_size - 1;
      for (int h = 0; h < n_heads; ++h) {
        int64_t c = current + 1;
        while (!is_prime_u64(uint64_t(c)) || seen.count(c)) ++c;
        seen.insert(c);
        layer.push_back(c);
        current = c;
      }
    }
    out.push_back(std::move(layer));
  }
  return out;
}

std::vector<std::vector<int64_t>> engram_primes(const ModelConfig& c) {
  return engram_primes(int(c.engram_layer_ids.size()), c.engram_max_ngram_size, c.engram_n_heads,
                       c.engram_vocab_size);
}

std::vector<int64_t> engram_prime_sums(const ModelConfig& c) {
  std::vector<int64_t> sums;
  for (const auto& layer : engram_primes(c)) {
    int64_t s = 0;
    for (int64_t p : layer) s += p;
    sums.push_back(s);
  }
  return sums;
}

}  // namespace uf::model
