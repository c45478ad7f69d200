"""Time plan() on one core: the planning targets (packed documents: <= 10 ms at 128k tokens / cp 8, <= 100 ms at
1M tokens / cp 64) and a plain causal mask at 1M / cp 64, with the plans' balance and traffic beside the times.

    python tools/bench_plan.py [--repeat 5] [--docs 1000] [--seqlen 131072 1048576 --cp 8 64] [--out DIR]

--seqlen / --cp: packed documents, one case per pair (--docs log-normal lengths, sigma 1, causal within each). One
table: mask build time, plan() wall and CPU time, the target, met when the median CPU time is within it and the
imbalance (busiest rank's cells / mean - 1) within 3%, the solver, tokens per rank and K/V tokens received. Writes
OUT/bench_plan<tag>.json; exit status 1 when a case misses its target.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import numpy as np

import megatron_cp as mcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Progress, markdown_table, out_dir, parser, run_record, write_json  # noqa: E402

# (mask, seqlen, cp) -> plan() median target in seconds (issue #27)
TARGETS = {("packed", 131072, 8): 0.010, ("packed", 1 << 20, 64): 0.100}
DEFAULT_CASES = (("packed", 131072, 8), ("packed", 1 << 20, 64), ("causal", 1 << 20, 64))
MAX_IMBALANCE = 0.03


def doc_cu_seqlens(total: int, docs: int, seed: int = 0) -> np.ndarray:
    """``docs`` log-normal document lengths (sigma 1: many short, a few long) summing to ``total``."""
    w = np.random.default_rng(seed).lognormal(0.0, 1.0, docs)
    lens = np.maximum(1, np.floor(w / w.sum() * total)).astype(np.int64)
    lens[np.argmax(lens)] += total - lens.sum()
    return np.concatenate([[0], np.cumsum(lens)])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def run_case(mask_name: str, seqlen: int, cp: int, docs: int, repeat: int, bar: Progress) -> dict:
    cu = doc_cu_seqlens(seqlen, docs) if mask_name == "packed" else np.array([0, seqlen], dtype=np.int64)
    lens = np.diff(cu)
    what = (f"docs={len(lens)} (len min {lens.min()} median {int(np.median(lens))} max {lens.max()})"
            if mask_name == "packed" else "one causal sequence")
    print(f"{mask_name}: S={seqlen} {what} cp={cp}, 1 core")
    bar.running(f"{mask_name} S={seqlen} cp={cp}")
    wall, cpu, build = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mask = mcp.masks.varlen(cu, causal=True)
        _ = mask.traps  # normalisation is part of the mask's cost
        t1, c1 = time.perf_counter(), time.process_time()
        plan = mcp.plan(mask, cp)
        wall.append(time.perf_counter() - t1)
        cpu.append(time.process_time() - c1)
        build.append(t1 - t0)
        bar.step()
    st, target, cpu_median = plan.stats(), TARGETS.get((mask_name, seqlen, cp)), statistics.median(cpu)
    print(f"candidates (imbalance, max remote, total remote): {plan.candidates}")
    return {"mask": mask_name, "seqlen": seqlen, "cp": cp, "docs": len(lens), "mask_build_s_min": min(build),
            "plan_s_first": wall[0], "plan_s_median": statistics.median(wall), "plan_s_min": min(wall),
            "plan_cpu_s_median": cpu_median, "plan_cpu_s_min": min(cpu), "target_s": target,
            "met": None if target is None else bool(cpu_median <= target and st["imbalance"] <= MAX_IMBALANCE),
            "solver": plan.solver, "imbalance": st["imbalance"],
            "tokens_per_rank": [min(st["tokens_per_rank"]), max(st["tokens_per_rank"])],
            "max_remote_kv_tokens": st["max_remote_kv_tokens"],
            "total_remote_kv_tokens": sum(st["remote_kv_tokens_per_rank"]),
            "tiles_per_rank_max": max(st["tiles_per_rank"]), "digest": plan.digest}


def main(argv=None):
    ap = parser(__doc__, "out/plan")
    ap.add_argument("--seqlen", type=int, nargs="+", default=None, help="packed documents (default: the cases above)")
    ap.add_argument("--cp", type=int, nargs="+", default=[64], help="cp sizes, one per --seqlen (or one for all)")
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    cps = args.cp * len(args.seqlen or []) if len(args.cp) == 1 else args.cp
    if args.seqlen and len(cps) != len(args.seqlen):
        ap.error(f"--seqlen and --cp pair up: {len(args.seqlen)} lengths, {len(args.cp)} cp sizes")
    cases = ([("packed", s, c) for s, c in zip(args.seqlen, cps)] if args.seqlen else
             [("packed", 4096, 2)] if args.dry_run else DEFAULT_CASES)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one CPU core
    with Progress(args.repeat * len(cases), "plan()") as bar:
        rows = [run_case(m, s, c, args.docs, args.repeat, bar) for m, s, c in cases]
    times = ("plan_s_first", "plan_s_median", "plan_s_min", "plan_cpu_s_median", "plan_cpu_s_min")
    print("\n".join(markdown_table(
        ["mask build ms (min)", "plan() s: first", "median", "min", "CPU s: median", "min", "mask", "S", "cp",
         "target s", "met", "solver", "imbalance", "tokens/rank", "max remote KV tokens", "all remote KV tokens",
         "tiles/rank max"],
        [[f"{1e3 * r['mask_build_s_min']:.1f}", *(f"{r[k]:.4f}" for k in times), r["mask"], r["seqlen"], r["cp"],
          "-" if r["target_s"] is None else f"{r['target_s']:.3f}", {None: "-", True: "yes", False: "NO"}[r["met"]],
          r["solver"], f"{100 * r['imbalance']:.2f}%", "..".join(map(str, r["tokens_per_rank"])),
          r["max_remote_kv_tokens"], r["total_remote_kv_tokens"], r["tiles_per_rank_max"]] for r in rows])))
    write_json(os.path.join(out_dir(args), f"bench_plan{args.tag}.json"), {"rows": rows, "meta": run_record(
        f"{cpu_name()}, 1 core (CPU only)", numpy=np.__version__, cpus=os.cpu_count(),
        load_average_1_5_15_min=list(os.getloadavg()) if hasattr(os, "getloadavg") else None)})
    return 0 if all(r["met"] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
