"""head_context (Ulysses over heads inside groups x megatron-cp across groups) and choose_layout.

Distributed (CPU, gloo, spawned ranks; one spawn per world size): cp 4 as 2 groups x u 2 and cp 8 as
2 x 4 against the fp64 dense reference (out, lse, dq, dk, dv; lse gradient included) for causal,
full, packed documents, sliding window and a random union of slices, MHA / GQA / K/V head repeat
(Hkv < u), a plan not made for head_context (rows reordered), fp32 inputs; the bytes every rank
actually sends inside and across the emulated nodes equal ``planner.layout.head_context_traffic``;
the cross-group process groups are created once; bad input raises ValueError before any collective.

Pure: ``choose_layout`` byte counts computed by hand for three small cases, and its choice on
realistic shapes (dense masks -> head_context, sparse masks -> cp).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import masks as M
from megatron_cp.baselines import get_strategy, plan_for
from megatron_cp.planner.cost import CostModel, Workload
from megatron_cp.planner.layout import (choose_layout, group_order, group_plan, head_context_plan,
                                        head_context_traffic)

from _dist import raise_before_collectives, run_ranks
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


def _expected_traffic(name, world, hq, hkv):
    """Bytes sent intra- and inter-node, all ranks together, predicted from the plan alone."""
    topo = mcp.Topology(2, world // 2)
    plan = plan_for("head_context", _masks()[name], world, topology=topo)
    node = np.arange(world) // topo.gpus_per_node
    same = node[:, None] == node[None, :]
    intra = inter = 0.0
    for _, mat in head_context_traffic(plan, topo.gpus_per_node, Workload(hq, hkv, D, 8)):
        mat = mat.copy()
        np.fill_diagonal(mat, 0)
        intra += mat[same].sum()
        inter += mat[~same].sum()
    return int(intra), int(inter)


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
    for name in results[0]["traffic"]:
        intra = sum(res["traffic"][name][1]["intra"] for res in results)
        inter = sum(res["traffic"][name][1]["inter"] for res in results)
        assert (intra, inter) == _expected_traffic(name, world, 4, 2), (name, intra, inter)
        assert inter > 0


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


# explicit numbers (the defaults follow calibrations): hand-computed times are bytes / bandwidth only
NO_LATENCY = CostModel(intra_gbps=150.0, inter_gbps=45.0, latency_us=0.0)
# the 4 x H200 calibration's link figures (NVLink all-to-all 335 GB/s, 400 Gb/s NIC, 40 us a collective)
H200 = CostModel(intra_gbps=335.0, inter_gbps=45.0, latency_us=40.0)


def _phases(pred):
    return {p.name: (p.intra_bytes, p.inter_bytes) for p in pred.phases}


def test_choose_layout_full_2x2_by_hand():
    """Full mask, S 64, 2 nodes x 2 GPUs, Hq 4, Hkv 2, D 8, bf16: a K|V row is 2*2*8*2 = 64 bytes.
    cp: every rank holds 16 rows. Phase A: 16 rows from the node mate (intra) and 16 from the
    same-rail GPU of the other node (inter); phase B forwards the other rail's 16 rows (intra);
    backward reduces the same rows in float32 (128 bytes a row). head_context (u 2): the q|k|v
    all-to-all sends 16 rows of (2 + 1 + 1) heads * 8 * 2 = 64 bytes; each group needs the other's
    32 rows of 2*1*8*2 = 32 bytes; out 16 * 2*8*2, lse 16 * 2*4; backward exchanges also send each
    group peer int32 "gradient present" flags (two with dout|dlse, three with the q, k, v gradients)."""
    c = choose_layout(M.full(64), 4, mcp.Topology(2, 2), Workload(4, 2, 8, 2), NO_LATENCY)
    assert _phases(c.cp) == {"cast_a": (1024, 1024), "cast_b": (1024, 0), "reduce_b": (2048, 0),
                             "reduce_a": (2048, 2048)}
    assert _phases(c.head_context) == {"a2a_qkv": (1024, 0), "cast_a": (0, 1024), "a2a_out": (512, 0),
                                       "a2a_lse": (128, 0), "a2a_dout": (512 + 8, 0), "a2a_dlse": (128, 0),
                                       "reduce_a": (0, 2048), "a2a_dqkv": (1024 + 12, 0)}
    assert (c.cp.intra_bytes, c.cp.inter_bytes) == (6144, 3072)
    assert (c.head_context.intra_bytes, c.head_context.inter_bytes) == (3328 + 20, 3072)
    # seconds (GB/s = bytes/ns): cp 1024/45 + 1024/150 + 2048/150 + 2048/45; hc the same inter plus 3348/150
    assert c.cp.comm_s == pytest.approx((1024 / 45 + 1024 / 150 + 2048 / 150 + 2048 / 45) * 1e-9)
    assert c.head_context.comm_s == pytest.approx((3072 / 45 + 3348 / 150) * 1e-9)
    assert c.layout == "cp"  # few heads per K/V head and 2 GPUs a node: the fan-out is cheap


def test_choose_layout_full_2x4_by_hand():
    """Full mask, S 64, 2 x 4 GPUs, Hq 8, Hkv 4, D 8, bf16 (K|V row 128 bytes), 8 rows a rank.
    cp: phase A 3*8 rows from node mates (3072) and 8 rows from the rail (1024); phase B forwards
    3*8 rows (3072); backward twice that (float32). head_context (u 4, 2 query + 1 + 1 K/V heads a
    rank): q|k|v all-to-all 3*8 rows * 4 heads * 16 = 1536; the cast 32 rows * 2*1*8*2 = 1024;
    out 3*8 * 2*8*2 = 768, lse 3*8 * 2*4 = 192; flags to 3 peers x (8 + 12) bytes. head_context wins: the intra-node fan-out of
    plain CP grows with the GPUs per node, the all-to-alls do not."""
    c = choose_layout(M.full(64), 8, mcp.Topology(2, 4), Workload(8, 4, 8, 2), NO_LATENCY)
    assert _phases(c.cp) == {"cast_a": (3072, 1024), "cast_b": (3072, 0), "reduce_b": (6144, 0),
                             "reduce_a": (6144, 2048)}
    assert _phases(c.head_context) == {"a2a_qkv": (1536, 0), "cast_a": (0, 1024), "a2a_out": (768, 0),
                                       "a2a_lse": (192, 0), "a2a_dout": (768 + 3 * 8, 0), "a2a_dlse": (192, 0),
                                       "reduce_a": (0, 2048), "a2a_dqkv": (1536 + 3 * 12, 0)}
    cp_s = (max(3072 / 150, 1024 / 45) + 3072 / 150 + 6144 / 150 + max(6144 / 150, 2048 / 45)) * 1e-9
    hc_s = (3072 / 45 + (4992 + 60) / 150) * 1e-9
    assert c.cp.comm_s == pytest.approx(cp_s) and c.head_context.comm_s == pytest.approx(hc_s)
    assert c.layout == "head_context" and c.ulysses_degree == 4
    # flat routes: every GPU receives all 32 rows of the other node itself (4096 bytes inter)
    flat = choose_layout(M.full(64), 8, mcp.Topology(2, 4), Workload(8, 4, 8, 2), NO_LATENCY, hierarchical=False)
    assert _phases(flat.cp) == {"cast_a": (3072, 4096), "reduce_a": (6144, 8192)}
    assert flat.layout == "head_context" and flat.cp.inter_bytes == 4 * flat.head_context.inter_bytes


def test_choose_layout_sliding_window_by_hand():
    """Sliding window (left 3), S 64, 2 x 2, contiguous layout, Hq 4, Hkv 2, D 8, bf16 (row 64 bytes).
    cp: rank 1 needs 3 rows of rank 0, rank 3 three of rank 2 (intra), rank 2 three of rank 1, which
    cross to the rail GPU (rank 3) and are forwarded (phase B). head_context: the all-to-alls move
    16-row blocks for 3 boundary rows: cp wins."""
    c = choose_layout(M.sliding_window(64, 3), 4, mcp.Topology(2, 2), Workload(4, 2, 8, 2), NO_LATENCY,
                      solver="contiguous")
    assert _phases(c.cp) == {"cast_a": (192, 192), "cast_b": (192, 0), "reduce_b": (384, 0), "reduce_a": (384, 384)}
    ph = _phases(c.head_context)
    assert ph["a2a_qkv"] == (1024, 0) and ph["cast_a"] == (0, 3 * 32) and ph["reduce_a"] == (0, 3 * 64)
    assert c.head_context.inter_bytes == 288 < c.cp.inter_bytes == 576  # fewer inter bytes ...
    assert c.layout == "cp"  # ... but far more intra-node bytes


@pytest.mark.parametrize("name,want", [("causal", "head_context"), ("full", "head_context"),
                                       ("packed", "cp"), ("sliding_window", "cp")])
def test_choose_layout_realistic(name, want):
    """2 nodes x 8 GPUs, S 65536, Hq 32, Hkv 8, D 128, bf16, H200-calibrated links. (At S 16384 the
    dense masks are a near tie that cp wins: head_context's eight collectives cost 8 x 40 us.)"""
    S = 65536
    mask = {"causal": M.causal(S), "full": M.full(S), "packed": M.varlen(list(range(0, S + 1, 512)), causal=True),
            "sliding_window": M.sliding_window(S, 512)}[name]
    c = choose_layout(mask, 16, mcp.Topology(2, 8), Workload(32, 8, 128, 2), H200)
    assert c.layout == want, c.reason
    a, b = c.cp, c.head_context
    if name in ("causal", "full"):  # 4096 rows a rank, each sent to 7 node mates: 4 q + 1 k + 1 v heads
        assert _phases(b)["a2a_qkv"] == (7 * 4096 * (4 + 1 + 1) * 128 * 2, 0)
        assert b.inter_bytes == a.inter_bytes  # each K/V row crosses once per destination node in both
    if want == "head_context":
        assert b.comm_s < a.comm_s and b.intra_bytes < a.intra_bytes
    else:
        assert a.comm_s <= b.comm_s


def test_choose_layout_refuses_bad_heads():
    c = choose_layout(M.causal(256), 8, mcp.Topology(2, 4), Workload(6, 2, 8, 2), H200)
    assert c.layout == "cp" and c.head_context is None and "query heads (6)" in c.reason
