#!/usr/bin/env python3
"""Distributed attention as training runs it: a new packed-document mask every micro-batch, planned ahead.

    torchrun --nproc-per-node 4 tools/bench_train.py --tokens-per-gpu 8192,32768 --out-dir results/
    python tools/bench_train.py --cpu --world 2 --tiny                      # gloo dry run, spawned ranks

Per implementation (megatron-cp and the baselines ring, ulysses, usp, allgather) and tokens per GPU: every
micro-batch draws new document lengths (lognormal, sigma 1, median min(1500, S/64), clipped to [64, S/4]; the
same on every rank and for every implementation), a background thread plans the next micro-batches as the
Megatron plugin does (``megatron.PlanAhead`` over ``plan_for_batch``'s work: megatron-cp's plan and exchange
choice, made on a GPU by the planning helper process, ``runtime.plan_in_helper``), and the step runs
``--layers`` attention calls forward (each layer its own q, k, v), then their backward, micro-batch after
micro-batch, with no synchronisation inside a step. Reported (rank 0, the slowest rank's figures where they
differ):

- ``step_ms``: wall time of a step of ``--micro-batches`` micro-batches (median over the timed steps);
  ``planned_before_ms``: the timed steps again with their plans all made before them (nothing planned beside
  them): ``step_ms`` minus it is what planning ahead costs the step on the host;
- ``gpu_ms``: the device time inside one such step outside NCCL (kernels and copies of rank 0, intervals merged
  over its streams, torch.profiler; CUDA only): ``step_ms / gpu_ms`` bounds how much the host adds; ``nccl_ms``
  the NCCL kernels' time apart (it includes their waits for the other ranks);
- ``first_call_ms`` / ``call_ms``: host time to issue a micro-batch's first layer call (megatron-cp builds the
  plan's execution state there, and the cross-rank plan check waits there) and the median of the other forward
  calls;
- ``plan_ms``: the planning thread's time per micro-batch of the timed steps (on a GPU mostly waiting for the
  helper process), ``wait_ms`` what the step waited on it.

Writes ``bench_train_<world>x<device>_<date>.json`` into ``--out-dir`` after every implementation, and
``host_profile_megatron-cp_<tokens per GPU>.txt``: rank 0's host time by function over one more step (cProfile,
which on Python 3.12 sees the planning thread too).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import os
import pstats
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp.baselines import get_strategy, plan_for
from megatron_cp.megatron import PlanAhead, default_workers, in_turn
from megatron_cp.planner import Workload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: the shared result record
from common import run_record  # noqa: E402

IMPLS = ("megatron-cp", "ring", "ulysses", "usp", "allgather")


def doc_lengths(seqlen: int, rng: np.random.Generator) -> list[int]:
    """Document lengths summing to ``seqlen`` (the module doc's rule)."""
    median, lo, hi = min(1500, max(8, seqlen // 64)), min(64, max(1, seqlen // 64)), max(2, seqlen // 4)
    out, total = [], 0
    while total < seqlen:
        n = int(np.clip(rng.lognormal(np.log(median), 1.0), lo, hi))
        n = min(n, seqlen - total)
        out.append(n)
        total += n
    return out


def micro_batch_masks(seqlen: int, count: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [mcp.masks.varlen(np.concatenate([[0], np.cumsum(doc_lengths(seqlen, rng))]).tolist(), causal=True)
            for _ in range(count)]


def _planner(impl: str, cp: int, work: Workload, device, group):
    """mask -> (plan, attention function of (q, k, v, plan, group)): what the planning thread makes (for
    megatron-cp the plan with its exchange choice, on a GPU from the planning helper process, checked across
    the ranks, as the plugin does; the rank's execution state is built by the plan's first call)."""
    if impl == "megatron-cp":
        check = mcp.runtime.planning_group(group, "bench_train")  # every rank, here, before the thread starts

        def make(mask):
            if device.type == "cuda":
                plan = mcp.runtime.plan_in_helper(mask, cp, work=work)
            else:
                plan = mcp.plan(mask, cp)
                mcp.runtime.prebuild(plan, work)
            with in_turn():  # plans made at once check in micro-batch order
                mcp.runtime.check_plan_ahead(plan, group, check)
            return plan
        return make, lambda q, k, v, plan, group: mcp.attention(q, k, v, plan, group)[0]
    fn = get_strategy(impl)
    return (lambda mask: plan_for(impl, mask, cp)), lambda q, k, v, plan, group: fn(q, k, v, plan, group)[0]


def _busy_ms(prof) -> tuple[float, float]:
    """Rank 0's device time in a profiled step, intervals merged across streams: (compute and copies, NCCL
    kernels). Apart because an NCCL kernel also runs while it waits for a rank that is still issuing: counted
    with the rest it can exceed the step itself."""
    def merged(spans):
        busy, end = 0.0, -1.0
        for a, b in sorted(spans):
            if b > end:
                busy += b - max(a, end)
                end = b
        return busy / 1e3

    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl = [(e.time_range.start, e.time_range.end) for e in ev if "nccl" in e.name.lower()]
    rest = [(e.time_range.start, e.time_range.end) for e in ev if "nccl" not in e.name.lower()]
    return merged(rest), merged(nccl)


def bench(impl: str, seqlen: int, args, ctx) -> dict:
    rank, cp, device, group, dtype = ctx["rank"], ctx["cp"], ctx["device"], ctx["group"], ctx["dtype"]
    work = Workload(args.heads, args.kv_heads, args.head_dim, torch.finfo(dtype).bits // 8)
    make, attend = _planner(impl, cp, work, device, group)
    steps = args.warmup + args.steps + (2 if device.type == "cuda" else 1)
    masks = micro_batch_masks(seqlen, steps * args.micro_batches, args.seed)
    plans: dict[int, object] = {}
    workers = default_workers(torch.cuda.device_count()) if device.type == "cuda" else 1  # as the plugin
    ahead = PlanAhead(iter(range(len(masks))), lambda i: plans.__setitem__(i, make(masks[i])), depth=2,
                      max_workers=workers)
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    first, calls, step_ms, busy, nccl = [], [], [], None, None
    base: list = []  # per layer (q, k, v) on the device, made once: a step's inputs are views of their first rows

    def tensors(n):
        if not base or base[0][0].shape[0] < n:  # (re)made outside the timed steps but for a rare larger plan
            base[:] = [tuple(torch.randn(max(n, 2 * seqlen // cp), h, args.head_dim, generator=g, device=device,
                                         dtype=dtype) for h in (args.heads, args.kv_heads, args.kv_heads))
                       for _ in range(args.layers)]
        return [tuple(t[:n].detach().requires_grad_() for t in layer) for layer in base]

    def planned_ahead():
        while True:
            plan = plans.pop(next(ahead))
            if impl == "megatron-cp":  # the step takes the planning thread's check (runtime.accept_plan_check)
                mcp.runtime.accept_plan_check(plan, group)
            yield plan

    src = planned_ahead()

    def step(timed, source=src):
        for _ in range(args.micro_batches):
            plan = next(source)
            layers = tensors(plan.num_local(rank))
            outs = []
            for j, (q, k, v) in enumerate(layers):
                t = time.perf_counter()
                outs.append(attend(q, k, v, plan, group))
                if timed:
                    (first if j == 0 else calls).append((time.perf_counter() - t) * 1e3)
            sum(o.float().square().mean() for o in outs).backward()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group)

    for _ in range(args.warmup):
        step(False)
    for _ in range(args.steps):
        sync()
        t = time.perf_counter()
        step(True)
        sync()
        step_ms.append((time.perf_counter() - t) * 1e3)
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(False)
            sync()
        busy, nccl = _busy_ms(prof)
    # where the host's time goes: one more step, rank 0's under cProfile (every rank joins its collectives)
    with cProfile.Profile() if rank == 0 and impl == "megatron-cp" else contextlib.nullcontext() as host_prof:
        step(False)
        sync()
    if host_prof is not None:
        text = io.StringIO()
        pstats.Stats(host_prof, stream=text).sort_stats("tottime").print_stats(30)
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, f"host_profile_{impl}_{seqlen // cp}.txt"), "w") as f:
            f.write(text.getvalue())
    ahead.close()
    # the timed steps again (the same masks: no kernel compiles for a layout not seen yet) with every plan made
    # before them, nothing planned beside the step: what planning ahead costs the step on the host
    a, b = args.warmup * args.micro_batches, (args.warmup + args.steps) * args.micro_batches
    made = [make(m) for m in masks[a:b]]
    for p in made if impl == "megatron-cp" else ():
        mcp.runtime.accept_plan_check(p, group)
    made = iter(made)
    floor = []
    for _ in range(args.steps):
        sync()
        t = time.perf_counter()
        step(False, made)
        sync()
        floor.append((time.perf_counter() - t) * 1e3)
    mine = torch.tensor([float(np.median(step_ms)), float(np.median(first)), float(np.median(calls or [0.0])),
                         float(np.median(floor))], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    # the timed steps' micro-batches only (a, b): the warm-up's first plans load the kernels and fill caches

    def timed_ms(xs):
        xs = list(xs)[a:b]
        return 1e3 * float(np.mean(xs)) if xs else 0.0

    return dict(impl=impl, seqlen=seqlen, tokens_per_gpu=seqlen // cp, layers=args.layers,
                micro_batches=args.micro_batches, step_ms=mine[0].item(), planned_before_ms=mine[3].item(),
                gpu_ms=busy, nccl_ms=nccl,
                host_over_gpu=None if busy is None else mine[0].item() / busy,
                first_call_ms=mine[1].item(), call_ms=mine[2].item(),
                plan_ms=timed_ms(ahead.plan_times), wait_ms=timed_ms(ahead.waits))


def run(rank: int, world: int, argv) -> list[dict]:
    args = parse(argv)
    if args.cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
    rank, cp = dist.get_rank(), dist.get_world_size()
    ctx = dict(rank=rank, cp=cp, device=device, group=dist.group.WORLD,
               dtype=torch.float32 if args.cpu else torch.bfloat16)
    name = "cpu" if args.cpu else torch.cuda.get_device_name(device)
    now = datetime.datetime.now(datetime.UTC)
    meta = run_record(name, "python tools/bench_train.py " + " ".join(argv), world=cp, heads=args.heads,
                      kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=str(ctx["dtype"]))
    path = os.path.join(args.out_dir, f"bench_train_{cp}x{name.replace(' ', '_')}_{now:%Y%m%d_%H%M}.json")
    rows = []
    for tpg in [int(x) for x in args.tokens_per_gpu.split(",")]:
        for impl in args.impls.split(","):
            rows.append(bench(impl, tpg * cp, args, ctx))
            if rank == 0:
                r = rows[-1]
                gpu = "-" if r["gpu_ms"] is None else f"{r['gpu_ms']:.2f} (x{r['host_over_gpu']:.2f})"
                print(f"{tpg:>7} tokens/GPU {impl:>12}: step {r['step_ms']:.2f} ms (plans made before: "
                      f"{r['planned_before_ms']:.2f}), GPU {gpu}, first call "
                      f"{r['first_call_ms']:.2f} ms, call {r['call_ms']:.3f} ms, plan {r['plan_ms']:.2f} ms "
                      f"(waited {r['wait_ms']:.2f})", flush=True)
                os.makedirs(args.out_dir, exist_ok=True)
                with open(path, "w") as f:
                    json.dump({**meta, "rows": rows}, f, indent=1)
    return rows


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-per-gpu", default=None, help="comma list (default 8192,16384,32768; --tiny 64,128)")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--layers", type=int, default=8, help="attention layers per micro-batch (default 8)")
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps (plans, compilation; default 2)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    ap.add_argument("--heads", type=int, default=None, help="query heads (default 32; --tiny 4)")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default 8; --tiny 2)")
    ap.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; --tiny 16)")
    ap.add_argument("--seed", type=int, default=0, help="document lengths' seed")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU dry run")
    ap.add_argument("--cpu", action="store_true", help="gloo on spawned CPU processes (--world of them)")
    ap.add_argument("--world", type=int, default=2, help="CPU processes with --cpu (default 2)")
    ap.add_argument("--out-dir", default="out")
    a = ap.parse_args(argv)
    a.heads, a.kv_heads = a.heads or (4 if a.tiny else 32), a.kv_heads or (2 if a.tiny else 8)
    a.head_dim = a.head_dim or (16 if a.tiny else 128)
    a.tokens_per_gpu = a.tokens_per_gpu or ("64,128" if a.tiny else "8192,16384,32768")
    for i in a.impls.split(","):
        if i not in IMPLS:
            ap.error(f"--impls: {i!r} is not one of {', '.join(IMPLS)}")
    for name in ("layers", "micro_batches", "steps", "heads", "kv_heads", "head_dim", "world"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0 or a.heads % a.kv_heads:
        ap.error(f"--warmup must be >= 0 and --kv-heads divide --heads (got {a.warmup}, {a.heads}:{a.kv_heads})")
    if any(int(x) < 1 for x in a.tokens_per_gpu.split(",")):
        ap.error(f"--tokens-per-gpu must be positive integers, got {a.tokens_per_gpu}")
    if not a.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device: use --cpu (gloo processes) for a dry run")
    return a


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse(argv)
    if a.cpu:
        from megatron_cp.testing import run_ranks

        return run_ranks(run, a.world, argv)[0]
    return run(0, 1, argv)


if __name__ == "__main__":
    main()
