#include "engine/generation_loop.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "engine/confidence_schedule.h"
#include "sampling/rng.h"
#include "sampling/sampler.h"

namespace uf::engine {

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}
}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
  }
  return "?";
}

GenerationLoop::GenerationLoop(Backend& backend, const HardwareProfile& profile)
    : backend_(backend), profile_(profile), vocab_(backend.config().vocab_size) {
  UF_CHECK(backend.max_rows() >= 1, "backend {} reports no decode rows", backend.name());
  // Device drafts keep their q rows in the backend: only device verification can read them.
  UF_CHECK(!backend.device_draft() || backend.device_verify(),
           "backend {} drafts on the device but verifies on the host", backend.name());
  const size_t rows = size_t(kMaxVerifyRows);
  logits_.resize(rows * size_t(vocab_));
  target_.resize(rows * size_t(vocab_));
  draft_.resize(rows * size_t(vocab_));
  scratch_.resize(rows * size_t(vocab_));
  rows_.reserve(rows);
  emitted_.reserve(rows);
}

int32_t GenerationLoop::sample_plain(const float* logits, const GenerationParams& p, uint64_t step,
                                     int index) {
  const float u =
      sampling::stream_uniform(p.seed, step, sampling::RngPurpose::kPlain, uint32_t(index));
  return sampling::sample_from_logits(logits, vocab_, p.sampling, u, target_.data(),
                                      scratch_.data());
}

StepStats GenerationLoop::plain_step(SessionState& s, int32_t anchor, const GenerationParams& p,
                                     uint64_t step) {
  rows_.assign(1, anchor);
  backend_.decode_rows(s, rows_, std::span<float>(logits_.data(), size_t(vocab_)));
  backend_.commit(s, 1);
  emitted_.assign(1, sample_plain(logits_.data(), p, step, 0));
  return StepStats{1, 0, 0, 0};
}

StepStats GenerationLoop::speculative_step(SessionState& s, int32_t anchor,
                                           const GenerationParams& p, uint64_t step, int max_emit) {
  const size_t V = size_t(vocab_);
  // 1. Draft: slot i's token is drawn from exactly the q row kept for verification.
  const DraftSampler sampler = [&](int slot, std::span<const float> logits) -> int32_t {
    UF_CHECK(slot >= 0 && slot < kMaxVerifyRows, "draft slot {} is beyond the {} the engine keeps",
             slot, kMaxVerifyRows);
    const float u =
        sampling::stream_uniform(p.seed, step, sampling::RngPurpose::kDraft, uint32_t(slot));
    float* q = draft_.data() + size_t(slot) * V;
    return sampling::sample_from_logits(logits.data(), vocab_, p.sampling, u, q, scratch_.data());
  };
  // On a backend with device drafting the same sampler runs where the logits are, and the q rows
  // stay there for verification (backend.h: draft_on_device).
  const bool device_draft = backend_.device_draft();
  const DraftBlock block = device_draft
                               ? backend_.draft_on_device(s, anchor, p.sampling, p.seed, step)
                               : backend_.draft(s, anchor, sampler);
  UF_CHECK(block.confidence.size() >= block.tokens.size(),
           "backend {} drafted {} tokens with {} confidences", backend_.name(), block.tokens.size(),
           block.confidence.size());

  // 2. How many drafts to verify: the confidence schedule, the profile's block size, the
  //    backend's rows, the tokens still allowed and the session's capacity.
  int g = scheduled_draft_length(block.confidence, profile_.confidence_threshold);
  const int draft_cap = p.draft_tokens > 0 ? p.draft_tokens : profile_.draft_tokens;
  g = std::min({g, int(block.tokens.size()), draft_cap, backend_.max_rows() - 1, max_emit - 1,
                int(s.max_seq() - s.length() - 1)});
  g = std::max(g, 0);

  // 3. Verify forward over anchor + drafts.
  rows_.assign(1, anchor);
  rows_.insert(rows_.end(), block.tokens.begin(), block.tokens.begin() + g);
  sampling::VerifyResult r;
  if (backend_.device_verify()) {
    // 3-4 on the backend's device: the target logits never leave it.
    backend_.decode_rows(s, rows_, {});
    // Device drafts: an empty q span means "the q rows the backend kept" (backend.h).
    const std::span<const float> q = device_draft
                                         ? std::span<const float>()
                                         : std::span<const float>(draft_.data(), size_t(g) * V);
    r = backend_.verify_last_rows(s, p.verify, p.sampling, q,
                                  std::span<const int32_t>(rows_.data() + 1, size_t(g)), p.seed,
                                  step);
  } else {
    backend_.decode_rows(s, rows_, std::span<float>(logits_.data(), size_t(g + 1) * V));
    // The g + 1 target rows are independent and each costs 1-4 ms at the real vocab on one core
    // (bench_sampling): transform them in parallel, each with its own scratch (same bits).
#pragma omp parallel for schedule(static, 1) if (g > 0)
    for (int i = 0; i <= g; ++i) {
      sampling::logits_to_probs(logits_.data() + size_t(i) * V, vocab_, p.sampling,
                                target_.data() + size_t(i) * V, scratch_.data() + size_t(i) * V);
    }
    // 4. Verification on (p_0..p_g, q_1..q_g).
    sampling::VerifyRows vr;
    vr.num_drafts = g;
    vr.vocab = vocab_;
    vr.target = target_.data();
    vr.draft = draft_.data();
    vr.tokens = rows_.data() + 1;
    r = sampling::verify(p.verify, vr, sampling::make_verify_draws(p.seed, step));
  }
  UF_CHECK(r.extra_token >= 0, "verification produced no token (all-zero target row)");

  // 5. Commit the anchor and the accepted drafts; the extra token is the next anchor.
  backend_.commit(s, 1 + r.accepted);
  emitted_.assign(rows_.begin() + 1, rows_.begin() + 1 + r.accepted);
  emitted_.push_back(r.extra_token);
  return StepStats{int(emitted_.size()), g, r.accepted, 0};
}

