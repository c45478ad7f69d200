"""Distributed attention (CPU, gloo, spawned ranks) against a single-process fp64 dense reference.

Every builder mask x cp in {1, 2, 4} (two masks also at cp 8) x MHA/GQA, seeded random masks of
overlapping slices of all four kinds with lengths not divisible by cp, float64 within 1e-12 on both exchange
paths and torch.autograd.gradcheck at cp 1, 2 and 3, bf16 under the 2x-low-precision-reference rule, and bad
inputs that must raise before any collective (or, for inputs that differ across ranks, on every rank).
Each world size is spawned once and runs all its cases.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import masks as M

from megatron_cp.testing import reference_attention, run_ranks

from _dist import raise_before_collectives
from reference import assert_bf16, bf16_errors, local_errors

S = 53  # not divisible by any cp tested


def builder_masks():
    table = np.array([[2, 0, 0, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0], [0, 1, 2, 0, 0, 0, 0], [1, 0, 1, 2, 0, 0, 0],
                      [1, 1, 1, 1, 2, 0, 0], [0, 0, 0, 0, 1, 2, 0], [1, 0, 0, 1, 0, 1, 2]])
    return {
        "full": M.full(S),
        "causal": M.causal(S),
        "sliding_window": M.sliding_window(S, 7, 3),
        "varlen": M.varlen([0, 5, 17, 18, 40, S], causal=True),
        "varlen_window": M.varlen([0, 20, 21, S], causal=True, window=6),
        "block_causal": M.block_causal(S, 8),
        "prefix_lm": M.prefix_lm(S, 13),
        "strided": M.strided(S, 4, 3),
        "global_local": M.global_local(S, 4, 1, 1),
        "star": M.star(S, 8, 6),
        "streaming": M.streaming(S, 3, 6),
        "block_table": M.from_block_table(table, 8, S, S),
        "mask_mod": M.from_mask_mod(lambda b, h, q, kv: ((q - kv).abs() < 5) | (kv % 7 == 0), S, S, block=16),
    }


def random_mask(seed: int) -> mcp.AttnMask:
    rng = np.random.default_rng(seed)
    s = int(rng.integers(20, 70))
    slices = []
    for _ in range(int(rng.integers(2, 9))):
        q0 = int(rng.integers(0, s - 1)); q1 = int(rng.integers(q0 + 1, s + 1))
        k0 = int(rng.integers(0, s - 1)); k1 = int(rng.integers(k0 + 1, s + 1))
        slices.append(mcp.AttnSlice((q0, q1), (k0, k1), M.KINDS[int(rng.integers(0, 4))]))
    return mcp.AttnMask(slices, s, s)


def _case(rank, world, mask, hq, hkv, dtype=torch.float32, solver="auto", with_lse_grad=False, d=8, guest_rows="auto",
          ahead=None, **attn_kw):
    """Max abs errors of out, lse, dq, dk, dv on this rank vs the fp64 dense reference. ``ahead``: a backend whose
    plan, exchange and first-call host work the planning helper process makes (``plan_in_helper(rank=)``, as the
    Megatron plugin asks), checked to be what the first call took."""
    s = mask.seqlen_q
    gen = torch.Generator().manual_seed(1234 + s + hq)
    q, do = (torch.randn(s, hq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(s, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    dl = torch.randn(s, hq, generator=gen, dtype=torch.float64)
    scale = 0.37
    ref = reference_attention(q, k, v, mask, scale, dout=do, dlse=dl if with_lse_grad else None)

    if ahead is None:
        plan = mcp.plan(mask, world, solver=solver, guest_rows=guest_rows)
    else:
        from megatron_cp.runtime import state

        work = mcp.planner.Workload(hq, hkv, d, torch.empty(0, dtype=dtype).element_size())
        stages = attn_kw.get("stages")
        plan = mcp.runtime.plan_in_helper(mask, world, work=work, stages=stages, rank=rank, backend=ahead,
                                          device="cpu", solver=solver, guest_rows=guest_rows)
        key = state._ahead_key(rank, stages, True, mcp.runtime.CostModel(), work)
        made = state.plan_cache(plan)[key]  # the single exchange's or staged routes' arrays, the guest rows'
        assert (made.single is None) == (made.routes is not None) and (made.guests is not None) == plan.has_guests
        attn_kw = dict(attn_kw, backend=ahead)
    group = dist.group.WORLD if world > 1 else None
    ql, kl, vl = (mcp.dispatch(t.to(dtype), plan, group).detach().requires_grad_() for t in (q, k, v))
    out, lse = mcp.attention(ql, kl, vl, plan, group, softmax_scale=scale, **attn_kw)
    if ahead is not None:
        assert key not in state.plan_cache(plan)  # taken by the first call
    ids = torch.from_numpy(plan.local_ids(rank))
    loss = (out.double() * do[ids]).sum()
    if with_lse_grad:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * dl[ids]).sum()
    loss.backward()
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), lse.dtype
    fin = torch.isfinite(ref.lse[ids])
    assert torch.equal(torch.isfinite(lse), fin), "fully masked rows must give lse -inf exactly there"
    assert (out[~fin.all(-1)].abs().sum() == 0) if (~fin).any() else True
    errs = local_errors(ids, out, lse, (ql, kl, vl), ref)
    errs["full_out"] = float((mcp.undispatch(out, plan, group).detach().double() - ref.out).abs().max()) if world > 1 else 0.0
    return errs


def _exact_cases(rank, world, names):
    masks = builder_masks()
    res = {}
    for name in names:
        for hq, hkv in ((2, 2), (4, 2), (4, 1)):
            if hkv == 1 and name not in ("causal", "varlen"):
                continue  # MQA on two masks is enough
            res[(name, hq, hkv)] = _case(rank, world, masks[name], hq, hkv)
    for seed in range(6 if world > 1 else 2):
        res[("random", seed)] = _case(rank, world, random_mask(seed), 4, 2, with_lse_grad=seed % 2 == 0)
    for solver in ("contiguous", "zigzag", "greedy", "swap", "documents"):
        res[("solver", solver)] = _case(rank, world, masks["varlen"], 4, 2, solver=solver)
    if world == 4:  # rank 3 holds a whole document (no traffic) while ranks 0-2 exchange: it must join
        idle = M.varlen([0, 39, S], causal=True)  # every collective anyway (it hung in the single exchange)
        for kw in ({"stages": 0}, {"stages": 1}, {}):
            res[("idle rank", str(kw))] = _case(rank, world, idle, 4, 2, solver="contiguous", **kw)
    # float64 stays float64 through lse, every merge and the gradient sums: exact to rounding on either exchange path
    # (and in guest rows' partials: the last rows of causal); cp 1, 2 and 4 (cp 8 runs two masks only)
    for name in ("varlen", "sliding_window", "global_local", "guests") if world <= 4 else ():
        for kw in ({"stages": 0}, {"stages": 1}):
            extra = {"guest_rows": [[S - 6, S]]} if name == "guests" else {}
            res[("float64", name, str(kw))] = _case(rank, world, masks["causal" if name == "guests" else name], 4, 2,
                                                    dtype=torch.float64, with_lse_grad=True, **extra, **kw)
    if world == 2:  # the first call's host work made in each rank's planning helper (FA4's lists: test_plan_process)
        for name, kw in (("varlen", {"stages": 0}), ("guests", {"stages": 0}), ("causal", {"stages": 1})):
            extra = {"guest_rows": [[S - 6, S]]} if name == "guests" else {}
            res[("float64", "ahead", name)] = _case(rank, world, masks["causal" if name == "guests" else name], 4, 2,
                                                    dtype=torch.float64, with_lse_grad=True, ahead="reference",
                                                    **extra, **kw)
    if world > 1:  # the runtime's row moves as slice copies per run (by default several runs go indexed)
        from megatron_cp.runtime import rowmap

        saved, rowmap.MAX_RUNS = rowmap.MAX_RUNS, 10**9
        try:
            for name in ("global_local", "varlen", "star"):
                if name in names:
                    res[("slice rows", name)] = _case(rank, world, masks[name], 4, 2, with_lse_grad=True)
        finally:
            rowmap.MAX_RUNS = saved
    return res


def _check(results, tol=1e-4):
    """Every error within ``tol`` (float32 inputs), those of cases keyed "float64" within 1e-12."""
    bad = [(rank, key, k, v) for rank, r in enumerate(results) for key, e in r.items() for k, v in e.items()
           if v > (1e-12 if key[0] == "float64" else tol)]
    assert not bad, f"errors above {tol} (1e-12 for float64): {bad[:10]}"


ALL = list(builder_masks())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_builder_mask_matches_fp64_reference(world):
    _check(run_ranks(_exact_cases, world, ALL))


def test_cp8_two_masks():
    _check(run_ranks(_exact_cases, 8, ["causal", "varlen"]))


class _SumOverRanks(torch.autograd.Function):
    """The sum over ranks of each rank's part (an all-reduce), whose backward hands the output's gradient to every
    rank's part as it is: one loss of the sum, counted once, the same function on every rank (what gradcheck
    differentiates), whose gradient the attention's collective backward assembles across the ranks."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def _whole(plan, group, rank, s, **kw):
    """(q, k, v) of the whole sequence, identical on every rank -> the whole (out, lse) of ``mcp.attention`` under
    ``plan`` (each rank's rows in place, summed over the ranks); lse 0 where it is -inf."""
    ids = torch.from_numpy(plan.local_ids(rank))

    def f(q, k, v):
        local = [mcp.dispatch(t, plan, group) if group is not None else mcp.dispatch(t, plan, rank=0) for t in (q, k, v)]
        out, lse = mcp.attention(*local, plan, group, **kw)
        lse = torch.where(torch.isfinite(lse), lse, 0.0)
        parts = [x.new_zeros((s,) + x.shape[1:]).index_copy(0, ids, x) for x in (out, lse)]
        return tuple(parts) if group is None else tuple(_SumOverRanks.apply(x, group) for x in parts)

    return f


