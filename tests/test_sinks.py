"""Attention sinks under CP (``mcp.apply_sink`` on the merged ``(out, lse)``) against a dense fp64 softmax
with the sink column (``reference.dense_attention``): out, lse, dq, dk, dv and dsink, CP 1 / 2 / 4 (gloo,
spawned ranks, every case in one spawn per world size; CP 1 runs inside the CP 2 spawn), packed documents and rows that keep no key,
megatron-cp's single-exchange and staged paths, guest rows, the Triton backend (CPU interpreter) and the
baseline strategies."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import masks as M
from megatron_cp.testing import run_ranks

from _dist import assert_errors_within
from reference import dense_attention

S = 45


def _masks():
    # rows 7-9 and 40-44 keep no key (out 0, lse' = sink); three packed documents around them
    holes = mcp.AttnMask([mcp.AttnSlice((0, 7), (0, 7), "causal"), mcp.AttnSlice((10, 26), (10, 26), "causal"),
                          mcp.AttnSlice((26, 40), (20, 40), "causal")], S, S)
    return {"causal": M.causal(S), "packed": M.varlen([0, 5, 17, 18, 33, S], causal=True), "holes": holes}


def _inputs(hq, hkv, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(S, hq, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(S, hkv, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(S, hkv, dv, generator=gen, dtype=torch.float64)
    do = torch.randn(S, hq, dv, generator=gen, dtype=torch.float64)
    dl = torch.randn(S, hq, generator=gen, dtype=torch.float64)
    sink = torch.randn(hq, generator=gen, dtype=torch.float64)
    return q, k, v, do, dl, sink


def reference(mask, q, k, v, do, dl, sink, scale):
    """fp64 dense attention with the sink column: out, lse, dq, dk, dv, dsink of sum(out*do) + sum(lse*dl)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out, lse = dense_attention(*leaves[:3], torch.as_tensor(mask.to_dense()), scale, leaves[3])
    ((out * do).sum() + (lse * dl).sum()).backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def sink_case(rank, world, mask, attend, dtype, hq=4, hkv=2, dk=8, dv=8, seed=3, fixed=False, plan=None):
    """Max abs errors of this rank's (out, lse, dq, dk, dv) rows and of the summed dsink against the fp64
    reference; ``attend(q, k, v, plan, group, scale) -> (out, lse)`` is the strategy under test; ``fixed``:
    an off-by-one sink (zeros, no gradient)."""
    q, k, v, do, dl, sink = _inputs(hq, hkv, dk, dv, seed)
    if fixed:
        sink = torch.zeros(hq, dtype=torch.float64)
    scale = 0.4
    ref = reference(mask, q, k, v, do, dl, sink, scale)
    plan = plan if plan is not None else mcp.plan(mask, world)
    group = dist.group.WORLD if world > 1 else None
    ids = torch.from_numpy(plan.local_ids(rank))
    ls = [mcp.dispatch(t.to(dtype), plan, group).detach().requires_grad_() for t in (q, k, v)]
    sk = sink.to(dtype).requires_grad_(not fixed)
    o, l = attend(*ls, plan, group, scale)
    o, l = mcp.apply_sink(o, l, sk)
    assert not torch.isnan(o).any() and torch.isfinite(l).all()
    ((o.double() * do[ids]).sum() + (l.double() * dl[ids]).sum()).backward()
    got = [o, l] + [t.grad for t in ls]
    errs = {n: float((a.detach().double() - b[ids]).abs().max()) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref)}
    dsink = torch.zeros(hq, dtype=torch.float64) if fixed else sk.grad.double()
    if group is not None:
        dist.all_reduce(dsink, group=group)  # the CP ranks' partial sink gradients add up (Megatron's dp-cp grad reduce)
    errs["dsink"] = 0.0 if fixed else float((dsink - ref[5]).abs().max())
    return errs


def _ours(**kw):
    return lambda q, k, v, plan, group, scale: mcp.attention(q, k, v, plan, group, softmax_scale=scale, **kw)


