"""Research instrument: one plan over the DP x CP world against the fixed layout, at 64-1024 GPUs, predicted.

For each world size W (``--worlds``; ``--cp`` ranks per DP group, 8 GPUs per node) every DP group gets a
micro-batch of ``--tokens-per-gpu`` x cp tokens, causal documents of log-normal lengths (``--docs``). Attention
forward + backward of one layer as tools/sim/simulate.py predicts it (GPU time, the default cost model):
``fixed``, each group's micro-batch planned over its own CP ranks (the step waits for the slowest group), and
``global``, the groups' masks side by side planned over all W ranks (what ``--cp-balance-over-dp`` runs); their
times, work imbalance over all W ranks, K/V bytes to the busiest GPU and the global plan's planning time here
(one core). Equal tokens per rank in both: the linear layers' time is the same and not counted. ``--step-s S``
also plans as training does: ``--ahead-batches`` global batches planned by ``megatron.PlanAhead`` (plans from
``runtime.plan_in_helper``) beside a loop of S seconds a micro-batch, one plan at a time and up to
``--max-workers`` at once: the step's wait per micro-batch.

    python tools/sim/dp_x_cp.py                                   # W 64..1024, CP 8, 4096 tokens/GPU
    python tools/sim/dp_x_cp.py --worlds 256,1024 --step-s 0.25   # do the plans keep ahead of the step?
    python tools/sim/dp_x_cp.py --dry-run                         # W 16, CP 4, 256 tokens/GPU

Writes OUT/dp_x_cp<tag>.json and ends with the table (with --step-s, a second one).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import megatron_cp as mcp
from megatron_cp.planner import Workload
from megatron_cp.runtime import CostModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/sim: simulate's model
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/common.py
from common import Progress, markdown_table, out_dir, parser, run_record, write_json  # noqa: E402
from simulate import GPUS_PER_NODE as G, INTER_GBPS, ours  # noqa: E402


def micro_batch(n: int, median: int, lo: int, hi: int, sigma: float, rng) -> mcp.AttnMask:
    """Causal documents of log-normal lengths filling ``n`` tokens (the last one cut to fit)."""
    lens = []
    while sum(lens) < n:
        lens.append(min(int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi)), n - sum(lens)))
    return mcp.masks.varlen(np.concatenate([[0], np.cumsum(lens)]).tolist(), causal=True)


def _plan_args(world, cost=None) -> dict:
    """mcp.plan's topology and solver over all ``world`` ranks, as simulate.ours plans (``cost``: its links)."""
    gbps = {} if cost is None else dict(intra_node_gbps=cost.links.intra_gbps, inter_node_gbps=cost.links.inter_gbps)
    return dict(topology=mcp.Topology(max(1, world // G), min(G, world), **gbps),
                solver="hierarchical" if world > G else "auto")


def compare(world: int, cp: int, tpg: int, docs, cost: CostModel, work: Workload, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    masks = [micro_batch(tpg * cp, *docs, rng) for _ in range(world // cp)]
    fixed = [ours(m, cp, G, cost, work) for m in masks]
    areas = np.array([r.area for m in masks for r in mcp.plan(m, cp).ranks], dtype=np.float64)
    glob_mask = mcp.masks.block_diagonal(masks)
    t = time.perf_counter()
    plan = mcp.plan(glob_mask, world, **_plan_args(world, cost))
    plan_s = time.perf_counter() - t
    glob = ours(glob_mask, world, G, cost, work, plan=plan)
    g_areas = np.array([r.area for r in plan.ranks], dtype=np.float64)
    t_fixed, t_glob = max(f["fwd_s"] + f["bwd_s"] for f in fixed), glob["fwd_s"] + glob["bwd_s"]
    kv = [max(f["inter_node_bytes_per_gpu"], f["intra_node_bytes_per_gpu"]) for f in fixed + [glob]]
    return dict(world=world, cp=cp, dp=world // cp, tokens=tpg * world, fixed_ms=1e3 * t_fixed,
                global_ms=1e3 * t_glob, speedup=t_fixed / t_glob, fixed_imbalance=float(areas.max() / areas.mean() - 1),
                global_imbalance=float(g_areas.max() / g_areas.mean() - 1), global_solver=plan.solver, plan_s=plan_s,
                fixed_kv_bytes=max(kv[:-1]), global_kv_bytes=kv[-1])


def ahead(world: int, cp: int, tpg: int, docs, step_s: float, n: int, workers: int, seed: int = 1) -> dict:
    """Waits of a loop taking ``step_s`` a micro-batch for ``n`` global plans made ahead (PlanAhead, helper
    processes): one at a time, and up to ``workers`` at once."""
    from megatron_cp.megatron import PlanAhead

    rng = np.random.default_rng(seed)
    batches = [mcp.masks.block_diagonal([micro_batch(tpg * cp, *docs, rng) for _ in range(world // cp)])
               for _ in range(n)]

    def make(m):
        return mcp.runtime.plan_in_helper(m, world, **_plan_args(world))

    with ThreadPoolExecutor(workers) as pool:  # the helper processes started (and warm) before the timing
        list(pool.map(make, batches[:workers]))
    out = {}
    for name, cap in (("one", 1), ("several", workers)):
        it = PlanAhead(iter(batches), make, depth=2, max_workers=cap)
        for _ in it:
            time.sleep(step_s)
        out.update({f"wait_{name}_s": float(np.mean(it.waits[n // 2:])), f"workers_{name}": it.workers,
                    f"plan_{name}_s": float(np.mean(it.plan_times))})
    return out


def _docs(text: str) -> tuple:
    """--docs MEDIAN,LO,HI,SIGMA: the documents' lengths (LO <= MEDIAN <= HI, SIGMA > 0)."""
    median, lo, hi, sigma = (f(x) for f, x in zip((int, int, int, float), text.split(",")))
    if not (1 <= lo <= median <= hi and sigma > 0):
        raise ValueError(text)
    return median, lo, hi, sigma


def main(argv=None) -> list[dict]:
    ap = parser(__doc__, "out")
    ap.add_argument("--worlds", default=None, help="comma list of GPU counts, multiples of --cp (default 64,..,1024)")
    ap.add_argument("--cp", type=int, default=None, help="CP ranks per DP group in the fixed layout (default 8)")
    ap.add_argument("--tokens-per-gpu", type=int, default=None, help="default 4096")
    ap.add_argument("--docs", type=_docs, default="1024,128,32768,1.0", help=_docs.__doc__)
    ap.add_argument("--step-s", type=float, default=None, help="also plan ahead beside a step of this many seconds")
    ap.add_argument("--ahead-batches", type=int, default=16, help="global batches planned ahead (--step-s)")
    ap.add_argument("--max-workers", type=int, default=8, help="plans at once at most (--step-s)")
    a = ap.parse_args(argv)
    worlds = [int(x) for x in (a.worlds or ("16" if a.dry_run else "64,128,256,512,1024")).split(",")]
    cp, tpg = a.cp or (4 if a.dry_run else 8), a.tokens_per_gpu or (256 if a.dry_run else 4096)
    if any(w < cp or w % cp for w in worlds):
        ap.error(f"--worlds {worlds} must be multiples of --cp {cp}")
    median, lo, hi, sigma = docs = a.docs
    # GPU time (the host ahead, as in training), the NIC figure simulate asks about
    cost = CostModel().replace(links={"inter_gbps": INTER_GBPS}, call={"fwd_us": 0.0, "bwd_us": 0.0})
    rows = []
    with Progress(len(worlds), "dp x cp", verbose=a.verbose) as bar:
        for w in worlds:
            bar.running(f"W={w}")
            rows.append(compare(w, cp, tpg, docs, cost, Workload()))
            if a.step_s is not None:
                rows[-1].update(ahead(w, cp, tpg, docs, a.step_s, a.ahead_batches, a.max_workers))
            bar.step()
    write_json(os.path.join(out_dir(a), f"dp_x_cp{a.tag}.json"), run_record("cpu", cost_model=cost.flat(), rows=rows))
    print(f"attention fwd + bwd of one layer, predicted GPU time; CP {cp} per DP group, {tpg} tokens/GPU, documents "
          f"log-normal median {median} in [{lo}, {hi}] sigma {sigma}; {G} GPUs/node, {INTER_GBPS} GB/s/GPU between "
          f"nodes; cost model: {cost.source}")
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
