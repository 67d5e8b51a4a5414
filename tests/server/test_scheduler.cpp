// The scheduler: FIFO order, one request at a time, at most `max_prepared` prepared, a bounded
// queue, cancellation in the queue and mid-generation. Also the stub engine and metrics text.
#include <gtest/gtest.h>

#include <thread>

#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/stub_engine.h"

namespace uf::server {
namespace {

using namespace std::chrono_literals;

// A controllable engine: generate() blocks until released, and records what ran and when.
class GateEngine : public GenerationEngine {
 public:
  std::shared_ptr<PreparedState> prepare(const GenerationRequest& r) override {
    std::lock_guard l(mu);
    prepared.push_back(r.request_id);
    return std::make_shared<PreparedState>();
  }
  GenerationResult generate(const GenerationRequest& r, const std::shared_ptr<PreparedState>&,
                            TokenSink& sink) override {
    {
      std::lock_guard l(mu);
      ran.push_back(r.request_id);
      ++active;
      max_active = std::max(max_active, active);
    }
    GenerationResult res;
    int32_t tok = 5;
    while (true) {
      if (r.cancel && r.cancel->load()) {
        res.finish = EngineFinish::kCancelled;
        break;
      }
      {
        std::unique_lock l(mu);
        if (release_all || released.count(r.request_id)) break;
      }
      sink.on_step(StepEvent{std::span<const int32_t>(&tok, 1), 0.1, false});
      ++res.generated_tokens;
      std::this_thread::sleep_for(1ms);
    }
    std::lock_guard l(mu);
    --active;
    return res;
  }
  std::string model_name() const override { return "gate"; }
  void release(const std::string& id) {
    std::lock_guard l(mu);
    released.insert(id);
  }
  std::mutex mu;
  std::vector<std::string> prepared, ran;
  std::set<std::string> released;
  bool release_all = false;
  int active = 0, max_active = 0;
};

std::shared_ptr<RequestJob> make_job(const std::string& id) {
  auto j = std::make_shared<RequestJob>();
  j->gen.request_id = id;
  j->gen.max_new_tokens = 1000;
  j->gen.cancel = &j->cancel;
  return j;
}

bool wait_for(const std::function<bool()>& cond, std::chrono::milliseconds limit = 5000ms) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return cond();
}

bool finished(const std::shared_ptr<RequestJob>& j) {
  std::lock_guard l(j->mu);
  return j->finished;
}

TEST(ServerScheduler, FifoOneAtATimeBoundedPreparation) {
  MetricsRegistry reg;
  ServerMetrics m(reg);
  GateEngine eng;
  Scheduler s(eng, m, SchedulerConfig{20, 3});
  s.start();
  std::vector<std::shared_ptr<RequestJob>> jobs;
  for (int i = 0; i < 10; ++i) {
    jobs.push_back(make_job("r" + std::to_string(i)));
    ASSERT_TRUE(s.submit(jobs.back()));
  }
  ASSERT_TRUE(wait_for([&] {
    std::lock_guard l(eng.mu);
    return eng.ran.size() == 1 && eng.prepared.size() == 4;
  }));
  // r0 runs; r1..r3 are prepared (3 = max_prepared); nothing more is prepared ahead.
  std::this_thread::sleep_for(20ms);
  {
    std::lock_guard l(eng.mu);
    EXPECT_EQ(eng.prepared.size(), 4u);
  }
  EXPECT_EQ(s.prepared_count(), 3u);
  EXPECT_EQ(s.queue_depth(), 9u);
  EXPECT_EQ(m.queue_depth.value(), 9.0);
  for (int i = 0; i < 10; ++i) eng.release("r" + std::to_string(i));
  for (auto& j : jobs) ASSERT_TRUE(wait_for([&] { return finished(j); }));
  std::lock_guard l(eng.mu);
  EXPECT_EQ(eng.max_active, 1);
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(eng.ran[i], "r" + std::to_string(i));
    EXPECT_EQ(eng.prepared[i], "r" + std::to_string(i));
  }
  EXPECT_EQ(s.queue_depth(), 0u);
  EXPECT_EQ(s.prepared_count(), 0u);
}

TEST(ServerScheduler, BoundedQueueAndCancellation) {
  MetricsRegistry reg;
  ServerMetrics m(reg);
  GateEngine eng;
  Scheduler s(eng, m, SchedulerConfig{2, 6});
  s.start();
  auto a = make_job("a"), b = make_job("b"), c = make_job("c"), d = make_job("d");
  ASSERT_TRUE(s.submit(a));
  ASSERT_TRUE(wait_for([&] {
    std::lock_guard l(eng.mu);
    return eng.ran.size() == 1;
  }));
  ASSERT_TRUE(s.submit(b));
  ASSERT_TRUE(s.submit(c));
  EXPECT_FALSE(s.submit(d));  // a runs, b and c wait: the queue (2) is full
  // Cancelling a queued job frees its slot at once and never runs it.
  s.cancel(b);
  EXPECT_TRUE(finished(b));
  EXPECT_EQ(b->result.finish, EngineFinish::kCancelled);
  EXPECT_TRUE(s.submit(d));
  // Cancelling the running job stops it at its next step.
  s.cancel(a);
  ASSERT_TRUE(wait_for([&] { return finished(a); }));
  EXPECT_EQ(a->result.finish, EngineFinish::kCancelled);
  {
    std::lock_guard l(a->mu);
    EXPECT_GT(a->generated, 0);
  }
  eng.release("c");
  eng.release("d");
  ASSERT_TRUE(wait_for([&] { return finished(c) && finished(d); }));
  std::lock_guard l(eng.mu);
  EXPECT_EQ(eng.ran, (std::vector<std::string>{"a", "c", "d"}));
}

