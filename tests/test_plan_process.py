"""The planning helper process (runtime.plan_process): the same plan, bit for bit, as planning here, with the
exchange choice made there and kept (prebuild then does not choose again); the planner's errors come back as
themselves; a helper that dies raises a clear error and the next call starts a new one."""

from __future__ import annotations

import dataclasses
import os
import pickle

import numpy as np
import pytest

import megatron_cp as mcp
import megatron_cp.runtime.state as state
from megatron_cp.planner import Workload
from megatron_cp.runtime import plan_in_helper

WORK = Workload(8, 2, 64, 2)


def _packed(seed: int, n: int = 8192):
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < n:
        lens.append(min(int(rng.integers(16, 2048)), n - sum(lens)))
    return mcp.masks.varlen(np.concatenate([[0], np.cumsum(lens)]).tolist(), causal=True)


@pytest.mark.parametrize("cp", [4, 16])
def test_same_plan_and_exchange_choice_as_here(cp, monkeypatch):
    mask = _packed(cp)
    got = plan_in_helper(mask, cp, work=WORK)
    here = mcp.plan(mask, cp)
    assert got.digest64 == here.digest64
    assert [r.num_tokens for r in got.ranks] == [r.num_tokens for r in here.ranks]
    want = state.choose_schedule(here, None, mcp.runtime.CostModel(), WORK, True)
    # the choice travelled with the plan: prebuild finds it and never chooses again
    def chosen_again(*a):
        raise LookupError("exchange chosen again")

    monkeypatch.setattr(state, "choose_schedule", chosen_again)
    mcp.runtime.prebuild(got, WORK)
    kept = state.exchange_choice(got, stages=None, hierarchical=True, cost=mcp.runtime.CostModel(), work=WORK)
    assert pickle.dumps(kept) == pickle.dumps(want)
    with pytest.raises(LookupError, match="exchange chosen again"):  # a plan made here still chooses
        mcp.runtime.prebuild(mcp.plan(mask, cp), WORK)


def test_planner_errors_come_back_as_themselves():
    with pytest.raises(ValueError, match="cp_size must be a positive int, got 0") as e:
        plan_in_helper(_packed(0, 256), 0)
    assert "in megatron-cp's planning helper process" in str(e.value.__cause__)
    with pytest.raises(TypeError, match="needs an AttnMask, got list"):
        plan_in_helper([0, 256], 2)
    with pytest.raises(ValueError, match="work must be a megatron_cp.planner.Workload, got tuple"):
        plan_in_helper(_packed(0, 256), 2, work=(8, 2, 64, 2))


class _Fatal(mcp.AttnMask):
    """A mask whose unpickling ends the helper process (exit code 3)."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_helper_that_dies_raises_and_the_next_call_starts_another():
    m = _packed(1, 512)
    fatal = _Fatal(list(m.slices), m.seqlen_q, m.seqlen_k)
    with pytest.raises(RuntimeError, match=r"planning helper process exited \(code 3\) before answering"):
        plan_in_helper(fatal, 2)
    assert plan_in_helper(m, 2).digest64 == mcp.plan(m, 2).digest64


class _Noisy(mcp.AttnMask):
    """A mask that prints on stdout when the helper unpickles it (and arrives as None)."""

    def __reduce__(self):
        return print, ("noise on the helper's stdout",)


def test_what_the_helper_prints_does_not_reach_its_answers():
    """Printed on the helper's stdout, the noise goes to its stderr: the answer (the planner's TypeError for the
    None that arrived) is read intact, and the helper goes on answering."""
    m = _packed(2, 512)
    with pytest.raises(TypeError, match="plan\\(\\) needs an AttnMask, got NoneType"):
        plan_in_helper(_Noisy(list(m.slices), m.seqlen_q, m.seqlen_k), 2)
    assert plan_in_helper(m, 2).digest64 == mcp.plan(m, 2).digest64


def test_threads_asking_at_once_each_get_a_helper():
    """Plans asked for at once (PlanAhead making several slow plans together) are made by as many helpers side
    by side, each the plan made here."""
    from concurrent.futures import ThreadPoolExecutor

    from megatron_cp.runtime import plan_process

    masks = [_packed(40 + i, 16384) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda m: plan_in_helper(m, 8, work=WORK), masks))
    assert [p.digest64 for p in got] == [mcp.plan(m, 8).digest64 for m in masks]
    alive = [p for p in plan_process._IDLE if p.poll() is None]
    assert len({p.pid for p in alive}) >= 2  # more than one helper answered


def test_helpers_started_ahead_answer_and_taking_the_last_idle_one_starts_a_spare():
    """start_planning_helpers starts idle helpers without waiting for their imports; a plan takes one of them; the
    call that takes the last idle helper leaves a spare started behind it (the next thread asking at once does not
    wait seconds for a helper's imports)."""
    from megatron_cp.runtime import plan_process, start_planning_helpers

    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="count must be an int >= 0"):
            start_planning_helpers(bad)
    with plan_process._LOCK:
        idle, plan_process._IDLE[:] = list(plan_process._IDLE), []
    for p in idle:
        plan_process._stop(p)
    assert start_planning_helpers(1) == 1 and start_planning_helpers(1) == 0  # one alive and idle: none more
    (ahead,) = plan_process._IDLE
    m = _packed(7, 2048)
    assert plan_in_helper(m, 4, work=WORK).digest64 == mcp.plan(m, 4).digest64
    alive = [p for p in plan_process._IDLE if p.poll() is None]
    assert len(alive) == 2 and ahead in alive  # the helper started ahead answered and is idle again, beside a spare
    assert start_planning_helpers(3) == 1 and len(plan_process._IDLE) == 3


