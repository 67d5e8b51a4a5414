// Robustness of parse_safetensors_header (label `slow`). If the libFuzzer target was built
// (-DUF_BUILD_FUZZ=ON with clang, fuzz/CMakeLists.txt), run it for a bounded time: 60 s, or 10 s
// with UF_SLOW_REDUCED=1. Otherwise run the parser over a deterministic set of mutated headers
// (seeded byte flips, truncations, deletions, duplications, insertions of valid headers) and
// require that every input either parses to entries that tile the data section or throws
// uf::core::Error: any other exception, or a crash, fails.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "model/checkpoint.h"

namespace fs = std::filesystem;

namespace {

bool reduced() {
  const char* v = std::getenv("UF_SLOW_REDUCED");
  return v && std::string(v) == "1";
}

const fs::path kSeedDir = fs::path(UF_SOURCE_DIR) / "fuzz" / "corpus" / "safetensors_header";

fs::path fuzzer_path() {
  if (const char* p = std::getenv("UF_HEADER_FUZZER")) return p;
  return fs::path(UF_BINARY_DIR) / "fuzz" / "fuzz_safetensors_header";
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct Seed {
  std::string header;
  uint64_t data_size;
};

std::vector<Seed> load_seeds() {
  std::vector<Seed> seeds;
  // Fuzzer seeds: 2-byte little-endian data size, then the header.
  for (const auto& e : fs::directory_iterator(kSeedDir)) {
    const auto b = read_all(e.path());
    if (b.size() < 2) continue;
    seeds.push_back({b.substr(2), uint64_t(uint8_t(b[0])) | (uint64_t(uint8_t(b[1])) << 8)});
  }
  // A real header: the fixture's Engram-table shard (small, two big tensors).
  const auto shard =
      fs::path(UF_SHARED_DIR) / "fixtures" / "tiny-a" / "model-00003-of-00003.safetensors";
  const auto b = read_all(shard);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(b[size_t(i)]);
  seeds.push_back({b.substr(8, n), uint64_t(b.size() - 8 - n)});
  return seeds;
}

}  // namespace

TEST(HeaderFuzzSlow, ParserNeverCrashes) {
  const fs::path fuzzer = fuzzer_path();
  if (fs::exists(fuzzer)) {
    const int secs = reduced() ? 10 : 60;
    const fs::path corpus =
        fs::temp_directory_path() / ("uf_fuzz_corpus_" + std::to_string(::getpid()));
    fs::create_directories(corpus);
    const std::string cmd = fuzzer.string() + " -max_total_time=" + std::to_string(secs) +
                            " -rss_limit_mb=2048 -print_final_stats=1 " + corpus.string() + " " +
                            kSeedDir.string() + " > " + (corpus / "log.txt").string() + " 2>&1";
    const int rc = std::system(cmd.c_str());
    const auto log = read_all(corpus / "log.txt");
    fs::remove_all(corpus);
    EXPECT_EQ(rc, 0) << log.substr(log.size() > 4000 ? log.size() - 4000 : 0);
    return;
  }

  const auto seeds = load_seeds();
  ASSERT_GE(seeds.size(), 4u);
  std::mt19937_64 rng(20261129);
  auto below = [&](uint64_t n) { return n ? rng() % n : 0; };
  static const char kInteresting[] = "\"{}[],:0123456789-.e \\\xff\xc3\x80\xed";
  const int iterations = reduced() ? 20000 : 200000;
  int accepted = 0, rejected = 0;
  for (int it = 0; it < iterations; ++it) {
    const Seed& s = seeds[below(seeds.size())];
    std::string h = s.header;
    const int n_mut = 1 + int(below(4));
    for (int m = 0; m < n_mut && !h.empty(); ++m) {
      const size_t pos = below(h.size());
      switch (below(6)) {
        case 0:  // flip a bit
          h[pos] = char(h[pos] ^ (1 << below(8)));
          break;
        case 1:  // a structurally interesting byte
          h[pos] = kInteresting[below(sizeof(kInteresting) - 1)];
          break;
        case 2:  // truncate
          h.resize(pos);
          break;
        case 3:  // delete a range
          h.erase(pos, below(16) + 1);
          break;
        case 4: {  // duplicate a range somewhere else
          const std::string piece = h.substr(pos, below(24) + 1);
          h.insert(below(h.size() + 1), piece);
          break;
        }
        default:  // insert a random byte
          h.insert(h.begin() + std::ptrdiff_t(pos), char(below(256)));
      }
    }
    // Unmutated seeds must parse (the data size is theirs); mutated sizes probe offset checks.
    uint64_t data_size = s.data_size;
    if (below(4) == 0) data_size = below(s.data_size + 64);
    try {
      const auto entries = uf::model::parse_safetensors_header(h, data_size, "mutant");
      uint64_t total = 0;
      for (const auto& e : entries) {
        ASSERT_LE(e.begin, e.end);
        ASSERT_LE(e.end, data_size);
        ASSERT_EQ(e.view.nbytes, e.end - e.begin);
        total += e.end - e.begin;
      }
      ASSERT_EQ(total, data_size);
      ++accepted;
    } catch (const uf::core::Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      FAIL() << "iteration " << it << ": a " << typeid(e).name()
             << " escaped the parser: " << e.what();
    }
  }
  // Both outcomes occur, so the mutations neither always break nor never touch the structure.
  EXPECT_GT(accepted, iterations / 100);
  EXPECT_GT(rejected, iterations / 2);
  std::cout << "mutated headers: " << accepted << " accepted, " << rejected << " rejected\n";
}
