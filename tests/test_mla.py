"""MLA and large heads: a v head dim of its own (DeepSeek MLA: q/k 192, v 128) and head dim 256 through
megatron-cp's runtime (K/V exchanged side by side with their own head dims, partials merged at v's) on the
reference and Triton backends (CPU interpreter, small stand-in dims: 48/32 exercises the padded q/k dim
like 192/128), against a dense fp64 reference (``reference.dense_attention``), forward and backward,
CP 1 and 2 (gloo, spawned ranks, one spawn per world size); strategies that cannot refuse by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import masks as M
from megatron_cp.testing import run_ranks

from reference import dense_attention

S = 37


def mla_case(rank, world, mask, dk, dv, backend, dtype, hq=4, hkv=2, stages=None, sink=False, plan=None):
    """Max abs errors of this rank's out, lse, dq, dk, dv (and the summed dsink) against fp64."""
    gen = torch.Generator().manual_seed(11 + dk + dv)
    q = torch.randn(S, hq, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(S, hkv, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(S, hkv, dv, generator=gen, dtype=torch.float64)
    do = torch.randn(S, hq, dv, generator=gen, dtype=torch.float64)
    sk = torch.randn(hq, generator=gen, dtype=torch.float64) if sink else None
    scale = 0.2
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sk.clone().requires_grad_()] if sink else [])
    ro, rl = dense_attention(*leaves[:3], torch.as_tensor(mask.to_dense()), scale, leaves[3] if sink else None)
    (ro * do).sum().backward()
    plan = plan if plan is not None else mcp.plan(mask, world)
    group = dist.group.WORLD if world > 1 else None
    ids = torch.from_numpy(plan.local_ids(rank))
    ls = [mcp.dispatch(t.to(dtype), plan, group).detach().requires_grad_() for t in (q, k, v)]
    o, l = mcp.attention(*ls, plan, group, softmax_scale=scale, backend=backend, stages=stages)
    s_t = None
    if sink:
        s_t = sk.to(dtype).requires_grad_()
        o, l = mcp.apply_sink(o, l, s_t)
    assert o.shape == (len(ids), hq, dv) and o.dtype == dtype
    (o.double() * do[ids]).sum().backward()
    fin = torch.isfinite(rl[ids])
    errs = {"out": float((o.detach().double() - ro.detach()[ids]).abs().max()),
            "lse": float((l.detach().double()[fin] - rl.detach()[ids][fin]).abs().max())}
    for n, a, ref in zip(("dq", "dk", "dv"), ls, leaves):
        errs[n] = float((a.grad.double() - ref.grad[ids]).abs().max())
    if sink:
        g = s_t.grad.double()
        if group is not None:
            dist.all_reduce(g, group=group)
        errs["dsink"] = float((g - leaves[3].grad).abs().max())
    return errs


def _cases(rank, world):
    torch.set_num_threads(1)
    masks = {"causal": M.causal(S), "packed": M.varlen([0, 6, 19, 20, S], causal=True)}
    res = {}
    for name, mask in masks.items():
        res[(name, "reference", "mla")] = mla_case(rank, world, mask, 24, 16, "reference", torch.float64)
        res[(name, "reference", "mla", "sink")] = mla_case(rank, world, mask, 24, 16, "reference", torch.float64,
                                                             sink=True)
    # Triton (CPU interpreter): q/k 48 padded to a 64 block beside v 32, MLA's 192 / 128 in miniature
    res[("packed", "triton")] = mla_case(rank, world, masks["packed"], 48, 32, "triton", torch.float32)
    if world > 1:
        res[("causal", "triton", "staged")] = mla_case(rank, world, masks["causal"], 48, 32, "triton", torch.float32,
                                                       stages=1)
        res[("packed", "staged")] = mla_case(rank, world, masks["packed"], 24, 16, "reference", torch.float64,
                                             stages=1)
        res[("packed", "single")] = mla_case(rank, world, masks["packed"], 24, 16, "reference", torch.float64,
                                             stages=0)
        plan = mcp.plan(masks["causal"], world, guest_rows=[[S - 5, S]])
        res[("causal", "guests")] = mla_case(rank, world, masks["causal"], 24, 16, "reference", torch.float64,
                                             plan=plan)
    return res


