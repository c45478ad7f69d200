"""Routes by measured cost: where a tile list could run on FA4 or on the Triton fallback, each is timed once on
the device in hand and the faster one runs every later list of the same class.

Why: the rules in ``calls.py`` (varlen calls, block-sparse calls, the backward's partial-block threshold) were
measured for a few masks on one device; a list unlike those (many partial blocks read through an aux-tensor
``mask_mod``, say) can run several times slower on FA4 than on our Triton kernels, and the crossover moves with the
device, the head counts and the FA4 version. Measuring where it runs costs a few kernel runs once per class.

A class (``route_class``) is what decides the kernels' relative speed, coarsely enough that a new plan per
micro-batch meets classes already timed: device, direction, dtype, head counts and dims, FA4's route for the list (varlen calls or one block-sparse call), its number of calls or its partial-block
fraction (tenths), band or interval mask arithmetic, and the list's size in powers of two. One FA4 call on a dense
layout is never timed: it is FA4's own best case.

Timing (``cuda_time``): one untimed run (compilation, first-call work), the device synchronised, then three runs
between CUDA events on the current stream. Only where the device can be timed: a CUDA tensor outside CUDA graph
capture (or a timer the caller gives, as the CPU tests do), and not in deterministic mode (``TritonConfig
(deterministic=True)``: every run must take the same kernels, and two close timings may order either way);
elsewhere the rules of ``calls.py`` hold. A class whose candidates time within noise of each other may take
either in another run: results then differ in rounding only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .calls import BLOCK


def cuda_time(fn: Callable[[], object], reps: int = 3) -> float:
    """Seconds one ``fn()`` takes on the current CUDA stream (after one untimed run)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _log2(x: float) -> int:
    return int(round(math.log2(max(1.0, float(x)))))


def route_class(phase: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls, fa4_route: str) -> tuple | None:
    """The class of a list whose ``phase`` could run on FA4 (``fa4_route``: "varlen" / "blocks") or Triton, or
    None where nothing is to be chosen (one FA4 call on a dense layout)."""
    runs = calls.fwd if phase == "fwd" else calls.bwd
    if fa4_route == "varlen" and len(runs) == 1 and runs[0].dense:
        return None
    head = (str(q.device), phase, str(q.dtype), q.shape[1], k.shape[1], q.shape[2], v.shape[2], _log2(calls.seqlen_q))
    if fa4_route == "blocks":
        b = calls.blocks
        total = b.full_blocks + b.partial_blocks
        return head + ("blocks", b.band is not None, b.intervals, round(10 * b.partial_blocks / max(1, total)),
                       _log2(total))
    return head + ("varlen", len(runs), _log2(sum(c.area for c in runs) / BLOCK ** 2))


@dataclass
class RouteTimes:
    """The routes measured so far in this process, per class: (choice, FA4 seconds, Triton seconds).
    ``timer``: how a candidate is timed (default ``cuda_time`` on CUDA tensors outside graph capture)."""

    timer: Callable[[Callable[[], object]], float] | None = None
    chosen: dict = field(default_factory=dict)

    def can_time(self, q: torch.Tensor) -> bool:
        if self.timer is not None:
            return True
        return q.is_cuda and not torch.cuda.is_current_stream_capturing()

    def choose(self, key: tuple, fa4: Callable[[], object], triton: Callable[[], object]) -> tuple:
        """(choice, FA4 s, Triton s) of ``key``: timed now on the first meeting of its class, kept after."""
        got = self.chosen.get(key)
        if got is None:
            time = self.timer or cuda_time
            t_fa4, t_tri = time(fa4), time(triton)
            got = self.chosen[key] = ("triton" if t_tri < t_fa4 else "fa4", t_fa4, t_tri)
        return got

    def describe(self) -> list[dict]:
        return [{"class": k, "runs": c, "fa4_ms": round(f * 1e3, 4), "triton_ms": round(t * 1e3, 4)}
                for k, (c, f, t) in self.chosen.items()]


def list_reason(routes: RouteTimes, phase: str, q, k, v, prepared, deterministic: bool,
                candidates: tuple | None) -> str | None:
    """Why the list ``prepared`` runs ``phase`` on Triton - a rule of ``calls.py`` where nothing was measured, or
    Triton measured faster here - or None (FA4 runs it). ``candidates``: makes this call's (FA4 run, Triton run),
    called only to time the class on first meeting (None, or making None: they cannot be timed here; the class
    keeps the rules until a call can time them)."""
    calls = prepared.calls
    route = calls.fa4_route(phase)
    if route is None or deterministic:  # deterministic: the same kernels in every run, never a timing's pick
        return calls.triton_reason(phase)
    sig = (phase, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], v.shape[2])
    if sig not in prepared._classes:  # a list's class is fixed for its inputs' shapes: found once
        prepared._classes[sig] = route_class(phase, q, k, v, calls, route)
    key = prepared._classes[sig]
    got = routes.chosen.get(key) if key is not None else None
    if got is None and key is not None and candidates is not None and routes.can_time(q):
        pair = candidates()
        if pair is not None:
            got = routes.choose(key, *pair)
    if got is None:
        return calls.triton_reason(phase)
    if got[0] == "triton":
        return f"measured faster here: {got[2] * 1e3:.3f} ms against FA4's {route} {got[1] * 1e3:.3f} ms"
    return None