def _gradcheck_cases(rank, world):
    """torch.autograd.gradcheck of float64 attention (atol 1e-9, rtol 1e-7; float32 lse failed it at 2e-7) on a
    packed and a windowed mask: cp 1 on every rank, cp 2 on ranks 0-1, cp 3 on all three, both exchange paths at
    cp 3; then double backward, refused on every rank with one message."""
    torch.set_num_threads(1)
    s = 48
    masks = {"packed": M.varlen([0, 20, 21, 33, s], causal=True), "window": M.sliding_window(s, 7, 3)}
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(s, h, 4, generator=gen, dtype=torch.float64) for h in (2, 1, 1)]
    pair = dist.new_group([0, 1])
    res = {}
    for cp, group in ((1, None), (2, pair), (3, dist.group.WORLD)):
        if cp == 2 and rank == 2:
            continue
        r = rank if cp > 1 else 0
        for name, mask in masks.items():
            for stages in ((None, 1) if cp == 3 else (None,)):
                plan = mcp.plan(mask, cp)
                torch.manual_seed(7)  # gradcheck's random projections: the same on every rank
                inputs = tuple(t.clone().requires_grad_() for t in qkv)
                res[(cp, name, stages)] = torch.autograd.gradcheck(_whole(plan, group, r, s, stages=stages), inputs,
                                                                   atol=1e-9, rtol=1e-7, fast_mode=True)
    plan = mcp.plan(masks["packed"], world)
    local = [mcp.dispatch(t, plan, dist.group.WORLD).requires_grad_() for t in qkv]
    out, _ = mcp.attention(*local, plan, dist.group.WORLD)
    try:
        torch.autograd.grad(out.pow(2).sum(), local, create_graph=True)
        res["double backward"] = "no error"
    except RuntimeError as e:
        res["double backward"] = str(e)
    return res


