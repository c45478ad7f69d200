#!/usr/bin/env python3
"""One rank's host path under its GPU work: rank r of a cp N plan, alone on one GPU, its collectives on no wire.

    python tools/host_path.py --out results/                     # packed 8k per rank, cp 4 and 8, 32:8 and 64:8 heads
    python tools/host_path.py --masks causal,sliding_window,global_local --tokens-per-rank 16384,32768
    python tools/host_path.py --dry-run                          # CPU, reference kernels, tiny sizes

The rank's process group is ``comm.loopback``: every collective returns at once and moves nothing, so the
rank's host path (input checks, state, index copies, exchange calls, kernel launches) and its kernels run exactly as
rank r runs them in a job of N GPUs, less the other ranks' data (received K/V rows are whatever the buffers held)
and the time the exchange takes on the wire. A new plan per micro-batch, made ahead in the planning helper process and
checked across the ranks on the planning thread as the Megatron plugin does; per micro-batch ``--layers`` attention calls forward, then the backward of all of them.

Per row (mask, tokens per rank, cp, heads): the forward's and the backward's back-to-back wall (all the phase's calls
issued with no sync between, then one sync; medians over the timed micro-batches); a training step's wall per
micro-batch (``step_ms_per_mb``: as many fresh plans' micro-batches, forward and backward, issued back to back with one
sync at the end, so that a phase's host work may run under the previous phase's queued GPU work) over the same
micro-batches' GPU busy time (``step_over_gpu``; the lower of two steps': a plan that meets a list class first times
its routes inside its step); the GPU's busy time in the same
phase (kernels and copies, streams merged: the timed micro-batches run again, each profiled; ratios are medians of each
micro-batch's own), the host time of a layer call (the forward call's wall; the backward's
``*AttentionBackward`` autograd nodes' host time), the first call of a new plan (state built there), the wait
for the planning helper, and the host's own speed just before and after the timed micro-batches (``host_ref_us``: a
fixed allocation-and-Python loop; it moves between sittings of the same code by as much as a change, so compare rows
per unit of it). Writes OUT/host_path<tag>.json, OUT/host_path_profile<tag>.txt (the first row's last
profiled micro-batch: host time by op), per row the inclusive host time of the runtime's, its backend's and Triton's
named functions in one more micro-batch's later calls (``pieces_us``; printed) and OUT/host_path_pyprofile<tag>.txt
(every row: one more micro-batch, then a
new plan's first call, under cProfile: Python functions by own and cumulative time).
"""

from __future__ import annotations

import contextlib
import cProfile
import datetime
import os
import pstats
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import megatron_cp as mcp
from megatron_cp.comm import loopback
from megatron_cp.masks import catalog
from megatron_cp.planner import Workload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/
from bench_train import micro_batch_masks  # noqa: E402
from common import (case_args, case_lists, device_name, heads_list, keep_row, markdown_table, out_dir,  # noqa: E402
                    parser, run_record)

BACKWARD_NODE = "AttentionBackward"
STEPS = 2  # training steps timed per row, each on fresh plans  # autograd's name of _SingleExchangeAttention / _StagedAttention's backward


