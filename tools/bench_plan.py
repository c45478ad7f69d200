"""Time plan() on one core: the planning targets (packed documents: <= 10 ms at 128k tokens / cp 8, <= 100 ms at
1M tokens / cp 64) and a plain causal mask at 1M / cp 64, with the plans' balance and traffic beside the times.

    python tools/bench_plan.py [--repeat 5] [--docs 1000] [--json out/bench_plan.json]
    python tools/bench_plan.py --seqlen 131072,1048576 --cp 8,64 [--masks packed,causal]

Without ``--seqlen`` the three cases above run. ``--seqlen`` / ``--cp`` are paired lists (one case per pair
and mask, masks ``packed`` by default). Packed documents: ``--docs`` log-normal lengths (sigma 1: many
short, a few long) summing to S, causal within each (``doc_cu_seqlens``). While it runs a progress bar
on stderr counts the plans (redrawn at most every 30 s where stderr is not a terminal: tools/common.py).
Per case one setup line and the auto solver's candidates on stdout, then one table: mask build time (min),
plan() wall time (first, median, min) and CPU time (median, min), the target and whether it is met, the
chosen solver, imbalance (busiest rank's cells / mean - 1), tokens per rank and K/V tokens received (most
on a rank, all ranks). A target is met when the median CPU time of plan() is within it and the imbalance
within 3%: the cost of planning on one core, which the wall time shows too where nothing else needs the
core (on a shared machine it also counts the time other processes held it). The JSON (device, date,
command, load average, rows) goes to ``--json``. Exit status 1 when a case misses its target.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

import megatron_cp as mcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: the progress bar and table
from common import Progress, markdown_table  # noqa: E402

# (mask, seqlen, cp) -> plan() median target in seconds (issue #27)
TARGETS = {("packed", 131072, 8): 0.010, ("packed", 1 << 20, 64): 0.100}
DEFAULT_CASES = (("packed", 131072, 8), ("packed", 1 << 20, 64), ("causal", 1 << 20, 64))
MAX_IMBALANCE = 0.03


def doc_cu_seqlens(total: int, docs: int, seed: int = 0) -> np.ndarray:
    """``docs`` log-normal document lengths (sigma 1: many short, a few long) summing to ``total``."""
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, 1.0, docs)
    lens = np.maximum(1, np.floor(w / w.sum() * total)).astype(np.int64)
    lens[np.argmax(lens)] += total - lens.sum()
    return np.concatenate([[0], np.cumsum(lens)])


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--{name} takes comma-separated ints, got {text!r}") from None
    if any(v < 1 for v in vals):
        raise SystemExit(f"--{name} values must be positive, got {text!r}")
    return vals


def cases_of(args) -> list[tuple[str, int, int]]:
    if args.seqlen is None and args.cp is None and args.masks is None:
        return list(DEFAULT_CASES)
    seqlens = _ints(args.seqlen or "1048576", "seqlen")
    cps = _ints(args.cp or "64", "cp")
    if len(cps) == 1:
        cps = cps * len(seqlens)
    if len(seqlens) != len(cps):
        raise SystemExit(f"--seqlen and --cp pair up: {len(seqlens)} lengths, {len(cps)} cp sizes")
    masks = (args.masks or "packed").split(",")
    for m in masks:
        if m not in ("packed", "causal"):
            raise SystemExit(f"--masks takes packed and/or causal, got {m!r}")
    return [(m, s, c) for s, c in zip(seqlens, cps) for m in masks]


def device() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, 1 core (CPU only)"


def run_case(mask_name: str, seqlen: int, cp: int, docs: int, repeat: int, bar: Progress) -> dict:
    cu = doc_cu_seqlens(seqlen, docs) if mask_name == "packed" else np.array([0, seqlen], dtype=np.int64)
    lens = np.diff(cu)
    what = f"docs={len(lens)} (len min {lens.min()} median {int(np.median(lens))} max {lens.max()})" \
        if mask_name == "packed" else "one causal sequence"
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
    st = plan.stats()
    print(f"candidates (imbalance, max remote, total remote): {plan.candidates}")
    target = TARGETS.get((mask_name, seqlen, cp))
    cpu_median = statistics.median(cpu)
    return {
        "mask": mask_name, "seqlen": seqlen, "cp": cp, "docs": len(lens),
        "mask_build_s_min": min(build), "plan_s_first": wall[0], "plan_s_min": min(wall),
        "plan_s_median": statistics.median(wall), "plan_cpu_s_median": cpu_median, "plan_cpu_s_min": min(cpu),
        "target_s": target,
        "met": None if target is None else bool(cpu_median <= target and st["imbalance"] <= MAX_IMBALANCE),
        "solver": plan.solver, "imbalance": st["imbalance"], "tokens_per_rank": [min(st["tokens_per_rank"]),
                                                                                 max(st["tokens_per_rank"])],
        "max_remote_kv_tokens": st["max_remote_kv_tokens"],
        "total_remote_kv_tokens": sum(st["remote_kv_tokens_per_rank"]),
        "tiles_per_rank_max": max(st["tiles_per_rank"]), "digest": plan.digest,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", default=None, help="comma-separated sequence lengths (default: the three cases)")
    ap.add_argument("--cp", default=None, help="comma-separated cp sizes, one per --seqlen (or one for all)")
    ap.add_argument("--masks", default=None, help="packed and/or causal (default packed with --seqlen)")
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None, help="write device, date, command and rows here")
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one CPU core
    cases = cases_of(args)
    bar = Progress(args.repeat * len(cases), "plan()")
    rows = [run_case(m, s, c, args.docs, args.repeat, bar) for m, s, c in cases]
    bar.close()
    print("\n".join(markdown_table(
        ["mask build ms (min)", "plan() s: first", "median", "min", "CPU s: median", "min", "mask", "S", "cp",
         "target s",
         "met", "solver", "imbalance", "tokens/rank", "max remote KV tokens", "all remote KV tokens",
         "tiles/rank max"],
        [[f"{1e3 * r['mask_build_s_min']:.1f}", f"{r['plan_s_first']:.4f}", f"{r['plan_s_median']:.4f}",
          f"{r['plan_s_min']:.4f}", f"{r['plan_cpu_s_median']:.4f}", f"{r['plan_cpu_s_min']:.4f}", r["mask"],
          r["seqlen"], r["cp"],
          "-" if r["target_s"] is None else f"{r['target_s']:.3f}",
          "-" if r["met"] is None else ("yes" if r["met"] else "NO"), r["solver"], f"{100 * r['imbalance']:.2f}%",
          f"{r['tokens_per_rank'][0]}..{r['tokens_per_rank'][1]}", r["max_remote_kv_tokens"],
          r["total_remote_kv_tokens"], r["tiles_per_rank_max"]] for r in rows])))
    if args.json:
        meta = {"device": device(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(["python"] + sys.argv), "numpy": np.__version__,
                "load_average_1_5_15_min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                "cpus": os.cpu_count()}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0 if all(r["met"] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