def test_float64_gradcheck_at_cp_1_2_3_and_double_backward_refused():
    for r in run_ranks(_gradcheck_cases, 3):
        msg = r.pop("double backward")
        assert "megatron_cp.attention is differentiable once" in msg and "create_graph=True" in msg, msg
        assert r and all(r.values()), r


def _bf16_cases(rank, world):
    """bf16 errors beside a plain bf16 dense PyTorch reference's (the 2x rule, checked by assert_bf16)."""
    out = {}
    for name in ("causal", "varlen", "sliding_window", "strided"):
        for tag, errs in bf16_errors(rank, world, builder_masks()[name]).items():
            out[(name, tag)] = errs
    return out


def test_bf16_within_twice_plain_bf16_error():
    for r in run_ranks(_bf16_cases, 2):
        for key, e in r.items():
            assert_bf16({key[1]: e}, key[0])


def _bad_input_cases(rank, world):
    """Each bad input raises ValueError naming the value, and no collective runs before it."""
    group = dist.group.WORLD
    mask = M.causal(40)
    plan = mcp.plan(mask, world)
    n = plan.num_local(rank)
    q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    bad = {
        "hkv": (lambda: mcp.attention(q, torch.randn(n, 3, 8), torch.randn(n, 3, 8), plan, group), "3 must divide .* 4"),
        "tokens": (lambda: mcp.attention(q[:-1], k, v, plan, group), f"{n - 1} tokens"),
        "kv_shape": (lambda: mcp.attention(q, k, v[:, :1], plan, group), "k and v shapes differ"),
        "dtype": (lambda: mcp.attention(q, k.double(), v, plan, group), "dtypes differ"),
        "head_dim": (lambda: mcp.attention(q, k[..., :4], v[..., :4], plan, group), "head_dim"),
        "rank": (lambda: mcp.attention(q[0], k, v, plan, group), "3-D"),
        "cp_size": (lambda: mcp.attention(q, k, v, mcp.plan(mask, world + 1), group), f"cp_size={world + 1}"),
        "scale": (lambda: mcp.attention(q, k, v, plan, group, softmax_scale=-1.0), "softmax_scale"),
        "dispatch_len": (lambda: mcp.dispatch(torch.randn(39, 2), plan, group), "39 entries, expected 40"),
        "backend": (lambda: mcp.attention(q, k, v, plan, group, backend="cudnn"), "unknown attention backend 'cudnn'"),
        "backend_obj": (lambda: mcp.attention(q, k, v, plan, group, backend=object()), "implementing megatron_cp.kernels.Backend"),
        "group": (lambda: mcp.attention(q, k, v, plan, "notagroup"),
                  "group must be the CP torch.distributed.ProcessGroup .* got 'notagroup'"),
        "no heads": (lambda: mcp.attention(q[:, :0], k[:, :0], v[:, :0], plan, group),
                     "at least one head each, got 0 query and 0 key/value heads"),
    }
    mcp.attention(q, k, v, plan, group)  # a good call first: the bad ones below are later calls of the same plan
    out = raise_before_collectives(bad)
    # plans that differ across ranks: same local sizes (contiguous), different masks
    other = mcp.plan(M.full(40) if rank == 0 else M.causal(40), world, solver="contiguous")
    try:
        mcp.attention(q, k, v, other, group)
        out["digest"] = "no error"
    except ValueError as e:
        out["digest"] = "ok" if "plan digest differs" in str(e) else repr(e)
    # a later call of a plan the ranks agreed on, whose inputs differ on the last rank: a ValueError naming the
    # value on every rank, before the exchange (which aborted gloo), and the plan runs on afterwards
    mcp.attention(q, k, v, plan, group)
    odd = rank == world - 1
    later = {
        "later dtype": ((q.double(), k.double(), v.double()) if odd else (q, k, v), "dtype differs .*float32 to float64"),
        "later kv heads": ((q, k[:, :1], v[:, :1]) if odd else (q, k, v), "key/value heads differs .*from 1 to 2"),
        "later query heads": ((q[:, :2], k, v) if odd else (q, k, v), "query heads differs .*from 2 to 4"),
        "later head dim": ((q[..., :4], k[..., :4], v[..., :4]) if odd else (q, k, v), "q/k head_dim differs .*4 to 8"),
        "later v head dim": ((q, k, v[..., :4]) if odd else (q, k, v), "v head_dim differs .*4 to 8"),
    }
    for key, (args, pattern) in later.items():
        try:
            mcp.attention(*args, plan, group)
            out[key] = "no error"
        except ValueError as e:
            import re

            out[key] = "ok" if re.search(pattern, str(e)) else repr(e)
    o, _ = mcp.attention(q, k, v, plan, group)
    out["runs after"] = "ok" if torch.isfinite(o).all() else "not finite"
    return out


