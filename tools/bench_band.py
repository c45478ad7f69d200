"""Kernel-only time of sliding-window tiles with and without band squares (TritonConfig.band_squares: a band's
chunks as a causal and an inverse-causal square on cuDNN), one GPU: rank 1's tiles of sliding_window at S 131072,
CP 4, or (--windows) one BI_CAUSAL band of S / CP rows per window. Triton at each --squares (0: none), bf16, Hq 32,
Hkv 8, D 128, Timer.sustained: forward (written; accumulated in float32 as the staged runtime does), backward;
paths, cuDNN calls, peak memory, max |diff| of out, dq, dk against the first setting. Writes OUT/bench_band.json.

    python tools/bench_band.py --out DIR
    python tools/bench_band.py --windows 1024 2048 4096 8192 --squares 0 1024 --out DIR
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

import megatron_cp as mcp
from megatron_cp.kernels import TritonBackend, TritonConfig, kept_area
from megatron_cp.masks import catalog

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: common
from common import Progress, Timer, device_name, markdown_table, out_dir, parser, run_record, write_json  # noqa: E402

SEQLEN, CP, RANK, MASK = 131072, 4, 1, "sliding_window"
HQ, HKV, D = 32, 8, 128


def main(argv=None):
    ap = parser(__doc__, os.path.join("out", "band"))
    ap.add_argument("--squares", type=int, nargs="+", default=[0, 2048, 4096], help="band_squares settings")
    ap.add_argument("--windows", type=int, nargs="*", default=[], help="bands of these windows, not rank 1's tiles")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per measurement (back to back)")
    args = ap.parse_args(argv)
    if args.dry_run:
        ap.error("no dry run: band squares run on cuDNN (GPU only)")
    dev = torch.device("cuda")
    timer = Timer(dev)
    if args.windows:
        n = SEQLEN // CP
        cases = [(f"band W={w}", np.array([[0, n, 0, n + w, 3]], dtype=np.int64), n, n + w) for w in args.windows]
    else:
        rp = mcp.plan(catalog.build(MASK, SEQLEN), CP).ranks[RANK]
        cases = [(f"{MASK} S={SEQLEN} cp{CP} rank {RANK}", rp.tiles, rp.num_tokens, rp.buffer_len)]
    path = os.path.join(out_dir(args), f"bench_band{args.tag}.json")
    rows, tiles_out = [], []
    bar = Progress(len(cases) * len(args.squares), "bench_band", verbose=args.verbose)
    for name, tiles_np, sq, sk in cases:
        tiles = torch.from_numpy(tiles_np.astype("int32"))
        tiles_out.append(dict(case=name, tiles=tiles_np.tolist(), seqlen_q=sq, seqlen_k=sk))
        fl = 4.0 * float(kept_area(tiles)) * HQ * D
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(n, h, D, device=dev, dtype=torch.bfloat16, generator=g) * 0.5
                   for n, h in ((sq, HQ), (sk, HKV), (sk, HKV)))
        do = torch.randn(sq, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
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
            ref = ref or (out.float(), dq.float(), dk.float())
            diff = max(float((a.float() - b).abs().max()) for a, b in zip((out, dq, dk), ref))
            tf = timer.sustained(lambda: be.forward(q, k, v, prep), args.iters, 0.5)
            acc = torch.zeros(q.shape, device=dev, dtype=torch.float32)  # the staged runtime's running pair
            acc_lse = torch.full(q.shape[:2], float("-inf"), device=dev)
            ta = timer.sustained(lambda: be.forward_accumulate(q, k, v, prep, None, acc, acc_lse), args.iters, 0.5)
            tbw = timer.sustained(lambda: be.backward(q, k, v, out, lse, do, prep, None, delta), args.iters, 0.5)
            mem = torch.cuda.max_memory_allocated() / 2**30  # (sustained ends with a sync)
            torch.cuda.reset_peak_memory_stats()
            n_fwd, n_bwd = (0 if x is None else len(x.pieces) for x in (prep.cudnn_fwd, prep.cudnn_bwd))
            rows.append(dict(case=name, band_squares=sqr, fwd_ms=tf * 1e3, fwd_accumulate_ms=ta * 1e3,
                             bwd_ms=tbw * 1e3, fwd_tflops=fl / tf / 1e12, bwd_tflops=2.5 * fl / tbw / 1e12,
                             paths=[path_f, path_b], max_abs_diff_vs_first=diff, fwd_cudnn_calls=n_fwd,
                             bwd_cudnn_calls=n_bwd, peak_mem_gib=mem,
                             cudnn={str(tuple(map(str, key))): f.layout or f.reason
                                    for key, f in be.cudnn_probes.items()}))
            write_json(path, run_record(device_name(), cases=tiles_out, rows=rows))  # after every row
            bar.step(f"{name} band_squares {sqr:5d}: fwd {tf * 1e3:.2f} ms (accumulating {ta * 1e3:.2f}), bwd "
                     f"{tbw * 1e3:.2f} ms {path_f}/{path_b} cuDNN calls {n_fwd}/{n_bwd} |diff| {diff:.3g} {mem:.1f}G")
        torch.cuda.empty_cache()
    bar.close()
    print("wrote", path)
    print("\n".join(markdown_table(
        ["case", "band squares", "fwd ms", "fwd TF/s", "fwd accumulating ms", "bwd ms", "bwd TF/s", "paths fwd/bwd",
         "cuDNN calls fwd/bwd", "max |diff|", "peak GiB"],
        [[r["case"], r["band_squares"], f"{r['fwd_ms']:.2f}", f"{r['fwd_tflops']:.0f}", f"{r['fwd_accumulate_ms']:.2f}",
          f"{r['bwd_ms']:.2f}", f"{r['bwd_tflops']:.0f}", "/".join(map(str, r["paths"])),
          f"{r['fwd_cudnn_calls']}/{r['bwd_cudnn_calls']}", f"{r['max_abs_diff_vs_first']:.3g}",
          f"{r['peak_mem_gib']:.1f}"] for r in rows])))


if __name__ == "__main__":
    main()