def _baseline(name):
    from megatron_cp.baselines import get_strategy

    return get_strategy(name, lse_grad=True)


def _cases(rank, world):
    """CP 1 (in every process, no group) and CP = world: each mask, GQA, the off-by-one sink; CP 2 adds MHA,
    both exchange paths, guest rows, Triton and the baselines; CP 4 a subset (the suite's time budget)."""
    torch.set_num_threads(1)
    from megatron_cp.baselines import plan_for

    masks = _masks()
    res = {}
    if world == 4:  # packed documents on both exchange paths
        res[("packed", "fp64")] = sink_case(rank, world, masks["packed"], _ours(), torch.float64)
        res[("holes", "staged")] = sink_case(rank, world, masks["holes"], _ours(stages=1), torch.float64)
        return res
    for cp in (1, 2):
        r = rank if cp > 1 else 0
        for name in masks:
            res[(cp, name, "fp64")] = sink_case(r, cp, masks[name], _ours(), torch.float64)
        res[(cp, "holes", "off-by-one")] = sink_case(r, cp, masks["holes"], _ours(), torch.float64, fixed=True)
    res[("holes", "staged")] = sink_case(rank, world, masks["holes"], _ours(stages=1), torch.float64)
    res[("ulysses",)] = sink_case(rank, world, masks["packed"], _baseline("ulysses"), torch.float64,
                                  plan=plan_for("ulysses", masks["packed"], world))
    if world == 2:
        res[("packed", "mha")] = sink_case(rank, world, masks["packed"], _ours(), torch.float64, hq=2, hkv=2)
        res[("holes", "single")] = sink_case(rank, world, masks["holes"], _ours(stages=0), torch.float64)
        # the last rows keep most keys: computed by the keys' owners, partials merged before the sink
        plan = mcp.plan(masks["causal"], world, guest_rows=[[S - 6, S]])
        assert plan.has_guests
        res[("guests",)] = sink_case(rank, world, masks["causal"], _ours(), torch.float64, plan=plan)
        for strategy in ("ring", "allgather"):
            mask = masks["causal"] if strategy == "ring" else masks["packed"]
            res[(strategy,)] = sink_case(rank, world, mask, _baseline(strategy), torch.float64,
                                         plan=plan_for(strategy, mask, world))
        res[("triton",)] = sink_case(rank, world, masks["packed"], _ours(backend="triton"), torch.float32, dk=16, dv=16)
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_sinks_match_fp64_softmax_with_sink_column(world):
    assert_errors_within(run_ranks(_cases, world))


def test_apply_sink_refuses_bad_shapes():
    out, lse = torch.zeros(3, 2, 4), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="one logit per head"):
        mcp.apply_sink(out, lse, torch.zeros(3))
    with pytest.raises(ValueError, match="lse"):
        mcp.apply_sink(out, lse[:, :1], torch.zeros(2))
    with pytest.raises(ValueError, match="floating"):
        mcp.apply_sink(out, lse, torch.zeros(2, dtype=torch.long))


def test_apply_sink_keeps_float64_and_refuses_double_backward():
    """float64 in, float64 out (lse too), first derivatives exact by gradcheck; a second derivative would be cut
    at the saved weight: refused with one message."""
    g = torch.Generator().manual_seed(0)
    out, lse = torch.randn(5, 2, 3, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (out, lse, torch.randn(2, generator=g, dtype=torch.float64))]
    o, l = mcp.apply_sink(*leaves)
    assert o.dtype == l.dtype == torch.float64
    assert torch.autograd.gradcheck(mcp.apply_sink, tuple(leaves), atol=1e-9, rtol=1e-7)
    with pytest.raises(RuntimeError, match="megatron_cp.apply_sink is differentiable once.*create_graph=True"):
        torch.autograd.grad((o ** 2).sum() + l.sum(), leaves, create_graph=True)