def _fa4_emulated():
    import fa4_semantics
    import torch

    from megatron_cp.kernels import FA4Backend
    from megatron_cp.kernels.fa4.backend import Fa4Functions

    return FA4Backend(functions=Fa4Functions(fa4_semantics.fwd, fa4_semantics.bwd, "reference", (torch.float64,),
                                             fa4_semantics.block_sparse, fa4_semantics.interval_masks(),
                                             fa4_semantics.band_mask))


@pytest.mark.parametrize("mask_name,cp,stages,kw", [("packed", 4, None, {}), ("global_local", 4, None, {}),
                                                    ("global_local", 4, None, {"guest_rows": [[0, 64]]}),
                                                    ("causal", 4, 2, {})])
def test_a_ranks_first_call_host_work_made_in_the_helper_is_what_the_call_would_make(mask_name, cp, stages, kw,
                                                                                     monkeypatch):
    """Given the rank and an FA4 backend, the helper makes the rank's single-exchange host part (or staged routes)
    and prepares its tile lists (single exchange: the whole list; staged: one per stage) for the exchange it chose; the plan's
    first rank_state takes them and makes neither on the step's thread; each is what is made here, and each
    list runs to the same attention."""
    import torch

    from megatron_cp.kernels.fa4.prepared import prepare_list

    mask = _packed(7, 2048) if mask_name == "packed" else mcp.masks.catalog.build(mask_name, 2048)
    be = _fa4_emulated()
    rank, cost = 1, mcp.runtime.CostModel()
    got = plan_in_helper(mask, cp, work=WORK, stages=stages, rank=rank, backend=be, device="cpu", **kw)
    ahead = state.plan_cache(got)[state._ahead_key(rank, stages, True, cost, WORK)]
    assert ahead.prepare == state.prepare_name(prepare_list)
    kept = ahead.lists
    sched = state.exchange_choice(got, stages=stages, hierarchical=True, cost=cost, work=WORK)
    assert (sched is None) == (stages is None) == (ahead.single is not None)
    here = state.prepare_lists(mcp.plan(mask, cp, **kw), rank, sched, be.prepare)
    assert len(kept) == len(here) >= 1 and any(p is not None for p in kept)

    def made_again(*a, **k):
        raise LookupError("made on the step's thread")

    be.prepare = made_again
    monkeypatch.setattr(state, "single_host", made_again)
    monkeypatch.setattr(state.RouteIndex, "of", made_again)
    monkeypatch.setattr(state.guests, "guest_host", made_again)
    assert (ahead.routes is not None) == (sched is not None)
    assert (ahead.guests is not None) == got.has_guests == ("guest_rows" in kw)
    if got.has_guests:  # the guest list too, prepared there
        assert ahead.guest_list is not None
    st = state.rank_state(got, rank, torch.device("cpu"), be, "fa4-emulated", stages=stages, hierarchical=True,
                          cost=cost, work=WORK)
    assert [id(p) for p in st.prepared_lists()] == [id(p) for p in kept + [ahead.guest_list] if p is not None]
    if ahead.routes is not None:  # the staged exchange's routes are the helper's, as made here
        monkeypatch.undo()
        want = [state.RouteIndex.of(s.route) for s in sched.ranks[rank][1:]]
        for got_r, want_r in zip(ahead.routes[1:], want, strict=True):
            for f in dataclasses.fields(want_r):
                a, b = getattr(got_r, f.name), getattr(want_r, f.name)
                assert (a is None and b is None) or (np.array_equal(a, b) if isinstance(b, np.ndarray) else a == b)
        assert [torch.equal(r.out_idx, torch.from_numpy(w.out_idx)) for r, w in zip(st.staged.routes[1:], want)] \
            == [True] * len(want)
    if ahead.single is not None:  # the single exchange's maps and arrays are the helper's, as made here
        monkeypatch.undo()
        want = state.single_host(mcp.plan(mask, cp, **kw), rank)
        assert pickle.dumps(ahead.single) == pickle.dumps(want)
        assert st.single.own.runs == want.own.runs and st.single.send.indexed == want.send.indexed
        assert torch.equal(st.single.red_pos, torch.from_numpy(want.red_pos))
    g = torch.Generator().manual_seed(0)
    for a, b in zip(kept, here):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a._triton is None  # no list of this process ran on the Triton fallback: no Triton form made ahead
        assert torch.equal(a.tiles, b.tiles) and pickle.dumps(a.calls) == pickle.dumps(b.calls)
        q = torch.randn(a.seqlen_q, 4, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(a.seqlen_k, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
        for x, y in zip(be.forward(q, k, v, a), be.forward(q, k, v, b)):
            assert torch.equal(x, y)


def test_lists_are_prepared_ahead_only_where_the_backend_can_and_with_what_they_need():
    """A backend without prepare_host (the reference) gets the rank's index arrays ahead but no lists: its first
    call prepares them. rank= without work, backend= without device= or rank=, or a rank out of range, is
    refused before the helper is asked."""
    import torch

    mask = _packed(8, 1024)
    got = plan_in_helper(mask, 2, work=WORK, rank=0, backend="reference", device="cpu")
    cost = mcp.runtime.CostModel()
    ahead = state.plan_cache(got)[state._ahead_key(0, None, True, cost, WORK)]
    assert ahead.single is not None and ahead.prepare is None and ahead.lists is None
    be = mcp.kernels.get_backend("reference")
    st = state.rank_state(got, 0, torch.device("cpu"), be, "reference", stages=None, hierarchical=True, cost=cost,
                          work=WORK)
    assert len(st.prepared_lists()) == 1 and state._ahead_key(0, None, True, cost, WORK) not in state.plan_cache(got)
    with pytest.raises(ValueError, match="needs work too"):
        plan_in_helper(mask, 2, rank=0, backend="reference", device="cpu")
    with pytest.raises(ValueError, match="backend= and device= come together"):
        plan_in_helper(mask, 2, work=WORK, rank=0, backend="reference")
    with pytest.raises(ValueError, match="backend= and device= come together"):
        plan_in_helper(mask, 2, work=WORK, backend="reference", device="cpu")
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, cp_size=2\), got 2"):
        plan_in_helper(mask, 2, work=WORK, rank=2, backend=_fa4_emulated(), device="cpu")


def test_a_request_that_cannot_be_pickled_is_refused_before_any_helper_reads_it():
    """A backend whose prepare_host is a lambda: the pickling error comes back at once, and the helper that
    answers next is not left reading half a request."""
    be = mcp.kernels.get_backend("reference")
    be = type(be)()  # an object of its own, given an unpicklable prepare_host
    be.prepare_host = lambda tiles, sq, sk: None
    mask = _packed(9, 512)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        plan_in_helper(mask, 2, work=WORK, rank=0, backend=be, device="cpu")
    assert plan_in_helper(mask, 2, work=WORK).digest64 == mcp.plan(mask, 2).digest64



@pytest.mark.parametrize("mask_name", ["packed", "global_local"])
def test_triton_lists_are_prepared_in_the_helper_with_their_schedules(mask_name, monkeypatch):
    """TritonBackend's prepare_host (a HostPrepare of its config): the helper prepares the rank's list with the block
    schedules of the calls' head dim (the most of a list's preparation), the plan's first rank_state takes it and
    prepares nothing, the list equals the one prepared here (tiles, descriptors, row class, every schedule array)
    and runs to the same attention; a backend of another configuration does not take it."""
    import dataclasses as dc

    import torch

    from megatron_cp.kernels import TritonBackend, TritonConfig

    mask = _packed(3, 1024) if mask_name == "packed" else mcp.masks.catalog.build(mask_name, 1024)
    be, rank, cost = TritonBackend(), 1, mcp.runtime.CostModel()
    got = plan_in_helper(mask, 4, work=WORK, rank=rank, backend=be, device="cpu")
    ahead = state.plan_cache(got)[state._ahead_key(rank, None, True, cost, WORK)]
    assert ahead.prepare == state.prepare_name(be.prepare_host) != state.prepare_name(
        TritonBackend(TritonConfig(dkdv_split_min=8)).prepare_host)
    (kept,) = ahead.lists
    (here,) = state.prepare_lists(mcp.plan(mask, 4), rank, None, be.prepare)
    c = be.config.for_head_dim(WORK.head_dim, here.row_class)
    shapes = {(k.block_m, k.block_n) for k in (c.fwd, c.dq, c.dkdv)}
    assert set(kept._host) == shapes and not here._host  # built there; here they would be built on first use
    assert torch.equal(kept.tiles, here.tiles) and torch.equal(kept.desc, here.desc)
    assert kept.row_class == here.row_class and kept.cudnn_fwd is None is here.cudnn_fwd
    for bm, bn in shapes:
        for a, b in zip(kept._host[(bm, bn)], here.host_schedules(bm, bn)):
            assert all(np.array_equal(x, y) for x, y in zip(a.arrays(), b.arrays(), strict=True))

    def made_again(*a, **k):
        raise LookupError("prepared on the step's thread")

    monkeypatch.setattr(be, "prepare", made_again)
    st = state.rank_state(got, rank, torch.device("cpu"), be, "triton", stages=None, hierarchical=True, cost=cost,
                          work=WORK)
    assert [id(p) for p in st.prepared_lists()] == [id(kept)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 1, WORK.head_dim, generator=g) for n in (kept.seqlen_q, kept.seqlen_k, kept.seqlen_k))
    for x, y in zip(TritonBackend().forward(q, k, v, kept), TritonBackend().forward(q, k, v, here)):
        assert torch.equal(x, y)
    other = mcp.plan(mask, 4)
    state.keep_rank_ahead(other, rank, dc.replace(ahead), stages=None, hierarchical=True, cost=cost, work=WORK)
    monkeypatch.undo()
    st2 = state.rank_state(other, rank, torch.device("cpu"), TritonBackend(TritonConfig(dkdv_split_min=8)),
                           "triton-other", stages=None, hierarchical=True, cost=cost, work=WORK)
    assert st2.prepared_lists()[0] is not kept  # another configuration's lists: prepared in the call


