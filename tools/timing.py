"""How the benchmarks time a step: ``Timer`` (GPU time behind a held stream, wall time, back to back).

A module shared by tools/bench_dist.py and tools/sim/calibrate.py (which must time kernels the way the
benchmark times a step, or the cost model it fits would predict another quantity); not a tool itself.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from megatron_cp.comm import all_gather_single


class Timer:
    """Times one forward + backward step per iteration, two ways (medians of the slowest rank's times),
    then a few steps back to back (the third way, ``back_to_back``):

    * GPU time (the headline): the stream is held by a spin kernel (then a tiny all-reduce that
      releases every GPU at once) while the host issues the step, so CUDA events time the GPU work
      alone. In training the host runs ahead of the GPU (other layers' kernels are queued).
      ``kernel-only`` below is timed the same way (its calls queued behind a held stream), so that
      both start from the same GPU state (after a hold, the same kernels ran 5-17% faster than in a
      loop of calls on H200: docs/cost-model.md); a step whose host issue outlasts the hold shows that
      as GPU idle time.
    * wall time: host issue + GPU of an isolated step (sync, barrier, time, sync), which also counts
      the host's launch latency before the first kernel.
    * back to back (``fwd_b2b_ms``): steps with no sync or hold between them, CUDA events around each
      phase: a training step's conditions (host ahead when it can be, kernels at sustained clocks).
    On CPU (gloo dry runs) the first two are wall time and the third is not measured."""

    HOLD_CYCLES = 20_000_000  # ~10 ms of GPU clock: longer than any implementation's host issue time

    def __init__(self, device, warm_seconds=0.0):
        self.device = device
        self.warm_seconds = warm_seconds

    def warm(self, step, group=None):
        """Run ``step`` back to back for about ``warm_seconds`` before timing (a GPU that has been busy,
        not only the few warm-up steps; on 4 x H200 it changed nothing beyond run-to-run spread).
        With ``group``, every rank runs the same number of steps (their collectives must match): the most
        any rank needs."""
        if self.warm_seconds <= 0:
            return
        self.sync()
        t0 = time.perf_counter()
        step()
        self.sync()
        n = torch.tensor([math.ceil(self.warm_seconds / max(time.perf_counter() - t0, 1e-6))], device=self.device)
        if group is not None:
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        for _ in range(int(n.item()) - 1):
            step()
        self.sync()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def hold(self, group):
        """Hold this GPU's stream, then (with ``group``) line the GPUs up: the spin lasts a different time
        on each GPU (clocks differ), so a tiny all-reduce queued behind it releases all of them together."""
        torch.cuda._sleep(self.HOLD_CYCLES)  # torch's only spin kernel (private, used by its own tests)
        if group is not None:
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)

    def held(self, fwd, bwd, group=None):
        """(fwd, bwd) GPU seconds of one step, each phase issued while the stream is held (CUDA events from
        the end of the hold); ``group``: the GPUs are released together."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        self.sync()
        self.hold(group)
        ev[0].record()
        out = fwd()
        ev[1].record()
        self.hold(group)
        ev[2].record()
        bwd(out)
        ev[3].record()
        self.sync()
        del out
        return ev[0].elapsed_time(ev[1]) / 1e3, ev[2].elapsed_time(ev[3]) / 1e3

    def run(self, fwd, bwd, warmup, iters, group):
        """(fwd, bwd, fwd wall, bwd wall, fwd back to back, bwd back to back) seconds (the last two None on
        CPU)."""
        cuda = self.device.type == "cuda"
        rows = []
        self.warm(lambda: bwd(fwd()), group)
        for i in range(warmup + iters):
            self.sync()
            dist.barrier(group)
            t0 = time.perf_counter()
            out = fwd()
            self.sync()
            t1 = time.perf_counter()
            bwd(out)
            self.sync()
            t2 = time.perf_counter()
            del out
            gf, gb = t1 - t0, t2 - t1
            if cuda:
                dist.barrier(group)
                gf, gb = self.held(fwd, bwd, group)
            if i >= warmup:
                t = torch.tensor([gf, gb, t1 - t0, t2 - t1], dtype=torch.float64, device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                rows.append(t.tolist())
        rows = torch.tensor(rows, dtype=torch.float64)
        return tuple(float(x) for x in rows.median(dim=0).values) + self.back_to_back(fwd, bwd, iters, group)

    def back_to_back(self, fwd, bwd, iters, group):
        """(fwd, bwd) seconds of steps run back to back with no sync or hold between them (the host
        issues step i+1 while the GPU runs step i, as in training; kernels at the GPU's sustained rate,
        which a step behind a held stream exceeds by 5-17%: docs/cost-model.md),
        CUDA events around each phase, the first step dropped; (None, None) on CPU. Each rank's medians
        (GPU fwd, GPU bwd, host issue fwd, host issue bwd; seconds) are left in ``self.b2b_ranks``: a phase
        whose host issue outlasts the GPU's work runs at the host's pace, and one rank's slower phase is
        the max the others wait for at the next collective."""
        if self.device.type != "cuda":
            return None, None
        self.sync()
        dist.barrier(group)
        evs, host = [], []
        for _ in range(iters + 1):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            h0 = time.perf_counter()
            ev[0].record()
            out = fwd()
            ev[1].record()
            h1 = time.perf_counter()
            bwd(out)
            ev[2].record()
            host.append((h1 - h0, time.perf_counter() - h1))
            del out
            evs.append(ev)
        self.sync()
        t = torch.tensor([[a.elapsed_time(b) / 1e3, b.elapsed_time(c) / 1e3] + list(h)
                          for (a, b, c), h in zip(evs[1:], host[1:])], dtype=torch.float64, device=self.device)
        # each rank's medians (GPU fwd, bwd, host issue fwd, bwd): where the slowest rank's time comes from
        mine = t.median(dim=0).values
        ranks = torch.empty(dist.get_world_size(group), 4, dtype=torch.float64, device=self.device)
        all_gather_single(ranks, mine, group=group)
        self.b2b_ranks = ranks.tolist()
        t = t[:, :2].contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return tuple(float(x) for x in t.median(dim=0).values)
