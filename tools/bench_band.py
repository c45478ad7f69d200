"""Kernel-only time of one rank's sliding-window tiles by band chunk (kernels/dense_tiles.py), one GPU.

The benchmark's sliding window (tools/_cp_masks.py) at ``--seqlen`` planned for ``--cp`` ranks; rank
``--rank``'s tile list and K/V buffer run through the Triton backend with ``TritonConfig.band_chunk`` =
each of ``--chunks`` (0: the band stays on Triton), forward and backward (delta given, as the runtime
does). bf16, Hq 32, Hkv 8, D 128. Times: sustained (0.5 s warm-up, then ``--iters`` calls, CUDA sync).

    python tools/bench_band.py --out DIR          # writes DIR/bench_band.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatron_cp as mcp  # noqa: E402
from megatron_cp.kernels import triton_backend as tb  # noqa: E402
from megatron_cp.planner.cost import tile_areas  # noqa: E402

import _cp_masks  # noqa: E402


def _time(fn, iters, warm_s):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--mask", default="sliding_window")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 512, 1024])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup-s", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    plan = mcp.plan(_cp_masks.build(args.mask, args.seqlen), args.cp)
    rp = plan.ranks[args.rank]
    tiles = torch.from_numpy(rp.tiles.astype("int32"))
    sq, sk = rp.num_tokens, rp.buffer_len
    area = float(tile_areas(rp.tiles)[0].sum())
    hq, hkv, d = 32, 8, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(sq, hq, d, device=dev, dtype=torch.bfloat16, generator=g) * 0.5
    k = torch.randn(sk, hkv, d, device=dev, dtype=torch.bfloat16, generator=g) * 0.5
    v = torch.randn(sk, hkv, d, device=dev, dtype=torch.bfloat16, generator=g) * 0.5
    do = torch.randn(sq, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    fl = 4.0 * area * hq * d
    rows, ref = [], None
    for c in args.chunks:
        be = tb.TritonBackend(tb.TritonConfig(band_chunk=c))
        prep = be.prepare(tiles, sq, sk)
        out, lse = be.forward(q, k, v, prep)
        path_f = be.last_path
        delta = (do.float() * out.float()).sum(-1)
        dq, dk, dv = be.backward(q, k, v, out, lse, do, prep, None, delta)
        path_b = be.last_path
        if ref is None:
            ref = (out.float(), dq.float(), dk.float())
        diff = max(float((a.float() - b).abs().max()) for a, b in zip((out, dq, dk), ref))
        tf = _time(lambda: be.forward(q, k, v, prep), args.iters, args.warmup_s)
        tbw = _time(lambda: be.backward(q, k, v, out, lse, do, prep, None, delta), args.iters, args.warmup_s)
        torch.cuda.synchronize()
        mem = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        r = dict(band_chunk=c, fwd_ms=tf * 1e3, bwd_ms=tbw * 1e3, fwd_tflops=fl / tf / 1e12,
                 bwd_tflops=2.5 * fl / tbw / 1e12, paths=[path_f, path_b], max_abs_diff_vs_first=diff,
                 dense_calls=len(prep.dense_plan), peak_mem_gib=mem)
        rows.append(r)
        print(f"{args.mask} S={args.seqlen} cp{args.cp} rank {args.rank} band_chunk {c:5d}: fwd {r['fwd_ms']:.2f} ms "
              f"{r['fwd_tflops']:.0f} TF/s, bwd {r['bwd_ms']:.2f} ms {r['bwd_tflops']:.0f} TF/s  {path_f}/{path_b} "
              f"calls {len(prep.dense_plan)}  |diff| {diff:.3g}  peak {mem:.1f} GiB", flush=True)
    res = dict(device=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               torch=torch.__version__, command=" ".join(sys.argv), tiles=rp.tiles.tolist(), seqlen_q=sq,
               seqlen_k=sk, rows=rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_band.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
