"""Later attention calls of a plan on a group that checks only the plan's first call (NCCL; gloo with the plan
checked ahead): a call whose head counts, head dims or dtype were never agreed on the group is checked then.
Every rank changed alike (a model whose layers differ): the ranks meet in the check and go on, exact; a rank alone
in its change raises a ValueError naming its fields and the agreed ones, before any exchange, and its peers raise
it from their exchange (``runtime.faults``) instead of finishing; so does an input check failing on one rank
alone. Gloo ranks that take NCCL's decision (``_checks_every_call`` False), and gloo's own (every call checks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp.runtime import faults, state
from megatron_cp.testing import reference_attention, run_ranks

S = 96


def _counted():
    calls, real = [], dist.all_reduce

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    dist.all_reduce = counted
    return calls


def _inputs(hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(S, h, d, generator=g, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv)]


def _alike(rank, world):
    """Every rank: heads 4:2, then 6:3 (new: one check), 6:3 and 4:2 again (agreed: none); each call exact."""
    state._checks_every_call = lambda group: False
    mask = mcp.masks.varlen([0, 40, S], causal=True)
    plan = mcp.plan(mask, world)
    ids = torch.from_numpy(plan.local_ids(rank))
    reduces = _counted()
    calls = lambda: len(reduces) + sum(state._STORE_CHECKS.values())  # noqa: E731 - collectives and store checks
    out = []
    for hq, hkv in ((4, 2), (6, 3), (6, 3), (4, 2)):
        before = calls()
        q, k, v = _inputs(hq, hkv, 16, torch.float64, seed=hq)
        o, _ = mcp.attention(q[ids], k[ids], v[ids], plan, dist.group.WORLD)
        ref = reference_attention(q, k, v, mask).out
        out.append((calls() - before, float((o - ref[ids]).abs().max())))
    return out


def test_a_later_call_whose_fields_every_rank_changed_alike_checks_once_and_runs():
    for rank_out in run_ranks(_alike, 3):
        assert [c for c, _ in rank_out] == [1, 1, 0, 0], rank_out  # checks per call
        assert max(e for _, e in rank_out) < 1e-12, rank_out


class _NoClone:
    """A store whose client cannot be cloned: the watcher reads the fault key every ``POLL_S`` instead."""

    def __init__(self, store):
        self._s = store

    def __getattr__(self, name):
        if name == "clone":
            raise AttributeError(name)
        return getattr(self._s, name)


def _alone(rank, world, shared_client=False, change="dtype", every_call=False):
    """Rank 1 alone calls with float32 (``change`` "dtype") or one row short ("rows") on its second call: it raises,
    naming both; rank 0 raises rank 1's error from its exchange (its watcher waits on a client of its own, or
    reads the shared one every 0.2 s), and again on a later call. ``every_call``: gloo's own decision (every
    call checks: rank 0 waits in the check instead of the exchange)."""
    if not every_call:
        state._checks_every_call = lambda group: False
    state.FIELD_CHANGE_TIMEOUT_S = 3.0
    if shared_client:
        real, faults.POLL_S = faults._store, 0.2
        faults._store = lambda hg: _NoClone(real(hg))
    mask = mcp.masks.varlen([0, 40, S], causal=True)
    plan = mcp.plan(mask, world)
    ids = torch.from_numpy(plan.local_ids(rank))
    q, k, v = (t[ids] for t in _inputs(4, 2, 16, torch.float64))
    try:  # a peer's error may reach rank 0 still in the first call (rank 1 may be through it first)
        mcp.attention(q, k, v, plan, dist.group.WORLD)
        if rank == 1 and change == "dtype":
            q, k, v = q.float(), k.float(), v.float()
        if rank == 1 and change == "rows":  # not the plan's rows: the input check fails on rank 1 alone
            q, k, v = q[1:], k[1:], v[1:]
        mcp.attention(q, k, v, plan, dist.group.WORLD)
    except Exception as e:  # noqa: BLE001 - what each rank met is the result
        again = ""
        if rank == 0:
            try:  # a call after the error was caught: the same error, before any exchange
                mcp.attention(q, k, v, plan, dist.group.WORLD)
                again = "finished"
            except Exception as e2:  # noqa: BLE001
                again = type(e2).__name__ if str(e2) == str(e) else f"another error: {e2}"
        return type(e).__name__, isinstance(e, ValueError), str(e), again
    return "finished", False, "", ""


@pytest.mark.parametrize("shared_client", [False, True])
def test_a_rank_alone_in_a_later_change_raises_and_so_do_its_peers(shared_client):
    (kind0, _, msg0, again0), (kind1, is_value_error, msg1, _) = run_ranks(_alone, 2, shared_client)
    assert kind1 == "RanksDisagreeError" and is_value_error, msg1
    assert "dtype float32" in msg1 and "dtype float64" in msg1 and "within 3 s" in msg1, msg1
    # its exchange met no peer: rank 1's error, told through the store (runtime.faults), not a result
    assert kind0 == "RanksDisagreeError", (kind0, msg0)
    assert "CP rank 1 of this group raised" in msg0 and "dtype float32" in msg0 and "dtype float64" in msg0, msg0
    assert again0 == "RanksDisagreeError", again0


@pytest.mark.parametrize("every_call", [False, True])
def test_an_input_check_failing_on_one_rank_alone_in_a_later_call_raises_on_its_peers_too(every_call):
    (kind0, _, msg0, again0), (kind1, is_value_error, msg1, _) = run_ranks(_alone, 2, False, "rows", every_call)
    assert kind1 == "ValueError" and "q has 47 tokens but the plan gives rank 1 48" in msg1, msg1
    assert kind0 == "RanksDisagreeError" and "CP rank 1 of this group raised" in msg0 and msg1 in msg0, msg0
    assert again0 == "RanksDisagreeError", again0