def test_bad_inputs_raise_before_any_collective():
    for r in run_ranks(_bad_input_cases, 2):
        assert all(v == "ok" for v in r.values()), r


def _host_group_cases(rank, world):
    """Two CP groups of 2 in a world of 4, the first seen as a device (non-gloo) group: the plan check's CPU
    twin of it is made by its two ranks alone (the other pair, a gloo group checked over itself, never joins),
    kept, and checks plans over those ranks only; a plan differing inside a group raises on both its ranks. A plan's
    later calls check again on the gloo pair (one all-reduce per call) and not on the device pair (none)."""
    from unittest import mock

    from megatron_cp.runtime import groups

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    real = dist.get_backend
    with mock.patch.object(groups.dist, "get_backend", lambda g=None: "nccl" if g is pairs[0] else real(g)):
        twin = groups.host_group(mine)
        again = groups.host_group(mine)
        ranks = dist.get_process_group_ranks(twin)
        mask = M.causal(40) if rank < 2 else M.full(40)  # the groups differ from each other: allowed
        plan = mcp.plan(mask, 2, solver="contiguous")
        q, k, v = (torch.randn(plan.num_local(dist.get_rank(mine)), h, 8) for h in (4, 2, 2))
        out, _ = mcp.attention(q, k, v, plan, mine)
        reduces, real_reduce = [], dist.all_reduce
        with mock.patch.object(dist, "all_reduce", lambda *a, **k: reduces.append(1) or real_reduce(*a, **k)):
            mcp.attention(q, k, v, plan, mine)  # a later call of the same plan
        # inside the second pair: rank 3 holds another plan of the same local sizes
        bad = mcp.plan(M.full(40) if rank == 3 else M.causal(40), 2, solver="contiguous")
        try:
            mcp.attention(q, k, v, bad, mine)
            caught = "no error"
        except RuntimeError as e:
            caught = "plan digest differs" in str(e)
    return dict(twin_is_new=twin is not mine, kept=twin is again, ranks=ranks, finite=bool(torch.isfinite(out).all()),
                caught=caught, later_checks=len(reduces))


