// The engine's device-draft path (Backend::device_draft / draft_on_device, verify_last_rows with an
// empty q span) on the exact Markov backend: a backend that drafts "on the device" (here: samples
// slot i itself with stream_uniform(seed, step, kDraft, i) and keeps the q rows) and verifies
// "on the device" (keeps the verify logits, uses its own q rows when the span is empty) must make
// the generation loop emit exactly what the host-draft, host-verify loop emits. This pins the
// contract of backend.h on the CPU: the uniforms the backend must use, the q rows, the empty span.
#include <gtest/gtest.h>

#include <vector>

#include "engine/generation_loop.h"
#include "markov_backend.h"
#include "sampling/rng.h"
#include "sampling/sampler.h"

namespace uf::engine {
namespace {

using testing::MarkovBackend;

// MarkovBackend with the optional device hooks, implemented by the contract's definition.
class DeviceMarkovBackend : public MarkovBackend {
 public:
  using MarkovBackend::MarkovBackend;
  int device_drafts = 0, kept_q_verifies = 0;

  bool device_verify() const override { return true; }
  bool device_draft() const override { return true; }

  DraftBlock draft_on_device(SessionState& s, int32_t anchor,
                             const sampling::SamplingParams& params, uint64_t seed,
                             uint64_t step) override {
    ++device_drafts;
    const int64_t V = config().vocab_size;
    q_.clear();
    std::vector<float> q(static_cast<size_t>(V)), scratch(static_cast<size_t>(V));
    DraftBlock b = draft(s, anchor, [&](int slot, std::span<const float> l) {
      const float u =
          sampling::stream_uniform(seed, step, sampling::RngPurpose::kDraft, uint32_t(slot));
      const int32_t t =
          sampling::sample_from_logits(l.data(), V, params, u, q.data(), scratch.data());
      q_.insert(q_.end(), q.begin(), q.end());
      return t;
    });
    b.logits.clear();  // as a device backend: nothing but tokens and confidences comes back
    drafted_ = b.tokens;
    return b;
  }

  void decode_rows(SessionState& s, std::span<const int32_t> tokens,
                   std::span<float> logits) override {
    UF_CHECK(logits.empty(), "the device-verify engine path must not ask for the logits");
    rows_.resize(tokens.size() * size_t(config().vocab_size));
    MarkovBackend::decode_rows(s, tokens, rows_);
  }

  sampling::VerifyResult verify_last_rows(SessionState&, sampling::VerifyMode mode,
                                          const sampling::SamplingParams& params,
                                          std::span<const float> draft_probs,
                                          std::span<const int32_t> tokens, uint64_t seed,
                                          uint64_t step) override {
    const int64_t V = config().vocab_size;
    const int g = int(tokens.size());
    if (draft_probs.empty() && g > 0) {
      ++kept_q_verifies;
      UF_CHECK(std::equal(tokens.begin(), tokens.end(), drafted_.begin()),
               "verify: the drafts are not those of the last device draft");
      draft_probs = std::span<const float>(q_.data(), size_t(g) * size_t(V));
    }
    std::vector<float> p(rows_.size()), scratch(static_cast<size_t>(V));
    for (int i = 0; i <= g; ++i)
      sampling::logits_to_probs(rows_.data() + int64_t(i) * V, V, params, p.data() + int64_t(i) * V,
                                scratch.data());
    sampling::VerifyRows vr;
    vr.num_drafts = g;
    vr.vocab = V;
    vr.target = p.data();
    vr.draft = draft_probs.data();
    vr.tokens = tokens.data();
    return sampling::verify(mode, vr, sampling::make_verify_draws(seed, step));
  }

 private:
  std::vector<float> q_, rows_;
  std::vector<int32_t> drafted_;
};

// A small random chain: target [2][V][V], draft [V][V] (logits), block of 5 confidences.
struct Chain {
  int V = 6;
  std::vector<float> target, draft, conf = {3.0f, 2.0f, 1.0f, 0.5f, 0.0f};
  Chain() {
    uint32_t x = 12345;
    auto next = [&] {
      x = x * 1664525u + 1013904223u;
      return float((x >> 8) & 0xffff) / 65536.0f * 4.0f - 2.0f;
    };
    target.resize(size_t(2 * V * V));
    draft.resize(size_t(V * V));
    for (auto& v : target) v = next();
    // Drafts close to the target (so some are accepted) but not equal (so some are rejected).
    for (int a = 0; a < V; ++a)
      for (int b = 0; b < V; ++b)
        draft[size_t(a * V + b)] = target[size_t(a * V + b)] + 0.3f * next();
  }
};

struct LoopOut {
  std::vector<int32_t> tokens;
  std::vector<int> accepted;
};

LoopOut generate(Backend& be, const GenerationParams& p) {
  GenerationLoop loop(be, resolve_hardware_profile({"cpu", "", 0}, 5));
  auto s = be.new_session(4096);
  LoopOut out;
  const std::vector<int32_t> prompt = {1, 2, 3};
  out.tokens = loop.run(*s, prompt, p,
                        [&](std::span<const int32_t>, const StepStats& st) {
                          out.accepted.push_back(st.accepted);
                          return true;
                        })
                   .tokens;
  return out;
}

TEST(DeviceDraftLoop, EqualsHostDraftAndVerify) {
  const Chain c;
  MarkovBackend host(c.V, c.target, c.draft, c.conf);
  DeviceMarkovBackend dev(c.V, c.target, c.draft, c.conf);
  int accepted = 0, steps = 0;
  for (auto mode : {sampling::VerifyMode::kBlock, sampling::VerifyMode::kTokenWise})
    for (float t : {0.0f, 0.7f, 1.0f})
      for (float top_p : {1.0f, 0.8f})
        for (uint64_t seed : {1u, 2u, 99u}) {
          GenerationParams p;
          p.sampling.temperature = t;
          p.sampling.top_p = top_p;
          p.sampling.top_k = top_p < 1.0f ? 4 : 0;
          p.seed = seed;
          p.verify = mode;
          p.max_new_tokens = 60;
          const LoopOut a = generate(dev, p), b = generate(host, p);
          EXPECT_EQ(a.tokens, b.tokens)
              << "mode " << int(mode) << " T " << t << " top_p " << top_p << " seed " << seed;
          EXPECT_EQ(a.accepted, b.accepted) << "mode " << int(mode) << " seed " << seed;
          steps += int(a.accepted.size());
          for (int n : a.accepted) accepted += n;
        }
  EXPECT_GT(dev.device_drafts, 0) << "the engine never used draft_on_device";
  EXPECT_GT(dev.kept_q_verifies, 0) << "the engine never verified against the kept q rows";
  EXPECT_EQ(dev.drafts_called, dev.device_drafts) << "the engine called the host draft() too";
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, steps * 4) << "every draft accepted: rejections are not covered";
}

}  // namespace
}  // namespace uf::engine
