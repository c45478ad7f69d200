"""Planning off the step's critical path (megatron_cp.megatron.plan_ahead, batch.plan_for_batch, PlanCache).

One process, no model: a training loop whose step takes a known time (a sleep: the step waiting on the
GPU with the GIL released) consumes micro-batches of packed documents with varying boundaries. The time
the loop spends blocked on plans is measured, with planning ahead and without.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import megatron_cp as mcp
from megatron_cp.megatron import batch as B
from megatron_cp.megatron import planning
from megatron_cp.megatron.plan_ahead import PlanAhead, plan_ahead

EOD = 0
S, CP = 32768, 8
SPEC = B.MaskSpec("packed", eod=EOD)
OPTIONS = B.PlanOptions()


class _Group:
    """A CP group as prepare_batch reads it (size, rank): it runs no collective."""

    def size(self):
        return CP

    def rank(self):
        return 0


def _tokens(seed: int) -> torch.Tensor:
    """[1, S] int64 of packed documents (log-normal lengths, each ending in EOD), boundaries by seed."""
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, 1.0, 200)
    ends = np.unique(np.clip(np.cumsum(w / w.sum() * S).astype(np.int64), 1, S)) - 1
    tok = rng.integers(1, 1000, size=S)
    tok[ends] = EOD
    return torch.from_numpy(tok).reshape(1, S)


def _direct_digest(tokens: torch.Tensor) -> str:
    """The plan's digest computed from this micro-batch's own boundaries, without any cache."""
    cu = B.document_bounds(tokens.numpy(), SPEC)
    return mcp.plan(mcp.masks.varlen(cu, causal=True), CP).digest


def _plan_fn(batch):
    return B.plan_for_batch(batch["tokens"], SPEC, CP, OPTIONS)


@pytest.fixture
def fresh_cache(monkeypatch):
    cache = B.PlanCache()
    monkeypatch.setattr(planning, "PLANS", cache)
    return cache


def _train(batches, depth: int, step_s: float):
    """The loop: pull a micro-batch, get its plan as the step does (plan_for_batch: a cache hit when
    planned ahead), then 'compute' for step_s. Returns (PlanAhead, the plans the loop used)."""
    it = PlanAhead(batches, _plan_fn, depth=depth)
    plans = []
    for batch in it:
        plans.append(B.plan_for_batch(batch["tokens"], SPEC, CP, OPTIONS)[0])
        time.sleep(step_s)
    return it, plans


def test_step_never_waits_on_plans_planned_ahead(fresh_cache, monkeypatch):
    batches = [{"tokens": _tokens(100 + i)} for i in range(12)]
    plan_s = []
    for i in range(3):  # the plan's cost here, on this machine now
        t = time.perf_counter()
        _direct_digest(_tokens(900 + i))
        plan_s.append(time.perf_counter() - t)
    step_s = min(0.3, max(0.03, 10 * min(plan_s)))  # a step ten plans long (bounded: the test stays short)

    it, plans = _train(batches, depth=2, step_s=step_s)
    st = it.stats()
    # each layout planned once, by the thread: the step's own plan_for_batch only ever hit the cache
    assert st["micro_batches"] == len(batches) and fresh_cache.made == len(batches)
    # the first micro-batch is planned when the loop starts; after it the step does not wait on a plan: every wait
    # but the longest is well under a plan's time (a loaded machine may deschedule the planning thread once, for
    # tens of milliseconds), and all of them together stay under half the plans' time
    waits, typical = sorted(it.waits[1:]), float(np.median(it.plan_times[1:]))
    assert waits[-2] < 0.05 * typical and sum(waits) < 0.5 * sum(it.plan_times[1:]), (it.waits, it.plan_times)
    assert [p.digest for p in plans] == [_direct_digest(b["tokens"]) for b in batches]

    # the same loop planning inline (depth 0): the step waits for every plan, so the check above fails
    monkeypatch.setattr(planning, "PLANS", B.PlanCache())
    inline, plans0 = _train(batches, depth=0, step_s=step_s)
    assert planning.PLANS.made == len(batches)
    assert sum(inline.waits[1:]) >= 0.9 * sum(inline.plan_times[1:]) > 0
    assert not sorted(inline.waits[1:])[-2] < 0.05 * float(np.median(inline.plan_times[1:]))
    assert [p.digest for p in plans0] == [p.digest for p in plans]


def test_each_micro_batch_gets_its_own_plan_and_prepare_batch_finds_it(fresh_cache, monkeypatch):
    seeds = [1, 2, 1, 3, 4, 2, 5]  # repeated layouts share one plan; distinct ones never mix
    batches = [{"tokens": _tokens(s), "seed": s} for s in seeds]
    planners = []  # the thread of every plan made (the planner thread keeps planning while the loop runs)
    make = B.make_plan
    monkeypatch.setattr(planning, "make_plan", lambda *a: (planners.append(threading.current_thread()), make(*a))[1])
    it = PlanAhead(batches, _plan_fn, depth=3)
    seen = {}
    for batch in it:
        bt = B.prepare_batch(batch["tokens"], None, None, SPEC, _Group(), OPTIONS)
        assert threading.main_thread() not in planners  # found in the cache: prepare_batch did not plan
        assert bt.params.plan.digest == _direct_digest(batch["tokens"])
        seen.setdefault(batch["seed"], bt.params.plan)
        assert bt.params.plan is seen[batch["seed"]]
        ids = torch.from_numpy(bt.params.plan.local_ids(0))
        assert torch.equal(bt.tokens.reshape(-1), batch["tokens"].reshape(-1)[ids])  # dispatched by that plan
    assert fresh_cache.made == len(set(seeds))
    assert len({p.digest for p in seen.values()}) == len(set(seeds))


def test_plan_cache_makes_a_key_once_across_threads():
    cache, calls = B.PlanCache(), []

    def make():
        calls.append(1)
        time.sleep(0.2)
        return object()

    got = [None, None]
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, cache.get("k", make))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and cache.made == 1 and got[0] is got[1] is not None

    def bad():
        time.sleep(0.1)
        raise ValueError("no plan")

    errors = []

    def ask():
        try:
            cache.get("bad", bad)
        except ValueError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == ["no plan", "no plan"] and cache.made == 1  # both askers see the error; nothing cached


def test_plan_ahead_wraps_once_and_reports_errors(fresh_cache):
    def gen():
        yield {"tokens": _tokens(7)}
        yield {"tokens": torch.zeros(S, dtype=torch.int64)}  # 1-D: plan_for_batch refuses it

    g = gen()
    a = plan_ahead(g, _plan_fn)
    assert plan_ahead(g, _plan_fn) is a and plan_ahead(a, _plan_fn) is a
    assert next(a)["tokens"].shape == (1, S)
    with pytest.raises(ValueError, match=r"tokens must be \[b, S\]"):
        next(a)
    with pytest.raises(TypeError, match="weakly reference"):
        plan_ahead(iter([1, 2]), _plan_fn)
    with pytest.raises(ValueError, match="depth"):
        PlanAhead([], _plan_fn, depth=-1)
    assert list(PlanAhead([], _plan_fn)) == []


def test_forward_step_plans_below_megatrons_replay_buffer(fresh_cache):
    """plugin.plan_ahead_of puts the planner under Megatron's RerunDataIterator (around the loader's
    iterator): the step's micro-batches come out in order with their plans made ahead, and a rewind replays
    exactly the iteration's micro-batches (not ones the planner read ahead of it)."""
    from megatron.core.rerun_state_machine import RerunDataIterator, RerunMode, get_rerun_state_machine

    from megatron_cp.megatron.plugin import plan_ahead_of

    machine = get_rerun_state_machine()
    mode = machine.get_mode()
    machine.set_mode(RerunMode.VALIDATE_RESULTS)  # Megatron's default: the iterator saves for replay
    try:
        _replay_case(fresh_cache, RerunDataIterator, plan_ahead_of)
    finally:
        machine.set_mode(mode)


