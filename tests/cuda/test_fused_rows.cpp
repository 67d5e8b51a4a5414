// row_chains (cuda/ops/elementwise.h, ops/fused_rows.cu) against the unfused op sequences it
// replaces in the decode attention block (cuda_model.cpp finish_kv / finish_entries /
// index_queries, cuda_ring_span.cpp attention_program / kv_program): BITWISE, on fresh random
// inputs, at T = 1, 7, 8, real dims (head_dim 512, rope_dim 64, index head dim 128) and tiny ones.
// Every output buffer of both runs is poisoned with NaN first (rings start from the same random
// rows); outputs must match bit for bit and hold no NaN where the ops write. Window slot lists are
// compared as (buffer, offset) pairs, each run pointing into its own buffers.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/backend/backend_kernels.h"
#include "cuda/device_memory.h"
#include "cuda/device_weights.h"
#include "cuda/ops/elementwise.h"
#include "cuda_test_util.h"
#include "model/rope.h"
#include "model/weights.h"

namespace uf::cuda::test {
namespace {

using model::WFormat;

constexpr int kRows[] = {1, 7, 8};

std::vector<float> randn(size_t n, std::mt19937& rng, float sd = 1.f) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Bitwise equality of want (the unfused ops) and got (the fused kernel); `valid` elements (the
// first ones) must not be NaN.
::testing::AssertionResult same_bits(const std::string& what, const std::vector<float>& got,
                                     const std::vector<float>& want, size_t valid = SIZE_MAX) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << what << ": size " << got.size() << " != " << want.size();
  size_t bad = 0, nan = 0, first = SIZE_MAX;
  for (size_t i = 0; i < got.size(); ++i) {
    if (i < valid && std::isnan(got[i])) ++nan;
    if (!bits_equal(got[i], want[i])) {
      if (first == SIZE_MAX) first = i;
      ++bad;
    }
  }
  if (bad == 0 && nan == 0) return ::testing::AssertionSuccess();
  char buf[256] = "";
  if (first != SIZE_MAX)
    std::snprintf(buf, sizeof(buf), " first at %zu: got %.9g (0x%08x) want %.9g (0x%08x)", first,
                  double(got[first]), f32_bits(got[first]), double(want[first]),
                  f32_bits(want[first]));
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size()
                                       << " elements differ, " << nan << " NaN" << buf;
}

// A bf16 copy that a fused chain wrote into poisoned memory: its first n values hold `want`'s first
// n exactly (FP4 QDQ values: exact in bf16), and nothing past them was written (still 0xFFFF).
::testing::AssertionResult bf16_copy_exact(const std::string& what,
                                           const std::vector<uint16_t>& got,
                                           std::vector<float> want, size_t n) {
  want.resize(n);
  const auto head = same_bits(
      what, bf16_values(std::vector<uint16_t>(got.begin(), got.begin() + int64_t(n))), want);
  if (!head) return head;
  if (!std::all_of(got.begin() + int64_t(n), got.end(), [](uint16_t v) { return v == 0xFFFFu; }))
    return ::testing::AssertionFailure() << what << ": written past its " << n << " values";
  return ::testing::AssertionSuccess();
}

// A norm weight [n, 1] (model::bind_weights binds vectors so) on the device.
struct NormWeight {
  std::vector<uint8_t> bytes;
  DeviceArena arena;
  DeviceWeight dw;
};
void make_norm(NormWeight& w, WFormat fmt, int n, std::mt19937& rng) {
  const auto v = randn(size_t(n), rng, 0.3f);
  model::Weight mw;
  mw.format = fmt;
  mw.rows = n;
  mw.cols = 1;
  mw.name = "norm";
  if (fmt == WFormat::kF32) {
    w.bytes.resize(size_t(n) * 4);
    for (int i = 0; i < n; ++i) {
      const float x = 1.f + v[size_t(i)];
      std::memcpy(&w.bytes[size_t(i) * 4], &x, 4);
    }
  } else {
    w.bytes.resize(size_t(n) * 2);
    for (int i = 0; i < n; ++i) {
      const uint16_t h = core::float_to_bf16(1.f + v[size_t(i)]);
      std::memcpy(&w.bytes[size_t(i) * 2], &h, 2);
    }
  }
  mw.data = w.bytes.data();
  w.dw = upload_weight(mw, w.arena);
}

// A device cell holding one pointer (the span block's ring / destination pointers).
template <typename P>
struct PtrCell {
  DeviceBuffer<P> cell{1};
  explicit PtrCell(P p) { cell.upload(std::vector<P>{p}); }
  P const* get() const { return cell.get(); }
};

struct Dims {
  const char* name;
  int hd, rope_dim, ihd, H, Hi, W;
};
constexpr Dims kDims[] = {{"real", 512, 64, 128, 8, 32, 128}, {"tiny", 64, 16, 32, 2, 2, 4}};
constexpr int kMaxRows = 8;  // the window ring's extra slots (CudaModelOptions::max_rows)

model::Rope rope_for(const Dims& d) {  // YaRN, as the compressed layers
  return model::Rope(d.rope_dim, 160000.0, 65536, 16.0, 32.0, 1.0);
}

std::string tag(const Dims& d, int T, const char* more = "") {
  return std::string(d.name) + " T=" + std::to_string(T) + more;
}

// Every case runs on both kernels of row_chains: the default one (the row in shared memory,
// weights and block values read before the PDL wait) and the in-place one it replaced
// (UF_ROW_CHAINS_LEGACY=1, also the path of rows over 12288 floats).
class CudaFusedRows : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { setenv("UF_ROW_CHAINS_LEGACY", GetParam() ? "1" : "0", 1); }
  void TearDown() override { unsetenv("UF_ROW_CHAINS_LEGACY"); }
};

// Slot pointers as (buffer id, offset) with 0 = null, 1 = ring, 2 = local; -1 = elsewhere.
std::vector<int64_t> slot_ids(const std::vector<const float*>& s, const float* ring, int64_t rn,
                              const float* local, int64_t ln) {
  std::vector<int64_t> out;
  for (const float* p : s) {
    if (!p) {
      out.push_back(0);
      out.push_back(0);
    } else if (p >= ring && p < ring + rn) {
      out.push_back(1);
      out.push_back(p - ring);
    } else if (p >= local && p < local + ln) {
      out.push_back(2);
      out.push_back(p - local);
    } else {
      out.push_back(-1);
      out.push_back(0);
    }
  }
  return out;
}

// attention_program's launch: rope(q) + finish_kv's chain + put_ring_rows + build_window_slots.
TEST_P(CudaFusedRows, AttentionQkvRingSlotsBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(601);
  for (const Dims& d : kDims)
    for (WFormat fmt : {WFormat::kBF16, WFormat::kF32})
      for (int64_t p0 : {int64_t(2), int64_t(100003)})
        for (int T : kRows) {
          const std::string what =
              tag(d, T, fmt == WFormat::kBF16 ? " bf16" : " f32") + " p0=" + std::to_string(p0);
          const int hd = d.hd, H = d.H, slots = d.W + kMaxRows;
          NormWeight nw;
          make_norm(nw, fmt, hd, rng);
          const auto ropes = rope_for(d);
          DeviceBuffer<float> freqs(ropes.freqs());
          std::vector<int64_t> pos(static_cast<size_t>(T));
          for (int t = 0; t < T; ++t) pos[size_t(t)] = p0 + t;
          DeviceBuffer<int64_t> dpos(pos), dp0(std::vector<int64_t>{p0});
          const auto q = randn(size_t(T) * H * hd, rng), kv = randn(size_t(T) * hd, rng, 2.f);
          const auto ring0 = randn(size_t(slots) * hd, rng);
          const float eps = 1e-6f;
          // The ops.
          DeviceBuffer<float> q1(q), kv1(kv), ring1(ring0);
          DeviceBuffer<const float*> slots1(size_t(T) * d.W);
          slots1.poison();
          PtrCell<float*> rc1(ring1.get());
          rope(freqs.get(), d.rope_dim, q1.get(), T, H, hd, 0, 1, false, nullptr, dpos.get());
          rms_norm(nw.dw, eps, kv1.get(), T, hd, kv1.get(), nullptr);
          rope(freqs.get(), d.rope_dim, kv1.get(), T, 1, hd, 0, 1, false, nullptr, dpos.get());
          qdq_fp8(kv1.get(), T, hd, 32, nullptr);
          build_window_slots(dpos.get(), dp0.get(), T, d.W, rc1.get(), slots, kv1.get(), hd,
                             slots1.get(), nullptr);
          put_ring_rows(kv1.get(), T, hd, dpos.get(), rc1.get(), slots, nullptr);
          sync_and_check();
          // The fused launch.
          DeviceBuffer<float> q2(q), kv2(kv), ring2(ring0);
          DeviceBuffer<const float*> slots2(size_t(T) * d.W);
          slots2.poison();
          PtrCell<float*> rc2(ring2.get());
          RowChain c[2];
          c[0].rows = T;
          c[0].n = H * hd;
          c[0].y = q2.get();
          c[0].count = H;
          c[1].rows = T;
          c[1].n = hd;
          c[1].y = kv2.get();
          c[1].norm = nw.dw;
          c[1].eps = eps;
          c[1].qdq = QdqKind::kFp8;
          c[1].qdq_block = 32;
          c[1].ring = rc2.get();
          c[1].ring_pos = dpos.get();
          c[1].ring_slots = slots;
          for (RowChain& e : c) {
            e.freqs = freqs.get();
            e.rope_dim = d.rope_dim;
            e.positions = dpos.get();
          }
          WindowSlotsJob ws;
          ws.pos = dpos.get();
          ws.p0 = dp0.get();
          ws.T = T;
          ws.W = d.W;
          ws.ring = rc2.get();
          ws.ring_slots = slots;
          ws.local = kv2.get();
          ws.hd = hd;
          ws.out = slots2.get();
          row_chains(c, 2, &ws, nullptr);
          sync_and_check();
          EXPECT_TRUE(same_bits(what + " q", q2.download(), q1.download()));
          EXPECT_TRUE(same_bits(what + " kv", kv2.download(), kv1.download()));
          EXPECT_TRUE(same_bits(what + " ring", ring2.download(), ring1.download()));
          const int64_t rn = int64_t(slots) * hd, ln = int64_t(T) * hd;
          EXPECT_EQ(slot_ids(slots2.download(), ring2.get(), rn, kv2.get(), ln),
                    slot_ids(slots1.download(), ring1.get(), rn, kv1.get(), ln))
              << what << " window slots";
        }
}

// finish_kv alone with p0 instead of positions (the host-driven path), and the norm on widths of
// every load mode (q_lora_rank 1280, an odd width).
TEST_P(CudaFusedRows, KvChainP0AndNormWidthsBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(602);
  for (const Dims& d : kDims)
    for (int T : kRows) {
      const std::string what = tag(d, T, " finish_kv p0");
      NormWeight nw;
      make_norm(nw, WFormat::kBF16, d.hd, rng);
      const auto ropes = rope_for(d);
      DeviceBuffer<float> freqs(ropes.freqs());
      const auto kv = randn(size_t(T) * d.hd, rng);
      const int64_t p0 = 4097;
      DeviceBuffer<float> a(kv), b(kv);
      rms_norm(nw.dw, 1e-6f, a.get(), T, d.hd, a.get(), nullptr);
      rope(freqs.get(), d.rope_dim, a.get(), T, 1, d.hd, p0, 1, false, nullptr);
      qdq_fp8(a.get(), T, d.hd, 32, nullptr);
      RowChain c;
      c.rows = T;
      c.n = d.hd;
      c.y = b.get();
      c.norm = nw.dw;
      c.eps = 1e-6f;
      c.freqs = freqs.get();
      c.rope_dim = d.rope_dim;
      c.p0 = p0;
      c.qdq = QdqKind::kFp8;
      c.qdq_block = 32;
      row_chains(&c, 1, nullptr, nullptr);
      sync_and_check();
      EXPECT_TRUE(same_bits(what, b.download(), a.download()));
    }
  for (WFormat fmt : {WFormat::kBF16, WFormat::kF32})
    for (int n : {101, 1280, 4096})
      for (int T : kRows) {
        const std::string what = "norm n=" + std::to_string(n) + " T=" + std::to_string(T);
        NormWeight nw;
        make_norm(nw, fmt, n, rng);
        const auto x = randn(size_t(T) * n, rng);
        DeviceBuffer<float> a(x), b(x);
        rms_norm(nw.dw, 1e-6f, a.get(), T, n, a.get(), nullptr);
        RowChain c;
        c.rows = T;
        c.n = n;
        c.y = b.get();
        c.norm = nw.dw;
        c.eps = 1e-6f;
        row_chains(&c, 1, nullptr, nullptr);
        sync_and_check();
        EXPECT_TRUE(same_bits(what, b.download(), a.download()));
      }
}

// output_proj's inverse rope of the attention output (H heads), with positions and with p0.
TEST_P(CudaFusedRows, OutputInverseRopeBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(606);
  for (const Dims& d : kDims)
    for (bool with_pos : {true, false})
      for (int T : kRows) {
        const std::string what = tag(d, T, with_pos ? " inverse positions" : " inverse p0");
        const auto ropes = rope_for(d);
        DeviceBuffer<float> freqs(ropes.freqs());
        const int64_t p0 = 65530;
        std::vector<int64_t> pos(static_cast<size_t>(T));
        for (int t = 0; t < T; ++t) pos[size_t(t)] = p0 + t;
        DeviceBuffer<int64_t> dpos(pos);
        const int64_t* P = with_pos ? dpos.get() : nullptr;
        const auto o = randn(size_t(T) * d.H * d.hd, rng);
        DeviceBuffer<float> a(o), b(o);
        rope(freqs.get(), d.rope_dim, a.get(), T, d.H, d.hd, with_pos ? 0 : p0, 1, true, nullptr,
             P);
        RowChain c;
        c.rows = T;
        c.n = d.H * d.hd;
        c.y = b.get();
        c.count = d.H;
        c.freqs = freqs.get();
        c.rope_dim = d.rope_dim;
        c.p0 = with_pos ? 0 : p0;
        c.positions = P;
        c.inverse = true;
        row_chains(&c, 1, nullptr, nullptr);
        sync_and_check();
        EXPECT_TRUE(same_bits(what, b.download(), a.download()));
      }
}

// index_queries: scale_round_bf16(iw) + rope(iq, Hi heads) + qdq_fp4_e8m0_scale(iq, 32).
TEST_P(CudaFusedRows, IndexQueriesBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(603);
  for (const Dims& d : kDims)
    for (bool with_pos : {true, false})
      for (int T : kRows) {
        const std::string what = tag(d, T, with_pos ? " positions" : " p0");
        const int Hi = d.Hi, ihd = d.ihd;
        const auto ropes = rope_for(d);
        DeviceBuffer<float> freqs(ropes.freqs());
        const int64_t p0 = 777;
        std::vector<int64_t> pos(static_cast<size_t>(T));
        for (int t = 0; t < T; ++t) pos[size_t(t)] = p0 + t;
        DeviceBuffer<int64_t> dpos(pos);
        const int64_t* P = with_pos ? dpos.get() : nullptr;
        const auto iq = randn(size_t(T) * Hi * ihd, rng), iw = randn(size_t(T) * Hi, rng, 3.f);
        const float scale = float(std::pow(double(ihd), -0.5) * std::pow(double(Hi), -0.5));
        DeviceBuffer<float> q1(iq), w1(iw), q2(iq), w2(iw);
        scale_round_bf16(w1.get(), int64_t(T) * Hi, scale, nullptr);
        rope(freqs.get(), d.rope_dim, q1.get(), T, Hi, ihd, with_pos ? 0 : p0, 1, false, nullptr,
             P);
        qdq_fp4_e8m0_scale(q1.get(), T, Hi * ihd, 32, nullptr);
        RowChain c[2];
        c[0].rows = T;
        c[0].n = Hi;
        c[0].y = w2.get();
        c[0].scale_round = true;
        c[0].scale = scale;
        c[1].rows = T;
        c[1].n = Hi * ihd;
        c[1].y = q2.get();
        c[1].freqs = freqs.get();
        c[1].rope_dim = d.rope_dim;
        c[1].count = Hi;
        c[1].p0 = with_pos ? 0 : p0;
        c[1].positions = P;
        c[1].qdq = QdqKind::kFp4E8m0;
        c[1].qdq_block = 32;
        row_chains(c, 2, nullptr, nullptr);
        sync_and_check();
        EXPECT_TRUE(same_bits(what + " iw", w2.download(), w1.download()));
        EXPECT_TRUE(same_bits(what + " iq", q2.download(), q1.download()));
      }
}

// kv_program / finish_entries: [compress_pool + round_bf16 | c_wkv rows] + rms_norm(c_norm), the
// raw rings' put_ring_rows, then the keys' rms_norm + rope + FP4 (UE8M0, 32) and the latents' rope
// + FP4 (E4M3, 16), each with copy_rows_to of the first n rows; with or without index keys.
TEST_P(CudaFusedRows, CompressorEntriesBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(604);
  for (const Dims& d : kDims)
    for (int r : {1, 2, 4})
      for (bool keys : {true, false})
        for (int T : kRows) {
          const int G = r == 1 ? T : (T + r - 1) / r, hd = d.hd, ihd = d.ihd;
          const int raw_slots = r + kMaxRows;
          const std::string what =
              tag(d, T, keys ? " keys" : " no keys") + " r=" + std::to_string(r);
          NormWeight cn, kn;
          make_norm(cn, WFormat::kBF16, hd, rng);
          make_norm(kn, WFormat::kBF16, ihd, rng);
          const auto ropes = rope_for(d);
          DeviceBuffer<float> freqs(ropes.freqs());
          const int64_t p0 = 4 * 1000 + 1;  // the span's positions p0 .. p0 + T - 1
          std::vector<int64_t> pos(static_cast<size_t>(T)), epos(static_cast<size_t>(G));
          for (int t = 0; t < T; ++t) pos[size_t(t)] = p0 + t;
          for (int g = 0; g < G; ++g) epos[size_t(g)] = int64_t(1000 + g) * r;
          const int n_emit = std::max(0, G - 1 - T % 2);  // some rows are padding
          DeviceBuffer<int64_t> dpos(pos), depos(epos);
          DeviceBuffer<int32_t> dn(std::vector<int32_t>{n_emit});
          // Pool sources: G * r rows of the span scratch / an older-rows buffer.
          const auto kvrows = randn(size_t(T) * hd, rng), gaterows = randn(size_t(T) * hd, rng);
          const auto oldkv = randn(size_t(r) * hd, rng), oldgate = randn(size_t(r) * hd, rng);
          DeviceBuffer<float> dkv(kvrows), dgate(gaterows), dokv(oldkv), dogate(oldgate);
          std::vector<const float*> pk, pg;
          std::uniform_int_distribution<int> pick(0, 2 * T - 1);
          for (int i = 0; i < G * r; ++i) {
            const int s = pick(rng);
            pk.push_back(s < T ? dkv.get() + int64_t(s) * hd : dokv.get() + int64_t(s % r) * hd);
            pg.push_back(s < T ? dgate.get() + int64_t(s) * hd
                               : dogate.get() + int64_t(s % r) * hd);
          }
          DeviceBuffer<const float*> dpk(pk), dpg(pg);
          const auto wkv_rows = randn(size_t(G) * hd, rng);  // ratio 1: c_wkv's output
          const auto keys_in = randn(size_t(G) * ihd, rng);  // i_wk's output (both runs)
          const auto rk0 = randn(size_t(raw_slots) * hd, rng),
                     rg0 = randn(size_t(raw_slots) * hd, rng);
          const float eps = 1e-6f;
          // The ops.
          DeviceBuffer<float> e1(r == 1 ? wkv_rows : std::vector<float>(size_t(G) * hd));
          if (r > 1) e1.poison();
          DeviceBuffer<float> k1(keys_in), ckv1(size_t(G) * hd), ik1(size_t(G) * ihd);
          DeviceBuffer<float> rk1(rk0), rg1(rg0);
          ckv1.poison();
          ik1.poison();
          PtrCell<float*> ckv1c(ckv1.get()), ik1c(ik1.get()), rk1c(rk1.get()), rg1c(rg1.get());
          if (r > 1) {
            compress_pool(dpk.get(), dpg.get(), G, r, hd, e1.get(), nullptr);
            round_bf16(e1.get(), int64_t(G) * hd, nullptr);
          }
          rms_norm(cn.dw, eps, e1.get(), G, hd, e1.get(), nullptr);
          if (r > 1) {
            put_ring_rows(dkv.get(), T, hd, dpos.get(), rk1c.get(), raw_slots, nullptr);
            put_ring_rows(dgate.get(), T, hd, dpos.get(), rg1c.get(), raw_slots, nullptr);
          }
          if (keys) {
            rms_norm(kn.dw, eps, k1.get(), G, ihd, k1.get(), nullptr);
            rope(freqs.get(), d.rope_dim, k1.get(), G, 1, ihd, 0, 1, false, nullptr, depos.get());
            qdq_fp4_e8m0_scale(k1.get(), G, ihd, 32, nullptr);
          }
          rope(freqs.get(), d.rope_dim, e1.get(), G, 1, hd, 0, 1, false, nullptr, depos.get());
          qdq_fp4_e4m3_scale(e1.get(), G, hd, 16, nullptr);
          if (keys) copy_rows_to(k1.get(), G, ihd, dn.get(), ik1c.get(), nullptr);
          copy_rows_to(e1.get(), G, hd, dn.get(), ckv1c.get(), nullptr);
          sync_and_check();
          // The fused launches (kv_program's).
          DeviceBuffer<float> e2(r == 1 ? wkv_rows : std::vector<float>(size_t(G) * hd));
          if (r > 1) e2.poison();
          // The session's compressed KV and index keys are bf16 (cuda_session.h).
          DeviceBuffer<float> k2(keys_in);
          DeviceBuffer<uint16_t> ckv2(size_t(G) * hd), ik2(size_t(G) * ihd);
          ik2.poison();
          DeviceBuffer<float> rk2(rk0), rg2(rg0);
          ckv2.poison();
          PtrCell<float*> rk2c(rk2.get()), rg2c(rg2.get());
          PtrCell<uint16_t*> ckv2c(ckv2.get()), ik2c(ik2.get());
          RowChain src, lat, put[2], fin[2];
          src.rows = G;
          src.n = hd;
          src.y = e2.get();
          src.norm = cn.dw;
          src.eps = eps;
          if (r > 1) {
            src.pool_kv = dpk.get();
            src.pool_gate = dpg.get();
            src.pool_r = r;
            src.pool_round = true;
          }
          lat.rows = G;
          lat.n = hd;
          lat.y = e2.get();
          lat.freqs = freqs.get();
          lat.rope_dim = d.rope_dim;
          lat.positions = depos.get();
          lat.qdq = QdqKind::kFp4E4m3;
          lat.qdq_block = 16;
          lat.copy_n = dn.get();
          lat.copy_dst_bf16 = ckv2c.get();
          if (!keys) {
            src.freqs = lat.freqs;
            src.rope_dim = lat.rope_dim;
            src.positions = lat.positions;
            src.qdq = lat.qdq;
            src.qdq_block = lat.qdq_block;
            src.copy_n = lat.copy_n;
            src.copy_dst_bf16 = lat.copy_dst_bf16;
          }
          put[0].y = dkv.get();
          put[0].ring = rk2c.get();
          put[1].y = dgate.get();
          put[1].ring = rg2c.get();
          RowChain c[3];
          int nc = 0;
          c[nc++] = src;
          for (RowChain& e : put) {
            e.rows = T;
            e.n = hd;
            e.ring_pos = dpos.get();
            e.ring_slots = raw_slots;
            if (r > 1) c[nc++] = e;
          }
          row_chains(c, nc, nullptr, nullptr);
          if (keys) {
            fin[0].rows = G;
            fin[0].n = ihd;
            fin[0].y = k2.get();
            fin[0].norm = kn.dw;
            fin[0].eps = eps;
            fin[0].freqs = freqs.get();
            fin[0].rope_dim = d.rope_dim;
            fin[0].positions = depos.get();
            fin[0].qdq = QdqKind::kFp4E8m0;
            fin[0].qdq_block = 32;
            fin[0].copy_n = dn.get();
            fin[0].copy_dst_bf16 = ik2c.get();  // the session's bf16 index keys
            fin[1] = lat;
            row_chains(fin, 2, nullptr, nullptr);
          }
          sync_and_check();
          EXPECT_TRUE(same_bits(what + " latents", e2.download(), e1.download()));
          EXPECT_TRUE(bf16_copy_exact(what + " ckv copy", ckv2.download(), ckv1.download(),
                                      size_t(n_emit) * hd));
          EXPECT_TRUE(same_bits(what + " raw kv ring", rk2.download(), rk1.download()));
          EXPECT_TRUE(same_bits(what + " raw gate ring", rg2.download(), rg1.download()));
          if (keys) {
            EXPECT_TRUE(same_bits(what + " keys", k2.download(), k1.download()));
            EXPECT_TRUE(bf16_copy_exact(what + " ikeys copy", ik2.download(), ik1.download(),
                                        size_t(n_emit) * ihd));
          }
        }
}

// finish_entries on the host-driven path: positions p0 + i * stride instead of a position list.
TEST_P(CudaFusedRows, EntriesStrideBitwise) {
  UF_REQUIRE_GPU();
  std::mt19937 rng(605);
  for (const Dims& d : kDims)
    for (int T : kRows) {
      const std::string what = tag(d, T, " stride");
      NormWeight kn;
      make_norm(kn, WFormat::kBF16, d.ihd, rng);
      const auto ropes = rope_for(d);
      DeviceBuffer<float> freqs(ropes.freqs());
      const int64_t p0 = 4 * 77, stride = 4;
      const auto lat = randn(size_t(T) * d.hd, rng), keys = randn(size_t(T) * d.ihd, rng);
      DeviceBuffer<float> l1(lat), k1(keys), l2(lat), k2(keys);
      // finish_entries' bf16 keys and latents
      DeviceBuffer<uint16_t> kb(size_t(T) * d.ihd), lb(size_t(T) * d.hd);
      rms_norm(kn.dw, 1e-6f, k1.get(), T, d.ihd, k1.get(), nullptr);
      rope(freqs.get(), d.rope_dim, k1.get(), T, 1, d.ihd, p0, stride, false, nullptr);
      qdq_fp4_e8m0_scale(k1.get(), T, d.ihd, 32, nullptr);
      rope(freqs.get(), d.rope_dim, l1.get(), T, 1, d.hd, p0, stride, false, nullptr);
      qdq_fp4_e4m3_scale(l1.get(), T, d.hd, 16, nullptr);
      RowChain c[2];
      c[0].n = d.ihd;
      c[0].y = k2.get();
      c[0].norm = kn.dw;
      c[0].eps = 1e-6f;
      c[0].qdq = QdqKind::kFp4E8m0;
      c[0].qdq_block = 32;
      c[0].y_bf16 = kb.get();
      c[1].n = d.hd;
      c[1].y = l2.get();
      c[1].qdq = QdqKind::kFp4E4m3;
      c[1].qdq_block = 16;
      c[1].y_bf16 = lb.get();
      for (RowChain& e : c) {
        e.rows = T;
        e.freqs = freqs.get();
        e.rope_dim = d.rope_dim;
        e.p0 = p0;
        e.stride = stride;
      }
      row_chains(c, 2, nullptr, nullptr);
      sync_and_check();
      EXPECT_TRUE(same_bits(what + " keys", k2.download(), k1.download()));
      EXPECT_TRUE(same_bits(what + " bf16 keys", bf16_values(kb.download()), k1.download()));
      EXPECT_TRUE(same_bits(what + " latents", l2.download(), l1.download()));
      EXPECT_TRUE(same_bits(what + " bf16 latents", bf16_values(lb.download()), l1.download()));
    }
}

INSTANTIATE_TEST_SUITE_P(Kernels, CudaFusedRows, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return std::string(i.param ? "legacy" : "fast");
                         });

}  // namespace
}  // namespace uf::cuda::test
