"""head_context (Ulysses over heads inside groups x megatron-cp across groups).

Distributed (CPU, gloo, spawned ranks; one spawn per world size): cp 4 as 2 groups x u 2 and cp 8 as
2 x 4 against the fp64 dense reference (out, lse, dq, dk, dv; lse gradient included) for causal,
full, packed documents, sliding window and a random union of slices, MHA / GQA / K/V head repeat
(Hkv < u), a plan not made for head_context (rows reordered), fp32 inputs, a 2-node topology whose
K/V cross nodes; the cross-group process groups are created once; bad input raises ValueError before
any collective.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import masks as M
from megatron_cp.baselines import get_strategy, plan_for
from megatron_cp.planner.layout import group_order, group_plan, head_context_plan
from megatron_cp.testing import run_ranks

from _dist import raise_before_collectives
from test_baselines import _case, _masks

FP64_TOL, FP32_TOL = 1e-5, 1e-4  # as tests/test_baselines.py and tests/test_attention_dist.py
D = 8  # head_dim of test_baselines._case


def _run(rank, world, mask, hq, hkv, u=None, dtype=torch.float64, **plan_kwargs):
    opts = {} if u is None else {"ulysses_degree": u}
    return _case(rank, world, "head_context", mask, hq, hkv, opts, dtype, plan_kwargs={**opts, **plan_kwargs})


def _count_bytes(fn, rank, gpus_per_node):
    """Run ``fn`` while counting the bytes this rank sends to ranks of its own / other emulated nodes
    through all_to_all_single (GroupCast/GroupReduce) and batch_isend_irecv (the all-to-alls)."""
    real_a2a, real_p2p = dist.all_to_all_single, dist.batch_isend_irecv
    sent = {"intra": 0, "inter": 0}

    def add(dst, nbytes):
        sent["inter" if dst // gpus_per_node != rank // gpus_per_node else "intra"] += nbytes

    def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        row = input.numel() * input.element_size() // max(input.shape[0], 1)
        peers = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        for i, n in enumerate(input_split_sizes):
            if peers[i] != rank:
                add(peers[i], n * row)
        return real_a2a(output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                        group=group, async_op=async_op)

    def p2p(ops):
        for op in ops:
            if op.op is dist.isend:
                add(op.peer, op.tensor.numel() * op.tensor.element_size())
        return real_p2p(ops)

    dist.all_to_all_single, dist.batch_isend_irecv = a2a, p2p
    try:
        res = fn()
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = real_a2a, real_p2p
    return res, sent


def _bad_cases(rank, world):
    """Every bad input raises ValueError naming the value, before any collective or group creation."""
    group = dist.group.WORLD
    u = world // 2
    mask = M.causal(_masks()["causal"].seqlen_q)
    plan = plan_for("head_context", mask, world, ulysses_degree=u)
    n = plan.num_local(rank)
    q, k = torch.randn(n, 4, D), torch.randn(n, 2, D)
    hc = get_strategy("head_context")
    other = mcp.plan(mask, world, solver="contiguous")
    qo = torch.randn(other.num_local(rank), 4, D)
    cases = {
        "degree": (lambda: get_strategy("head_context", ulysses_degree=3)(qo, qo[:, :2], qo[:, :2], other, group, None),
                   "ulysses_degree=3 must divide cp_size"),
        "plan_degree": (lambda: get_strategy("head_context", ulysses_degree=1)(q, k, k, plan, group, None),
                        f"ulysses_degree=1 but the plan was made for ulysses_degree={u}"),
        "heads": (lambda: hc(torch.randn(n, 3, D), torch.randn(n, 1, D), torch.randn(n, 1, D), plan, group, None),
                  "query heads \\(3\\)"),
        "tokens": (lambda: hc(q[:-1], k, k, plan, group, None), f"{n - 1} tokens"),
        "stages": (lambda: get_strategy("head_context", stages=-1)(q, k, k, plan, group, None), "stages must be"),
        "backend": (lambda: get_strategy("head_context", backend="cudnn")(q, k, k, plan, group, None), "'cudnn'"),
        "plan_for": (lambda: plan_for("head_context", mask, world, ulysses_degree=3), "ulysses_degree=3"),
    }
    return raise_before_collectives(cases)


def _traffic_case(rank, world, mask_name, hq, hkv):
    """(errors, bytes sent intra/inter) of one forward + backward on a 2-node topology."""
    topo = mcp.Topology(2, world // 2)
    mask = _masks()[mask_name]
    res, sent = _count_bytes(lambda: _run(rank, world, mask, hq, hkv, topology=topo), rank, topo.gpus_per_node)
    return res, sent


def _all(rank, world):
    real_new_group, made = dist.new_group, []  # head_context creates its u groups on the first call only
    dist.new_group = lambda *a, **k: (made.append(a), real_new_group(*a, **k))[1]
    try:
        res = _cases(rank, world)
    finally:
        dist.new_group = real_new_group
    res["groups_made"] = len(made)
    return res


def _cases(rank, world):
    m = _masks()
    u = world // 2
    exact, fp32 = {}, {}
    if world == 4:
        for name, mask in m.items():
            exact[(name, 4, 2)] = _run(rank, world, mask, 4, 2, u=u)
        for name in ("causal", "full"):
            exact[(name, 4, 4)] = _run(rank, world, m[name], 4, 4, u=u)
        exact[("varlen", 4, 1)] = _run(rank, world, m["varlen"], 4, 1, u=u)  # Hkv 1 < u: K/V heads repeated
        exact[("u1_topology", 4, 2)] = _run(rank, world, m["varlen"], 4, 2, u=1, topology=mcp.Topology(2, 2))
        fp32[("causal", 4, 2)] = _run(rank, world, m["causal"], 4, 2, u=u, dtype=torch.float32)
    else:
        exact[("causal", 8, 4)] = _run(rank, world, m["causal"], 8, 4, u=u)
        exact[("random", 8, 2)] = _run(rank, world, m["random"], 8, 2, u=u)  # Hkv 2 < u 4: repeat 2
        exact[("varlen", 4, 4)] = _run(rank, world, m["varlen"], 4, 4, u=u)
    # a plan not made for head_context: the group's rows arrive out of order and are permuted
    zz = plan_for("ring", m["causal"], world)
    assert group_order(zz, u, rank // u) is not None
    exact[("zigzag_plan", 4, 2)] = _case(rank, world, "head_context", m["causal"], 4, 2, {"ulysses_degree": u},
                                         plan_name="ring")
    traffic = {name: _traffic_case(rank, world, name, 4, 2) for name in (("full", "sliding_window") if world == 4 else ("causal",))}
    return {"exact": exact, "fp32": fp32, "traffic": traffic, "bad": _bad_cases(rank, world)}


def _check(results, world):
    bad = [(r, key, k, v) for r, res in enumerate(results) for key, e in res["exact"].items()
           for k, v in e.items() if v > FP64_TOL]
    bad += [(r, key, k, v) for r, res in enumerate(results) for key, e in res["fp32"].items()
            for k, v in e.items() if v > FP32_TOL]
    bad += [(r, ("traffic", key), k, v) for r, res in enumerate(results) for key, (e, _) in res["traffic"].items()
            for k, v in e.items() if v > FP64_TOL]
    assert not bad, bad[:10]
    for res in results:
        assert all(v == "ok" for v in res["bad"].values()), res["bad"]
        assert res["groups_made"] == world // 2, res["groups_made"]  # u groups, first call only
    for name in results[0]["traffic"]:  # the group plan's K/V cross the emulated nodes
        assert sum(res["traffic"][name][1]["inter"] for res in results) > 0, name


@pytest.mark.parametrize("world", [4, 8])
def test_head_context_matches_fp64_reference(world):
    _check(run_ranks(_all, world), world)


# ------------------------------------------------------------------------------------ the planner


def test_head_context_plan_layout():
    mask = M.causal(64)
    p = head_context_plan(mask, 4, 2)
    assert p.solver.startswith("head_context/u2/")
    gp = mcp.plan(mask, 2)
    for g in range(2):  # group g's tokens = the G-rank plan's, cut in two equal pieces in order
        ids = np.concatenate([p.local_ids(2 * g), p.local_ids(2 * g + 1)])
        assert np.array_equal(ids, gp.local_ids(g))
        assert abs(p.num_local(2 * g) - p.num_local(2 * g + 1)) <= 1
        assert group_order(p, 2, g) is None
    derived = group_plan(p, 2)
    assert [r.segments.tolist() for r in derived.ranks] == [r.segments.tolist() for r in gp.ranks]
    assert plan_for("head_context", mask, 8, topology=mcp.Topology(2, 4)).solver.startswith("head_context/u4/")
    with pytest.raises(ValueError, match="fewer than ulysses_degree=4"):
        head_context_plan(M.causal(6), 8, 4)