def _replay_case(fresh_cache, RerunDataIterator, plan_ahead_of):

    seeds = [11, 12, 13, 14, 15, 16]
    loader = iter([{"tokens": _tokens(s), "seed": s} for s in seeds])
    rerun = RerunDataIterator(loader)
    it = plan_ahead_of(rerun, lambda: _plan_fn)
    assert it is rerun and isinstance(rerun.iterable, PlanAhead)
    assert plan_ahead_of(rerun, lambda: _plan_fn).iterable is rerun.iterable  # wrapped once
    rerun.saved_microbatches.clear()
    first = [next(it)["seed"] for _ in range(2)]  # one iteration of 2 micro-batches
    saved = [b["seed"] for b in rerun.saved_microbatches]
    rerun.rewind()
    replay = [next(it)["seed"] for _ in range(2)]
    rerun.advance()
    rest = [next(it)["seed"] for _ in range(4)]
    assert first == [11, 12] and replay == first and rest == [13, 14, 15, 16]
    assert saved == [11, 12]  # what the step read, never micro-batches the planner read ahead
    assert fresh_cache.made == len(seeds)  # every micro-batch planned once, by the planner thread
    ahead = rerun.iterable
    assert len(ahead.waits) == len(seeds) and len(ahead.plan_times) == len(seeds)


