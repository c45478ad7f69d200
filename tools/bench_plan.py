"""Time plan() for S = 1,048,576 tokens of packed documents (1,000 documents) at cp = 64 on one core.

    python tools/bench_plan.py [--seqlen 1048576] [--docs 1000] [--cp 64] [--repeat 5]

While it runs a progress bar on stderr counts the repeats (redrawn at most every 30 s where stderr is not
a terminal: tools/progress.py). Ends with one table on stdout: the wall time of the calls (mask building
separately; first, median, min) and the resulting balance and traffic.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import megatron_cp as mcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: the progress bar and table
from progress import Progress, markdown_table  # noqa: E402


def doc_cu_seqlens(total: int, docs: int, seed: int = 0) -> np.ndarray:
    """``docs`` log-normal document lengths (sigma 1: many short, a few long) summing to ``total``."""
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, 1.0, docs)
    lens = np.maximum(1, np.floor(w / w.sum() * total)).astype(np.int64)
    lens[np.argmax(lens)] += total - lens.sum()
    return np.concatenate([[0], np.cumsum(lens)])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=1 << 20)
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--cp", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one CPU core
    cu = doc_cu_seqlens(args.seqlen, args.docs)
    lens = np.diff(cu)
    print(f"S={args.seqlen} docs={args.docs} (len min {lens.min()} median {int(np.median(lens))} max {lens.max()}) cp={args.cp}, 1 core")
    times, mask_times = [], []
    bar = Progress(args.repeat, "plan()")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        mask = mcp.masks.varlen(cu, causal=True)
        _ = mask.traps  # normalisation is part of the mask's cost
        t1 = time.perf_counter()
        plan = mcp.plan(mask, args.cp)
        t2 = time.perf_counter()
        mask_times.append(t1 - t0)
        times.append(t2 - t1)
        bar.step()
    bar.close()
    st = plan.stats()
    print(f"candidates (imbalance, max remote, total remote): {plan.candidates}")
    print("\n".join(markdown_table(
        ["mask build ms (min)", "plan() s: first", "median", "min", "solver", "imbalance", "tokens/rank",
         "max remote KV tokens", "tiles/rank max"],
        [[f"{1e3 * min(mask_times):.1f}", f"{times[0]:.3f}", f"{statistics.median(times):.3f}", f"{min(times):.3f}",
          plan.solver, f"{100 * st['imbalance']:.2f}%", f"{min(st['tokens_per_rank'])}..{max(st['tokens_per_rank'])}",
          st["max_remote_kv_tokens"], max(st["tiles_per_rank"])]])))
    return 0 if statistics.median(times) < 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