def test_fa4_lists_come_with_their_triton_form_once_the_process_ran_lists_on_triton(monkeypatch):
    """Once an FA4 backend has run some list on its Triton fallback (a measured route, a rule, a dtype), the helper
    also prepares each list's Triton form with the calls' head dim's block schedules: the fallback takes it rather
    than preparing it on the step's thread, and it is the form prepared here."""
    import torch

    mask = mcp.masks.catalog.build("global_local", 1024)
    be, rank, cost = _fa4_emulated(), 1, mcp.runtime.CostModel()
    be.fallbacks["fwd list"] = "measured fastest here"  # what a call routed to Triton leaves
    got = plan_in_helper(mask, 4, work=WORK, rank=rank, backend=be, device="cpu")
    (kept,) = state.plan_cache(got)[state._ahead_key(rank, None, True, cost, WORK)].lists
    tri = kept._triton
    assert tri is not None and tri._host  # prepared there, schedules built
    want = be.triton.prepare(kept.tiles, kept.seqlen_q, kept.seqlen_k, head_dims=(WORK.head_dim,))
    assert torch.equal(tri.desc, want.desc) and tri.row_class == want.row_class and set(tri._host) == set(want._host)
    for key in want._host:
        for a, b in zip(tri._host[key], want._host[key]):
            assert all(np.array_equal(x, y) for x, y in zip(a.arrays(), b.arrays(), strict=True))

    def made_again(*a, **k):
        raise LookupError("prepared on the step's thread")

    monkeypatch.setattr(be.triton, "prepare", made_again)
    st = state.rank_state(got, rank, torch.device("cpu"), be, "fa4-emulated", stages=None, hierarchical=True,
                          cost=cost, work=WORK)
    assert st.prepared_lists()[0] is kept and be._triton_prepared(kept) is tri