def _check(results):
    for rank, r in enumerate(results):
        for key, errs in r.items():
            # float64 inputs; lse is float32 by protocol, which the sink's weight carries (test_sinks)
            tol = 1e-4 if "triton" in key else 1e-6
            bad = {n: e for n, e in errs.items() if e > tol}
            assert not bad, (rank, key, bad)


@pytest.mark.parametrize("world", [1, 2])
def test_value_head_dim_of_its_own_matches_fp64(world):
    _check(run_ranks(_cases, world))


def test_fa4_backend_value_head_dim_emulated():
    """FA4Backend's calls with q/k 48 and v 32 through the emulated FA4 (tests/fa4_semantics.py, FA4's call
    semantics in fp64 on the CPU): forward, forward_accumulate, backward with an lse gradient and
    backward_into against fp64 autograd; and the head-dim pairs FA4 itself cannot run go to Triton with
    the reason (sm100 runs (192, 128) only)."""
    import fa4_semantics

    from megatron_cp.kernels import CAUSAL, FULL
    from megatron_cp.kernels.fa4_backend import FA4Backend, Fa4Functions, fa4_head_dims_reason
    from megatron_cp.masks.catalog import tiles_to_dense

    be = FA4Backend(functions=Fa4Functions(fa4_semantics.fwd, fa4_semantics.bwd, "reference", (torch.float64,)))
    tiles = torch.tensor([[0, 13, 0, 13, CAUSAL], [14, 40, 14, 40, CAUSAL], [14, 40, 0, 5, FULL]], dtype=torch.int32)
    prep = be.prepare(tiles, 40, 40)
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(40, 4, 48, generator=gen, dtype=torch.float64), torch.randn(40, 2, 48, generator=gen, dtype=torch.float64)
    v, do = torch.randn(40, 2, 32, generator=gen, dtype=torch.float64), torch.randn(40, 4, 32, generator=gen, dtype=torch.float64)
    dl = torch.randn(40, 4, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ro, rl = dense_attention(*leaves, tiles_to_dense(tiles, 40, 40), 0.3)
    fin = torch.isfinite(rl)
    ((ro * do).sum() + (torch.where(fin, rl, 0) * dl).sum()).backward()
    out, lse = be.forward(q, k, v, prep, 0.3)
    assert be.last_path == "fa4" and out.shape == (40, 4, 32)
    assert (out - ro.detach()).abs().max() < 1e-10 and (lse[fin] - rl.detach()[fin]).abs().max() < 1e-6
    acc, run = torch.zeros(40, 4, 32, dtype=torch.float64), torch.full((40, 4), float("-inf"), dtype=torch.float64)
    be.forward_accumulate(q, k, v, prep, 0.3, acc, run)
    assert (acc - ro.detach()).abs().max() < 1e-10
    delta = (do * out).sum(-1) - torch.where(fin, dl, 0)
    grads = be.backward(q, k, v, out, lse, do, prep, 0.3, delta)
    sums = [torch.zeros_like(t) for t in (q, k, v)]
    be.backward_into(q, k, v, out, lse, do, prep, 0.3, delta, *sums)
    for g, s, r in zip(grads, sums, leaves):
        assert be.last_path == "fa4" and (g - r.grad).abs().max() < 1e-6 and (s - r.grad).abs().max() < 1e-6
    assert fa4_head_dims_reason(192, 128, 10) is None and fa4_head_dims_reason(192, 128, 9) is None
    assert "sm100" in fa4_head_dims_reason(256, 128, 10) and "v head_dim" in fa4_head_dims_reason(192, 12, 9)
