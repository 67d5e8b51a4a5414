// `ultrafast bench-loop --model DIR`: benchmark 6 of the performance issue in the real decode
// loop: the engine's host time between backend calls (target: step end to next launch < 20 us).
//
// engine::GenerationLoop runs on the backend (`--backend cuda`, e.g. on the tiny-a fixture, whose
// vocabulary is the real one) wrapped in a timing decorator: every Backend call's entry and exit
// time (steady_clock) is recorded. The calls synchronise before they return (CudaBackend), so the
// time between one call's exit and the next call's entry is host work of the engine (sampling,
// acceptance, bookkeeping, the token callback) with the device idle. Per decode step (between two
// token callbacks) it reports: wall, time inside backend calls, engine host time (the rest), and
// the gap from the step's last backend call to the next step's first (the "step end to next
// launch" of the issue, without the backend's own host work before its launch, which
// `ultrafast bench-host` measures). Plain and speculative decoding, greedy unless --temperature.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cli/backend_factory.h"
#include "cli/cmd_bench_common.h"
#include "cli/command_registry.h"
#include "core/error.h"
#include "engine/backend.h"
#include "engine/generation_loop.h"

namespace {

using nlohmann::json;
namespace bench = uf::cli::bench;
using uf::engine::Backend;
using uf::engine::SessionState;

struct Call {
  const char* name;
  bench::Clock::time_point in, out;
};

// Forwards every call to `b` and records its interval.
class TimingBackend final : public Backend {
 public:
  explicit TimingBackend(Backend& b) : b_(b) {}
  std::vector<Call> calls;

  const uf::model::ModelConfig& config() const override { return b_.config(); }
  std::string name() const override { return b_.name(); }
  int max_rows() const override { return b_.max_rows(); }
  std::unique_ptr<SessionState> new_session(int64_t max_seq) override {
    return b_.new_session(max_seq);
  }
  void prefill(SessionState& s, std::span<const int32_t> t, const uf::engine::PrefillOptions& o,
               std::span<float> logits) override {
    timed("prefill", [&] { b_.prefill(s, t, o, logits); });
  }
  void decode_rows(SessionState& s, std::span<const int32_t> t, std::span<float> logits) override {
    timed("decode_rows", [&] { b_.decode_rows(s, t, logits); });
  }
  void commit(SessionState& s, int n) override {
    timed("commit", [&] { b_.commit(s, n); });
  }
  uf::engine::DraftBlock draft(SessionState& s, int32_t anchor,
                               const uf::engine::DraftSampler& sampler) override {
    uf::engine::DraftBlock r;
    timed("draft", [&] { r = b_.draft(s, anchor, sampler); });
    return r;
  }
  std::vector<uint8_t> snapshot(const SessionState& s) const override { return b_.snapshot(s); }
  void restore(SessionState& s, std::span<const uint8_t> bytes) const override {
    b_.restore(s, bytes);
  }
  bool device_verify() const override { return b_.device_verify(); }
  uf::sampling::VerifyResult verify_last_rows(SessionState& s, uf::sampling::VerifyMode mode,
                                              const uf::sampling::SamplingParams& params,
                                              std::span<const float> draft_probs,
                                              std::span<const int32_t> tokens, uint64_t seed,
                                              uint64_t step) override {
    uf::sampling::VerifyResult r;
    timed("verify_last_rows",
          [&] { r = b_.verify_last_rows(s, mode, params, draft_probs, tokens, seed, step); });
    return r;
  }
  bool device_draft() const override { return b_.device_draft(); }
  uf::engine::DraftBlock draft_on_device(SessionState& s, int32_t anchor,
                                         const uf::sampling::SamplingParams& params, uint64_t seed,
                                         uint64_t step) override {
    uf::engine::DraftBlock r;
    timed("draft_on_device", [&] { r = b_.draft_on_device(s, anchor, params, seed, step); });
    return r;
  }