TEST(ServerScheduler, StopCancelsEverything) {
  MetricsRegistry reg;
  ServerMetrics m(reg);
  GateEngine eng;
  auto s = std::make_unique<Scheduler>(eng, m, SchedulerConfig{8, 6});
  s->start();
  auto a = make_job("a"), b = make_job("b");
  ASSERT_TRUE(s->submit(a));
  ASSERT_TRUE(s->submit(b));
  ASSERT_TRUE(wait_for([&] {
    std::lock_guard l(eng.mu);
    return eng.ran.size() == 1;
  }));
  s->stop();
  EXPECT_TRUE(finished(a));
  EXPECT_TRUE(finished(b));
  EXPECT_EQ(b->result.finish, EngineFinish::kCancelled);
}

class CollectSink : public TokenSink {
 public:
  void on_step(const StepEvent& e) override {
    tokens.insert(tokens.end(), e.tokens.begin(), e.tokens.end());
    steps.push_back(int(e.tokens.size()));
    prefill.push_back(e.is_prefill);
  }
  std::vector<int32_t> tokens;
  std::vector<int> steps;
  std::vector<bool> prefill;
};

StubEngineConfig stub_config() {
  StubEngineConfig c;
  c.vocabulary = {10, 11, 12, 13, 14, 15};
  c.think_start_id = 100;
  c.think_end_id = 101;
  c.eos_id = 1;
  return c;
}

TEST(ServerStubEngine, SeededSequencesRepeatAndDiffer) {
  StubEngine eng(stub_config());
  GenerationRequest r;
  r.prompt_ids = {0, 5, 100};
  r.max_new_tokens = 1000;
  r.stop_token_ids = {1};
  r.sampling.seed = 7;
  CollectSink s1, s2, s3;
  auto res1 = eng.generate(r, nullptr, s1);
  auto res2 = eng.generate(r, nullptr, s2);
  r.sampling.seed = 8;
  eng.generate(r, nullptr, s3);
  EXPECT_EQ(s1.tokens, s2.tokens);
  EXPECT_NE(s1.tokens, s3.tokens);
  EXPECT_EQ(res1.finish, EngineFinish::kStopToken);
  EXPECT_EQ(s1.tokens.back(), 1);
  // Thinking prompt: reasoning, then </think>, then content.
  EXPECT_NE(std::find(s1.tokens.begin(), s1.tokens.end(), 101), s1.tokens.end());
  // First step is the prefill with one token; later steps carry 1..6 tokens.
  EXPECT_TRUE(s1.prefill[0]);
  EXPECT_EQ(s1.steps[0], 1);
  for (size_t i = 1; i < s1.steps.size(); ++i) {
    EXPECT_GE(s1.steps[i], 1);
    EXPECT_LE(s1.steps[i], 6);
  }
  EXPECT_EQ(res1.decode_steps, int(s1.steps.size()) - 1);
  EXPECT_EQ(res1.generated_tokens, int(s1.tokens.size()));
}

TEST(ServerStubEngine, HonoursMaxTokensAndCancel) {
  StubEngine eng(stub_config());
  GenerationRequest r;
  r.prompt_ids = {0, 5};
  r.max_new_tokens = 5;
  r.stop_token_ids = {1};
  r.sampling.seed = 3;
  CollectSink s;
  auto res = eng.generate(r, nullptr, s);
  EXPECT_EQ(res.finish, EngineFinish::kLength);
  EXPECT_EQ(s.tokens.size(), 5u);
  std::atomic<bool> cancel{true};
  r.cancel = &cancel;
  CollectSink c;
  EXPECT_EQ(eng.generate(r, nullptr, c).finish, EngineFinish::kCancelled);
  EXPECT_TRUE(c.tokens.empty());
}

TEST(ServerStubEngine, ReusesSessionPrefix) {
  StubEngine eng(stub_config());
  GenerationRequest r;
  r.session_key = "abc";
  r.prompt_ids = {0, 5, 6, 7};
  r.max_new_tokens = 3;
  r.sampling.seed = 1;
  EXPECT_EQ(eng.prepare(r)->kv_source, KvSource::kNone);
  CollectSink s;
  eng.generate(r, nullptr, s);
  GenerationRequest next = r;
  next.prompt_ids.insert(next.prompt_ids.end(), s.tokens.begin(), s.tokens.end());
  next.prompt_ids.push_back(9);
  auto p = eng.prepare(next);
  EXPECT_EQ(p->kv_source, KvSource::kLocal);
  EXPECT_EQ(p->reused_tokens, 4 + int(s.tokens.size()));
}

TEST(ServerMetrics, PrometheusText) {
  MetricsRegistry reg;
  auto& c = reg.counter("t_total", "A counter.");
  auto& h = reg.histogram("t_seconds", "A histogram.", {0.1, 1});
  auto& l = reg.labeled_counter("t_by", "Labelled.", "outcome");
  c.add(3);
  h.observe(0.05);
  h.observe(0.5, 2);
  h.observe(5);
  l.with("stop").add();
  const std::string text = reg.render();
  EXPECT_NE(text.find("# TYPE t_total counter\nt_total 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("t_seconds_bucket{le=\"0.1\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("t_seconds_bucket{le=\"1\"} 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("t_seconds_bucket{le=\"+Inf\"} 4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("t_seconds_sum 6.05\n"), std::string::npos) << text;
  EXPECT_NE(text.find("t_seconds_count 4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("t_by{outcome=\"stop\"} 1\n"), std::string::npos) << text;
}

}  // namespace
}  // namespace uf::server
