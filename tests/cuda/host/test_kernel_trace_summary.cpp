// summarize_trace (cuda/trace/kernel_trace.h) on hand-made records: no device needed, so CI runs
// it. The figures the benchmarks print (span, busy, idle, advance per kernel) must add up.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda/trace/kernel_trace.h"

namespace uf::cuda {
namespace {

KernelRecord rec(const char* name, uint64_t s_us, uint64_t e_us) {
  KernelRecord r;
  r.name = name;
  r.start_ns = s_us * 1000;
  r.end_ns = e_us * 1000;
  r.grid = 1;
  r.block = 32;
  return r;
}

// The line of `name` in the table: "advance share calls adv/call dur/call grid name".
std::string line_of(const std::string& table, const std::string& name) {
  const size_t at = table.find("  " + name + "\n");
  if (at == std::string::npos) return "";
  const size_t begin = table.rfind('\n', at) + 1;
  return table.substr(begin, at - begin);
}

TEST(KernelTraceSummary, SpanBusyIdleAndAdvance) {
  // a: 0-10; b overlaps a (PDL: starts early, ends at 14); a gap 14-20; c: 20-25; a again 22-30.
  const std::vector<KernelRecord> recs = {rec("a", 0, 10), rec("b", 5, 14), rec("c", 20, 25),
                                          rec("a", 22, 30)};
  const std::string t = summarize_trace(recs, 10);
  EXPECT_NE(t.find("4 kernels, span 30.0 us, busy 24.0 us, idle 6.0 us"), std::string::npos) << t;
  // Advances in end order: a 10, b 4, c 11 (20-25 after the 14 end, idle included), a 5.
  const std::string la = line_of(t, "a"), lb = line_of(t, "b"), lc = line_of(t, "c");
  ASSERT_FALSE(la.empty() || lb.empty() || lc.empty()) << t;
  EXPECT_EQ(la.substr(0, 9), "     15.0") << la;  // 10 + 5
  EXPECT_EQ(lb.substr(0, 9), "      4.0") << lb;
  EXPECT_EQ(lc.substr(0, 9), "     11.0") << lc;
  // Sorted by advance: a, c, b.
  EXPECT_LT(t.find(la), t.find(lc));
  EXPECT_LT(t.find(lc), t.find(lb));
}

TEST(KernelTraceSummary, TopLimitsTheRowsAndEmptyIsSaid) {
  const std::vector<KernelRecord> recs = {rec("x", 0, 1), rec("y", 1, 3), rec("z", 3, 6)};
  const std::string t = summarize_trace(recs, 2);
  EXPECT_TRUE(line_of(t, "z").size() && line_of(t, "y").size()) << t;
  EXPECT_TRUE(line_of(t, "x").empty()) << t;
  EXPECT_EQ(summarize_trace({}, 5), "trace: no kernel records\n");
  const std::string raw = trace_records_text(recs);
  EXPECT_NE(raw.find("      3.00       6.00"), std::string::npos) << raw;
}

}  // namespace
}  // namespace uf::cuda
