"""Benchmark: head-gated attention after discretisation (DuoAttention / PruLong deployment), one GPU.

A share (--sparsity) of the KV heads streams (64 sink keys of each document + 256 recent, inside the mask), the
rest attend fully (megatron_cp.gating.attention.pattern_attention), against all heads full on the same mask
(causal or packed documents); bf16, Hq 32, Hkv 8, D 128; Timer.medians. Quality is the recipe's business
(examples/tiny_llama/train_gates.py). Writes OUT/bench_heads.json ({meta, rows}), OUT/bench_heads.png, a table.

    python tools/bench_heads.py --seqlen 65536 --sparsity 0.5 0.75 --backend fa4 --out out/heads
    python tools/bench_heads.py --dry-run    # CPU, reference kernels: S 512, Hq = Hkv = 4, D 16, sink 4, window 32
"""

from __future__ import annotations

import os
import sys

import torch

import megatron_cp as mcp
from megatron_cp.gating.attention import pattern_attention, streaming_plans

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: common
from common import Timer, bar_panels, device_name, markdown_table, out_dir, parser, run_record, write_json  # noqa: E402


def main(argv=None) -> int:
    ap = parser(__doc__, os.path.join("out", "heads"), timing=(2, 5))
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.75], help="shares of streaming KV heads")
    ap.add_argument("--mask", choices=("causal", "packed"), default="causal")
    ap.add_argument("--backend", default="auto")
    a = ap.parse_args(argv)
    if not all(0 < sp < 1 for sp in a.sparsity):
        ap.error(f"--sparsity values must be in (0, 1), got {a.sparsity}")
    s, hq, hkv, d, sink, window = (512, 4, 4, 16, 4, 32) if a.dry_run else (a.seqlen, 32, 8, 128, 64, 256)
    if a.dry_run:
        a.backend, a.warmup, a.iters = "reference", 0, 1
    dev = torch.device("cpu" if a.dry_run else "cuda")
    dtype = torch.float32 if a.dry_run else torch.bfloat16
    mask = mcp.masks.causal(s) if a.mask == "causal" else mcp.masks.catalog.build("docs_causal", s)
    full, stream = streaming_plans(mask, 1, sink, window)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(s, h, d, device=dev, dtype=dtype, generator=g).requires_grad_() for h in (hq, hkv, hkv))
    timer = Timer(dev)
    rows = []
    for sp in [0.0] + list(a.sparsity):
        n_stream = int(round(sp * hkv))
        heads = [h >= n_stream for h in range(hkv)]  # the first n_stream KV heads stream
        f, b = timer.medians(lambda: pattern_attention(q, k, v, full, stream, None, heads, backend=a.backend)[0],
                             lambda out: out.backward(torch.ones_like(out)), a.warmup, a.iters)
        rows.append({"sparsity": n_stream / hkv, "streaming_kv_heads": n_stream, "fwd_ms": f, "bwd_ms": b})
    for r in rows:
        r.update(speedup_fwd=rows[0]["fwd_ms"] / r["fwd_ms"], speedup_bwd=rows[0]["bwd_ms"] / r["bwd_ms"],
                 ideal_speedup=1.0 / max(1e-9, 1.0 - r["sparsity"]))
    meta = run_record(device_name(dev), None if argv is None else " ".join(["python tools/bench_heads.py", *argv]),
                      seqlen=s, mask=a.mask, sink=sink, window=window, Hq=hq, Hkv=hkv, D=d,
                      dtype=str(dtype).removeprefix("torch."), backend=a.backend,
                      timing="GPU: CUDA events behind a held stream; CPU: wall clock; medians")
    write_json(os.path.join(out_dir(a), f"bench_heads{a.tag}.json"), {"meta": meta, "rows": rows})
    bar_panels(os.path.join(a.out, f"bench_heads{a.tag}.png"), [{
        "labels": [f"{r['streaming_kv_heads']} / {hkv} KV heads streaming" for r in rows], "hline": 1.0,
        "ylabel": "speedup vs all heads full",
        "series": {"forward": [r["speedup_fwd"] for r in rows], "backward": [r["speedup_bwd"] for r in rows],
                   "1 / full share": [r["ideal_speedup"] for r in rows]}}],
        f"{meta['device']} {meta['date']}: S={s} {a.mask}, sink {sink} window {window}")
    print("\n" + "\n".join(markdown_table(
        ["sparsity", "streaming KV heads", "fwd ms", "bwd ms", "speedup fwd / bwd", "ideal"],
        [[f"{r['sparsity']:.2f}", r["streaming_kv_heads"], f"{r['fwd_ms']:.2f}", f"{r['bwd_ms']:.2f}",
          f"{r['speedup_fwd']:.2f} / {r['speedup_bwd']:.2f}", f"{r['ideal_speedup']:.2f}"] for r in rows])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