 private:
  template <typename F>
  void timed(const char* name, F&& f) {
    Call c{name, bench::Clock::now(), {}};
    f();
    c.out = bench::Clock::now();
    calls.push_back(c);
  }
  Backend& b_;
};

struct LoopArgs {
  std::string model, backend = "cuda";
  int prompt_tokens = 256, max_tokens = 64;
  float temperature = 0, top_p = 1;
  bool no_graphs = false;
  double target_us = 20;
  std::string json_file;
  uint64_t seed = 1;
};

double us_between(bench::Clock::time_point a, bench::Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

json run_mode(const LoopArgs& a, TimingBackend& tb, const uf::engine::HardwareProfile& prof,
              uf::engine::DecodeMode mode, const char* label) {
  const auto& cfg = tb.config();
  std::mt19937_64 rng(a.seed);
  std::vector<int32_t> prompt = {cfg.bos_token_id};
  while (int(prompt.size()) < a.prompt_tokens)
    prompt.push_back(int32_t(3 + rng() % uint64_t(cfg.vocab_size - 3)));
  uf::engine::GenerationParams p;
  p.sampling.temperature = a.temperature;
  p.sampling.top_p = a.top_p;
  p.seed = a.seed;
  p.max_new_tokens = a.max_tokens;
  p.mode = mode;  // no stop tokens: run the whole budget
  uf::engine::GenerationLoop loop(tb, prof);
  auto s = tb.new_session(int64_t(prompt.size()) + a.max_tokens + tb.max_rows() + 1);
  tb.calls.clear();
  std::vector<bench::Clock::time_point> marks;  // token callbacks: step ends
  const auto r = loop.run(*s, prompt, p, [&](std::span<const int32_t>, const auto&) {
    marks.push_back(bench::Clock::now());
    return true;
  });
  // Steps k = 1.. : between callbacks k - 1 and k (callback 0 ends the prefill's first token).
  std::vector<double> wall, inside, host, gap;
  std::map<std::string, std::vector<double>> per_call;
  size_t ci = 0;
  bench::Clock::time_point prev_out{};  // exit of the latest backend call seen
  bool have_prev = false;
  for (size_t k = 1; k < marks.size(); ++k) {
    double in = 0;
    bench::Clock::time_point first{}, gap_from{};
    bool any = false, gap_ok = false;
    while (ci < tb.calls.size() && tb.calls[ci].out <= marks[k]) {
      const auto& c = tb.calls[ci];
      if (c.in >= marks[k - 1]) {  // a call of step k (earlier ones: the prefill)
        in += us_between(c.in, c.out);
        per_call[c.name].push_back(us_between(c.in, c.out));
        if (!any) {
          first = c.in;
          gap_from = prev_out;
          gap_ok = have_prev;
        }
        any = true;
      }
      prev_out = c.out;
      have_prev = true;
      ++ci;
    }
    if (!any) continue;
    const double w = us_between(marks[k - 1], marks[k]);
    wall.push_back(w);
    inside.push_back(in);
    host.push_back(w - in);
    if (gap_ok) gap.push_back(us_between(gap_from, first));
  }
  const auto W = bench::stats_of(wall), I = bench::stats_of(inside), H = bench::stats_of(host),
             G = bench::stats_of(gap);
  std::cout << fmt::format("{:<12} {:>5} {:>10.1f} {:>10.1f} {:>10.1f} {:>12.1f} {:>8.2f}   {}\n",
                           label, wall.size(), W.median_us, I.median_us, H.median_us, G.median_us,
                           r.average_accept_length(),
                           H.median_us < a.target_us ? "" : "over target");
  json calls = json::object();
  for (const auto& [n, v] : per_call) {
    const auto st = bench::stats_of(v);
    std::cout << fmt::format("             {:<18} {:>5} calls, median {:>9.1f} us\n", n, v.size(),
                             st.median_us);
    calls[n] = {{"calls", v.size()}, {"median_us", st.median_us}};
  }
  return {{"mode", label},
          {"steps", wall.size()},
          {"wall_us", W.median_us},
          {"inside_backend_us", I.median_us},
          {"engine_host_us", H.median_us},
          {"gap_to_first_call_us", G.median_us},
          {"accept_length", r.average_accept_length()},
          {"calls", calls}};
}

int run_loop(const LoopArgs& a) {
  std::cout << std::unitbuf;
  uf::cli::BackendChoice choice;
  choice.kind = a.backend;
  choice.cuda_graphs = !a.no_graphs;
  auto loaded = uf::cli::load_backend(std::filesystem::path(a.model), choice);
  TimingBackend tb(*loaded.backend);
  std::cout << fmt::format(
      "decode loop on {} ({}; prompt {} tokens, {} new tokens, temperature {}); medians per step, "
      "us (engine host = wall - inside backend calls; target < {:.0f} us):\n"
      "{:<12} {:>5} {:>10} {:>10} {:>10} {:>12} {:>8}\n",
      a.model, tb.name(), a.prompt_tokens, a.max_tokens, a.temperature, a.target_us, "mode",
      "steps", "wall", "backend", "host", "gap->call", "accept");
  json out = {{"model", a.model}, {"backend", tb.name()}, {"target_us", a.target_us}};
  json modes = json::array();
  modes.push_back(run_mode(a, tb, loaded.profile, uf::engine::DecodeMode::kPlain, "plain"));
  modes.push_back(
      run_mode(a, tb, loaded.profile, uf::engine::DecodeMode::kSpeculative, "speculative"));
  out["modes"] = modes;
  bench::write_json(a.json_file, out);
  return 0;
}

void setup_bench_loop(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "bench-loop", "Host time of the decode loop between backend calls (GenerationLoop)");
  auto a = std::make_shared<LoopArgs>();
  cmd->add_option("--model", a->model, "Model folder (e.g. the tiny-a fixture)")->required();
  cmd->add_option("--backend", a->backend, "cpu or cuda");
  cmd->add_option("--prompt-tokens", a->prompt_tokens, "Random prompt length");
  cmd->add_option("--max-tokens", a->max_tokens, "New tokens per mode");
  cmd->add_option("--temperature", a->temperature, "0 = greedy");
  cmd->add_option("--top-p", a->top_p, "Nucleus sampling");
  cmd->add_flag("--no-graphs", a->no_graphs, "Eager launches");
  cmd->add_option("--target-us", a->target_us, "Target host time per step");
  cmd->add_option("--json", a->json_file, "Write every figure to this JSON file");
  cmd->add_option("--seed", a->seed, "Seed of the prompt and the sampling");
  cmd->callback([a, &exit_code] { exit_code = run_loop(*a); });
}

UF_REGISTER_COMMAND("bench-loop", setup_bench_loop);

}  // namespace
