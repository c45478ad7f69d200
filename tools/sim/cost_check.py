"""Research instrument (the cost model's check; not needed to use megatron-cp).

The cost model's kernel time (``CostModel.tile_time``, ``--cost``) against the kernel, call by call: every call
tools/bench_dist.py's implementations make on each benchmark mask (``--masks``) at S = 131072 (``--seqlen``)
planned for cp 4, with its own tile list and shapes: ``megatron-cp`` (rank r's tiles over its K/V buffer;
``megatron-cp-guest``, its guest rows' over its own keys), ``ring`` (step i of rank r against rank (r - i) % cp's
block, ``plan_for("ring")``'s layout, through ``forward_accumulate``), ``ulysses`` (the whole mask on Hq / cp
heads, K/V heads repeated as the baseline does) and ``allgather`` (rank r's rows against every key). Each call
forward and backward with the default backend on one GPU, back to back for 0.2 s after as long a warm-up, one
sync at the end (as a training step runs them).

    python tools/sim/cost_check.py --cost cost.json --out out
    python tools/sim/cost_check.py --cost cost.json --masks causal,packed --seqlen 32768 --out out --tag _32k
    python tools/sim/cost_check.py --dry-run                     # CPU: the causal mask, S = 1024, tiny heads

Writes OUT/cost_check<tag>.json (after every call) and ends with one table: per mask and implementation, the
calls' measured and predicted totals and the worst call.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

import megatron_cp as mcp
from megatron_cp import kernels
from megatron_cp.baselines import mask_tiles, plan_for, rank_tiles, ring_tiles
from megatron_cp.masks import catalog
from megatron_cp.planner import Workload
from megatron_cp.planner.layout import kv_head_repeat
from megatron_cp.runtime import CostModel
from megatron_cp.runtime.cost import tile_areas

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/sim: calibrate's kernel calls
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/common.py
from calibrate import kernel_calls  # noqa: E402
from common import Progress, Timer, device_name, markdown_table, out_dir, parser, run_record, write_json  # noqa: E402

CP, SECONDS = 4, 0.2


def calls(name: str, s: int, cp: int, work: Workload):
    """Every kernel call of the benchmark's implementations on mask ``name``: dicts with the call's impl,
    rank, step, tiles, sq, sk, heads, kv_heads (the K/V heads the kernel sees), head_dim."""
    mask = catalog.build(name, s)
    base = dict(mask=name, seqlen=s, cp=cp, heads=work.num_heads, kv_heads=work.num_kv_heads, head_dim=work.head_dim)
    out = []
    for r in mcp.plan(mask, cp).ranks:
        out.append(dict(base, impl="megatron-cp", rank=r.rank, step=0, tiles=r.tiles, sq=r.num_tokens,
                        sk=max(r.buffer_len, 1)))
        if len(r.guest_tiles) and sum(r.guest_recv_counts()):
            out.append(dict(base, impl="megatron-cp-guest", rank=r.rank, step=0, tiles=r.guest_tiles,
                            sq=sum(r.guest_recv_counts()), sk=r.num_tokens))
    plan = plan_for("ring", mask, cp)
    for r in range(cp):
        for i, t in enumerate(ring_tiles(plan, 1, r)):  # step i: rank r's rows x rank (r - i) % cp's keys
            out.append(dict(base, impl="ring", rank=r, step=i, tiles=t, sq=plan.num_local(r),
                            sk=plan.num_local((r - i) % cp), layout=plan.solver))
    if work.num_heads % cp == 0:
        f = kv_head_repeat(work.num_heads, work.num_kv_heads, cp)
        out.append(dict(base, impl="ulysses", rank=0, step=0, tiles=mask_tiles(plan_for("ulysses", mask, cp)),
                        sq=s, sk=s, heads=work.num_heads // cp, kv_heads=work.num_kv_heads * f // cp))
    plan = plan_for("allgather", mask, cp)
    out += [dict(base, impl="allgather", rank=r, step=0, tiles=rank_tiles(plan, r), sq=plan.num_local(r), sk=s)
            for r in range(cp)]
    return [c for c in out if len(c["tiles"])]


def summary_table(rows):
    """The closing table (lines): per mask and implementation, the number of calls, their summed measured
    and predicted ms (predicted / measured) per phase, and the call whose prediction is furthest off."""
    out = []
    for key in dict.fromkeys((r["mask"], r["impl"]) for r in rows):
        rs = [r for r in rows if (r["mask"], r["impl"]) == key]
        cells = []
        for ph in ("fwd", "bwd"):
            meas, pred = sum(r[f"{ph}_ms"] for r in rs), sum(r[f"{ph}_pred_ms"] for r in rs)
            worst = max(rs, key=lambda r: abs(np.log(r[f"{ph}_pred_ms"] / r[f"{ph}_ms"])))
            cells += [f"{meas:.3f} / {pred:.3f} ({pred / meas:.2f})",
                      f"{worst[f'{ph}_pred_ms'] / worst[f'{ph}_ms']:.2f} (rank {worst['rank']} step {worst['step']})"]
        out.append([*key, len(rs), *cells])
    return markdown_table(["mask", "impl", "calls", "fwd meas / pred ms (ratio)", "fwd worst call",
                           "bwd meas / pred ms (ratio)", "bwd worst call"], out)


def main(argv=None):
    ap = parser(__doc__, "out")
    ap.add_argument("--cost", default=None, help="CostModel JSON (tools/sim/calibrate.py); default CostModel()")
    ap.add_argument("--masks", default=None, help="comma list (default every benchmark mask; a dry run: causal)")
    ap.add_argument("--seqlen", type=int, default=None, help="default 131072 (a dry run: 1024)")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:  # tiny calls on CPU threads that other processes contend for take 10x longer
        torch.set_num_threads(1)
    masks, s, seconds, work = ("causal", 1024, 0.0, Workload(4, 2, 16)) if args.dry_run else \
        (",".join(catalog.DIST_MASKS), 131072, SECONDS, Workload())
    masks, s = (args.masks or masks).split(","), args.seqlen or s
    cost = CostModel.load(args.cost) if args.cost else CostModel()
    be, timer, rows = kernels.get_backend("auto", device), Timer(device), []
    path = os.path.join(out_dir(args), f"cost_check{args.tag}.json")
    jobs = [c for m in masks for c in calls(m, s, CP, work)]
    with Progress(len(jobs), "cost_check", verbose=args.verbose) as bar:
        for c in jobs:
            bar.running(f"{c['mask']} {c['impl']} rank {c['rank']} step {c['step']}")
            w = Workload(c["heads"], c["kv_heads"], c["head_dim"], 2)
            _, fwd, bwd = kernel_calls(be, c["tiles"], c["sq"], c["sk"], w, device, c["rank"] * 131 + c["step"],
                                       accumulate=c["impl"] == "ring")
            tf, tb = timer.sustained(fwd, 3, seconds), timer.sustained(bwd, 3, seconds)
            tiles = np.asarray(c["tiles"])
            rows.append({k: v for k, v in c.items() if k != "tiles"} | dict(
                n_tiles=len(tiles), area=float(tile_areas(tiles)[0].sum()), fwd_ms=tf * 1e3, bwd_ms=tb * 1e3,
                fwd_pred_ms=cost.tile_time(tiles, w) * 1e3, bwd_pred_ms=cost.tile_time(tiles, w, True) * 1e3))
            write_json(path, run_record(device_name(device), cost=cost.source, results=rows))
            r = rows[-1]
            bar.step(f"{r['mask']} {r['impl']} rank {r['rank']} step {r['step']}: {r['n_tiles']} tiles, fwd "
                     f"{r['fwd_ms']:.3f} / {r['fwd_pred_ms']:.3f} ms, bwd {r['bwd_ms']:.3f} / {r['bwd_pred_ms']:.3f}")
    print("wrote", path)
    print("\n".join(summary_table(sorted(rows, key=lambda r: (r["mask"], r["impl"], r["step"], r["rank"])))))


if __name__ == "__main__":
    main()