GenerationResult GenerationLoop::run(SessionState& s, std::span<const int32_t> prompt,
                                     const GenerationParams& p, const TokenCallback& on_tokens,
                                     const std::atomic<bool>* cancel,
                                     const PrefillCallback& after_prefill) {
  sampling::validate(p.sampling);
  if (p.draft_tokens > 0) validate_draft_tokens(p.draft_tokens);
  UF_CHECK(!prompt.empty(), "the prompt is empty");
  UF_CHECK(p.max_new_tokens >= 1, "max_new_tokens must be at least 1, got {}", p.max_new_tokens);
  UF_CHECK(s.length() + int64_t(prompt.size()) < s.max_seq(),
           "the prompt ({} tokens after {} already in the session) does not fit in the session's "
           "{} positions",
           prompt.size(), s.length(), s.max_seq());

  GenerationResult out;
  out.prompt_tokens = int64_t(prompt.size());
  const auto is_stop = [&](int32_t t) {
    return std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), t) != p.stop_token_ids.end();
  };

  // Prefill and the first token (step 0 of the plain stream).
  auto t0 = Clock::now();
  backend_.prefill(s, prompt, p.prefill, std::span<float>(logits_.data(), size_t(vocab_)));
  if (after_prefill) after_prefill(s);
  int32_t anchor = sample_plain(logits_.data(), p, 0, 0);
  out.prefill_ms = ms_since(t0);
  out.tokens.push_back(anchor);
  StepStats first{1, 0, 0, out.prefill_ms};
  if (is_stop(anchor)) {
    out.finish = FinishReason::kStop;
    on_tokens(std::span<const int32_t>(&anchor, 1), first);
    return out;
  }
  if (!on_tokens(std::span<const int32_t>(&anchor, 1), first)) {
    out.finish = FinishReason::kCancelled;
    return out;
  }

  for (uint64_t step = 1;; ++step) {
    const int remaining = p.max_new_tokens - int(out.tokens.size());
    if (remaining <= 0 || s.length() + 1 >= s.max_seq()) {
      out.finish = FinishReason::kLength;
      return out;
    }
    if (cancel && cancel->load(std::memory_order_relaxed)) {
      out.finish = FinishReason::kCancelled;
      return out;
    }
    const auto ts = Clock::now();
    StepStats st = p.mode == DecodeMode::kSpeculative
                       ? speculative_step(s, anchor, p, step, remaining)
                       : plain_step(s, anchor, p, step);
    st.ms = ms_since(ts);
    out.steps += 1;
    out.step_ms += st.ms;
    out.drafted += st.drafted;
    out.accepted += st.accepted;

    // Emit up to (and including) the first stop token.
    size_t n = emitted_.size();
    bool stopped = false;
    for (size_t i = 0; i < n; ++i) {
      if (is_stop(emitted_[i])) {
        n = i + 1;
        stopped = true;
        break;
      }
    }
    n = std::min(n, size_t(remaining));
    out.tokens.insert(out.tokens.end(), emitted_.begin(), emitted_.begin() + long(n));
    const bool keep_going = on_tokens(std::span<const int32_t>(emitted_.data(), n), st);
    if (stopped) {
      out.finish = FinishReason::kStop;
      return out;
    }
    if (!keep_going) {
      out.finish = FinishReason::kCancelled;
      return out;
    }
    anchor = emitted_[n - 1];
  }
}

}  // namespace uf::engine