def test_forward_step_plans_inline_for_an_iterator_it_cannot_keep(fresh_cache):
    """A built-in iterator (no weak reference, e.g. iter(list) handed to Megatron's schedule) is read as is:
    nothing is read ahead of the step."""
    from megatron_cp.megatron.plugin import plan_ahead_of

    batches = iter([{"tokens": _tokens(s)} for s in (21, 22)])
    assert plan_ahead_of(batches, lambda: _plan_fn) is batches
    assert fresh_cache.made == 0


def test_planning_ahead_chooses_the_exchange_off_the_step(fresh_cache, monkeypatch):
    """With ``PlanOptions.workload`` (what the plugin derives from Megatron's flags) the planning thread
    also chooses each plan's exchange, for the workload the core attention will see (the micro-batch's b
    sequences folded into heads): the step's first attention call then finds it instead of pricing the
    candidates itself. Without a workload, or for a baseline's plan, nothing is chosen ahead."""
    from megatron_cp.runtime import state

    chooser = []
    real = state.choose_schedule
    monkeypatch.setattr(state, "choose_schedule",
                        lambda *a, **k: chooser.append((threading.current_thread(), a[3])) or real(*a, **k))
    work = mcp.planner.Workload(8, 2, 128, 2)
    opts = B.PlanOptions(workload=work)
    tok = torch.cat([_tokens(7), _tokens(8)])  # b = 2
    it = PlanAhead([{"tokens": tok}], lambda b: B.plan_for_batch(b["tokens"], SPEC, CP, opts), depth=1)
    for batch in it:
        plan = B.prepare_batch(batch["tokens"], None, None, SPEC, _Group(), opts).params.plan
    assert [w for _, w in chooser] == [mcp.planner.Workload(16, 4, 128, 2)]
    assert chooser[0][0] is not threading.main_thread()
    assert any(k[0] == "exchange" and k[4] == mcp.planner.Workload(16, 4, 128, 2)
               for k in state.plan_cache(plan) if isinstance(k, tuple))
    chooser.clear()
    B.plan_for_batch(_tokens(9), SPEC, CP, OPTIONS)  # no workload
    B.plan_for_batch(_tokens(9), SPEC, CP, B.PlanOptions(workload=work, strategy="ring"))
    assert chooser == []


