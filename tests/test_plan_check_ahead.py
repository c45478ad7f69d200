"""A plan checked across the CP ranks by its planning thread (runtime.check_plan_ahead, on a gloo group of the
thread's own) and accepted by the step (runtime.accept_plan_check) needs no collective at its first attention call
once the inputs' fields were agreed on an earlier plan; a plan that differs across ranks is caught in the thread,
on every rank. Two gloo ranks."""

from __future__ import annotations

import gc
import threading
import weakref
from functools import partial

import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp.testing import run_ranks


def _in_thread(fn):
    """fn() on a thread of its own, as a planning thread runs it: its error string, or None."""
    err = []

    def run():
        try:
            fn()
        except RuntimeError as e:
            err.append(str(e))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return err[0] if err else None


def _rank(rank, world, case):
    group = dist.group.WORLD
    check = mcp.runtime.planning_group(group, "test")
    plans = [mcp.plan(mcp.masks.varlen(cu, causal=True), world) for cu in ([0, 100, 256], [0, 30, 256], [0, 200, 256])]
    if case == "differ":
        mine = plans[rank]  # rank 0 and rank 1 hold different plans of the same length
        return _in_thread(lambda: mcp.runtime.check_plan_ahead(mine, group, check))
    for p in plans:
        assert _in_thread(lambda p=p: mcp.runtime.check_plan_ahead(p, group, check)) is None
    for p in plans[:2]:  # the step takes these micro-batches; the third's check it never accepted
        mcp.runtime.accept_plan_check(p, group)
    calls = []
    real = dist.all_reduce

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    dist.all_reduce = counted
    g = torch.Generator().manual_seed(rank)
    per_plan = []
    try:
        for p in plans:  # accepted, accepted, checked ahead but not accepted
            before = len(calls)
            q, k, v = (torch.randn(p.num_local(rank), h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
            mcp.attention(q, k, v, p, group)
            per_plan.append(len(calls) - before)
    finally:
        dist.all_reduce = real
    return per_plan


def test_a_plan_checked_ahead_runs_no_collective_at_its_first_call():
    got = run_ranks(_rank, 2, "same")
    # the first plan agrees the fields (one check), the second was checked ahead and accepted with the same fields
    # (none), the third's check the step never accepted (one)
    assert got == [[1, 0, 1], [1, 0, 1]], got


def test_plans_that_differ_are_caught_in_the_planning_thread_on_every_rank():
    got = run_ranks(_rank, 2, "differ")
    assert all(m is not None and "CP ranks disagree: plan digest differs across ranks" in m for m in got), got


def _count_all_reduces(fn):
    calls, real = [], dist.all_reduce

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    dist.all_reduce = counted
    try:
        fn()
    finally:
        dist.all_reduce = real
    return len(calls)


def _replaced_group(rank, world):
    plans = [mcp.plan(mcp.masks.varlen(cu, causal=True), world) for cu in ([0, 100, 256], [0, 30, 256])]
    g = torch.Generator().manual_seed(rank)
    qkv = [[torch.randn(p.num_local(rank), h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2)] for p in plans]
    old = dist.new_group([0, 1])
    check = mcp.runtime.planning_group(dist.group.WORLD, "replaced")
    for p in plans:
        assert _in_thread(partial(mcp.runtime.check_plan_ahead, p, old, check)) is None
        mcp.runtime.accept_plan_check(p, old)
    counts = [_count_all_reduces(partial(mcp.attention, *qkv[i], plans[i], old)) for i in range(2)]
    # a layout change: the old group destroyed and collected (its id free for reuse), a new one over the same ranks
    dist.destroy_process_group(old)
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None, "nothing of megatron-cp's may keep a destroyed group alive"
    new = dist.new_group([0, 1])
    # the new group has agreed nothing, whether or not it took the old one's id: the cached plan's first call
    # with it checks again, on every rank (keyed by id, a rank that got the old id back skipped it: a hang)
    counts.append(_count_all_reduces(partial(mcp.attention, *qkv[1], plans[1], new)))
    return counts


def test_a_new_group_inherits_no_check_of_a_destroyed_one():
    got = run_ranks(_replaced_group, 2)
    assert got == [[1, 0, 1], [1, 0, 1]], got
