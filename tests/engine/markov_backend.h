#pragma once
// A Backend whose "model" is a position-dependent Markov chain over a tiny vocabulary, and whose
// DSpark draft is another chain. It makes the generation loop's distribution exactly computable:
// logits at position t = target[t % 2][token at t]; draft slot logits = draft[previous token].
// `commit_bug` commits every forwarded row regardless of n, a deliberately broken backend that the
// statistical tests must catch.

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "core/error.h"
#include "engine/backend.h"

namespace uf::engine::testing {

class MarkovSession : public SessionState {
 public:
  explicit MarkovSession(int64_t max_seq) : max_seq_(max_seq) {}
  int64_t length() const override { return int64_t(tokens_.size()); }
  int64_t max_seq() const override { return max_seq_; }
  const std::vector<int32_t>& tokens() const override { return tokens_; }
  std::vector<int32_t> tokens_;
  std::vector<int32_t> pending_;
  int64_t max_seq_;
};

class MarkovBackend : public Backend {
 public:
  MarkovBackend(int vocab, std::vector<float> target, std::vector<float> draft,
                std::vector<float> confidence, int max_rows = 8)
      : target_(std::move(target)),
        draft_(std::move(draft)),
        confidence_(std::move(confidence)),
        max_rows_(max_rows) {
    cfg_.vocab_size = vocab;
  }
  bool commit_bug = false;
  int drafts_called = 0;

  const model::ModelConfig& config() const override { return cfg_; }
  std::string name() const override { return "markov"; }
  int max_rows() const override { return max_rows_; }
  std::unique_ptr<SessionState> new_session(int64_t max_seq) override {
    return std::make_unique<MarkovSession>(max_seq);
  }
  void prefill(SessionState& s, std::span<const int32_t> tokens, const PrefillOptions&,
               std::span<float> logits) override {
    auto& m = static_cast<MarkovSession&>(s);
    m.tokens_.insert(m.tokens_.end(), tokens.begin(), tokens.end());
    row(m.length() - 1, m.tokens_.back(), logits.data());
  }
  void decode_rows(SessionState& s, std::span<const int32_t> tokens,
                   std::span<float> logits) override {
    auto& m = static_cast<MarkovSession&>(s);
    UF_CHECK(int(tokens.size()) <= max_rows_, "too many rows");
    UF_CHECK(logits.size() >= tokens.size() * size_t(cfg_.vocab_size), "logits too small");
    m.pending_.assign(tokens.begin(), tokens.end());
    for (size_t i = 0; i < tokens.size(); ++i) {
      row(m.length() + int64_t(i), tokens[i], logits.data() + i * size_t(cfg_.vocab_size));
    }
  }
  void commit(SessionState& s, int n) override {
    auto& m = static_cast<MarkovSession&>(s);
    if (commit_bug) n = int(m.pending_.size());
    UF_CHECK(n <= int(m.pending_.size()), "commit of {} rows after {} forwarded", n,
             m.pending_.size());
    m.tokens_.insert(m.tokens_.end(), m.pending_.begin(), m.pending_.begin() + n);
    m.pending_.clear();
  }
  DraftBlock draft(SessionState& s, int32_t anchor, const DraftSampler& sampler) override {
    ++drafts_called;
    const int V = cfg_.vocab_size;
    DraftBlock b;
    b.position = s.length() - 1;
    b.anchor = anchor;
    int32_t prev = anchor;
    for (size_t i = 0; i < confidence_.size(); ++i) {
      std::span<const float> l(draft_.data() + size_t(prev) * size_t(V), size_t(V));
      b.logits.insert(b.logits.end(), l.begin(), l.end());
      prev = sampler(int(i), l);
      b.tokens.push_back(prev);
    }
    b.confidence = confidence_;
    return b;
  }
  std::vector<uint8_t> snapshot(const SessionState&) const override { return {}; }
  void restore(SessionState&, std::span<const uint8_t>) const override {}

 private:
  void row(int64_t pos, int32_t token, float* out) const {
    const int V = cfg_.vocab_size;
    const float* src = target_.data() + (size_t(pos % 2) * size_t(V) + size_t(token)) * size_t(V);
    std::copy(src, src + V, out);
  }
  model::ModelConfig cfg_;
  std::vector<float> target_;      // [2][V][V]
  std::vector<float> draft_;       // [V][V]
  std::vector<float> confidence_;  // [block]
  int max_rows_;
};

}  // namespace uf::engine::testing
