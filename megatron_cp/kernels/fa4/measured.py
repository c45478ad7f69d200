"""Routes by measured cost: where a tile list could run more than one way - FA4's varlen calls, FA4's one
block-sparse call, the Triton kernels - each is timed once on the device in hand and the fastest runs every later
list of the same class, forward and backward apart.

Why: the rules in ``calls.py`` (up to two varlen calls, else one block-sparse call; the backward's partial-block
threshold) were measured for a few masks on one device; a list unlike those (many partial blocks read through an
aux-tensor ``mask_mod``, say) can run several times slower on FA4 than on our Triton kernels, and the crossovers
move with the device, the head counts and the FA4 version. Measuring where it runs costs a few kernel runs once per
class.

A class (``route_class``) is what decides the candidates' relative speed, coarsely enough that a new plan per
micro-batch meets classes already timed: device, direction, dtype, head counts and dims, the list's number of
varlen calls and its size in powers of two, and where it has a block-sparse form, band or interval mask arithmetic,
its partial-block fraction (tenths) and its block count in powers of two. One FA4 call on a dense layout, full or
causal, is never timed: it is FA4's own best case (a window's is: a narrow window's backward ran slower on FA4 than
on our Triton kernels).

Timing (``cuda_time``): two untimed runs (compilation, the first replay's check), the device synchronised, then
three runs between CUDA events on the current stream, queued behind a spin so that their GPU time is measured apart
from the host time that issues them; a candidate costs the larger of the two (fastest runs each). Layer calls are
issued back to back, so a list with little GPU work (a few guest rows, short documents) costs the step its host
time: a route of several launches there loses to a one-launch route whose kernel runs slower. Only where the device
can be timed: a CUDA tensor outside CUDA graph
capture (or a timer the caller gives, as the CPU tests do), and not in deterministic mode (``TritonConfig
(deterministic=True)``: every run must take the same kernels, and two close timings may order either way);
elsewhere the rules of ``calls.py`` hold. A class whose candidates time within noise of each other may take
either in another run: results then differ in rounding only.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .calls import BLOCK


def cuda_time(fn: Callable[[], object], reps: int = 3) -> float:
    """Seconds one ``fn()`` costs a step on the current CUDA stream: the larger of its GPU time and the host time
    that issues it, each the fastest of ``reps`` runs.

    Two untimed runs first: the first compiles and records (FA4's replayed launches), the second is a replay's
    first, checked against FA4's own path (an extra run and a sync). The timed runs are queued behind a spin of
    ``HOLD_CYCLES``, so that their GPU time does not include the host's issuing and each run's issuing is timed
    on the host while the GPU waits."""
    fn()
    fn()
    torch.cuda.synchronize()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    torch.cuda._sleep(HOLD_CYCLES)
    marks[0].record()
    host = []
    for m in marks[1:]:
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
        m.record()
    marks[-1].synchronize()
    return max(min(a.elapsed_time(b) for a, b in zip(marks, marks[1:])) / 1e3, min(host))


# ~5 ms of a GPU clock near 2 GHz: longer than the host needs to issue a candidate's timed runs (a Triton backward
# of a list with many pieces issues for about a millisecond a run)
HOLD_CYCLES = 10_000_000


def _log2(x: float) -> int:
    return int(round(math.log2(max(1.0, float(x)))))


ROUTES = ("varlen", "blocks", "triton")  # the ways a list's phase can run: FA4's varlen calls, its one block-sparse call, Triton

# more varlen calls than this are no candidate worth timing: each is a launch, and the block-sparse form exists
MAX_TIMED_VARLEN_CALLS = 8


def fa4_routes(calls, phase: str) -> tuple[str, ...]:
    """FA4's ways to run the list's ``phase`` worth timing: "varlen" (its calls, up to ``MAX_TIMED_VARLEN_CALLS``
    of them) and "blocks" (one block-sparse call) where that form exists (``calls.blocks``: every list of more
    than two calls that has one, and lists of whole blocks)."""
    runs = calls.fwd if phase == "fwd" else calls.bwd
    out = ("varlen",) if len(runs) <= MAX_TIMED_VARLEN_CALLS else ()
    return out + (("blocks",) if calls.blocks is not None else ())


def route_class(phase: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls) -> tuple | None:
    """The class of a list whose ``phase`` could run in more than one way, or None where nothing is to be chosen
    (one FA4 call on a dense layout, full or causal: FA4's own best case)."""
    runs = calls.fwd if phase == "fwd" else calls.bwd
    if len(runs) == 1 and runs[0].dense and runs[0].left is None:  # full or causal; a window's is timed (narrow
        return None  # windows' backward can run faster on our Triton kernels)
    head = (str(q.device), phase, str(q.dtype), q.shape[1], k.shape[1], q.shape[2], v.shape[2], _log2(calls.seqlen_q))
    b, blocks = calls.blocks, None
    if b is not None:
        total = b.full_blocks + b.partial_blocks
        form = 0 if b.band is None else len(b.band)  # a periodic band (six values) is priced apart from a plain one
        blocks = (form, b.mask(phase)[0], round(10 * b.partial_blocks / max(1, total)), _log2(total))
    return head + (len(runs), _log2(sum(c.area for c in runs) / BLOCK ** 2), blocks)


@dataclass
class RouteTimes:
    """The routes measured so far in this process, per class: (the fastest's name, {name: seconds}) over the
    candidates ("varlen", "blocks": FA4's; "triton"). ``timer``: how a candidate is timed (default ``cuda_time``
    on CUDA tensors outside graph capture)."""

    timer: Callable[[Callable[[], object]], float] | None = None
    chosen: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)  # (class, candidate) -> the error a timed candidate raised

    def can_time(self, q: torch.Tensor) -> bool:
        if self.timer is not None:
            return True
        return q.is_cuda and not torch.cuda.is_current_stream_capturing()

    def choose(self, key: tuple, candidates: dict) -> tuple:
        """(fastest, {name: seconds}) of ``key``: timed now on the first meeting of its class, kept after. A
        candidate that raises is left out (its error kept in ``failed``, shown by ``describe``) where another
        ran; where none ran, the first error is raised."""
        got = self.chosen.get(key)
        if got is None:
            time, times, errors = self.timer or cuda_time, {}, []
            for name, fn in candidates.items():
                try:
                    times[name] = time(fn)
                except Exception as e:  # noqa: BLE001 - once per class; the other candidates compute the same
                    self.failed[(key, name)] = f"{type(e).__name__}: {e}"
                    errors.append(e)
            if not times:
                raise errors[0]
            got = self.chosen[key] = (min(times, key=times.get), times)
        return got

    def describe(self) -> list[dict]:
        out = [{"class": k, "runs": c, **{f"{n}_ms": round(t * 1e3, 4) for n, t in times.items()}}
               for k, (c, times) in self.chosen.items()]
        return out + [{"class": k, "failed": n, "error": e} for (k, n), e in self.failed.items()]


def list_route(routes: RouteTimes, phase: str, q, k, v, prepared, deterministic: bool,
               candidates: Callable | None) -> tuple[str, str | None]:
    """(route, reason) of the list ``prepared``'s ``phase``: "varlen" / "blocks" (FA4's) with None, or "triton"
    with why - a rule of ``calls.py`` where nothing was measured, or Triton measured fastest here. Decided once per
    list and input shape (kept in ``prepared._routes``: a layer call after the first is one look-up).
    ``candidates(names)``: makes this call's runs {name: run} of those routes, called only to time the class on
    first meeting (None, or making None: they cannot be timed here)."""
    sig = (phase, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], v.shape[2])
    known = prepared._routes.get(sig)
    if known is not None:
        return known
    calls = prepared.calls
    prior = calls.route(phase)
    got, final = None, True
    if deterministic:  # the same kernels in every run, never a timing's pick; FA4's deterministic bwd is varlen
        prior = prior if prior == "triton" or phase == "fwd" else "varlen"
    else:
        key = route_class(phase, q, k, v, calls)
        ways = fa4_routes(calls, phase) if key is not None else ()
        got = routes.chosen.get(key) if ways else None
        if got is None and ways:
            if candidates is not None and routes.can_time(q):
                fns = candidates(ways + ("triton",))  # None: Triton cannot run these inputs, the rules hold
                got = routes.choose(key, fns) if fns is not None else None
            else:  # the rules for this call; a CPU tensor is never timed, graph capture may end
                final = not q.is_cuda
    if got is None:
        out = (prior, calls.triton_reason(phase) if prior == "triton" else None)
    elif got[0] != "triton":
        out = (got[0], None)
    else:
        times = got[1]
        fa4 = min(((t, n) for n, t in times.items() if n != "triton"), default=None)
        against = "no FA4 route that ran" if fa4 is None else f"FA4's {fa4[1]} {fa4[0] * 1e3:.3f} ms"
        out = ("triton", f"measured fastest here: {times['triton'] * 1e3:.3f} ms against {against}")
    if final:
        prepared._routes[sig] = out
    return out