def test_helper_process_plans_the_same_and_chooses_the_exchange_there(fresh_cache, monkeypatch):
    """With ``PlanOptions.helper_process`` (what the plugin sets on a GPU) the plan and its exchange choice are made
    in the planning helper process: the same plan as made here, and this process never prices the schedules."""
    from megatron_cp.runtime import state

    def priced_here(*a, **k):
        raise LookupError("exchange chosen in this process")

    monkeypatch.setattr(state, "choose_schedule", priced_here)
    work = mcp.planner.Workload(8, 2, 128, 4)
    tok = _tokens(10)
    plan, _ = B.plan_for_batch(tok, SPEC, CP, B.PlanOptions(workload=work, helper_process=True))
    assert plan.digest == _direct_digest(tok)
    assert ("exchange", None, True, mcp.runtime.CostModel(), work) in state.plan_cache(plan)
    # with the rank (what the plugin sets), that rank's host part of the first call is made there too
    ranked, _ = B.plan_for_batch(_tokens(12), SPEC, CP, B.PlanOptions(workload=work, helper_process=True, plan_rank=1))
    ahead = state.plan_cache(ranked)[state._ahead_key(1, None, True, mcp.runtime.CostModel(), work)]
    assert ahead.single is not None and ahead.lists is None  # on the CPU "auto" is the reference: no lists ahead
    with pytest.raises(LookupError, match="chosen in this process"):  # planned here, it is priced here
        B.plan_for_batch(_tokens(11), SPEC, CP, B.PlanOptions(workload=work))


def test_attention_workload_from_megatron_flags():
    """The plugin's per-sequence attention shape: heads and query groups per TP rank, kv_channels (else
    hidden / heads), 2 bytes under --bf16 / --fp16; none under MLA or heads the TP size does not divide."""
    from types import SimpleNamespace as NS

    from megatron_cp.megatron.plugin import attention_workload

    base = dict(num_attention_heads=32, hidden_size=4096, num_query_groups=8, group_query_attention=True,
                kv_channels=None, tensor_model_parallel_size=2, bf16=True, fp16=False)
    assert attention_workload(NS(**base)) == mcp.planner.Workload(16, 4, 128, 2)
    assert attention_workload(NS(**{**base, "group_query_attention": False, "bf16": False, "kv_channels": 96,
                                     "tensor_model_parallel_size": 1})) == mcp.planner.Workload(32, 32, 96, 4)
    assert attention_workload(NS(**{**base, "multi_latent_attention": True})) is None
    assert attention_workload(NS(**{**base, "num_query_groups": 1})) is None  # 1 group over TP 2: replicated


def test_prepare_batch_reads_the_plan_from_host_tokens(fresh_cache):
    """Given the loader's host copy, prepare_batch plans from it and never reads ``tokens`` back (here on
    the meta device, which has no data to read: a copy back would raise); a copy of another shape is refused."""
    tok = _tokens(11)
    meta = tok.to("meta")
    bt = B.prepare_batch(meta, None, None, SPEC, _Group(), OPTIONS, host_tokens=tok.numpy())
    assert bt.params.plan.digest == _direct_digest(tok) and bt.tokens.device.type == "meta"
    with pytest.raises(ValueError, match=r"host_tokens shape \(1, 16\) differs from tokens \(1, 32768\)"):
        B.prepare_batch(tok, None, None, SPEC, _Group(), OPTIONS, host_tokens=tok.numpy()[:, :16])