def start_rank_alone(rank: int, cp: int) -> None:
    """This process as rank ``rank`` of ``cp`` on a group with no peer (``comm.loopback``; a new default group per
    cp)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(loopback.BACKEND, store=dist.HashStore(), rank=rank, world_size=cp,
                            timeout=datetime.timedelta(minutes=5))


def cases_alone(rank: int, cps, masks, tokens, heads):
    """(cp, mask, tokens per rank, heads) of every row, this process rank ``rank`` of each cp alone in turn
    (``start_rank_alone``); the group destroyed after the last."""
    for cp in cps:
        start_rank_alone(rank, cp)
        for name in masks:
            for t in tokens:
                for h in heads:
                    yield cp, name, t, h
    dist.destroy_process_group()


def masks_for(name: str, seqlen: int, count: int) -> list:
    """``count`` micro-batches' masks: packed documents drawn anew each (bench_train's), else the catalog mask
    (each micro-batch still gets a plan of its own)."""
    if name == "packed":
        return micro_batch_masks(seqlen, count)
    return [catalog.build(name, seqlen)] * count


def host_speed_us(device, reps: int = 1000, rounds: int = 5) -> list[float]:
    """Microseconds per repetition of a fixed piece of host work (an allocation on ``device``, a view, a few Python
    operations), one figure per round: the host's own speed at the time. It wanders between sittings of the same
    code by as much as a change under test, so a row carries it (``host_ref_us``) and rows of different sittings or
    code can be compared per unit of it."""
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for i in range(reps):
            y = torch.empty(16, device=device).view(4, 4)
            _ = {"i": i, "shape": y.shape}
        out.append((time.perf_counter() - t) / reps * 1e6)
    return out


class Pieces:
    """Inclusive host time of named public functions of the runtime, its backend and Triton's launcher inside the real
    layer loop (a wrapper's timer around each; a few us per call added, so the row's timed figures are made without
    them): per forward call (each ``mcp.attention`` call apart) and over the backward (per layer). Where a later call's
    time goes in the loop, not in a piece timed alone (there each costs about half)."""

    def __init__(self, backend):
        import megatron_cp.runtime.attention  # noqa: F401  (the module, not the function the package exports)
        import megatron_cp.runtime.guests
        import megatron_cp.runtime.rowmap

        att = sys.modules["megatron_cp.runtime.attention"]
        targets = [(att, n) for n in ("verify_plan", "all_to_all_v", "copy_pairs", "reduce_row_pairs")]
        targets += [(megatron_cp.runtime.rowmap.RowMap, n) for n in ("copy", "copy_pair", "gather")]
        targets += [(megatron_cp.runtime.guests, n) for n in ("start_forward", "finish_forward", "start_backward",
                                                              "finish_backward")]
        targets += [(type(backend), n) for n in ("forward", "forward_accumulate", "backward", "backward_into")]
        replay = sys.modules.get("megatron_cp.kernels.fa4.replay")
        if replay is not None:
            targets += [(replay, "launch"), (replay, "launch_program")]
        with contextlib.suppress(ImportError):
            from triton.runtime.jit import JITFunction
            targets.append((JITFunction, "run"))
        self.targets = [(o, n) for o, n in targets if n in vars(o)]
        self.calls, self.bwd, self.current = [], {}, None

    def _timed(self, label, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc = self.bwd if self.current is None else self.current
                us, n = acc.get(label, (0.0, 0))
                acc[label] = (us + (time.perf_counter() - t) * 1e6, n + 1)
        return timed

    @contextlib.contextmanager
    def installed(self):
        saved = [(o, n, vars(o)[n]) for o, n in self.targets]
        real = mcp.attention

        def call(*args, **kwargs):
            self.current = {}
            try:
                return self._timed("attention (the whole call)", real)(*args, **kwargs)
            finally:
                self.calls.append(self.current)
                self.current = None

        try:
            for o, n, f in saved:
                name = f"{getattr(o, '__name__', '?').rsplit('.', 1)[-1]}.{n}"
                w = self._timed(name, f.__func__ if isinstance(f, staticmethod) else f)
                setattr(o, n, staticmethod(w) if isinstance(f, staticmethod) else w)
            mcp.attention = call
            yield self
        finally:
            mcp.attention = real
            for o, n, f in saved:
                setattr(o, n, f)

    def result(self, layers: int) -> dict:
        """{"forward": {name: [us a call (median over calls), calls a call]}, "backward": {name: [us a layer, calls a
        layer]}}, each by time, largest first."""
        names = {k for c in self.calls for k in c}
        fwd = {k: [float(np.median([c.get(k, (0.0, 0))[0] for c in self.calls])),
                   float(np.median([c.get(k, (0.0, 0))[1] for c in self.calls]))] for k in names}
        bwd = {k: [us / layers, n / layers] for k, (us, n) in self.bwd.items()}
        order = lambda d: dict(sorted(d.items(), key=lambda kv: -kv[1][0]))  # noqa: E731
        return {"forward": order(fwd), "backward": order(bwd)}


def not_replayed(device) -> dict:
    """{"function: why": records} of the launches the auto backend keeps on FA4's interface so far in this process
    (its ``describe()``; empty for backends without replayed launches)."""
    be = mcp.runtime.resolve_backend("auto", device)[1]
    rows = be.describe().get("not_replayed", []) if hasattr(be, "describe") else []
    return {f"{r['function']}: {r['why']}": r["records"] for r in rows}


def busy_ms(events, lo_us: float, hi_us: float) -> float:
    """ms of the union of the device events' intervals that start in [lo_us, hi_us)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if lo_us <= e.time_range.start < hi_us)
    busy, end = 0.0, -1.0
    for a, b in spans:
        busy, end = busy + max(0.0, b - max(a, end)), max(end, b)
    return busy / 1e3


