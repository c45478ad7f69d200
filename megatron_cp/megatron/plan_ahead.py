"""Planning off the step's critical path: plan the next micro-batches while the current one trains.

``PlanAhead(batches, plan_fn, depth)`` wraps the micro-batch iterator that ``forward_step`` pulls with
``next(data_iterator)``. A background thread (``concurrent.futures``) runs ``plan_fn`` on
the next ``depth`` micro-batches while the step computes; ``plan_fn`` leaves the plan in the plan cache
(``planning.plan_for_batch``), so ``prepare_batch`` finds it there instead of planning on the step.
``next()`` yields each micro-batch unchanged once its plan is made and records how long it was blocked
waiting for it (``waits``): zero when planning keeps ahead of the step.

The planner is pure numpy and Python: the thread shares the GIL with the training loop. Where the loop is
busy on the host (small micro-batches: issuing kernels is all it does), every numpy call of the planner that
releases the GIL then waits up to the interpreter's switch interval (5 ms by default) to get it back, and a
plan of hundreds of such calls takes many times its own CPU time. While a ``PlanAhead`` is open the switch
interval is at most ``SWITCH_INTERVAL_S`` (0.5 ms), restored when the last one closes; the setting matters
only while two threads want the GIL, i.e. while a plan is being made. ``depth = 0`` plans
inline in ``next()`` (the step then waits for every plan: the same measurement without planning ahead).

Plans that take longer than a micro-batch (one plan over DP x CP at hundreds of ranks: ~0.8 s at 1024) cannot
keep ahead one at a time, however deep the queue. So the plans start one at a time, in micro-batch order, and
each time two of four consecutive micro-batches wait for their plans (after the first ``depth``) one more may run
at once (up to ``max_workers``; on a GPU each waits on its own planning helper process, ``runtime.plan_in_helper``).
A ``plan_fn`` whose collectives must come in the same order on every rank puts them in ``with in_turn():``: the
plans' turns come in micro-batch order (one such section per plan).

    data_iterator = plan_ahead(data_iterator, lambda d: plan_for_batch(d["tokens"], spec, cp_size, options))
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

_WRAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
SWITCH_INTERVAL_S = 5e-4  # the GIL switch interval while a planning thread runs (module doc)
LATE_S = 1e-3  # a wait for a plan longer than this counts as planning falling behind
_OPEN = {"count": 0, "saved": None}
_OPEN_LOCK = threading.Lock()
_TURN = threading.local()  # the running plan's (turns, ticket), set by PlanAhead around plan_fn


def default_workers(processes_per_node: int) -> int:
    """Plans at most at once for a training process sharing its node's cores with ``processes_per_node - 1``
    others: 8 (a 2 s plan, one over DP x CP at 1024 ranks on a slow core, beside a 0.25 s micro-batch needs about
    that many), fewer where the cores per process leave less than one per planner beside the process itself."""
    if isinstance(processes_per_node, bool) or not isinstance(processes_per_node, int) or processes_per_node < 1:
        raise ValueError(f"processes_per_node must be an int >= 1, got {processes_per_node!r}")
    return max(1, min(8, (os.cpu_count() or 1) // processes_per_node - 1))


class _Turns:
    """Plans start in ticket order, at most ``workers`` at once, and pass their ordered section in ticket order
    (a plan that ends without one passes its turn when it ends)."""

    def __init__(self):
        self.cv = threading.Condition()
        self.workers, self.running, self.next_start, self.turn = 1, 0, 0, 0
        self.passed: set = set()

    def start(self, t: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.next_start == t and self.running < self.workers)
            self.next_start += 1
            self.running += 1

    def enter(self, t: int) -> None:
        with self.cv:
            if self.turn > t:
                raise RuntimeError("in_turn: one ordered section per plan (this plan's turn has passed)")
            self.cv.wait_for(lambda: self.turn == t)

    def leave(self, t: int, *, finished: bool = False) -> None:
        with self.cv:
            self.running -= finished
            if t >= self.turn:
                self.passed.add(t)
            while self.turn in self.passed:
                self.passed.discard(self.turn)
                self.turn += 1
            self.cv.notify_all()

    def grow(self, cap: int) -> bool:
        with self.cv:
            if self.workers >= cap:
                return False
            self.workers += 1
            self.cv.notify_all()
            return True


@contextlib.contextmanager
def in_turn():
    """Inside a ``PlanAhead``'s ``plan_fn``: the block runs in micro-batch order across the plans being made at
    once (put the plan's collectives here, so every rank issues them in one order). Elsewhere: no effect."""
    cur = getattr(_TURN, "cur", None)
    if cur is None:
        yield
        return
    turns, t = cur
    turns.enter(t)
    try:
        yield
    finally:
        turns.leave(t)


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
    ``depth`` micro-batches ahead by background threads (one at a time until two of four consecutive micro-batches
    wait on their plans after the first ``depth``; then one more at once each time, up to ``max_workers``: 1 unless
    given, e.g. ``default_workers(processes per node)`` as the Megatron plugin passes).

    ``waits``: seconds each ``next()`` spent blocked on its micro-batch's unfinished plan (a list, one
    float per micro-batch yielded); ``plan_times``: seconds each ``plan_fn`` call took, in the same
    order; ``workers``: plans allowed at once now; ``last``: what ``plan_fn`` returned for the micro-batch
    ``next()`` yielded last. An exception of ``plan_fn`` is raised by the ``next()`` that yields that
    micro-batch."""

    def __init__(self, batches, plan_fn: Callable, depth: int = 2, max_workers: int = 1):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"depth must be an int >= 0 (micro-batches planned ahead), got {depth!r}")
        cap = max_workers
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"max_workers must be an int >= 1 (plans made at once), got {max_workers!r}")
        self._it: Iterator = iter(batches)
        self._plan_fn = plan_fn
        self.depth, self.max_workers = depth, cap
        self._turns = _Turns()
        self._tickets = 0
        self._pool = ThreadPoolExecutor(max_workers=cap + 1, thread_name_prefix="megatron_cp-plan") if depth \
            else None
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

    @property
    def workers(self) -> int:
        return self._turns.workers

    def _timed(self, batch, ticket: int | None = None) -> tuple[float, object]:
        if ticket is not None:
            self._turns.start(ticket)
            _TURN.cur = (self._turns, ticket)
        try:
            t = time.perf_counter()
            out = self._plan_fn(batch)
            return time.perf_counter() - t, out
        finally:
            if ticket is not None:
                _TURN.cur = None
                self._turns.leave(ticket, finished=True)

    def _fill(self) -> None:
        """Pull micro-batches until ``depth`` of them are being planned (or the data ends)."""
        while not self._done and len(self._ahead) < self.depth:
            try:
                batch = next(self._it)
            except StopIteration:
                self._done = True
                break
            self._ahead.append((batch, self._pool.submit(self._timed, batch, self._tickets)))
            self._tickets += 1

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
        # planning fell behind: two of the last four micro-batches waited, after the first ``depth`` (a single late
        # plan, a pause of the loader or a slow node, does not start another helper for good; plans of uneven
        # length finish in bursts, so a pace just short of the step's shows as one wait in every few, not in a row)
        if len(self.waits) > self.depth + 1 and sum(w > LATE_S for w in self.waits[-4:]) >= 2 \
                and self._turns.grow(self.max_workers):
            self.depth = max(self.depth, self._turns.workers + 1)
            self._fill()
        return batch

    def close(self) -> None:
        """Stop the background threads (plans already queued finish first); the last open ``PlanAhead`` to close
        restores the switch interval."""
        self._done = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
            self._release()

    def stats(self) -> dict:
        """``{"micro_batches", "wait_s", "max_wait_s", "plan_s", "workers"}``: totals over the micro-batches
        yielded, and the plans allowed at once at the end."""
        return {"micro_batches": len(self.waits), "wait_s": sum(self.waits), "max_wait_s": max(self.waits, default=0.0),
                "plan_s": sum(self.plan_times), "workers": self.workers}


def wrapped_by(batches) -> PlanAhead | None:
    """The ``PlanAhead`` that ``plan_ahead`` made around ``batches`` (``batches`` itself if it is one), or None;
    TypeError for an iterator that cannot be weakly referenced."""
    return batches if isinstance(batches, PlanAhead) else _WRAPPED.get(batches)


def plan_ahead(batches, plan_fn: Callable, depth: int = 2, max_workers: int = 1) -> PlanAhead:
    """``PlanAhead(batches, plan_fn, depth, max_workers)``, once per iterator: a schedule hands ``forward_step`` the
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
        ahead = _WRAPPED[batches] = PlanAhead(batches, plan_fn, depth, max_workers)
    return ahead