def test_planning_thread_gets_the_gil_back_quickly_while_open(monkeypatch):
    """While a PlanAhead plans in its thread, the interpreter's GIL switch interval is at most 0.5 ms (a numpy call
    of the planner waits that long, not 5 ms, to get the GIL back from a busy training loop); the last one to
    close, or to be collected unclosed, restores the previous interval. depth 0 (no thread) leaves it alone."""
    import gc
    import sys

    from megatron_cp.megatron import plan_ahead as P

    gc.collect()
    # counted afresh: PlanAheads other tests left open (kept by their iterators) stay out of this count
    monkeypatch.setattr(P, "_OPEN", {"count": 0, "saved": None})
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        inline = PlanAhead(iter(range(3)), lambda b: None, depth=0)
        assert sys.getswitchinterval() == 0.005
        a = PlanAhead(iter(range(3)), lambda b: None, depth=1)
        b = PlanAhead(iter(range(3)), lambda b: None, depth=2)
        assert sys.getswitchinterval() == P.SWITCH_INTERVAL_S
        assert list(a) == [0, 1, 2]  # exhausted: closes itself
        assert sys.getswitchinterval() == P.SWITCH_INTERVAL_S  # b still plans
        del b
        gc.collect()
        assert sys.getswitchinterval() == 0.005
        c = PlanAhead(iter(range(3)), lambda b: None, depth=1)
        c.close()
        c.close()  # twice: no double restore
        assert sys.getswitchinterval() == 0.005 and list(inline) == [0, 1, 2]
        assert list(c) == [0]  # closed: the micro-batch already queued, nothing more
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("depth", [0, 2])
def test_last_is_the_plan_of_the_micro_batch_just_yielded(depth):
    """``PlanAhead.last``: what plan_fn returned for the micro-batch ``next()`` yielded last (how a plan over DP x
    CP, gathered and made in the thread, reaches the step), with or without planning ahead."""
    it = PlanAhead(iter(range(5)), lambda b: ("plan of", b), depth=depth)
    assert it.last is None
    for b in it:
        assert it.last == ("plan of", b)


def test_a_global_plan_made_for_another_micro_batch_is_planned_again(monkeypatch):
    """prepare_global_batch given a plan made ahead for other tokens (a micro-batch read again without its planning
    thread, as Megatron's rerun of a step does) does not train on that layout: it plans this micro-batch itself
    (here stopped at that call), and uses a plan made for these tokens as it is."""
    tok = _tokens(30)
    other = B.GlobalPlan(tokens=np.stack([_tokens(31).numpy(), _tokens(32).numpy()]), cu_seqlens=[], plan=None,
                         strategy="megatron_cp")
    asked = []

    def plan_here(host, *a, **k):
        asked.append(host)
        raise LookupError("planned here")

    monkeypatch.setattr(B, "plan_global_batch", plan_here)
    monkeypatch.setattr(mcp.runtime, "host_group", lambda g: g)
    kw = dict(dp_rank=0, cp_rank=0, cp_size=2, options=B.PlanOptions(over_dp=True))
    with pytest.raises(LookupError, match="planned here"):
        B.prepare_global_batch(tok, tok, torch.ones(tok.shape), SPEC, None, planned=other, **kw)
    assert len(asked) == 1 and np.array_equal(asked[0], tok.numpy())
    mine = B.GlobalPlan(tokens=np.stack([tok.numpy(), _tokens(32).numpy()]), cu_seqlens=[], plan=None,
                        strategy="megatron_cp")
    with pytest.raises(ValueError, match="process group has not been initialized"):  # used: on to the device gather
        B.prepare_global_batch(tok, tok, torch.ones(tok.shape), SPEC, None, planned=mine, **kw)
    assert len(asked) == 1


def test_prepare_batch_adds_the_windowed_layers_plan(fresh_cache):
    """MaskSpec.layer_window: the params carry the windowed layers' plan, the documents' causal mask with keys
    i-W..i only, on the full plan's token layout (one dispatch serves both kinds of layers); cached with it."""
    from megatron_cp.planner import plan_like

    spec = B.MaskSpec("packed", eod=EOD, layer_window=64)
    tok = _tokens(40)
    p = B.prepare_batch(tok, None, None, spec, _Group(), OPTIONS).params
    cu = B.document_bounds(tok.numpy(), SPEC)
    want = plan_like(mcp.masks.varlen(cu, causal=True, window=64), p.plan)
    assert p.layer_window == 64 and p.window_plan.digest == want.digest
    assert all(np.array_equal(p.window_plan.local_ids(r), p.plan.local_ids(r)) for r in range(CP))
    again = B.prepare_batch(tok, None, None, spec, _Group(), OPTIONS).params
    assert again.window_plan is p.window_plan
    with pytest.raises(ValueError, match="windowed layers \\(layer_window=64\\) run with megatron_cp's own plan"):
        B.prepare_batch(tok, None, None, spec, _Group(), B.PlanOptions(strategy="ring"))
    with pytest.raises(ValueError, match="needs the causal or packed mask"):
        B.MaskSpec("sliding_window", window=8, layer_window=4)


