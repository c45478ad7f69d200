"""Print plan.stats() for every builder mask at S=131072, cp=8, for the default solver beside
contiguous and zigzag, and save the table as JSON.

    python tools/plan_report.py [--seqlen 131072] [--cp 8] [--json out/plan_report.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

import megatron_cp as mcp
from megatron_cp import masks as M


def doc_lengths(total: int, seed: int = 0, mean: int = 4096) -> np.ndarray:
    """A realistic packed-document mix: log-normal lengths (many short, a few long), summing to total."""
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < total:
        lens.append(int(np.clip(rng.lognormal(np.log(mean) - 0.5, 1.0), 16, total)))
    lens[-1] -= sum(lens) - total
    return np.array([x for x in lens if x > 0])


def builder_masks(s: int) -> dict:
    cu = np.concatenate([[0], np.cumsum(doc_lengths(s))])
    rng = np.random.default_rng(1)
    nb = 16
    table = np.tril(rng.choice([0, 1], size=(nb, nb), p=[0.5, 0.5]), -1) + 2 * np.eye(nb, dtype=int)
    doc_id = np.searchsorted(cu, np.arange(s), side="right")
    import torch

    doc = torch.from_numpy(doc_id)

    def doc_causal(b, h, q, kv):
        return (doc[q] == doc[kv]) & (kv <= q)

    return {
        "full": M.full(s),
        "causal": M.causal(s),
        "sliding_window(1024)": M.sliding_window(s, 1024, 0),
        f"varlen({len(cu) - 1} docs)": M.varlen(cu, causal=True),
        "block_causal(2048)": M.block_causal(s, 2048),
        "prefix_lm(S/4)": M.prefix_lm(s, s // 4),
        "strided(512,4)": M.strided(s, 512, 4),
        "global_local(512,1,2)": M.global_local(s, 512, 1, 2),
        "star(4096)": M.star(s, 4096),
        "streaming(64,4096)": M.streaming(s, 64, 4096),
        "block_table(16x16)": M.from_block_table(table, s // nb),
        "mask_mod(doc causal)": M.from_mask_mod(doc_causal, s, s, block=1024),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    masks = builder_masks(args.seqlen)
    print(f"built {len(masks)} masks in {time.perf_counter() - t0:.1f}s; S={args.seqlen}, cp={args.cp}")
    hdr = (f"{'mask':24s} {'solver':10s} {'chosen':17s} {'imbal':>7s} {'max remote KV':>13s} {'MB moved':>9s} "
           f"{'guests':>6s} {'tiles':>6s} {'plan s':>7s}")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    worst = 0.0
    for name, mask in masks.items():
        for solver in ("auto", "contiguous", "zigzag"):
            t = time.perf_counter()
            p = mcp.plan(mask, args.cp, solver=solver)
            dt = time.perf_counter() - t
            st = p.stats(num_kv_heads=8, head_dim=128, dtype_bytes=2)
            rows.append({"mask": name, "solver": solver, "plan_seconds": dt, **st})
            if solver == "auto":
                worst = max(worst, st["imbalance"])
            chosen = p.solver + ("+guests" if p.has_guests else "")
            print(
                f"{name:24s} {solver:10s} {chosen:17s} {100 * st['imbalance']:6.2f}% {st['max_remote_kv_tokens']:13d} "
                f"{st['bytes_moved'] / 2**20:9.1f} {st['guest_rows']:6d} {max(st['tiles_per_rank']):6d} {dt:7.2f}"
            )
    print(f"\nworst imbalance of the default solver: {100 * worst:.2f}% (target <= 5%)")
    print("bytes: K and V of every received token, Hkv=8, D=128, bf16; guests: query rows computed by their keys'\n"
          "owners (planner.guests: q and partial outputs travel instead of K/V, not in MB moved)")
    if args.json:
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python"] + sys.argv),
            "machine": platform.processor() or platform.machine(),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