def run_case(mask_name: str, tokens: int, cp: int, heads: tuple[int, int], a, profile_path: str | None) -> dict:
    cuda = a.device.type == "cuda"
    hq, hkv = heads
    seqlen, group = tokens * cp, dist.group.WORLD
    n_mb = a.warmup + a.iters
    # then: a fresh plan whose first call is profiled alone, and STEPS training steps of ``iters`` fresh plans each
    masks = masks_for(mask_name, seqlen, n_mb + 1 + STEPS * a.iters)
    steps = [range(n_mb + 1 + j * a.iters, n_mb + 1 + (j + 1) * a.iters) for j in range(STEPS)]
    work = Workload(hq, hkv, a.head_dim, a.dtype.itemsize)

    check = mcp.runtime.planning_group(group, "host_path")

    def make(mask):  # as the Megatron plugin plans: the plan, its exchange, the rank's first-call host work, and the
        # plan checked across the ranks on the planning thread
        plan = mcp.runtime.plan_in_helper(mask, cp, work=work, rank=a.rank, backend="auto", device=a.device)
        mcp.runtime.check_plan_ahead(plan, group, check)
        return plan

    refused0 = not_replayed(a.device)
    pool = ThreadPoolExecutor(1)
    ahead = [pool.submit(make, m) for m in masks]  # one planning thread, in micro-batch order
    g = torch.Generator(device=a.device).manual_seed(1234 + a.rank)
    n_max = max(int(1.5 * tokens), 16)
    base = [tuple(torch.randn(n_max, h, a.head_dim, generator=g, device=a.device, dtype=a.dtype)
                  for h in (hq, hkv, hkv)) for _ in range(a.layers)]

    def sync():
        if cuda:
            torch.cuda.synchronize(a.device)

    def micro_batch(i, rec=None, phases=True):
        """Micro-batch ``i``'s forward of every layer, then its backward; ``phases``: synchronised before, between
        and after them (else issued as a training step issues micro-batches, back to back)."""
        t = time.perf_counter()
        plan = ahead[i].result()
        wait = (time.perf_counter() - t) * 1e3
        mcp.runtime.accept_plan_check(plan, group)  # as the plugin's step takes the micro-batch
        n = plan.num_local(a.rank)
        if n > n_max:
            raise ValueError(f"rank {a.rank} holds {n} tokens, more than the {n_max} this tool allocated")
        layers = [tuple(t[:n].detach().requires_grad_() for t in layer) for layer in base]
        if phases:
            sync()
        t0 = time.perf_counter()
        outs, calls = [], []
        for q, k, v in layers:
            t = time.perf_counter()
            outs.append(mcp.attention(q, k, v, plan, group)[0])
            calls.append((time.perf_counter() - t) * 1e3)
        if phases:
            sync()
        t1 = time.perf_counter()
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        if phases:
            sync()
        t2 = time.perf_counter()
        if rec is not None:
            rec.append(dict(fwd_b2b_ms=(t1 - t0) * 1e3, bwd_b2b_ms=(t2 - t1) * 1e3, first_call_ms=calls[0],
                            call_ms=float(np.median(calls[1:] or calls)), wait_ms=wait, t=(t0, t1, t2)))

    for i in range(a.warmup):  # compiles, caches, the helper process's start
        micro_batch(i)
    ref = host_speed_us(a.device)
    recs: list[dict] = []
    for i in range(a.warmup, a.warmup + a.iters):
        micro_batch(i, recs)
    ref += host_speed_us(a.device)
    # training steps: fresh plans' micro-batches issued back to back, one synchronisation at the end (a new plan's
    # first call and a forward's host work may then run while the GPU still works through the previous backward)
    step_ms = []
    for mbs in steps:
        sync()
        t = time.perf_counter()
        for i in mbs:
            micro_batch(i, phases=False)
        sync()
        step_ms.append((time.perf_counter() - t) * 1e3 / a.iters)
    med = {k: float(np.median([r[k] for r in recs])) for k in recs[0] if k != "t"}
    row = dict(mask=mask_name, tokens_per_rank=tokens, cp=cp, rank=a.rank, heads=f"{hq}:{hkv}", head_dim=a.head_dim,
               layers=a.layers, fwd_b2b_ms=med["fwd_b2b_ms"], bwd_b2b_ms=med["bwd_b2b_ms"],
               b2b_ms=med["fwd_b2b_ms"] + med["bwd_b2b_ms"], host_ms_per_call=med["call_ms"],
               first_call_ms=med["first_call_ms"], plan_wait_ms=med["wait_ms"], host_ref_us=float(np.median(ref)),
               fwd_gpu_ms=None, bwd_gpu_ms=None,
               gpu_ms=None, host_ms_per_call_bwd=None, b2b_over_gpu=None, fwd_b2b_over_gpu=None,
               bwd_b2b_over_gpu=None, step_ms_per_mb=min(step_ms), step_gpu_ms_per_mb=None, step_over_gpu=None,
               steps_ms_per_mb=step_ms, steps_gpu_ms_per_mb=None)
    # the timed micro-batches again, each under the profiler (the same plans, their state built): GPU busy time per
    # phase of the very micro-batches timed back to back (document mixes differ between micro-batches), the
    # backward nodes' host time
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fwd_gpu, bwd_gpu, bwd_host = [], [], []
    for i in range(a.warmup, a.warmup + a.iters):
        with profile(activities=acts) as prof:
            micro_batch(i)
        ev = prof.events()
        back = [e for e in ev if BACKWARD_NODE in e.name and e.device_type == torch.autograd.DeviceType.CPU
                and "evaluate_function" in e.name]
        if back:
            bwd_host.append(sum(e.cpu_time_total for e in back) / len(back) / 1e3)
        if cuda and back:
            dev = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
            cut = min(e.time_range.start for e in back)  # the phases' boundary: the backward's first node
            fwd_gpu.append(busy_ms(dev, 0.0, cut))
            bwd_gpu.append(busy_ms(dev, cut, float("inf")))
    if bwd_host:
        row["host_ms_per_call_bwd"] = float(np.median(bwd_host))
    if fwd_gpu:
        # medians of each micro-batch's ratio (its back-to-back time over its own GPU time): a micro-batch whose plan
        # meets a list class first times the class's routes (kernels.fa4.measured) inside its back-to-back run
        f, b = ([r[k] for r in recs] for k in ("fwd_b2b_ms", "bwd_b2b_ms"))
        row["fwd_gpu_ms"], row["bwd_gpu_ms"] = float(np.median(fwd_gpu)), float(np.median(bwd_gpu))
        row["gpu_ms"] = row["fwd_gpu_ms"] + row["bwd_gpu_ms"]
        row["fwd_b2b_over_gpu"] = float(np.median([x / g for x, g in zip(f, fwd_gpu)]))
        row["bwd_b2b_over_gpu"] = float(np.median([x / g for x, g in zip(b, bwd_gpu)]))
        row["b2b_over_gpu"] = float(np.median([(x + y) / (g + h) for x, y, g, h in zip(f, b, fwd_gpu, bwd_gpu)]))
        row["gpu_ms_per_call"] = row["fwd_gpu_ms"] / a.layers
        # each step's micro-batches again under the profiler (their states built: the GPU work is the same); the
        # step's figure is the steadier step's (a step whose plans meet a list class first times its routes there)
        gpu = []
        for mbs in steps:
            with profile(activities=acts) as sprof:
                for i in mbs:
                    micro_batch(i, phases=False)
                sync()
            dev = [e for e in sprof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            gpu.append(busy_ms(dev, 0.0, float("inf")) / a.iters)
        best = min(range(STEPS), key=lambda j: step_ms[j] / gpu[j])
        row["steps_gpu_ms_per_mb"] = gpu
        row["step_ms_per_mb"], row["step_gpu_ms_per_mb"] = step_ms[best], gpu[best]
        row["step_over_gpu"] = step_ms[best] / gpu[best]
    # where a later call's host time goes inside the loop: one more micro-batch (its state built) with timers
    pieces = Pieces(mcp.runtime.resolve_backend("auto", a.device)[1])
    with pieces.installed():
        micro_batch(a.warmup)
    row["pieces_us"] = pieces.result(a.layers)
    # launches this row kept on FA4's interface on every call (each costs the host its front), with why
    row["not_replayed"] = {k: n - refused0.get(k, 0) for k, n in not_replayed(a.device).items()
                           if n > refused0.get(k, 0)}
    if a.pyprofile_path is not None:  # where the host's Python goes: one more micro-batch under cProfile
        py = cProfile.Profile()
        # the backward on this thread (autograd runs a GPU's nodes on a thread of its own, which cProfile misses)
        with torch.autograd.set_multithreading_enabled(False):
            py.enable()
            micro_batch(a.warmup)
            py.disable()
        with open(a.pyprofile_path, "a") as f:
            f.write(f"\n== {mask_name}, {tokens} tokens per rank, cp {cp}, heads {hq}:{hkv}, rank {a.rank}: one micro-batch "
                    f"({a.layers} layers, forward then backward) under cProfile, by own time\n")
            pstats.Stats(py, stream=f).sort_stats("tottime").print_stats(30)
            pstats.Stats(py, stream=f).sort_stats("cumulative").print_stats(30)
        # a new plan's first call (the rank's state built there: over a third of a forward at 8k tokens per rank)
        plan = ahead[n_mb].result()
        mcp.runtime.accept_plan_check(plan, group)
        q, k, v = (t[:plan.num_local(a.rank)] for t in base[0])
        sync()
        py = cProfile.Profile()
        py.enable()
        mcp.attention(q, k, v, plan, group)
        sync()
        py.disable()
        with open(a.pyprofile_path, "a") as f:
            f.write(f"\n== {mask_name}, {tokens} tokens per rank, cp {cp}, heads {hq}:{hkv}, rank {a.rank}: a new plan's "
                    "first forward call under cProfile, by cumulative time\n")
            pstats.Stats(py, stream=f).sort_stats("cumulative").print_stats(40)
    if profile_path is not None:
        with open(profile_path, "w") as f:
            f.write(f"{mask_name}, {tokens} tokens per rank, cp {cp}, heads {hq}:{hkv}, rank {a.rank}: the last timed "
                    f"micro-batch ({a.layers} layers, forward then backward) again, profiled\n\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    pool.shutdown()
    return row


def summary(rows) -> list[str]:
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    return markdown_table(
        ["mask", "tokens / rank", "cp", "heads", "fwd b2b / GPU ms", "bwd b2b / GPU ms", "b2b / GPU",
         "step b2b / GPU ms per MB", "host ms / call fwd, bwd", "first call ms", "plan wait ms", "host ref us"],
        [[r["mask"], r["tokens_per_rank"], r["cp"], r["heads"], f"{f(r['fwd_b2b_ms'])} / {f(r['fwd_gpu_ms'])}",
          f"{f(r['bwd_b2b_ms'])} / {f(r['bwd_gpu_ms'])}", f(r["b2b_over_gpu"]),
          f"{f(r.get('step_ms_per_mb'))} / {f(r.get('step_gpu_ms_per_mb'))} ({f(r.get('step_over_gpu'))})",
          f"{f(r['host_ms_per_call'], 3)}, {f(r['host_ms_per_call_bwd'], 3)}", f(r["first_call_ms"]),
          f(r["plan_wait_ms"]), f(r.get("host_ref_us"))] for r in rows])


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser(__doc__, "out/host_path", timing=(6, 5))  # six warm-up micro-batches: their plans meet most list classes (route timings, FA4 compiles)
    case_args(ap, "packed")
    ap.add_argument("--heads", default=None, help="comma list of Hq:Hkv (default 32:8,64:8; dry run 4:2)")
    ap.add_argument("--layers", type=int, default=None, help="attention calls per micro-batch (default 26; dry 2)")
    a = ap.parse_args(argv)
    if not a.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: --dry-run runs on the CPU")
    dry = a.dry_run
    masks, cps, tokens = case_lists(ap, a, least_cp=2)
    heads = heads_list(a.heads, dry, "32:8,64:8")
    a.layers = a.layers or (2 if dry else 26)
    a.head_dim = 16 if dry else 128
    a.device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    a.dtype = torch.float32 if dry else torch.bfloat16
    if dry:
        a.warmup, a.iters = 1, 2
    out = out_dir(a)
    command = " ".join(["python", os.path.relpath(sys.argv[0]), *argv])
    meta = run_record(device_name(a.device), command, rank=a.rank, dtype=str(a.dtype), process_group=loopback.BACKEND)
    rows = []
    a.pyprofile_path = os.path.join(out, f"host_path_pyprofile{a.tag}.txt")
    open(a.pyprofile_path, "w").close()
    for cp, name, t, h in cases_alone(a.rank, cps, masks, tokens, heads):
        prof = os.path.join(out, f"host_path_profile{a.tag}.txt") if not rows else None
        keep_row(rows, run_case(name, t, cp, h, a, prof), summary, os.path.join(out, f"host_path{a.tag}.json"), meta)
    print("\n".join(summary(rows)))
    for r in rows:  # where a later call's host time goes; launches kept on FA4's interface (hundreds of us each)
        for phase, per in (("forward us a call", r["pieces_us"]["forward"]),
                           ("backward us a layer", r["pieces_us"]["backward"])):
            print(f"pieces ({r['mask']}, cp {r['cp']}, {r['heads']}), {phase}: "
                  + "; ".join(f"{k} {us:.0f} x{n:g}" for k, (us, n) in list(per.items())[:10]))
        for what, n in r.get("not_replayed", {}).items():
            print(f"not replayed ({r['mask']}, cp {r['cp']}, {r['heads']}): {what} [{n} records]")
    return rows


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
