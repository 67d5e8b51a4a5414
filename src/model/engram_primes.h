#pragma once
// The Engram bucket primes (model-arch.md §4.6, reference engram.py `EngramLayout.from_args`),
// kept here so that config validation and the tiny-model generator need nothing else. The hash
// itself lives in model/engram_hash.*; both must follow the same rule.
//
// Rule: for each Engram layer, for each n-gram size 2..max_ngram_size, start at
// engram_vocab_size - 1 and take, for each head in turn, the smallest prime above the previous
// one that no earlier (layer, n-gram, head) has taken. A layer's table has as many rows as its
// primes sum to.

#include <cstdint>
#include <vector>

namespace uf::model {

struct ModelConfig;

bool is_prime_u64(uint64_t n);
// primes[layer][(n - 2) * n_heads + head], in the order the hash uses them.
std::vector<std::vector<int64_t>> engram_primes(int n_layers, int max_ngram_size, int n_heads,
                                                int64_t vocab_size);
std::vector<std::vector<int64_t>> engram_primes(const ModelConfig& c);
// Per Engram layer: the sum of its primes (what engram_num_embeddings must equal).
std::vector<int64_t> engram_prime_sums(const ModelConfig& c);

}  // namespace uf::model
