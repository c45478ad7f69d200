"""Benchmark: head-gated attention after discretisation (DuoAttention / PruLong deployment), one GPU.

A fraction ``sparsity`` of the KV heads runs streaming attention (``--sink`` first keys of each document
+ ``--window`` recent keys, inside the mask), the rest full attention, through
``megatron_cp.gating.attention.pattern_attention`` (one attention call per head kind), against every head
full (sparsity 0) on the same mask. Forward and backward GPU time (CUDA events behind a held stream,
tools/common.py), medians of --iters after --warmup; bf16, Hq 32, Hkv 8, D 128 by default; mask causal
or packed documents (``--mask``). The quality of a discretised model is the recipe's business
(examples/tiny_llama/train_gates.py); this tool measures what the saving is worth in time.

Output: one markdown table (the last lines of stdout), OUT/bench_heads.json (device, date, command,
rows) and OUT/bench_heads.png. ``--dry-run``: CPU, tiny sizes, reference kernels, wall time.

    python tools/bench_heads.py --seqlen 65536 --sparsity 0.5 0.75 --out out/heads
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import megatron_cp as mcp  # noqa: E402
from megatron_cp.gating.attention import pattern_attention, streaming_plans  # noqa: E402
from common import Timer, device_name, run_record  # noqa: E402


def _mask(kind: str, s: int):
    if kind == "causal":
        return mcp.masks.causal(s)
    return mcp.masks.catalog.build("docs_causal", s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--mask", choices=("causal", "packed"), default="causal")
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, S 512, Hq 4, Hkv 4, D 16, reference kernels")
    a = ap.parse_args(argv)
    for sp in a.sparsity:
        if not 0 < sp < 1:
            raise SystemExit(f"--sparsity values must be in (0, 1), got {sp}")
    if a.dry_run:
        a.seqlen, a.heads, a.kv_heads, a.head_dim, a.backend, a.sink, a.window = 512, 4, 4, 16, "reference", 4, 32
        a.warmup, a.iters = 1, 1
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.dry_run else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out_dir = pathlib.Path(a.out or (tempfile.mkdtemp() if a.dry_run else "out/heads"))
    out_dir.mkdir(parents=True, exist_ok=True)
    mask = _mask(a.mask, a.seqlen)
    full, stream = streaming_plans(mask, 1, a.sink, a.window)
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda h: torch.randn(a.seqlen, h, a.head_dim, device=dev, dtype=dtype, generator=g)  # noqa: E731
    q, k, v = (mk(h).requires_grad_() for h in (a.heads, a.kv_heads, a.kv_heads))
    timer = Timer(dev)
    rows = []
    for sp in [0.0] + list(a.sparsity):
        n_stream = int(round(sp * a.kv_heads))
        heads = [h >= n_stream for h in range(a.kv_heads)]  # the first n_stream KV heads stream
        fn = lambda heads=heads: pattern_attention(q, k, v, full, stream, None, heads, backend=a.backend)[0]  # noqa: E731
        f, b = timer.medians(fn, lambda out: out.backward(torch.ones_like(out)), a.warmup, a.iters)
        rows.append({"sparsity": n_stream / a.kv_heads, "streaming_kv_heads": n_stream, "fwd_ms": f, "bwd_ms": b})
    base = rows[0]
    for r in rows:
        r["speedup_fwd"] = base["fwd_ms"] / r["fwd_ms"]
        r["speedup_bwd"] = base["bwd_ms"] / r["bwd_ms"]
        # a streaming head's ideal cost is ~0: time scales with the full heads' share at best
        r["ideal_speedup"] = 1.0 / max(1e-9, 1.0 - r["sparsity"])
    meta = run_record(device_name(dev), "python " + " ".join([os.path.relpath(__file__)] + list(
        argv if argv is not None else sys.argv[1:])), **{"seqlen": a.seqlen, "mask": a.mask, "sink": a.sink, "window": a.window, "Hq": a.heads,
            "Hkv": a.kv_heads, "D": a.head_dim, "dtype": str(dtype).removeprefix("torch."), "backend": a.backend,
            "timing": "GPU: CUDA events behind a held stream; CPU: wall clock; medians"})
    (out_dir / "bench_heads.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [r["sparsity"] for r in rows]
        ax.plot(xs, [r["speedup_fwd"] for r in rows], "o-", label="forward")
        ax.plot(xs, [r["speedup_bwd"] for r in rows], "s-", label="backward")
        ax.plot(xs, [r["ideal_speedup"] for r in rows], "k:", label="1 / full share")
        ax.set_xlabel("streaming KV heads (sparsity)")
        ax.set_ylabel("speedup vs all heads full")
        ax.set_title(f"{meta['device']} {meta['date']}\nS={a.seqlen} {a.mask}, sink {a.sink} window {a.window}",
                     fontsize=8)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "bench_heads.png", dpi=120)
        plt.close(fig)
    except ImportError:
        print("matplotlib missing: no PNG (pip install megatron-cp[plot])", file=sys.stderr)
    print("\n| sparsity | streaming KV heads | fwd ms | bwd ms | speedup fwd / bwd | ideal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sparsity']:.2f} | {r['streaming_kv_heads']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | "
              f"{r['speedup_fwd']:.2f} / {r['speedup_bwd']:.2f} | {r['ideal_speedup']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
