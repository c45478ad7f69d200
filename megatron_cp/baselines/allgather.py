"""All-gather context parallelism (Megatron/TE's ``all_gather`` CP, PyTorch's Flex CP): every rank
gathers the whole K/V, computes its own rows against it, and dK/dV are reduce-scattered back.

The gathered K|V stay in rank order (no permutation pass over them): each rank's tiles are the mask
clipped to its rows x every rank's runs in rank order (``rank_tiles``), so it is exact for any plan
and any mask.
"""

from __future__ import annotations

import numpy as np
import torch

from ..comm import all_gather_rows, all_to_all_v
from ..masks import geometry
from ..planner import Plan
from .common import TileAttention, all_runs, cached, empty_result, prepared, rank_order_ids, setup


class _GatherKV(torch.autograd.Function):
    """K|V rows of every rank concatenated in rank order; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, kv, counts, rank, group):
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        return all_gather_rows(kv.contiguous(), counts, group)

    @staticmethod
    def backward(ctx, g):
        counts, rank = ctx.counts, ctx.rank
        back = all_to_all_v(g.contiguous(), counts, [counts[rank]] * len(counts), ctx.group)
        return back.view((len(counts), counts[rank]) + tuple(g.shape[1:])).sum(0), None, None, None


class _SplitHeads(torch.autograd.Function):
    """x [s, sum(sizes), ...] -> views of consecutive head groups; backward concatenates the gradients
    in one pass (zeros for a missing one) instead of one full-size zero buffer per view."""

    @staticmethod
    def forward(ctx, x, sizes):
        ctx.set_materialize_grads(False)
        ctx.shape, ctx.sizes = x.shape, sizes
        return tuple(x.split(sizes, dim=1))

    @staticmethod
    def backward(ctx, *gs):
        ref = next(g for g in gs if g is not None)
        parts = [g if g is not None else ref.new_zeros((ctx.shape[0], n) + tuple(ctx.shape[2:]))
                 for g, n in zip(gs, ctx.sizes)]
        return torch.cat(parts, dim=1), None


def rank_tiles(plan: Plan, rank: int) -> np.ndarray:
    """The tiles rank ``rank`` computes under ``allgather`` (int32 [n, 5]): queries in its local order,
    keys in the gathered order (every rank's rows concatenated in rank order, ``seqlen`` keys)."""

    def build():
        if plan.has_guests:  # guest rows' cells are not among the rank's own: clip the whole mask
            return geometry.traps_to_tiles(plan.traps, plan.ranks[rank].segments, all_runs(plan))
        traps = plan.ranks[rank].traps  # rows local, keys global
        if rank_order_ids(plan) is None:  # gathered order is global order: one tile per trapezoid
            return np.asarray([geometry.trap_to_slice(t) for t in traps.tolist()], dtype=np.int32).reshape(-1, 5)
        return geometry.traps_to_tiles(traps, None, all_runs(plan))

    return cached(plan, ("allgather_tiles", rank), build)


def allgather(q, k, v, plan: Plan, group=None, softmax_scale=None, *, backend="auto", lse_grad: bool = True):
    """All-gather K/V, attend over this rank's rows' tiles, reduce-scatter dK/dV.

    q [s_local, Hq, D], k/v [s_local, Hkv, D] in ``plan``'s local order; returns out [s_local, Hq, D]
    (q's dtype) and lse [s_local, Hq] float32. Plan: any. Masks: any. ``backend``/``lse_grad``: as
    ``ring``.
    """
    rank, scale, bkey, be = setup(q, k, v, plan, group, softmax_scale, backend, lse_grad, "allgather")
    hkv = k.shape[1]
    cp = plan.cp_size
    counts = [plan.num_local(r) for r in range(cp)]
    kv_all = _GatherKV.apply(torch.cat([k, v], dim=1), counts, rank, group) if cp > 1 else None
    prep = prepared(plan, (bkey, "allgather", rank), be, rank_tiles(plan, rank), counts[rank], sum(counts))
    if prep is None:
        out, lse = empty_result(q, v.shape[-1])
        # keep the gather in the graph: its backward is a collective every rank must join
        return (out if kv_all is None else out + kv_all[:0].sum()), lse
    kh, vh = _SplitHeads.apply(kv_all, [hkv, hkv]) if cp > 1 else (k, v)
    out, lse = TileAttention.apply(q, kh, vh, be, prep, scale)
    return out, (lse if lse_grad else lse.detach())
