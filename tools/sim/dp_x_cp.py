"""Research instrument: one plan over the DP x CP world against the fixed layout, at 64-1024 GPUs, predicted.

For every world size W (``--worlds``; ``--cp`` ranks per DP group, ``--gpus-per-node`` per node) the DP groups get
a micro-batch each of ``--tokens-per-gpu`` x cp tokens, packed causal documents drawn log-normal (``--docs
MEDIAN,LO,HI,SIGMA``; every group its own draw, one seed). Compared, attention forward + backward of one layer
as tools/sim/simulate.py predicts it (the same planner and cost model, hierarchical routes across nodes):

- ``fixed``: each DP group's micro-batch planned over its own CP ranks; the step waits for the slowest group;
- ``global``: the DP groups' masks side by side (``masks.block_diagonal``) planned over all W ranks, what
  ``--cp-balance-over-dp`` runs.

Printed per W: both predicted times, their ratio, the attention work imbalance over all W ranks of each
(area, the planner's measure), K/V bytes received by the busiest GPU, and the global plan's planning time on
this CPU (one core), which the planning thread must hide behind a step. Equal tokens per rank in both layouts,
so the linear layers' time is the same and not counted. ``--step-s S`` also runs the planning as training does:
``--ahead-batches`` fresh global batches planned by ``megatron.PlanAhead`` (plans from ``runtime.plan_in_helper``)
beside a loop that takes S seconds a micro-batch, once with one plan at a time and once as PlanAhead grows
(``--max-workers``): the step's wait per micro-batch over the second half of the batches, each way.

    python tools/sim/dp_x_cp.py                                   # W 64..1024, CP 8, 4096 tokens/GPU
    python tools/sim/dp_x_cp.py --worlds 16 --cp 4 --tokens-per-gpu 1024 --json out.json
    python tools/sim/dp_x_cp.py --worlds 256,1024 --step-s 0.25   # do the plans keep ahead of the step?
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import megatron_cp as mcp
from megatron_cp.planner import Workload
from megatron_cp.runtime import CostModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import Progress, markdown_table  # noqa: E402
from simulate import ours  # noqa: E402


def micro_batch(n: int, median: int, lo: int, hi: int, sigma: float, rng) -> mcp.AttnMask:
    """Causal documents of log-normal lengths filling ``n`` tokens (the last one cut to fit)."""
    lens, total = [], 0
    while total < n:
        d = min(int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi)), n - total)
        lens.append(d)
        total += d
    return mcp.masks.varlen(np.concatenate([[0], np.cumsum(lens)]).tolist(), causal=True)


def imbalance(plan) -> float:
    """Attention work (mask area) of the busiest rank over the mean, minus 1."""
    a = np.array([r.area for r in plan.ranks], dtype=np.float64)
    return float(a.max() / a.mean() - 1)


def compare(world: int, cp: int, tpg: int, docs, g: int, cost: CostModel, work: Workload, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    masks = [micro_batch(tpg * cp, *docs, rng) for _ in range(world // cp)]
    fixed = [ours(m, cp, g, cost, work) for m in masks]
    areas = [float(r.area) for m in masks for r in mcp.plan(m, cp).ranks]
    glob_mask = mcp.masks.block_diagonal(masks)
    t = time.perf_counter()
    topo = mcp.Topology(max(1, world // g), min(g, world), intra_node_gbps=cost.intra_gbps,
                        inter_node_gbps=cost.inter_gbps)  # as simulate.ours plans
    plan = mcp.plan(glob_mask, world, topology=topo, solver="hierarchical" if world > g else "auto")
    plan_s = time.perf_counter() - t
    glob = ours(glob_mask, world, g, cost, work, plan=plan)
    t_fixed = max(f["fwd_s"] + f["bwd_s"] for f in fixed)
    t_glob = glob["fwd_s"] + glob["bwd_s"]
    return dict(world=world, cp=cp, dp=world // cp, tokens=tpg * world, fixed_ms=1e3 * t_fixed, global_ms=1e3 * t_glob,
                speedup=t_fixed / t_glob, fixed_imbalance=float(max(areas) / np.mean(areas) - 1),
                global_imbalance=imbalance(plan), global_solver=plan.solver, plan_s=plan_s,
                fixed_kv_bytes=max(max(f["inter_node_bytes_per_gpu"], f["intra_node_bytes_per_gpu"]) for f in fixed),
                global_kv_bytes=max(glob["inter_node_bytes_per_gpu"], glob["intra_node_bytes_per_gpu"]))


def ahead(world: int, cp: int, tpg: int, docs, g: int, seed: int, step_s: float, n: int, workers: int) -> dict:
    """Waits of a loop taking ``step_s`` a micro-batch for ``n`` global plans made ahead (PlanAhead, helper
    processes): one at a time, and up to ``workers`` at once."""
    from megatron_cp.megatron import PlanAhead

    rng = np.random.default_rng(seed + 1)
    batches = [mcp.masks.block_diagonal([micro_batch(tpg * cp, *docs, rng) for _ in range(world // cp)])
               for _ in range(n)]
    topo = mcp.Topology(max(1, world // g), min(g, world))
    solver = "hierarchical" if world > g else "auto"

    def make(m):
        return mcp.runtime.plan_in_helper(m, world, topology=topo, solver=solver)
    with ThreadPoolExecutor(workers) as pool:  # the helper processes started (and warm) before the timing
        list(pool.map(make, batches[:workers]))
    out = {}
    for name, cap in (("one", 1), ("several", workers)):
        it = PlanAhead(iter(batches), make, depth=2, max_workers=cap)
        for _ in it:
            time.sleep(step_s)
        out[f"wait_{name}_s"] = float(np.mean(it.waits[n // 2:]))
        out[f"plan_{name}_s"] = float(np.mean(it.plan_times))
        out[f"workers_{name}"] = it.workers
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="64,128,256,512,1024", help="comma list of GPU counts (multiples of --cp)")
    ap.add_argument("--cp", type=int, default=8, help="CP ranks per DP group in the fixed layout (default 8)")
    ap.add_argument("--tokens-per-gpu", type=int, default=4096)
    ap.add_argument("--docs", default="1024,128,32768,1.0", help="MEDIAN,LO,HI,SIGMA of the documents' lengths")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--inter-gbps", type=float, default=50.0, help="GB/s per GPU between nodes (400 Gb/s = 50)")
    ap.add_argument("--cost", default=None, help="CostModel JSON from tools/sim/calibrate.py")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--step-s", type=float, default=None, help="also plan ahead beside a step of this many seconds")
    ap.add_argument("--ahead-batches", type=int, default=16, help="global batches planned ahead (--step-s)")
    ap.add_argument("--max-workers", type=int, default=8, help="plans at once at most (--step-s)")
    a = ap.parse_args(argv)
    worlds = [int(x) for x in a.worlds.split(",")]
    try:
        median, lo, hi = (int(x) for x in a.docs.split(",")[:3])
        sigma = float(a.docs.split(",")[3])
    except (ValueError, IndexError):
        ap.error(f"--docs {a.docs!r}: MEDIAN,LO,HI,SIGMA")
    if a.cp < 1 or any(w < a.cp or w % a.cp for w in worlds) or not 1 <= lo <= median <= hi or sigma <= 0:
        ap.error(f"--worlds must be multiples of --cp {a.cp}, and --docs LO <= MEDIAN <= HI, SIGMA > 0")
    cost = CostModel.load(a.cost) if a.cost else CostModel()
    # GPU time (the host ahead, as in training), the NIC figure asked for
    cost = CostModel(**{**cost.__dict__, "inter_gbps": a.inter_gbps, "call_fwd_us": 0.0, "call_bwd_us": 0.0})
    work = Workload(32, 8, 128, 2)
    rows = []
    with Progress(len(worlds), "dp x cp") as bar:
        for w in worlds:
            bar.running(f"W={w}")
            rows.append(compare(w, a.cp, a.tokens_per_gpu, (median, lo, hi, sigma), a.gpus_per_node, cost, work,
                                a.seed))
            if a.step_s is not None:
                rows[-1].update(ahead(w, a.cp, a.tokens_per_gpu, (median, lo, hi, sigma), a.gpus_per_node, a.seed,
                                      a.step_s, a.ahead_batches, a.max_workers))
            bar.step()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "cost_model": cost.__dict__, "rows": rows}, f, indent=1)
    print(f"attention fwd + bwd of one layer, predicted GPU time; CP {a.cp} per DP group, {a.tokens_per_gpu} "
          f"tokens/GPU, documents log-normal median {median} in [{lo}, {hi}] sigma {sigma}; {a.gpus_per_node} "
          f"GPUs/node, {a.inter_gbps} GB/s/GPU between nodes; cost model: {cost.source}")
    print("\n".join(markdown_table(
        ["GPUs", "DP x CP", "fixed ms", "global ms", "global speed-up", "imbalance fixed / global",
         "K/V MB to the busiest GPU fixed / global", "global plan s"],
        [[r["world"], f"{r['dp']} x {r['cp']}", f"{r['fixed_ms']:.2f}", f"{r['global_ms']:.2f}", f"{r['speedup']:.2f}",
          f"{r['fixed_imbalance']:.3f} / {r['global_imbalance']:.3f}",
          f"{r['fixed_kv_bytes'] / 2**20:.1f} / {r['global_kv_bytes'] / 2**20:.1f}", f"{r['plan_s']:.2f}"]
         for r in rows])))
    if a.step_s is not None:
        print(f"\nplanned ahead beside a step of {a.step_s} s a micro-batch ({a.ahead_batches} global batches, plans "
              f"from helper processes; {os.cpu_count()} CPU cores here): the step's wait per micro-batch over the "
              "second half")
        print("\n".join(markdown_table(
            ["GPUs", "plan s, one at a time", "waited s, one at a time", "plans at once", "plan s, at once",
             "waited s, at once"],
            [[r["world"], f"{r['plan_one_s']:.2f}", f"{r['wait_one_s']:.3f}", r["workers_several"],
              f"{r['plan_several_s']:.2f}", f"{r['wait_several_s']:.3f}"] for r in rows])))
    return rows


if __name__ == "__main__":
    main()
