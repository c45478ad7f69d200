"""Planning off the step's critical path: plan the next micro-batches while the current one trains.

``PlanAhead(batches, plan_fn, depth)`` wraps the micro-batch iterator that ``forward_step`` pulls with
``next(data_iterator)``. One background thread (``concurrent.futures``, one worker) runs ``plan_fn`` on
the next ``depth`` micro-batches while the step computes; ``plan_fn`` leaves the plan in the plan cache
(``batch.plan_for_batch``), so ``prepare_batch`` finds it there instead of planning on the step.
``next()`` yields each micro-batch unchanged once its plan is made and records how long it was blocked
waiting for it (``waits``): zero when planning keeps ahead of the step.

The planner is pure numpy and Python: the thread shares the GIL with the training loop. Where the loop is
busy on the host (small micro-batches: issuing kernels is all it does), every numpy call of the planner that
releases the GIL then waits up to the interpreter's switch interval (5 ms by default) to get it back, and a
plan of hundreds of such calls takes many times its own CPU time. While a ``PlanAhead`` is open the switch
interval is at most ``SWITCH_INTERVAL_S`` (0.5 ms), restored when the last one closes; the setting matters
only while two threads want the GIL, i.e. while a plan is being made. ``depth = 0`` plans
inline in ``next()`` (the step then waits for every plan: the same measurement without planning ahead).

    data_iterator = plan_ahead(data_iterator, lambda d: plan_for_batch(d["tokens"], spec, cp_size, options))
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

_WRAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
SWITCH_INTERVAL_S = 5e-4  # the GIL switch interval while a planning thread runs (module doc)
_OPEN = {"count": 0, "saved": None}
_OPEN_LOCK = threading.Lock()


def _planning_started() -> None:
    with _OPEN_LOCK:
        if _OPEN["count"] == 0:
            _OPEN["saved"] = sys.getswitchinterval()
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        _OPEN["count"] += 1


def _release_pool(pool) -> None:
    pool.shutdown(wait=False)
    _planning_stopped()


def _planning_stopped() -> None:
    with _OPEN_LOCK:
        _OPEN["count"] -= 1
        if _OPEN["count"] == 0 and _OPEN["saved"] is not None:
            sys.setswitchinterval(_OPEN["saved"])
            _OPEN["saved"] = None


class PlanAhead:
    """Iterator over ``batches`` (unchanged, in order) whose plans ``plan_fn(batch)`` are made up to
    ``depth`` micro-batches ahead in one background thread.

    ``waits``: seconds each ``next()`` spent blocked on its micro-batch's unfinished plan (a list, one
    float per micro-batch yielded); ``plan_times``: seconds each ``plan_fn`` call took, in the same
    order; ``last``: what ``plan_fn`` returned for the micro-batch ``next()`` yielded last. An exception of
    ``plan_fn`` is raised by the ``next()`` that yields that micro-batch."""

    def __init__(self, batches, plan_fn: Callable, depth: int = 2):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"depth must be an int >= 0 (micro-batches planned ahead), got {depth!r}")
        self._it: Iterator = iter(batches)
        self._plan_fn = plan_fn
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatron_cp-plan") if depth else None
        if self._pool is not None:
            _planning_started()
            # the switch interval comes back when this object closes or, never closed, is collected
            self._release = weakref.finalize(self, _release_pool, self._pool)
        self._ahead: deque = deque()  # (batch, future of its plan_fn timing), oldest first
        self._done = False
        self.waits: list[float] = []
        self.plan_times: list[float] = []
        self.last = None
        self._fill()

    def _timed(self, batch) -> tuple[float, object]:
        t = time.perf_counter()
        out = self._plan_fn(batch)
        return time.perf_counter() - t, out

    def _fill(self) -> None:
        """Pull micro-batches until ``depth`` of them are being planned (or the data ends)."""
        while not self._done and len(self._ahead) < self.depth:
            try:
                batch = next(self._it)
            except StopIteration:
                self._done = True
                break
            self._ahead.append((batch, self._pool.submit(self._timed, batch)))

    def __iter__(self):
        return self

    def __next__(self):
        if self.depth == 0:
            batch = next(self._it)
            t = time.perf_counter()
            took, self.last = self._timed(batch)
            self.plan_times.append(took)
            self.waits.append(time.perf_counter() - t)
            return batch
        if not self._ahead:
            self.close()
            raise StopIteration
        batch, fut = self._ahead.popleft()
        self._fill()  # the next micro-batch starts planning behind the ones already queued
        t = time.perf_counter()
        try:
            took, self.last = fut.result()
            self.plan_times.append(took)
        finally:
            self.waits.append(time.perf_counter() - t)
        return batch

    def close(self) -> None:
        """Stop the background thread (plans already queued finish first); the last open ``PlanAhead`` to close
        restores the switch interval."""
        self._done = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
            self._release()

    def stats(self) -> dict:
        """``{"micro_batches", "wait_s", "max_wait_s", "plan_s"}``: totals over the micro-batches yielded."""
        return {"micro_batches": len(self.waits), "wait_s": sum(self.waits), "max_wait_s": max(self.waits, default=0.0),
                "plan_s": sum(self.plan_times)}


def wrapped_by(batches) -> PlanAhead | None:
    """The ``PlanAhead`` that ``plan_ahead`` made around ``batches`` (``batches`` itself if it is one), or None;
    TypeError for an iterator that cannot be weakly referenced."""
    return batches if isinstance(batches, PlanAhead) else _WRAPPED.get(batches)


def plan_ahead(batches, plan_fn: Callable, depth: int = 2) -> PlanAhead:
    """``PlanAhead(batches, plan_fn, depth)``, once per iterator: a schedule hands ``forward_step`` the
    same iterator every micro-batch, so wrapping it there returns the wrapper made the first time.
    Raises TypeError for an iterator that cannot be weakly referenced (a built-in one such as
    ``iter(list)``): wrap that once yourself with ``PlanAhead``."""
    if isinstance(batches, PlanAhead):
        return batches
    try:
        ahead = _WRAPPED.get(batches)
    except TypeError:
        raise TypeError(f"plan_ahead needs an iterator it can weakly reference to wrap it once, got a "
                        f"{type(batches).__name__}; wrap it once with PlanAhead(...) instead") from None
    if ahead is None:
        ahead = _WRAPPED[batches] = PlanAhead(batches, plan_fn, depth)
    return ahead
