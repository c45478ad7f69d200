#!/usr/bin/env python3
"""Distributed attention as training runs it: a new packed-document mask every micro-batch, planned ahead.

    torchrun --nproc-per-node 4 tools/bench_train.py --tokens-per-gpu 8192,32768 --out results/
    python tools/bench_train.py --dry-run                  # 2 gloo processes on the CPU, tiny sizes

Per implementation and tokens per GPU, a thread plans the next micro-batches (``megatron.PlanAhead``, as the plugin
does) while a step runs 4 micro-batches of 8 attention layers forward, then backward, with no sync inside. A row
(``bench``): the step's wall time, again with every plan made before it, its device time outside and inside NCCL,
the host time of a micro-batch's first layer call (megatron-cp builds the plan's state and waits for the plan check
there) and of the others, the planning thread's time per micro-batch and the step's wait for it, each timed step's
time and the one-time costs met in them (route classes timed, FA4 kernels compiled; the most on any rank). Writes
OUT/bench_train<tag>.json after every implementation and OUT/host_profile_megatron_cp_<tokens per GPU><tag>.txt:
rank 0's host time by function over one more step (cProfile, which on Python 3.12 sees the planning thread too).
At least six warm-up steps (--warmup), and up to SETTLE_STEPS more while a step still meets a one-time cost on some
rank: FA4 compiles a kernel per launch configuration it meets and our backend times the routes of each tile-list
class once (every implementation runs on it); new packed masks bring new ones for dozens of micro-batches, and
with fewer warm-up steps the timed steps held them (a step that compiles takes seconds).
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import pstats
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import megatron_cp as mcp
from megatron_cp.baselines import STRATEGY_NAMES, get_strategy, plan_for
from megatron_cp.planner import Workload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/
from bench_dist import start_ranks  # noqa: E402
from common import OURS, device_name, impl_list, out_dir, parser, run_record, write_json  # noqa: E402

IMPLS = STRATEGY_NAMES  # megatron-cp's own attention (OURS, every tool's record label) and each baseline
# by default all but head_context, which without a topology is plain Ulysses (one group of every rank)
DEFAULT_IMPLS = tuple(i for i in IMPLS if i != "head_context")


def micro_batch_masks(seqlen: int, count: int) -> list:
    """``count`` causal packed-document masks of ``seqlen`` tokens: document lengths lognormal (sigma 1, median
    min(1500, S/64)) clipped to [64, S/4] (tiny S: [S/64, S/4]); the same on every rank and implementation."""
    rng, masks = np.random.default_rng(0), []
    median, lo, hi = min(1500, max(8, seqlen // 64)), min(64, max(1, seqlen // 64)), max(2, seqlen // 4)
    for _ in range(count):
        cu = [0]
        while cu[-1] < seqlen:
            cu.append(min(cu[-1] + int(np.clip(rng.lognormal(np.log(median), 1.0), lo, hi)), seqlen))
        masks.append(mcp.masks.varlen(cu, causal=True))
    return masks


def _planner(impl: str, a):
    """mask -> plan (the planning thread's work; megatron-cp's checked across the ranks as the plugin does, its
    execution state built by the plan's first call) and the attention of (q, k, v, plan)."""
    if impl != OURS:
        fn = get_strategy(impl)
        return (lambda mask: plan_for(impl, mask, a.cp)), lambda q, k, v, plan: fn(q, k, v, plan, a.group)[0]
    from megatron_cp.megatron import in_turn

    check = mcp.runtime.planning_group(a.group, "bench_train")  # every rank, here, before the thread starts
    if a.device.type == "cuda":  # as the plugin does when it parses its flags (their imports take seconds)
        mcp.runtime.start_planning_helpers(2)
    work = Workload(a.heads, a.kv_heads, a.head_dim, a.dtype.itemsize)

    def make(mask):
        if a.device.type == "cuda":
            plan = mcp.runtime.plan_in_helper(mask, a.cp, work=work, rank=a.rank, backend="auto", device=a.device)
        else:
            plan = mcp.plan(mask, a.cp)
            mcp.runtime.prebuild(plan, work)
        with in_turn():  # plans made at once check in micro-batch order
            mcp.runtime.check_plan_ahead(plan, a.group, check)
        return plan
    return make, lambda q, k, v, plan: mcp.attention(q, k, v, plan, a.group)[0]


def _busy_ms(prof) -> tuple[float, float]:
    """Rank 0's device time in a profiled step, intervals merged across streams: (compute and copies, NCCL kernels),
    apart because an NCCL kernel also runs while it waits for a rank still issuing (it can exceed the step)."""
    def merged(spans):  # ms the union of the (start, end) us spans covers
        busy, end = 0.0, -1.0
        for a, b in sorted(spans):
            busy, end = busy + max(0.0, b - max(a, end)), max(end, b)
        return busy / 1e3

    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl = [(e.time_range.start, e.time_range.end) for e in ev if "nccl" in e.name.lower()]
    rest = [(e.time_range.start, e.time_range.end) for e in ev if "nccl" not in e.name.lower()]
    return merged(rest), merged(nccl)


# warm-up steps beyond --warmup while the last one still met a one-time cost on some rank (a route class timed, an
# FA4 kernel compiled): those cost a step seconds, and the timed steps are to show the steps a long run is made of
SETTLE_STEPS = 12


def one_time_counts(device) -> list[int]:
    """[route classes timed, FA4 kernels compiled] in this process so far: one-time costs a step may meet (the
    kernel backend's measured routes, FlashAttention-4's in-memory compile caches; 0 where there are none)."""
    routes = getattr(mcp.runtime.resolve_backend("auto", device)[1], "routes", None)
    compiled = 0
    try:
        from flash_attn.cute import interface as fa4
    except ImportError:
        fa4 = None
    for fn in ("_flash_attn_fwd", "_flash_attn_bwd"):
        compiled += len(getattr(getattr(getattr(fa4, fn, None), "compile_cache", None), "cache", ()))
    return [len(getattr(routes, "chosen", ())), compiled]


def bench(impl: str, seqlen: int, a) -> dict:
    # imported in the ranks: Megatron-Core takes seconds to import, and a dry run's parent needs none of it
    from megatron_cp.megatron import PlanAhead, default_workers

    cuda, mega = a.device.type == "cuda", impl == OURS
    make, attend = _planner(impl, a)
    masks = micro_batch_masks(seqlen, (a.warmup + SETTLE_STEPS + a.iters + (2 if cuda else 1)) * a.micro_batches)
    plans: dict[int, object] = {}
    ahead = PlanAhead(iter(range(len(masks))), lambda i: plans.__setitem__(i, make(masks[i])), depth=2,
                      max_workers=default_workers(torch.cuda.device_count()) if cuda else 1)  # as the plugin
    g = torch.Generator(device=a.device).manual_seed(1234 + a.rank)
    first, calls, busy, nccl = [], [], None, None
    base: list = []  # per layer (q, k, v) on the device, made once: a step's inputs are views of their first rows

    def tensors(n):
        if not base or base[0][0].shape[0] < n:  # (re)made outside the timed steps but for a rare larger plan
            base[:] = [tuple(torch.randn(max(n, 2 * seqlen // a.cp), h, a.head_dim, generator=g, device=a.device,
                                         dtype=a.dtype) for h in (a.heads, a.kv_heads, a.kv_heads))
                       for _ in range(a.layers)]
        return [tuple(t[:n].detach().requires_grad_() for t in layer) for layer in base]

    def planned_ahead():
        while True:
            plan = plans.pop(next(ahead))
            if mega:  # the step takes the planning thread's check (runtime.accept_plan_check)
                mcp.runtime.accept_plan_check(plan, a.group)
            yield plan

    def step(timed=False, source=planned_ahead()):
        for _ in range(a.micro_batches):
            plan, outs = next(source), []
            for j, (q, k, v) in enumerate(tensors(plan.num_local(a.rank))):
                t = time.perf_counter()
                outs.append(attend(q, k, v, plan))
                if timed:
                    (first if j == 0 else calls).append((time.perf_counter() - t) * 1e3)
            sum(o.float().square().mean() for o in outs).backward()

    def sync():
        if cuda:
            torch.cuda.synchronize(a.device)
        dist.barrier(a.group)

    def step_ms(**kw):
        sync()
        t = time.perf_counter()
        step(**kw)
        sync()
        return (time.perf_counter() - t) * 1e3

    warm, seen = 0, one_time_counts(a.device)
    while warm < a.warmup + SETTLE_STEPS:
        step()
        warm, now = warm + 1, one_time_counts(a.device)
        met = torch.tensor([float(sum(now) - sum(seen))], device=a.device)
        dist.all_reduce(met, op=dist.ReduceOp.MAX, group=a.group)  # every rank stops after the same step
        seen = now
        if warm >= a.warmup and met.item() == 0:
            break
    before = one_time_counts(a.device)
    wall = [step_ms(timed=True) for _ in range(a.iters)]
    met = [x - y for x, y in zip(one_time_counts(a.device), before)]
    if cuda:
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            sync()
        busy, nccl = _busy_ms(prof)
    # where the host's time goes: one more step, rank 0's under cProfile (every rank joins its collectives)
    with cProfile.Profile() if a.rank == 0 and mega else contextlib.nullcontext() as host_prof:
        step_ms()
    if host_prof is not None:
        with open(os.path.join(a.out, f"host_profile_{impl}_{seqlen // a.cp}{a.tag}.txt"), "w") as f:
            # by own time (where the host's time goes), then by time inside (the step's calls, which the planning
            # thread's work beside the step can crowd out of the first list)
            stats = pstats.Stats(host_prof, stream=f)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(30)
    ahead.close()
    # the timed steps again (the same masks: no kernel compiles for a layout not seen yet) with every plan made
    # before them, nothing planned beside the step: what planning ahead costs the step on the host
    lo, hi = warm * a.micro_batches, (warm + a.iters) * a.micro_batches
    made = [make(m) for m in masks[lo:hi]]
    for p in made if mega else ():
        mcp.runtime.accept_plan_check(p, a.group)
    floor = [step_ms(source=iter(made)) for _ in range(a.iters)]
    mine = torch.from_numpy(np.array([np.median(x) for x in (wall, first, calls or [0.0], floor)] + wall + met,
                                     dtype=np.float64)).to(a.device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=a.group)
    med, first_call, call, planned_before, *rest = mine.tolist()
    steps, (routes_timed, fa4_compiled) = rest[:a.iters], rest[a.iters:]
    # the timed steps' micro-batches only: the warm-up's first plans load the kernels and fill caches
    timed_ms = lambda xs: 1e3 * float(np.mean(list(xs)[lo:hi])) if list(xs)[lo:hi] else 0.0  # noqa: E731
    return dict(impl=impl, seqlen=seqlen, tokens_per_gpu=seqlen // a.cp, layers=a.layers,
                micro_batches=a.micro_batches, warmup_steps=warm, step_ms=med, planned_before_ms=planned_before,
                gpu_ms=busy, nccl_ms=nccl, host_over_gpu=None if busy is None else med / busy, first_call_ms=first_call,
                call_ms=call, plan_ms=timed_ms(ahead.plan_times), wait_ms=timed_ms(ahead.waits), steps_ms=steps,
                routes_timed_in_steps=int(routes_timed), fa4_compiles_in_steps=int(fa4_compiled))


def run(rank: int, world: int, a) -> list[dict]:
    a.device = start_ranks(a.dry_run)
    a.rank, a.cp, a.group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    a.dtype = torch.float32 if a.dry_run else torch.bfloat16
    meta = run_record(device_name(a.device), a.command, world=a.cp, heads=a.heads, kv_heads=a.kv_heads,
                      head_dim=a.head_dim, dtype=str(a.dtype))
    rows = []
    for tpg in a.tokens_per_gpu:
        for impl in a.impls:
            rows.append(r := bench(impl, tpg * a.cp, a))
            if a.rank == 0:
                gpu = "-" if r["gpu_ms"] is None else f"{r['gpu_ms']:.2f} (x{r['host_over_gpu']:.2f})"
                print(f"{tpg:>7} tokens/GPU {impl:>12}: step {r['step_ms']:.2f} ms (plans made before: "
                      f"{r['planned_before_ms']:.2f}), GPU {gpu}, first call {r['first_call_ms']:.2f} ms, call "
                      f"{r['call_ms']:.3f} ms, plan {r['plan_ms']:.2f} ms (waited {r['wait_ms']:.2f}); after "
                      f"{r['warmup_steps']} warm-up steps, timed steps "
                      f"{', '.join(f'{x:.0f}' for x in r['steps_ms'])} ms, in them (the slowest rank) "
                      f"{r['routes_timed_in_steps']} route classes timed, {r['fa4_compiles_in_steps']} FA4 "
                      "compiles", flush=True)
                write_json(os.path.join(a.out, f"bench_train{a.tag}.json"), {**meta, "rows": rows})
    return rows


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser(__doc__, "out/train", timing=(6, 3))
    ap.add_argument("--tokens-per-gpu", default=None, help="comma list (default 8192,16384,32768; dry run 64)")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS))
    a = ap.parse_args(argv)
    a.impls = impl_list(a.impls)
    if bad := [i for i in a.impls if i not in IMPLS]:
        ap.error(f"--impls: {bad[0]!r} is not one of {', '.join(IMPLS)}")
    if not a.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: --dry-run runs gloo processes on the CPU")
    dry = a.dry_run
    a.layers, a.micro_batches, a.heads, a.kv_heads, a.head_dim = (2, 2, 4, 2, 16) if dry else (8, 4, 32, 8, 128)
    a.tokens_per_gpu = [int(x) for x in (a.tokens_per_gpu or ("64" if dry else "8192,16384,32768")).split(",")]
    a.command = " ".join(["python", os.path.relpath(sys.argv[0]), *argv])  # the ranks' sys.argv is not this one
    out_dir(a)
    if dry:
        from megatron_cp.testing import run_ranks

        return run_ranks(run, 2, a)[0]
    rows = run(0, 1, a)
    dist.destroy_process_group()  # torchrun's ranks: NCCL warns at exit about a group left up
    return rows


if __name__ == "__main__":
    main()
