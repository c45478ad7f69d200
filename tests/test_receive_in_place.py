"""The single exchange's key buffer holds each token's K row then its V row (the all-to-all's layout): where a rank's
received rows are one run of the buffer in arrival order they are received there (no copy), else copied in one
copy per run (K and V together). Both ways exact against the fp64 dense reference (CPU, gloo, spawned ranks)."""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

import megatron_cp as mcp
from megatron_cp.runtime import state
from megatron_cp.runtime.rowmap import RowIndex, RowMap
from megatron_cp.testing import reference_attention, run_ranks

S = 61


def _rank(rank, world, mask_name):
    att = sys.modules["megatron_cp.runtime.attention"]
    mask = {"full": mcp.masks.full(S), "varlen": mcp.masks.varlen([0, 9, 30, 31, S], causal=True)}[mask_name]
    plan = mcp.plan(mask, world)
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(S, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref = reference_attention(q, k, v, mask, 0.3, dout=do)
    ids = torch.from_numpy(plan.local_ids(rank))
    ql, kl, vl = (t[ids].clone().requires_grad_() for t in (q, k, v))

    bufs, outs, copies = [], [], []
    real_buf, real_a2a, real_copy = att._kv_buffer, dist.all_to_all_single, RowMap.copy

    def kv_buffer(*a):
        bufs.append(real_buf(*a))
        return bufs[-1]

    def a2a(output, *a, **kw):
        outs.append(output)
        return real_a2a(output, *a, **kw)

    def copy(self, dst, src):
        copies.append(dst)
        return real_copy(self, dst, src)

    att._kv_buffer, dist.all_to_all_single, RowMap.copy = kv_buffer, a2a, copy
    out, lse = mcp.attention(ql, kl, vl, plan, dist.group.WORLD, 0.3, stages=0)
    (out * do[ids]).sum().backward()
    att._kv_buffer, dist.all_to_all_single, RowMap.copy = real_buf, real_a2a, real_copy

    key, be = att.resolve_backend("auto", ql.device)
    ex = state.rank_state(plan, rank, ql.device, be, key, stages=0, hierarchical=True, cost=att.DEFAULT_COST,
                          work=mcp.planner.Workload(4, 2, 8, 8)).single  # the call's state, cached
    (kv, kb, vb), = bufs
    store = kv.untyped_storage().data_ptr()
    in_place = outs[0].untyped_storage().data_ptr() == store
    copied = [d for d in copies if d.untyped_storage().data_ptr() == store and d.dim() == 2]  # received rows
    errs = [float((a.detach() - b).abs().max()) for a, b in ((out, ref.out[ids]), (lse, ref.lse[ids]),
                                                      (ql.grad, ref.dq[ids]), (kl.grad, ref.dk[ids]),
                                                      (vl.grad, ref.dv[ids]))]
    return dict(recv_into=ex.recv_into, in_place=in_place, copies=len(copied), errs=errs,
                views=(kb.stride(), vb.stride(), vb.data_ptr() - kb.data_ptr()), recv=int(sum(ex.recv_counts)))


def test_received_rows_land_in_the_key_buffer_where_they_are_one_run_else_one_copy():
    seen = set()
    for world, name in ((2, "full"), (4, "full"), (4, "varlen")):  # in place: 2 / 2, 2 / 4, 0 / 4 ranks
        for r in run_ranks(_rank, world, name):
            assert max(r["errs"]) < 1e-12, r
            # K and V as views of one row each: [rows, 2 heads, 8] at a row stride of 2 x 2 x 8, V after K's 16
            assert r["views"] == ((32, 8, 1), (32, 8, 1), 16 * 8), r["views"]
            if r["recv_into"] is not None:
                assert r["in_place"] and r["copies"] == 0 and r["recv_into"][1] == r["recv"], r
            elif r["recv"]:
                assert not r["in_place"] and r["copies"] == 1, r
            seen.add((r["recv_into"] is not None, r["recv"] > 0))
    assert {(True, True), (False, True)} <= seen, seen  # both ways ran


def test_in_order_takes_one_run_from_the_start_of_its_source_only():
    assert state._in_order(RowIndex.of(np.arange(5, 9), None), 4) == (5, 4)
    assert state._in_order(RowIndex.of(np.array([5, 6, 8, 9]), None), 4) is None  # two runs
    assert state._in_order(RowIndex.of(np.arange(5, 9), None), 0) is None  # nothing received
    assert state._in_order(RowIndex.of(np.arange(5, 9), None), 5) is None  # not every received row
