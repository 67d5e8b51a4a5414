#!/usr/bin/env python3
"""Benchmark 4 of the performance issue: one decoder layer of the TP8 rank slice in PyTorch,
side by side with ours.

The layer (DeepSeek-V4.1-Flash, rank 0 of TP8: 8 heads of 512, 1 output group, expert
intermediate 288; model-arch.md sections 4.2, 4.4, 4.5), in plain torch, on T rows at one decode
position of a session holding --context tokens:
  - mHC around each sublayer (hc_mixes with 20 Sinkhorn iterations, hc_pre, hc_post), fp32 stream
    [T, 4, 5120];
  - attention: qr = q_norm(wq_a x) [1280], q = wq_b qr [8, 512], kv = kv_norm(wkv x) [512] (MQA
    latent, K = V), RoPE on the last 64 channels, the new rows put in a 128-slot window ring; each
    row attends its 128 window slots + 512 top-k entries gathered from the compressed KV
    ([context, 512]) with an attention sink; inverse RoPE; wo_a [1024, 4096]; wo_b [5120, 1024];
  - MoE: sqrt-softplus gate [384, 5120] in fp32, top-6 with a bias, weights renormalised x 1.5;
    the chosen experts' slices (w1, w3 [288, 5120], w2 [5120, 288]) gathered by index and applied
    with bmm (the gather copies the chosen experts' weights: plain torch has no grouped GEMV), the
    clamped SwiGLU; plus the shared expert.
  - A Reuse-mode layer: no compressor, no indexer (they run on 4 / 8 of our 40 layers), no Engram.
  - Weights: the checkpoint's FP8 / FP4 weights dequantised to bf16 (random values; bf16 matmuls,
    fp32 accumulate), so torch reads 2x (FP8) to 4x (FP4) the weight bytes ours does.
--layers distinct weight sets run in sequence (so the attention weights do not stay in L2, as in
a 40-layer step) and the time is divided by their number. Timed as one CUDA graph replay (and
eagerly) with CUDA events, median of --iters.

Ours: our step bench's no-head verify time at T rows (`ultrafast bench --synthetic tp8-rank
--json`, read with --ours-json) / 40 layers: the average over all 40 layers, which includes the
indexers, compressors, Engram and the per-step overhead that the torch layer does not have.

Prints a human line and a JSON line ({"bench": "torch_layer", ...}) per row count.
"""
import argparse
import json
import math
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,7")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ours-json", default="")
    ap.add_argument("--json-out", default="")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the code")
    args = ap.parse_args()

    try:
        import torch
    except Exception as e:  # noqa: BLE001
        print(f"torch_layer_bench: cannot import torch ({e}); run with /opt/torch/.venv/bin/python")
        return 2
    on_gpu = args.device == "cuda"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
    if on_gpu and not torch.cuda.is_available():
        print("torch_layer_bench: no CUDA device visible to torch")
        return 2
    hf = "transformers not installed"
    try:
        import transformers  # noqa: F401
        hf = f"transformers {transformers.__version__}: no deepseek_v41 module"
        try:
            import importlib
            importlib.import_module("transformers.models.deepseek_v41")
            hf = (f"transformers {transformers.__version__} has deepseek_v41: not used (it needs "
                  "the whole model's config and weights; the plain layer below is the rank slice)")
        except Exception:  # noqa: BLE001
            pass
    except Exception:  # noqa: BLE001
        pass
    print(f"HF modules: {hf}; using the plain torch layer")

    dev = torch.device(args.device)
    bf = torch.bfloat16
    D, HC, H, HD, ROPE, QR, OR = 5120, 4, 8, 512, 64, 1280, 1024
    NE, TOPK, INTER, WIN, KTOP = 384, 6, 288, 128, 512
    eps, hc_eps = 1e-20, 1e-6
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*shape, dtype=bf, scale=0.02):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale).to(dtype)

    def make_layer():
        return {
            "hc_fn": [rnd(24, HC * D, dtype=torch.float32) for _ in range(2)],
            "hc_base": [rnd(24, dtype=torch.float32) for _ in range(2)],
            "hc_scale": [rnd(3, dtype=torch.float32, scale=1.0) for _ in range(2)],
            "attn_norm": 1 + rnd(D), "ffn_norm": 1 + rnd(D),
            "wq_a": rnd(QR, D), "q_norm": 1 + rnd(QR), "wq_b": rnd(H * HD, QR),
            "wkv": rnd(HD, D), "kv_norm": 1 + rnd(HD), "sink": rnd(H, dtype=torch.float32),
            "wo_a": rnd(OR, H * HD), "wo_b": rnd(D, OR),
            "gate": rnd(NE, D, dtype=torch.float32), "bias": rnd(NE, dtype=torch.float32),
            "w1": rnd(NE, INTER, D), "w3": rnd(NE, INTER, D), "w2": rnd(NE, D, INTER),
            "s1": rnd(INTER, D), "s3": rnd(INTER, D), "s2": rnd(D, INTER),
            "ring": rnd(WIN + 8, HD), "ckv": rnd(args.context, HD),
        }

    print(f"building {args.layers} layer weight sets (bf16, ~{args.layers * 3.5:.0f} GB) ...")
    layers = [make_layer() for _ in range(args.layers)]
    pos = args.context
    inv = 1.0 / (160000.0 ** (torch.arange(0, ROPE, 2, device=dev, dtype=torch.float32) / ROPE))

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(bf)

    def rope(x, ang, inverse=False):
        tail = x[..., -ROPE:].float().unflatten(-1, (ROPE // 2, 2))
        c, s = torch.cos(ang), torch.sin(ang)
        if inverse:
            s = -s
        a, b = tail[..., 0], tail[..., 1]
        rot = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)
        return torch.cat((x[..., :-ROPE], rot.to(x.dtype)), -1)

    def hc_mixes(L, i, X):
        v = X.flatten(1)
        m = (v @ L["hc_fn"][i].t()) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        sc, base = L["hc_scale"][i], L["hc_base"][i]
        pre = torch.sigmoid(m[:, 0:4] * sc[0] + base[0:4]) + hc_eps
        post = 2 * torch.sigmoid(m[:, 4:8] * sc[1] + base[4:8])
        comb = (m[:, 8:24] * sc[2] + base[8:24]).view(-1, 4, 4).softmax(-1) + hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
        for _ in range(19):
            comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
        return pre, post, comb

    def attention(L, x, T, win_idx, top_idx, slots, ang):
        qr = rms(x @ L["wq_a"].t(), L["q_norm"])
        q = rope((qr @ L["wq_b"].t()).view(T, H, HD), ang[:, None, :])
        kv = rope(rms(x @ L["wkv"].t(), L["kv_norm"]), ang)
        L["ring"].index_copy_(0, slots, kv)
        kvs = torch.cat((L["ring"][win_idx], L["ckv"][top_idx]), 1)  # [T, 640, 512]
        s = torch.einsum("thd,tjd->thj", q, kvs).float() * HD ** -0.5
        s = torch.cat((s, L["sink"].view(1, H, 1).expand(T, H, 1)), -1)
        p = s.softmax(-1)[..., :-1].to(bf)
        o = rope(torch.einsum("thj,tjd->thd", p, kvs), ang[:, None, :], inverse=True)
        return (o.reshape(T, H * HD) @ L["wo_a"].t()) @ L["wo_b"].t()

    def moe(L, x, T):
        s = torch.sqrt(torch.nn.functional.softplus(x.float() @ L["gate"].t()))
        idx = torch.topk(s + L["bias"], TOPK, dim=-1).indices  # [T, 6]
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * 1.5
        flat = idx.flatten()
        w1, w3, w2 = L["w1"][flat], L["w3"][flat], L["w2"][flat]  # gathered copies
        xr = x.repeat_interleave(TOPK, 0).unsqueeze(-1)  # [T*6, D, 1]
        gg = torch.bmm(w1, xr).squeeze(-1).float().clamp(max=10)
        u = torch.bmm(w3, xr).squeeze(-1).float().clamp(-10, 10)
        a = (w.flatten()[:, None] * torch.nn.functional.silu(gg) * u).to(bf)
        y = torch.bmm(w2, a.unsqueeze(-1)).squeeze(-1).float().view(T, TOPK, D).sum(1)
        sg = (x @ L["s1"].t()).float().clamp(max=10)
        su = (x @ L["s3"].t()).float().clamp(-10, 10)
        y = y + ((torch.nn.functional.silu(sg) * su).to(bf) @ L["s2"].t()).float()
        return y.to(bf)

    def layer(L, X, pre_in, T, win_idx, top_idx, slots, ang):
        R = X
        apre, apost, acomb = hc_mixes(L, 0, X)
        x = rms((pre_in[..., None] * X).sum(1), L["attn_norm"])
        y = attention(L, x, T, win_idx, top_idx, slots, ang).float()
        X = apost[..., None] * y[:, None, :] + torch.einsum("tjk,tjd->tkd", acomb, R)
        R = X
        fpre, fpost, fcomb = hc_mixes(L, 1, X)
        x = rms((apre[..., None] * X).sum(1), L["ffn_norm"])
        y = moe(L, x, T).float()
        X = fpost[..., None] * y[:, None, :] + torch.einsum("tjk,tjd->tkd", fcomb, R)
        return X, fpre

    ours = {}
    if args.ours_json:
        try:
            with open(args.ours_json) as f:
                j = json.load(f)
            for r in j["verify"]:
                ours[int(r["rows"])] = r["no_head"]["median_us"] / 40.0
            print(f"ours: {args.ours_json}: no-head verify step / 40 layers at context "
                  f"{j.get('context')}")
        except Exception as e:  # noqa: BLE001
            print(f"torch_layer_bench: cannot read --ours-json {args.ours_json}: {e}")

    results = []
    for T in [int(t) for t in args.rows.split(",")]:
        X0 = torch.randn(T, HC, D, generator=g, device=dev) * 0.1
        pre0 = torch.full((T, HC), 0.25, device=dev)
        win_idx = ((torch.arange(WIN, device=dev)[None, :] + torch.arange(T, device=dev)[:, None])
                   % (WIN + 8))
        top_idx = torch.randint(0, args.context, (T, KTOP), generator=g, device=dev)
        slots = torch.arange(T, device=dev) % (WIN + 8)
        ang = (pos + torch.arange(T, device=dev, dtype=torch.float32))[:, None] * inv[None, :]

        def run():
            X, p = X0, pre0
            for L in layers:
                X, p = layer(L, X, p, T, win_idx, top_idx, slots, ang)
            return X

        def time_it(fn):
            for _ in range(args.warmup):
                fn()
            ts = []
            if not on_gpu:
                import time
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    fn()
                    ts.append((time.perf_counter() - t0) * 1e6 / args.layers)
                ts.sort()
                return ts[len(ts) // 2]
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            for _ in range(args.iters):
                st.record()
                fn()
                en.record()
                en.synchronize()
                ts.append(st.elapsed_time(en) * 1e3 / args.layers)
            ts.sort()
            return ts[len(ts) // 2]

        with torch.no_grad():
            eager = time_it(run)
            graph_us, graph_err = None, None
            if on_gpu and not args.no_graphs:
                try:
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        for _ in range(3):
                            run()
                    torch.cuda.current_stream().wait_stream(s)
                    cg = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(cg):
                        run()
                    graph_us = time_it(cg.replay)
                except Exception as e:  # noqa: BLE001
                    graph_err = str(e).splitlines()[0] if str(e) else type(e).__name__
        best = graph_us if graph_us is not None else eager
        o = ours.get(T)
        ratio = (o / best) if o else None
        print(f"rows {T}: torch layer {best:.1f} us ({'CUDA graph' if graph_us else 'eager'}; "
              f"eager {eager:.1f} us){'' if graph_err is None else f' [graph failed: {graph_err}]'}"
              + (f"; ours {o:.1f} us per layer; ours / torch = {ratio:.2f}" if o else
                 "; ours: n/a (no --ours-json)"))
        rec = {"bench": "torch_layer", "rows": T, "context": args.context,
               "torch_graph_us": graph_us, "torch_eager_us": eager, "graph_error": graph_err,
               "ours_layer_us": o, "ratio_ours_over_torch": ratio, "hf": hf,
               "torch": torch.__version__}
        print(json.dumps(rec))
        results.append(rec)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
