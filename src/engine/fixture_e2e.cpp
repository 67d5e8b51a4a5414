#include "engine/fixture_e2e.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>

namespace uf::engine {

namespace fs = std::filesystem;
using model::Diff;
using model::FixtureReport;
using model::LogitStats;

namespace {

void check_line(FixtureReport& rep, std::string name, double v, double bound, bool pass,
                std::string detail = "") {
  rep.lines.push_back({std::move(name), v, bound, pass, false, std::move(detail)});
}
void info_line(FixtureReport& rep, std::string name, double v, std::string detail = "") {
  rep.lines.push_back({std::move(name), v, 0, true, true, std::move(detail)});
}

std::vector<int32_t> to_i32(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

}  // namespace

GoldenFixture::GoldenFixture(const fs::path& dir)
    : ref(dir / "golden" / "reference.safetensors"),
      own(dir / "golden" / "reference_ownerkeys.safetensors"),
      agreement(model::golden_agreement(dir / "golden")),
      prompt(to_i32(ref.i64("prompt_ids"))),
      decode_ids(to_i32(ref.i64("decode_ids"))) {
  if (ref.has("prefill_positions"))
    stored_pos = ref.i64("prefill_positions");
  else
    for (int64_t i = 0; i < int64_t(prompt.size()); ++i) stored_pos.push_back(i);
}

std::vector<float> check_e2e(Backend& be, const GoldenFixture& fx, const E2eOptions& opts,
                             FixtureReport& rep) {
  const auto bounds = model::e2e_bounds(fx.agreement, opts.bound_margin);
  const auto& cfg = be.config();
  const int V = cfg.vocab_size;
  const int S = int(fx.prompt.size()), N = int(fx.decode_ids.size());
  E2eObserver none;
  E2eObserver& obs = opts.observer ? *opts.observer : none;

  // The whole prompt as one span, as the reference prefills it.
  auto s = be.new_session(S + N + 8);
  PrefillOptions po;
  po.all_logits = true;
  po.chunk = S;
  std::vector<float> logits(size_t(S) * size_t(V));
  obs.begin_prefill();
  be.prefill(*s, fx.prompt, po, logits);
  const auto& ref_prefill_logits = fx.ref.f32("prefill_logits");
  LogitStats pl;
  for (size_t j = 0; j < fx.stored_pos.size(); ++j)
    pl.add(logits.data() + fx.stored_pos[j] * V, ref_prefill_logits.data() + int64_t(j) * V, V);
  const auto& pre_b = bounds.prefill;
  check_line(rep, "e2e prefill logits maxabs", pl.d.maxabs, pre_b.maxabs,
             pl.d.maxabs < pre_b.maxabs, pre_b.from);
  check_line(rep, "e2e prefill logits rms-rel", pl.d.rms_rel(), pre_b.rms,
             pl.d.rms_rel() < pre_b.rms, fmt::format("{} rows", pl.rows));
  check_line(rep, "e2e prefill argmax agreement", pl.argmax(), 0.85, pl.argmax() >= 0.85);
  obs.end_prefill(rep);

  // Owner keys (the default of every backend) against reference_ownerkeys.safetensors.
  const std::vector<E2eVariant> variants =
      opts.variants.empty() ? std::vector<E2eVariant>{{"owner keys", &fx.own}} : opts.variants;
  // Later variants continue from the prefilled state, not from the first variant's decode.
  std::vector<uint8_t> prefilled;
  if (variants.size() > 1) prefilled = be.snapshot(*s);
  const auto& dec_bv = bounds.decode;
  const auto& ds_b = bounds.dspark;
  for (size_t vi = 0; vi < variants.size(); ++vi) {
    const auto& var = variants[vi];
    std::unique_ptr<SessionState> fork;
    if (vi > 0) {
      fork = be.new_session(S + N + 8);
      be.restore(*fork, prefilled);
    }
    SessionState& sv = vi > 0 ? *fork : *s;
    obs.begin_variant(var);
    LogitStats dl, dsl, dsh;
    Diff bias, conf;
    size_t draft_agree = 0, draft_n = 0;
    const auto& rl = var.golden->f32("decode_logits");
    const auto& anchors = var.golden->i64("dspark_anchor");
    const auto& drafts = var.golden->i64("dspark_draft_tokens");
    const auto& d_logits = var.golden->f32("dspark_logits");
    const auto& d_head = var.golden->f32("dspark_head_logits");
    const auto& d_bias = var.golden->f32("dspark_markov_bias");
    const auto& d_conf = var.golden->f32("dspark_confidence");
    const int R = int(anchors.size()), B = cfg.dspark_block_size;
    std::vector<float> lg(static_cast<size_t>(V));
    for (int r = 0; r < R; ++r) {
      if (r > 0) {
        const int k = r - 1;
        obs.begin_decode_step(k);
        be.decode_rows(sv, std::span<const int32_t>(&fx.decode_ids[size_t(k)], 1), lg);
        be.commit(sv, 1);
        dl.add(lg.data(), rl.data() + int64_t(k) * V, V);
      }
      if (B == 0 || cfg.n_mtp_layers == 0) continue;
      // Teacher-forced tokens: the reference's anchor, and its drafts feed the Markov chain.
      auto blk = be.draft(sv, int32_t(anchors[size_t(r)]), [&](int slot, std::span<const float> l) {
        const int32_t mine = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
        const int32_t theirs = int32_t(drafts[size_t(r * B + slot)]);
        ++draft_n;
        draft_agree += mine == theirs;
        return theirs;
      });
      for (int i = 0; i < B; ++i) {
        const int64_t off = (int64_t(r) * B + i) * V;
        std::vector<float> head(static_cast<size_t>(V));
        for (int v = 0; v < V; ++v)
          head[size_t(v)] = blk.logits[size_t(i) * V + v] - blk.markov_bias[size_t(i) * V + v];
        dsl.add(blk.logits.data() + int64_t(i) * V, d_logits.data() + off, V);
        dsh.add(head.data(), d_head.data() + off, V);
        bias.add(blk.markov_bias.data() + int64_t(i) * V, d_bias.data() + off, size_t(V));
      }
      conf.add(blk.confidence.data(), d_conf.data() + int64_t(r) * B, size_t(B));
    }
    const std::string& vn = var.name;
    check_line(rep, fmt::format("e2e [{}] decode logits maxabs", vn), dl.d.maxabs, dec_bv.maxabs,
               dl.d.maxabs < dec_bv.maxabs, dec_bv.from);
    check_line(rep, fmt::format("e2e [{}] decode logits rms-rel", vn), dl.d.rms_rel(), dec_bv.rms,
               dl.d.rms_rel() < dec_bv.rms, fmt::format("{} steps", dl.rows));
    info_line(rep, fmt::format("e2e [{}] decode argmax agreement", vn), dl.argmax());
    if (dsl.rows) {
      check_line(rep, fmt::format("e2e [{}] dspark logits maxabs", vn), dsl.d.maxabs, ds_b.maxabs,
                 dsl.d.maxabs < ds_b.maxabs, ds_b.from);
      check_line(rep, fmt::format("e2e [{}] dspark logits rms-rel", vn), dsl.d.rms_rel(), ds_b.rms,
                 dsl.d.rms_rel() < ds_b.rms, fmt::format("{} slots", dsl.rows));
      check_line(rep, fmt::format("e2e [{}] dspark head logits rms-rel", vn), dsh.d.rms_rel(),
                 ds_b.rms, dsh.d.rms_rel() < ds_b.rms);
      // The Markov bias is a pure fp32 lookup-and-GEMV of the same token: only summation order
      // separates it from the reference.
      check_line(rep, fmt::format("e2e [{}] markov bias maxabs", vn), bias.maxabs, 1e-4,
                 bias.maxabs < 1e-4);
      check_line(rep, fmt::format("e2e [{}] confidence logits maxabs", vn), conf.maxabs,
                 ds_b.maxabs, conf.maxabs < ds_b.maxabs,
                 fmt::format("rms-rel {:.3g}", conf.rms_rel()));
      info_line(rep, fmt::format("e2e [{}] draft token agreement", vn),
                double(draft_agree) / double(std::max<size_t>(draft_n, 1)),
                fmt::format("{}/{} slots", draft_agree, draft_n));
    }
    obs.end_variant(var, rep);
  }
  return {logits.end() - V, logits.end()};
}

void check_ced(Backend& be, const GoldenFixture& fx, std::span<const float> full_last_logits,
               bool against_reference, FixtureReport& rep) {
  const int V = be.config().vocab_size;
  const int S = int(fx.prompt.size()), N = int(fx.decode_ids.size());
  auto s = be.new_session(S + N + 8);
  PrefillOptions co;
  co.ced_shortcut = true;
  std::vector<float> lg(static_cast<size_t>(V));
  be.prefill(*s, fx.prompt, co, lg);
  LogitStats c;
  c.add(lg.data(), full_last_logits.data(), V);
  FixtureReport add;  // appended only once every figure is in (a throw appends nothing)
  info_line(
      add, "ced shortcut vs full prefill, last logits", c.d.rms_rel(),
      fmt::format("rms-rel; maxabs {:.3g}, argmax {}", c.d.maxabs, c.agree ? "same" : "different"));
  if (against_reference) {
    const auto& ref_prefill_logits = fx.ref.f32("prefill_logits");
    LogitStats cr;
    cr.add(lg.data(), ref_prefill_logits.data() + int64_t(fx.stored_pos.size() - 1) * V, V);
    info_line(add, "ced shortcut vs reference, last logits", cr.d.rms_rel(),
              fmt::format("rms-rel; maxabs {:.3g}", cr.d.maxabs));
    // Decoding on from the shortcut's state (the backend's default, owner keys).
    const auto& rl = fx.own.f32("decode_logits");
    LogitStats cd;
    for (int k = 0; k < N; ++k) {
      be.decode_rows(*s, std::span<const int32_t>(&fx.decode_ids[size_t(k)], 1), lg);
      be.commit(*s, 1);
      cd.add(lg.data(), rl.data() + int64_t(k) * V, V);
    }
    info_line(add, "ced shortcut then decode vs reference", cd.d.rms_rel(),
              fmt::format("rms-rel over {} steps; maxabs {:.3g}, argmax {:.2f} (full prefill: see "
                          "e2e [owner keys] decode)",
                          N, cd.d.maxabs, cd.argmax()));
  }
  rep.lines.insert(rep.lines.end(), add.lines.begin(), add.lines.end());
}

}  // namespace uf::engine