def test_plan_check_runs_on_a_host_twin_of_a_device_group():
    r = run_ranks(_host_group_cases, 4)
    assert [x["ranks"] for x in r] == [[0, 1], [0, 1], [2, 3], [2, 3]], r
    assert [x["twin_is_new"] for x in r] == [True, True, False, False], r
    assert all(x["kept"] and x["finite"] for x in r), r
    # the first pair agrees (both causal); in the second, both ranks raise
    assert [x["caught"] for x in r] == ["no error", "no error", True, True], r
    assert [x["later_checks"] for x in r] == [0, 0, 1, 1], r


def test_plan_errors():
    with pytest.raises(ValueError, match="cp_size=9 exceeds"):
        mcp.plan(M.causal(8), 9)
    with pytest.raises(ValueError, match="seqlen_q=8 != seqlen_k=9"):
        mcp.plan(M.causal(8, 9), 2)
    with pytest.raises(ValueError, match="unknown solver 'best'"):
        mcp.plan(M.causal(8), 2, solver="best")
    import numpy as np

    with pytest.raises(TypeError, match="dispatch takes a torch.Tensor, got ndarray"):
        mcp.dispatch(np.zeros((8, 2)), mcp.plan(M.causal(8), 2), rank=0)
    with pytest.raises(ValueError, match="no process group"):
        mcp.attention(torch.randn(4, 1, 2), torch.randn(4, 1, 2), torch.randn(4, 1, 2), mcp.plan(M.causal(8), 2))


