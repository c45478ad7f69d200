"""Kernel-only time of one rank's sliding-window tiles with and without band squares (kernels/pieces.py), one GPU.

The benchmark's sliding window (megatron_cp.masks.catalog) at ``--seqlen`` planned for ``--cp`` ranks: rank
``--rank``'s tile list and K/V buffer; with ``--windows``, instead one band per window (``seqlen / cp``
rows, each keeping ``W + 1`` keys: one BI_CAUSAL tile, as the planner emits). Each runs through the Triton
backend with every setting of ``--squares`` (``TritonConfig.band_squares``; 0 keeps the band on Triton).
Forward (written, and accumulated into a float32 running pair as the staged runtime does) and backward
(delta given, as the runtime does; bands stay on Triton there). bf16, Hq 32, Hkv 8, D 128. Times: sustained (0.5 s
warm-up, then ``--iters`` calls, CUDA sync); ``max_abs_diff_vs_first``: against the case's first setting.

    python tools/bench_band.py --out DIR          # writes DIR/bench_band.json
    python tools/bench_band.py --windows 1024 2048 4096 8192 --squares 0 1024 --out DIR

While it runs a progress bar on stderr names the case and band-square setting being timed (redrawn at most
every 30 s where stderr is not a terminal: tools/common.py); each row's line goes to stderr with
--verbose. Ends with one table on stdout, a row per case and setting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

import megatron_cp as mcp
from megatron_cp.kernels import TritonBackend, TritonConfig, kept_area
from megatron_cp.masks import catalog

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: the progress bar and table
from common import Progress, Timer, device_name, markdown_table, run_record  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--mask", default="sliding_window")
    ap.add_argument("--squares", type=int, nargs="+", default=[0, 2048, 4096])
    ap.add_argument("--windows", type=int, nargs="*", default=[])
    ap.add_argument("--profile", action="store_true", help="print a kernel table of one forward per band-square setting")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup-s", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--verbose", action="store_true", help="each row's line on stderr as it finishes")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    timer = Timer(dev)  # calls back to back after a sustained warm-up of --warmup-s
    if args.windows:
        rows_n = args.seqlen // args.cp
        cases = [(f"band W={w}", np.array([[0, rows_n, 0, rows_n + w, 3]], dtype=np.int64), rows_n, rows_n + w)
                 for w in args.windows]
    else:
        plan = mcp.plan(catalog.build(args.mask, args.seqlen), args.cp)
        rp = plan.ranks[args.rank]
        cases = [(f"{args.mask} S={args.seqlen} cp{args.cp} rank {args.rank}", rp.tiles, rp.num_tokens, rp.buffer_len)]
    hq, hkv, d = 32, 8, 128
    rows, tiles_out = [], []
    bar = Progress(len(cases) * len(args.squares), "bench_band", verbose=args.verbose)
    for name, tiles_np, sq, sk in cases:
        tiles = torch.from_numpy(tiles_np.astype("int32"))
        tiles_out.append(dict(case=name, tiles=tiles_np.tolist(), seqlen_q=sq, seqlen_k=sk))
        area = float(kept_area(tiles))
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(sq, hq, d, device=dev, dtype=torch.bfloat16, generator=g) * 0.5
        k = torch.randn(sk, hkv, d, device=dev, dtype=torch.bfloat16, generator=g) * 0.5
        v = torch.randn(sk, hkv, d, device=dev, dtype=torch.bfloat16, generator=g) * 0.5
        do = torch.randn(sq, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
        fl = 4.0 * area * hq * d
        ref = None
        for sqr in args.squares:
            bar.running(f"{name} band_squares {sqr}")
            be = TritonBackend(TritonConfig(band_squares=sqr))
            prep = be.prepare(tiles, sq, sk)
            out, lse = be.forward(q, k, v, prep)
            path_f = be.last_path
            delta = (do.float() * out.float()).sum(-1)
            dq, dk, dv = be.backward(q, k, v, out, lse, do, prep, None, delta)
            path_b = be.last_path
            if ref is None:
                ref = (out.float(), dq.float(), dk.float())
            diff = max(float((a.float() - b).abs().max()) for a, b in zip((out, dq, dk), ref))
            tf = timer.sustained(lambda: be.forward(q, k, v, prep), args.iters, args.warmup_s)
            # as the staged runtime calls it: accumulated into a float32 running pair
            acc = torch.zeros(q.shape, device=dev, dtype=torch.float32)
            acc_lse = torch.full(q.shape[:2], float("-inf"), device=dev)
            ta = timer.sustained(lambda: be.forward_accumulate(q, k, v, prep, None, acc, acc_lse), args.iters, args.warmup_s)
            if args.profile and sqr:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    be.forward(q, k, v, prep)
                    torch.cuda.synchronize()
                bar.note(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14), file=sys.stdout)
            tbw = timer.sustained(lambda: be.backward(q, k, v, out, lse, do, prep, None, delta), args.iters, args.warmup_s)
            torch.cuda.synchronize()
            mem = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
            n_fwd, n_bwd = (0 if x is None else len(x.pieces) for x in (prep.cudnn_fwd, prep.cudnn_bwd))
            cudnn_found = {str(tuple(map(str, key))): f.layout or f.reason for key, f in be.cudnn_probes.items()}
            r = dict(case=name, band_squares=sqr, fwd_ms=tf * 1e3, fwd_accumulate_ms=ta * 1e3, bwd_ms=tbw * 1e3,
                     fwd_tflops=fl / tf / 1e12, bwd_tflops=2.5 * fl / tbw / 1e12, paths=[path_f, path_b],
                     max_abs_diff_vs_first=diff, fwd_cudnn_calls=n_fwd, bwd_cudnn_calls=n_bwd,
                     peak_mem_gib=mem, cudnn=cudnn_found)
            rows.append(r)
            bar.step(f"{name} band_squares {sqr:5d}: fwd {r['fwd_ms']:.2f} ms {r['fwd_tflops']:.0f} TF/s "
                  f"(accumulating {r['fwd_accumulate_ms']:.2f}), "
                  f"bwd {r['bwd_ms']:.2f} ms {r['bwd_tflops']:.0f} TF/s  {path_f}/{path_b} cuDNN calls "
                  f"{n_fwd}/{n_bwd}  |diff| {diff:.3g}  peak {mem:.1f} GiB")
        torch.cuda.empty_cache()
    bar.close()
    res = run_record(device_name(), cases=tiles_out, rows=rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_band.json"), "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", os.path.join(args.out, "bench_band.json"))
    print("\n".join(summary_table(rows)))


def summary_table(rows):
    """The closing table (lines): per case and band-square setting, times, TFLOP/s, paths, cuDNN calls,
    the difference to the case's first setting and peak memory."""
    return markdown_table(
        ["case", "band squares", "fwd ms", "fwd TF/s", "fwd accumulating ms", "bwd ms", "bwd TF/s", "paths fwd/bwd",
         "cuDNN calls fwd/bwd", "max |diff|", "peak GiB"],
        [[r["case"], r["band_squares"], f"{r['fwd_ms']:.2f}", f"{r['fwd_tflops']:.0f}", f"{r['fwd_accumulate_ms']:.2f}",
          f"{r['bwd_ms']:.2f}", f"{r['bwd_tflops']:.0f}", "/".join(map(str, r["paths"])),
          f"{r['fwd_cudnn_calls']}/{r['bwd_cudnn_calls']}", f"{r['max_abs_diff_vs_first']:.3g}",
          f"{r['peak_mem_gib']:.1f}"] for r in rows])


if __name__ == "__main__":
    main()
