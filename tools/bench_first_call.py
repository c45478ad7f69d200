#!/usr/bin/env python3
"""A new plan's first-call host work on the step's thread: the rank's execution state built in the call, beside the
same state with its host part made ahead by the planning helper (what ``runtime.plan_in_helper(rank=)`` hands the
call: the single exchange's arrays and row maps, a staged exchange's routes, guest rows, the backend's tile lists).

    python tools/bench_first_call.py --out results/     # packed, global + local, sliding window, causal; cp 4 and 8
    python tools/bench_first_call.py --backend triton   # the Triton backend's lists (GPUs without FA4)
    python tools/bench_first_call.py --dry-run          # tiny sizes

Per row (mask, tokens per rank, cp): medians over ``--plans`` new plans (after one untimed) of the state built in
the call, the state built from the helper's part, the helper's time making that part, and what it adds to the
helper's answer (bytes) and to unpickling it in the planning thread (which holds the GIL meanwhile). The lists are
FA4's or the Triton backend's (host work: no GPU needed; Triton's with the block schedules a first forward and
backward build, which the helper builds ahead for the calls' head dim); on a CUDA device the uploads are real,
elsewhere they are no copies. The helper's part is made here, by the code the helper runs, so the times are of that
code alone (no pipe, no second process).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time

import numpy as np
import torch

import megatron_cp as mcp
from megatron_cp.kernels import TritonBackend
from megatron_cp.masks import catalog
from megatron_cp.planner import Workload
from megatron_cp.runtime import state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/
from bench_train import micro_batch_masks  # noqa: E402
from common import case_args, case_lists, device_name, keep_row, markdown_table, out_dir, parser, run_record  # noqa: E402

COST = mcp.runtime.CostModel()
GPU_BACKENDS = tuple(b for b in mcp.kernels.BACKENDS if b != "reference")  # the backends whose lists a GPU runs
UNPICKLES = 10  # an answer's unpickling: the fastest of this many (one is a few tens of microseconds)


def _ms(f) -> tuple[float, object]:
    t0 = time.perf_counter()
    got = f()
    return (time.perf_counter() - t0) * 1e3, got


def _backend(name: str):
    return mcp.kernels.BACKENDS[name]()


def _state(plan, a, be, work):
    """The rank's state as its first call builds it, and for the Triton backend the block schedules its first
    forward and backward then build on first use (the helper builds them ahead: the calls' head dim)."""
    st = state.rank_state(plan, a.rank, a.device, be, a.backend, stages=None, hierarchical=True, cost=COST, work=work)
    if isinstance(be, TritonBackend):
        for lst in st.prepared_lists():
            c = be.config.for_head_dim(a.head_dim, lst.row_class)
            for kc in (c.fwd, c.dq, c.dkdv):
                lst.schedules(kc.block_m, kc.block_n, a.device)
    return st


def run_case(name: str, tokens: int, cp: int, a) -> dict:
    seqlen = tokens * cp
    n = a.plans + 1  # the first untimed
    masks = micro_batch_masks(seqlen, n) if name == "packed" else [catalog.build(name, seqlen)] * n
    work = Workload(a.heads[0], a.heads[1], a.head_dim, 2)
    rows = {k: [] for k in ("in_call_ms", "with_ahead_ms", "helper_ms", "answer_bytes", "unpickle_ms")}
    for i, mask in enumerate(masks):
        be = _backend(a.backend)  # a new object per plan: nothing one plan's state built serves the next
        prepare = be.prepare_host
        if hasattr(prepare, "with_head_dims"):  # as runtime.plan_in_helper asks
            prepare = prepare.with_head_dims((work.head_dim,))
        here, there = mcp.plan(mask, cp), mcp.plan(mask, cp)  # one per variant: each state is built once per plan
        for p in (here, there):  # the exchange choice is made ahead in both (the helper already did before)
            state.exchange_choice(p, stages=None, hierarchical=True, cost=COST, work=work)
        sched = state.exchange_choice(there, stages=None, hierarchical=True, cost=COST, work=work)
        in_call, _ = _ms(lambda: _state(here, a, be, work))
        helper, ahead = _ms(lambda: state.rank_ahead(there, a.rank, sched, prepare))
        bare, full = (pickle.dumps(("ok", there, sched, x), protocol=pickle.HIGHEST_PROTOCOL) for x in (None, ahead))
        un_bare, un_full = (min(_ms(lambda: pickle.loads(x))[0] for _ in range(UNPICKLES)) for x in (bare, full))
        _, plan, sched2, ahead2 = pickle.loads(full)
        state.keep_exchange_choice(plan, sched2, stages=None, hierarchical=True, cost=COST, work=work)
        state.keep_rank_ahead(plan, a.rank, ahead2, stages=None, hierarchical=True, cost=COST, work=work)
        taken, _ = _ms(lambda: _state(plan, a, _backend(a.backend), work))
        if i == 0:
            continue
        for k, v in zip(rows, (in_call, taken, helper, len(full) - len(bare), un_full - un_bare)):
            rows[k].append(v)
    return {"mask": name, "tokens_per_rank": tokens, "cp": cp, "rank": a.rank, "heads": f"{a.heads[0]}:{a.heads[1]}",
            "backend": a.backend, "plans": a.plans, **{k: float(np.median(v)) for k, v in rows.items()}}


def summary(rows) -> list[str]:
    return markdown_table(
        ["mask", "tokens / rank", "cp", "state in the call ms", "with the helper's part ms", "helper ms",
         "answer +bytes", "unpickle +ms"],
        [[r["mask"], r["tokens_per_rank"], r["cp"], f"{r['in_call_ms']:.2f}", f"{r['with_ahead_ms']:.2f}",
          f"{r['helper_ms']:.2f}", f"{r['answer_bytes']:.0f}", f"{r['unpickle_ms']:.3f}"] for r in rows])


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser(__doc__, "out/first_call")
    case_args(ap, "packed,global_local,sliding_window,causal")
    ap.add_argument("--plans", type=int, default=None, help="new plans timed per row (default 6; dry run 2)")
    ap.add_argument("--backend", choices=GPU_BACKENDS, default="fa4",
                    help="whose lists: FA4's (Hopper) or the Triton backend's (other GPUs; their block schedules, built "
                         "by a first call's forward and backward, counted in)")
    a = ap.parse_args(argv)
    masks, cps, tokens = case_lists(ap, a, least_cp=1)
    a.plans = a.plans or (2 if a.dry_run else 6)
    a.heads, a.head_dim = (32, 8), 128
    a.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not a.dry_run \
        else torch.device("cpu")
    out = out_dir(a)
    meta = run_record(device_name(a.device), " ".join(["python", os.path.relpath(sys.argv[0]), *argv]),
                      host_cpu=os.cpu_count())
    rows = []
    for cp in cps:
        for name in masks:
            for t in tokens:
                keep_row(rows, run_case(name, t, cp, a), summary, os.path.join(out, f"first_call{a.tag}.json"), meta,
                         a.verbose, sys.stderr)
    print("\n".join(summary(rows)))
    return rows


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
