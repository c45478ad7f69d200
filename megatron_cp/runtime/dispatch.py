"""Move whole-sequence tensors to the plan's per-rank layout and back."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..comm import all_gather_rows
from ..kernels import upload
from ..planner import Plan
from .groups import plan_rank
from .state import plan_cache


def _ids(plan: Plan, rank: int, device) -> torch.Tensor:
    cache = plan_cache(plan)
    key = ("ids", rank, str(device))
    t = cache.get(key)
    if t is None:
        t = cache[key] = upload(plan.local_ids(rank), device)
    return t


def _check_len(x: torch.Tensor, seq_dim: int, n: int, what: str):
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim} is out of range for a {x.dim()}-D tensor")
    if x.shape[seq_dim] != n:
        raise ValueError(f"{what}: dimension {seq_dim} has {x.shape[seq_dim]} entries, expected {n}")


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, rank, group, seq_dim):
        ctx.plan, ctx.rank, ctx.group, ctx.seq_dim, ctx.n = plan, rank, group, seq_dim, x.shape[seq_dim]
        return x.index_select(seq_dim, _ids(plan, rank, x.device))

    @staticmethod
    def backward(ctx, g):
        if ctx.group is not None and ctx.plan.cp_size > 1:
            # the replicated input's gradient is the sum over ranks (each rank's loss uses its part)
            return _gather(g, ctx.plan, ctx.group, ctx.seq_dim), None, None, None, None
        shape = list(g.shape)
        shape[ctx.seq_dim] = ctx.n
        full = g.new_zeros(shape)
        full.index_copy_(ctx.seq_dim, _ids(ctx.plan, ctx.rank, g.device), g)
        return full, None, None, None, None


def _gather(x_local: torch.Tensor, plan: Plan, group, seq_dim: int) -> torch.Tensor:
    """All-gather variable-length local parts (padded to the longest) into global order."""
    x = x_local.movedim(seq_dim, 0).contiguous()
    rows = all_gather_rows(x, [plan.num_local(r) for r in range(plan.cp_size)], group)
    cache = plan_cache(plan)
    key = ("gather_order", str(x.device))
    order = cache.get(key)
    if order is None:
        ids = np.concatenate([plan.local_ids(r) for r in range(plan.cp_size)])
        inv = np.empty_like(ids)
        inv[ids] = np.arange(len(ids))
        order = cache[key] = upload(inv, x.device)
    full = rows.index_select(0, order)
    return full.movedim(0, seq_dim)


class _Undispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, plan, group, seq_dim):
        ctx.plan, ctx.group, ctx.seq_dim = plan, group, seq_dim
        ctx.rank = dist.get_rank(group)
        return _gather(x_local, plan, group, seq_dim)

    @staticmethod
    def backward(ctx, g):
        # reduce-scatter: every rank's loss may use the whole output
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g.index_select(ctx.seq_dim, _ids(ctx.plan, ctx.rank, g.device)), None, None, None


def dispatch(x: torch.Tensor, plan: Plan, group: dist.ProcessGroup | None = None, seq_dim: int = 0, *,
             rank: int | None = None) -> torch.Tensor:
    """This rank's part of ``x`` (the whole sequence, identical on every rank) along ``seq_dim``.

    Returns a tensor with ``plan.num_local(rank)`` entries along ``seq_dim``, in the plan's local
    order. ``rank=`` replaces ``group`` for single-process use. Differentiable: with a group, the
    gradient of ``x`` is the sum over ranks; with ``rank=``, it is this rank's part, zeros elsewhere.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"dispatch takes a torch.Tensor, got {type(x).__name__} (e.g. torch.from_numpy(x) first)")
    r = plan_rank(plan, group, rank)
    _check_len(x, seq_dim, plan.seqlen, "dispatch input")
    return _Dispatch.apply(x, plan, r, group if rank is None else None, seq_dim)


def undispatch(x_local: torch.Tensor, plan: Plan, group: dist.ProcessGroup | None = None,
               seq_dim: int = 0) -> torch.Tensor:
    """The whole sequence from every rank's local part (an all-gather); inverse of ``dispatch``.

    Differentiable: the gradient of ``x_local`` is the sum over ranks of the output gradient's
    entries for this rank's tokens (reduce-scatter).
    """
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"undispatch takes a torch.Tensor, got {type(x_local).__name__}")
    r = plan_rank(plan, group, None)
    _check_len(x_local, seq_dim, plan.num_local(r), f"undispatch input of rank {r}")
    if group is None or plan.cp_size == 1:
        return x_local.index_select(seq_dim, _ids(plan, 0, x_local.device).argsort())
    return _Undispatch.apply(x_local, plan, group, seq_dim)
