"""Staged overlap: planner stages partition each rank's cells exactly; the staged runtime (prefetch of
stage s+1 while computing s, LSE merge, staged GroupReduce) matches the fp64 dense reference; the cast
of the next stage is issued before the current stage's kernel runs; buffers are reused across layers;
the cost model and its calibration file round-trip. One spawn of 4 CPU ranks runs every distributed case.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import masks as M
from megatron_cp.comm import BufferPool
from megatron_cp.masks import geometry
from megatron_cp.comm import device_pool
from megatron_cp.planner import Workload
from megatron_cp.runtime.cost import CostModel, tile_areas
from megatron_cp.runtime.schedule import schedule
from megatron_cp.runtime.state import states_of

from reference import assert_bf16, bf16_errors, local_errors, tiny_masks

from megatron_cp.testing import reference_attention, run_ranks

S = 61


def _masks():
    return tiny_masks(S)


def _random_mask(seed):
    rng = np.random.default_rng(seed)
    kinds = ("full", "causal", "inv_causal", "bi_causal")
    sl = []
    for _ in range(5):
        q0, q1 = sorted(rng.choice(S + 1, 2, replace=False))
        k0, k1 = sorted(rng.choice(S + 1, 2, replace=False))
        sl.append(mcp.AttnSlice((q0, q1), (k0, k1), kinds[rng.integers(4)]))
    return mcp.AttnMask(sl, S, S)


def _dense_of_tiles(tiles, q_ids, k_ids, n):
    """Global boolean picture of tiles whose rows/keys map to global ids ``q_ids``/``k_ids``."""
    d = np.zeros((n, n), dtype=np.int32)
    for q0, q1, k0, k1, kind in tiles.tolist():
        loc = geometry.traps_to_dense(np.array([geometry.slice_to_trap(q0, q1, k0, k1, kind)]), q1, k1)
        for i in range(q0, q1):
            d[q_ids[i], k_ids[np.nonzero(loc[i])[0]]] += 1
    return d


@pytest.mark.parametrize("cp", [2, 4])
def test_stages_partition_each_ranks_cells(cp):
    for name, mask in list(_masks().items()) + [(f"random{s}", _random_mask(s)) for s in range(4)]:
        plan = mcp.plan(mask, cp)
        assert np.array_equal(geometry.traps_to_dense(plan.computed_traps(), S, S), mask.to_dense()), name
        for n in (1, 2, 3):
            sched = schedule(plan, n)
            assert sched.num_stages == n and len(sched.active) == n
            total = np.zeros((S, S), dtype=np.int32)
            for r in range(cp):
                rp = plan.ranks[r]
                q_ids = rp.local_ids()
                st = sched.ranks[r]
                total += _dense_of_tiles(st[0].tiles, q_ids, q_ids, S)
                # guest rows' cells (planner.guests) are computed outside the stages, on own keys
                g_rows = np.array([i for runs in rp.guest_recv_runs for a, b in runs.tolist() for i in range(a, b)], dtype=np.int64)
                total += _dense_of_tiles(rp.guest_tiles, g_rows, q_ids, S)
                remote = np.concatenate([np.zeros(0, np.int64)] + [np.concatenate(
                    [np.arange(a, b) for a, b in runs.tolist()] or [np.zeros(0, np.int64)]) for runs in rp.recv_runs])
                remote = np.sort(remote)
                cut = (np.arange(n + 1) * len(remote)) // n
                for s in range(1, n + 1):
                    k_ids = remote[cut[s - 1]:cut[s]]  # equal pieces in global order (flat routes)
                    assert st[s].buf_len == len(k_ids)
                    total += _dense_of_tiles(st[s].tiles, q_ids, k_ids, S)
            # every cell of the mask exactly once over all ranks and stages
            assert np.array_equal(total, mask.to_dense().astype(np.int32)), (name, cp, n)


def test_traps_to_tiles_against_dense():
    mask = _random_mask(11)
    traps = mask.traps
    q_runs = np.array([[40, 61], [3, 17]])
    k_runs = np.array([[30, 50], [0, 12], [55, 61]])
    tiles = geometry.traps_to_tiles(traps, q_runs, k_runs)
    q_ids = np.concatenate([np.arange(a, b) for a, b in q_runs])
    k_ids = np.concatenate([np.arange(a, b) for a, b in k_runs])
    got = _dense_of_tiles(tiles, q_ids, k_ids, S)
    want = np.zeros((S, S), dtype=np.int32)
    want[np.ix_(q_ids, k_ids)] = mask.to_dense()[np.ix_(q_ids, k_ids)]
    assert np.array_equal(got, want)


def test_cost_model_chooses_stages_and_round_trips(tmp_path):
    mask = M.causal(1 << 15)
    plan = mcp.plan(mask, 8, solver="zigzag")
    work = Workload(32, 8, 128, 2)
    # communication much slower than compute: more stages hide more of it
    slow = CostModel.from_flat(dict(intra_gbps=2.0, launch_us=5.0, latency_us=5.0))
    fast = CostModel.from_flat(dict(intra_gbps=1e5, launch_us=200.0, latency_us=200.0))
    n_slow = schedule(plan, None, cost=slow, work=work).num_stages
    n_fast = schedule(plan, None, cost=fast, work=work).num_stages
    assert n_slow > 1 and n_fast == 1, (n_slow, n_fast)
    pred = schedule(plan, None, cost=slow, work=work).predicted
    assert pred["candidates"][n_slow] <= min(pred["candidates"].values()) * 1.02
    path = tmp_path / "cost.json"
    slow.save(str(path))
    assert CostModel.load(str(path)) == slow
    path.write_text('{"fwd_tflops": 1.0, "warp_speed": 9}')
    with pytest.raises(ValueError, match="warp_speed"):
        CostModel.load(str(path))
    with pytest.raises(ValueError, match="num_stages must be None or an int >= 0, got -1"):
        schedule(plan, -1)


def test_tile_areas_match_geometry():
    rng = np.random.default_rng(0)
    tiles = []
    for _ in range(400):
        q0, k0 = rng.integers(0, 50, 2)
        tiles.append((q0, q0 + rng.integers(1, 40), k0, k0 + rng.integers(1, 40), rng.integers(0, 4)))
    tiles = np.array(tiles)
    area, rows = tile_areas(tiles)
    for t, a, r in zip(tiles, area, rows):
        tr = geometry.slice_to_trap(*t)
        assert a == (0 if tr is None else geometry.traps_area(np.array([tr]))), t
        assert r == t[1] - t[0]


def test_buffer_pool_is_bounded():
    pool = BufferPool()
    a = pool.get((4, 3), torch.float32, "cpu", "x")
    b = pool.get((2, 3), torch.float32, "cpu", "x")
    assert b.data_ptr() == a.data_ptr() and pool.nbytes() == 48
    pool.get((8, 3), torch.float32, "cpu", "x")
    pool.get((3, 3), torch.float32, "cpu", "x")
    assert pool.nbytes() == 96


def _case(rank, world, mask, stages, hq=4, hkv=2, with_lse_grad=False, dtype=torch.float64, topology=None,
          hierarchical=True):
    s, d = mask.seqlen_q, 8
    gen = torch.Generator().manual_seed(7 + hq)
    q, do = (torch.randn(s, hq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(s, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    dl = torch.randn(s, hq, generator=gen, dtype=torch.float64)
    ref = reference_attention(q, k, v, mask, 0.3, dout=do, dlse=dl if with_lse_grad else None)
    plan = mcp.plan(mask, world, topology=topology)
    group = dist.group.WORLD
    ql, kl, vl = (mcp.dispatch(t.to(dtype), plan, group).detach().requires_grad_() for t in (q, k, v))
    out, lse = mcp.attention(ql, kl, vl, plan, group, softmax_scale=0.3, stages=stages, hierarchical=hierarchical)
    ids = torch.from_numpy(plan.local_ids(rank))
    loss = (out.double() * do[ids]).sum()
    if with_lse_grad:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * dl[ids]).sum()
    loss.backward()
    fin = torch.isfinite(ref.lse[ids])
    assert torch.equal(torch.isfinite(lse), fin), "fully masked rows must give lse -inf exactly there"
    return local_errors(ids, out, lse, (ql, kl, vl), ref)


def _order_case(rank, world):
    """Record the order of collectives and kernel calls: the cast of stage s+1 must be issued before
    the kernel of stage s, and backward reduces must be issued before the next stage's kernel."""
    events = []
    real_a2a = dist.all_to_all_single

    def spy(*a, **k):
        events.append(("a2a", bool(k.get("async_op"))))
        return real_a2a(*a, **k)

    mask = M.full(S)
    plan = mcp.plan(mask, world, solver="contiguous")
    group = dist.group.WORLD
    n = plan.num_local(rank)
    q, k, v = (torch.randn(n, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mcp.attention(q, k, v, plan, group, stages=3)  # builds and caches the runtime
    (rt,) = [st for st in states_of(plan) if st.staged is not None]
    backend = rt.backend
    real_fwd, real_bwd = backend.forward_accumulate, backend.backward_into
    backend.forward_accumulate = lambda *a, **k_: (events.append(("fwd",)), real_fwd(*a, **k_))[1]
    backend.backward_into = lambda *a, **k_: (events.append(("bwd",)), real_bwd(*a, **k_))[1]
    import importlib

    rt_mod = importlib.import_module("megatron_cp.runtime.attention")  # the module (the package exports the function)

    real_lead = rt_mod.comm_lead
    rt_mod.comm_lead = lambda device, us: events.append((f"lead{us:g}",))
    dist.all_to_all_single = spy
    try:
        out, _ = mcp.attention(q, k, v, plan, group, stages=3, comm_lead_us=7.5)
        out.sum().backward()
    finally:
        dist.all_to_all_single = real_a2a
        rt_mod.comm_lead = real_lead
        del backend.forward_accumulate, backend.backward_into  # the class's methods again
    return [e[0] if e[0] != "a2a" else ("a2a" if e[1] else "sync_a2a") for e in events]


class _CountingBackend:
    """The reference backend, counting the accumulating forwards and the backwards into running sums
    that the staged runtime calls."""

    def __init__(self, inner):
        self.inner, self.name, self.calls, self.into_calls = inner, "counting", 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward_accumulate(self, *a):
        self.calls += 1
        return self.inner.forward_accumulate(*a)

    def backward_into(self, *a):
        self.into_calls += 1
        return self.inner.backward_into(*a)


def _accumulate_case(rank, world):
    """fp32 inputs through the staged path (accumulating forwards, backwards into running sums) match the
    fp64 reference."""
    res = {}
    for name in ("causal", "varlen", "global_local"):
        mask = _masks()[name]
        plan = mcp.plan(mask, world)
        group = dist.group.WORLD
        s, hq, hkv, d = S, 4, 2, 8
        gen = torch.Generator().manual_seed(1)
        q, k, v, do = (torch.randn(s, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
        ref = reference_attention(q, k, v, mask, 0.3, dout=do)
        ls = [mcp.dispatch(t.float(), plan, group).detach().requires_grad_() for t in (q, k, v)]
        mcp.attention(*ls, plan, group, softmax_scale=0.3, stages=3)  # build the runtime
        (rt,) = [st for st in states_of(plan) if st.staged is not None]
        rt.backend = _CountingBackend(rt.backend)
        out, _ = mcp.attention(*ls, plan, group, softmax_scale=0.3, stages=3)
        ids = torch.from_numpy(plan.local_ids(rank))
        (out.double() * do[ids]).sum().backward()
        assert rt.backend.calls > 0 and rt.backend.into_calls > 0
        res[name] = max(float((a.detach().double() - b.detach()).abs().max())
                        for a, b in ((out, ref.out[ids]), (ls[0].grad, ref.dq[ids]), (ls[1].grad, ref.dk[ids])))
    return res


def _pool_case(rank, world):
    plan = mcp.plan(M.causal(S), world)
    group = dist.group.WORLD
    n = plan.num_local(rank)
    sizes = {}
    for stages in (2, 0):  # staged, then the single exchange (its send/receive buffers join the pool)
        sizes[stages] = []
        for layer in range(3):
            q, k, v = (torch.randn(n, 2, 8, requires_grad=True) for _ in range(3))
            out, _ = mcp.attention(q, k, v, plan, group, stages=stages)
            out.sum().backward()
            sizes[stages].append(device_pool(q.device).nbytes())
    return sizes


def _bad_case(rank, world):
    called = []
    real = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: (called.append(1), real(*a, **k))[1]
    plan = mcp.plan(M.causal(S), world)
    n = plan.num_local(rank)
    q = torch.randn(n, 2, 8)
    res = {}
    for name, kw, match in (("neg", {"stages": -1}, "stages must be None or an int >= 0, got -1"),
                            ("float", {"stages": 1.5}, "got 1.5"),
                            ("cost", {"cost_model": {"fwd_tflops": 1}}, "cost_model must be a CostModel"),
                            ("lead", {"comm_lead_us": -5}, "comm_lead_us must be a number of microseconds .*got -5"),
                            ("lead_str", {"comm_lead_us": "20"}, "comm_lead_us .*got '20'")):
        try:
            mcp.attention(q, q, q, plan, dist.group.WORLD, **kw)
            res[name] = "no error"
        except ValueError as e:
            import re

            res[name] = "ok" if re.search(match, str(e)) and not called else f"{e!r} {called}"
    dist.all_to_all_single = real
    return res


def _all_cases(rank, world):
    res = {}
    for name, mask in _masks().items():
        for stages in (None, 1, 2, 3):
            res[(name, stages)] = _case(rank, world, mask, stages, with_lse_grad=stages == 2)
    for seed in range(4):
        res[("random", seed)] = _case(rank, world, _random_mask(seed), 1 + seed % 3, with_lse_grad=True)
    res[("mqa", 2)] = _case(rank, world, _masks()["varlen"], 2, hq=4, hkv=1)
    bf = {}
    for name in ("causal", "varlen", "sliding_window"):
        bf[name] = _bf16_case(rank, world, _masks()[name])
    return {"exact": res, "bf16": bf, "order": _order_case(rank, world), "pool": _pool_case(rank, world),
            "bad": _bad_case(rank, world), "accumulate": _accumulate_case(rank, world)}


def _bf16_case(rank, world, mask):
    """bf16 errors beside a plain bf16 dense PyTorch reference's (the 2x rule, checked by assert_bf16)."""
    return bf16_errors(rank, world, mask, stages=3)


@pytest.fixture(scope="module")
def cp4():
    return run_ranks(_all_cases, 4)


def test_staged_attention_matches_fp64_reference(cp4):
    # the backend interface returns lse in float32, so fp64 results carry ~1e-7 of merge rounding
    bad = [(r, key, k, v) for r, res in enumerate(cp4) for key, e in res["exact"].items() for k, v in e.items() if v > 1e-5]
    assert not bad, bad[:10]


def test_staged_bf16_within_twice_plain_bf16_error(cp4):
    for res in cp4:
        for name, errs in res["bf16"].items():
            assert_bf16(errs, name)


def test_next_stage_cast_is_issued_before_current_kernel(cp4):
    for res in cp4:
        ev = res["order"]
        assert "sync_a2a" not in ev
        fwd = ev[: ev.index("bwd")]
        bwd = ev[ev.index("bwd"):]
        # forward of 3 remote stages on a full mask: a2a(1) fwd(0) a2a(2) fwd(1) a2a(3) fwd(2) fwd(3), each
        # kernel that overlaps an all-to-all queued after the lead given to mcp.attention (comm_lead)
        assert fwd == ["a2a", "lead7.5", "fwd", "a2a", "lead7.5", "fwd", "a2a", "lead7.5", "fwd", "fwd"], fwd
        # backward: bwd(1) a2a(1) bwd(2) a2a(2) bwd(3) a2a(3) bwd(0): each reduce flies during a kernel
        assert bwd == ["bwd", "a2a", "bwd", "a2a", "bwd", "a2a", "bwd"], bwd


def test_buffers_are_reused_across_layers(cp4):
    for res in cp4:
        staged, single = res["pool"][2], res["pool"][0]
        assert staged[0] > 0 and staged[0] == staged[1] == staged[2], staged
        # the single exchange adds its four buffers once, then reuses them layer after layer
        assert single[0] > staged[2] and single[0] == single[1] == single[2], single


def test_bad_overlap_arguments_raise_before_any_collective(cp4):
    for res in cp4:
        assert all(v == "ok" for v in res["bad"].values()), res["bad"]


def test_accumulating_backend_path_matches_reference(cp4):
    for res in cp4:
        assert max(res["accumulate"].values()) < 1e-4, res["accumulate"]
