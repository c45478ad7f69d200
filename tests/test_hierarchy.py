"""Hierarchical GroupCast/GroupReduce and node-first placement on emulated topologies (CPU, gloo).

2 nodes x 2 GPUs on 4 processes and 2 x 4 on 8: every result matches the fp64 dense reference, and
the bytes that cross the emulated node boundary (counted from the split sizes actually passed to
``all_to_all_single``) equal one copy of each needed K/V row per destination node, in forward and
(GroupReduce, pre-reduced on the relay) in backward; flat routes send one copy per destination GPU.
"""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp import masks as M
from megatron_cp.runtime.schedule import schedule
from megatron_cp.testing import run_ranks

from reference import tiny_masks
from test_overlap import _case, _random_mask

S = 61
HKV, D = 2, 8
ROW_BYTES = 2 * HKV * D * 8  # one K|V row in float64


def _masks():
    return {**tiny_masks(S, ("causal", "full", "varlen", "sliding_window", "global_local")), "random": _random_mask(3)}


def _count_inter(fn, topo: mcp.Topology, rank: int):
    """Run ``fn`` while counting bytes this rank sends to other nodes through all_to_all_single."""
    real = dist.all_to_all_single
    sent = {"bytes": 0}
    g = topo.gpus_per_node

    def spy(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        row = input.numel() * input.element_size() // max(input.shape[0], 1)
        for dst, n in enumerate(input_split_sizes):
            if dst // g != rank // g:
                sent["bytes"] += n * row
        return real(output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                    group=group, async_op=async_op)

    dist.all_to_all_single = spy
    try:
        res = fn()
    finally:
        dist.all_to_all_single = real
    return res, sent["bytes"]


def _hier_cases(rank, world, nodes, names):
    topo = mcp.Topology(nodes, world // nodes)
    out = {}
    for name in names:
        mask = _masks()[name]
        for hier in (True, False):
            for stages in (1, 2):
                errs, nbytes = _count_inter(
                    lambda: _case(rank, world, mask, stages, hkv=HKV, topology=topo, hierarchical=hier), topo, rank)
                out[(name, hier, stages)] = (errs, nbytes)
    return out


def _expected(name, world, nodes):
    """(hierarchical, flat) inter-node rows of one exchange, from the plan alone."""
    topo = mcp.Topology(nodes, world // nodes)
    plan = mcp.plan(_masks()[name], world, topology=topo)
    st = plan.stats(num_kv_heads=HKV, head_dim=D, dtype_bytes=8)
    per_tok = 2 * HKV * D * 8
    hier = st["inter_node_bytes_hierarchical"] // per_tok
    flat = st["inter_node_bytes"] // per_tok
    # the schedule's own count agrees for any number of stages
    for n in (1, 2):
        assert sum(schedule(plan, n).inter_node_rows) == hier
        assert sum(schedule(plan, n, hierarchical=False).inter_node_rows) == flat
    return hier, flat


def _check(results, world, nodes):
    keys = results[0].keys()
    for key in keys:
        name, hier, stages = key
        for r, res in enumerate(results):
            errs = res[key][0]
            assert max(errs.values()) < 1e-5, (key, r, errs)
        total = sum(res[key][1] for res in results)
        want_hier, want_flat = _expected(name, world, nodes)
        want = want_hier if hier else want_flat
        # forward cast + backward reduce: each crossing row crosses once each way
        assert total == 2 * want * ROW_BYTES, (key, total, 2 * want * ROW_BYTES)


def test_hierarchy_2x2_on_4_ranks():
    names = list(_masks())
    results = run_ranks(_hier_cases, 4, 2, names)
    _check(results, 4, 2)
    # dense masks: hierarchical routes move fewer bytes across nodes than flat ones
    for name in ("causal", "full"):
        h, f = _expected(name, 4, 2)
        assert h < f, (name, h, f)


def test_hierarchy_2x4_on_8_ranks():
    results = run_ranks(_hier_cases, 8, 2, ["causal", "varlen", "random"])
    _check(results, 8, 2)
    h, f = _expected("causal", 8, 2)
    assert 2 * h <= f  # with 4 GPUs per node, causal rows are shared by several GPUs of a node


def test_node_first_placement_cuts_inter_node_traffic():
    topo = mcp.Topology(2, 4)
    rng = np.random.default_rng(0)
    lens = rng.integers(200, 3000, size=12)
    cu = np.concatenate([[0], np.cumsum(lens)])
    for mask in (M.varlen(cu.tolist(), causal=True), M.sliding_window(int(cu[-1]), 512, 0)):
        hier = mcp.plan(mask, 8, topology=topo, solver="hierarchical")
        st = hier.stats()
        assert st["imbalance"] <= 0.03 + 1e-9, st["imbalance"]
        for other in ("zigzag", "greedy"):
            o = mcp.plan(mask, 8, topology=topo, solver=other).stats()
            if o["imbalance"] <= 0.03:
                assert st["inter_node_bytes_hierarchical"] <= o["inter_node_bytes_hierarchical"], other
        # every rank's GPUs of a node hold rows only of that node's layout
        auto = mcp.plan(mask, 8, topology=topo)
        assert auto.stats()["inter_node_bytes_hierarchical"] <= st["inter_node_bytes_hierarchical"]
    # without a topology the whole sequence is one node (in-order dealing, balanced by swaps)
    one = mcp.plan(M.causal(4096), 4, solver="hierarchical")
    assert one.solver == "hierarchical" and one.stats()["imbalance"] <= 0.03