def test_plans_slower_than_the_step_are_made_several_at_once_in_order():
    """A plan three steps long (a sleep: the planning thread waits on its helper process without the GIL) cannot
    keep ahead one at a time: each wait after the start lets one more plan run at once, up to max_workers, and
    then the step stops waiting. Micro-batches and plans stay in order, the ordered sections run in micro-batch
    order, and never more plans run at once than allowed."""
    from megatron_cp.megatron import in_turn

    step_s, plan_s, n = 0.02, 0.06, 64  # room to grow to the cap even on a loaded machine
    running, most, order, lock = [0], [0], [], threading.Lock()

    def plan_fn(b):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(plan_s * (1.5 if b % 3 == 0 else 1.0))  # uneven: later plans may finish first
        with in_turn():
            order.append(b)
        with lock:
            running[0] -= 1
        return ("plan of", b)

    it = PlanAhead(iter(range(n)), plan_fn, depth=2, max_workers=4)
    got = []
    for b in it:
        assert it.last == ("plan of", b)
        got.append(b)
        time.sleep(step_s)
    assert got == list(range(n)) and order == list(range(n))
    assert it.workers == 4 and most[0] <= 4
    assert sum(it.waits[-10:]) < 0.2 * sum(it.waits[2:12]), it.waits  # caught up once enough plans run at once
    # one late plan among quick ones (a pause, not a trend) starts no second helper
    # (steps of 50 ms: a quick plan queued behind the late one gets that long to be scheduled on a loaded machine,
    # where 20 ms was once too little and counted as a second late plan)
    late = PlanAhead(iter(range(20)), lambda b: time.sleep(0.3 if b == 10 else 0.0), depth=2, max_workers=4)
    for _ in late:
        time.sleep(0.05)
    assert late.workers == 1 and max(late.waits[3:]) > 0.1
    one = PlanAhead(iter(range(6)), lambda b: time.sleep(plan_s), depth=2, max_workers=1)
    assert list(one) == list(range(6)) and one.workers == 1
    with pytest.raises(ValueError, match="max_workers must be an int >= 1"):
        PlanAhead(iter([]), plan_fn, max_workers=0)
    assert PlanAhead(iter([]), plan_fn).max_workers == 1  # more only where the caller allows it


def test_default_workers_leave_each_planner_a_core():
    """The plugin's cap on plans at once: at most 8, and one less than the node's cores per training process
    (never below 1)."""
    import os

    from megatron_cp.megatron import default_workers

    cores = os.cpu_count() or 1
    assert default_workers(1) == max(1, min(8, cores - 1))
    assert default_workers(cores) == 1 and default_workers(10 ** 6) == 1
    with pytest.raises(ValueError, match="processes_per_node must be an int >= 1, got 0"):
        default_workers(0)


def _ordered_collectives(rank, world):
    import torch.distributed as dist

    from megatron_cp.megatron import in_turn

    rng = np.random.default_rng(rank)
    delays = rng.uniform(0.0, 0.05, 24)  # each rank's plans finish in its own order

    def plan_fn(b):
        time.sleep(float(delays[b]))
        with in_turn():
            t = torch.tensor([b], dtype=torch.int64)
            dist.all_reduce(t)  # a collective per plan: the same micro-batch's on every rank, or wrong sums
        return int(t)

    it = PlanAhead(iter(range(24)), plan_fn, depth=4, max_workers=3)
    sums = []
    for b in it:
        sums.append(it.last)
        time.sleep(0.005)
    return sums, it.workers


def test_collectives_in_turn_pair_the_same_micro_batch_on_every_rank():
    from megatron_cp.testing import run_ranks

    for sums, workers in run_ranks(_ordered_collectives, 2):
        assert sums == [2 * b for b in range(24)]
        assert workers > 1  # several plans were made at once