def _triton_cases(rank, world):
    """The distributed runtime on the Triton backend (CPU interpreter; K/V buffers are strided views)."""
    from megatron_cp.kernels.triton.backend import TritonBackend

    calls = []
    for name in ("forward", "forward_accumulate", "backward"):
        real = getattr(TritonBackend, name)
        setattr(TritonBackend, name, (lambda real, name: lambda self, *a, **k: calls.append(name) or real(self, *a, **k))(real, name))
    masks = builder_masks()
    res = {}
    for name in ("causal", "varlen", "strided", "global_local"):
        mask = masks[name]
        plan = mcp.plan(mask, world)
        res[name] = _case_backend(rank, world, mask, plan, "triton")
    res["random"] = _case_backend(rank, world, random_mask(3), mcp.plan(random_mask(3), world), "triton")
    assert {"forward", "forward_accumulate"} & set(calls) and "backward" in calls, calls
    return res


def _case_backend(rank, world, mask, plan, backend, hq=4, hkv=2, d=16, stages=None):
    s = mask.seqlen_q
    gen = torch.Generator().manual_seed(99)
    q, do = (torch.randn(s, hq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(s, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    ref = reference_attention(q, k, v, mask, 0.3, dout=do)
    group = dist.group.WORLD
    ql, kl, vl = (mcp.dispatch(t.float(), plan, group).detach().requires_grad_() for t in (q, k, v))
    out, lse = mcp.attention(ql, kl, vl, plan, group, softmax_scale=0.3, backend=backend, stages=stages)
    ids = torch.from_numpy(plan.local_ids(rank))
    (out.double() * do[ids]).sum().backward()
    fin = torch.isfinite(ref.lse[ids])
    assert torch.equal(torch.isfinite(lse), fin)
    return local_errors(ids, out, lse, (ql, kl, vl), ref)


def test_triton_backend_in_the_distributed_path():
    pytest.importorskip("triton")
    _check(run_ranks(_triton_cases, 2))


def test_a_repeated_call_reuses_its_checks_and_a_changed_one_checks_again(monkeypatch):
    """The checks and state look-up of a call are made once per plan and call signature: a layer that calls again
    with the same shapes, dtypes, devices and settings skips them (every layer of a micro-batch does); a call that
    differs in any of them is checked again, so a mistake on a later call still raises."""
    att_mod = sys.modules["megatron_cp.runtime.attention"]  # the package's ``attention`` is the function
    calls = []
    real = att_mod.check_inputs
    monkeypatch.setattr(att_mod, "check_inputs", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    plan = mcp.plan(M.causal(32), 1)
    q, k, v = torch.randn(32, 4, 8), torch.randn(32, 2, 8), torch.randn(32, 2, 8)
    first, _ = mcp.attention(q, k, v, plan)
    again, _ = mcp.attention(q * 1, k * 1, v * 1, plan)  # new tensors, same signature
    assert len(calls) == 1 and torch.equal(first, again)
    mcp.attention(q, k, v, plan, softmax_scale=0.5)
    mcp.attention(q.double(), k.double(), v.double(), plan)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="softmax_scale must be a positive number, got -1.0"):
        mcp.attention(q, k, v, plan, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="31 tokens but the plan gives rank 0 32"):
        mcp.attention(q[:31], k[:31], v[:31], plan)
    with pytest.raises(ValueError, match="stages must be None or an int >= 0, got -1"):
        mcp.attention(q, k, v, plan, stages=-1)
    with pytest.raises(ValueError, match="comm_lead_us must be"):
        mcp.attention(q, k, v, plan, comm_lead_us=-1.0)
    assert len(calls) == 7
