"""What the baseline strategies share: argument checks, the per-plan state cache, one differentiable
backend call over a tile list, and the permutation between rank order and global order.

Per-plan state (prepared tile lists, group plans, row permutations) is derived once from the plan's
public fields and kept in the runtime's per-plan dictionary (``runtime.plan_cache``, keyed weakly by the
plan object): nothing is written on the (frozen) plan, and a plan that is dropped takes its state with it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..kernels import accumulate_dtype, refuse_double_backward, upload
from ..masks import geometry
from ..planner import Plan
from ..runtime import check_inputs, plan_cache, plan_rank, resolve_backend


def cached(plan: Plan, key, build):
    """``build()``, computed once per (plan, key) and kept while the plan lives (None is a value too)."""
    state = plan_cache(plan).setdefault("baselines", {})
    if key not in state:
        state[key] = build()
    return state[key]


def check_lse_grad(lse_grad, name: str) -> None:
    """The strategies' ``lse_grad`` option: True or False (a ValueError before any collective)."""
    if not isinstance(lse_grad, bool):
        raise ValueError(f"{name}: lse_grad must be True or False, got {lse_grad!r}")


def setup(q, k, v, plan: Plan, group, softmax_scale, backend, lse_grad, name: str):
    """Check a strategy's arguments before any collective; returns (rank in the plan, softmax scale,
    backend cache key, backend object). ``backend``: a name or an object implementing
    ``kernels.Backend``; the cache key names the device too (``auto`` is another backend on a GPU)."""
    rank = plan_rank(plan, group)
    check_inputs(q, k, v, plan, rank, softmax_scale)
    check_lse_grad(lse_grad, name)
    bkey, be = resolve_backend(backend, q.device)
    bkey = (str(q.device), bkey)
    why = be.supports(q.device, q.dtype, q.shape[2])
    if why is not None:
        raise ValueError(f"{name}: backend {be.name!r} cannot run these inputs: {why}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return rank, scale, bkey, be


def prepared(plan: Plan, key, backend, tiles: np.ndarray, sq: int, sk: int):
    """``backend.prepare`` of the tile list ``tiles`` (int [n, 5]) for ``sq`` queries and ``sk`` keys,
    cached per (plan, key); None when the list is empty (nothing to compute)."""

    def build():
        if len(tiles) == 0:
            return None
        return backend.prepare(torch.from_numpy(np.asarray(tiles).astype("int32")), sq, max(sk, 1))

    return cached(plan, ("prepared",) + tuple(key), build)


def mask_tiles(plan: Plan) -> np.ndarray:
    """The plan's whole mask as one tile list in global order (int32 [n, 5]: one tile per trapezoid)."""
    return cached(plan, ("mask_tiles",), lambda: np.asarray(
        [geometry.trap_to_slice(t) for t in plan.traps.tolist()], dtype=np.int32).reshape(-1, 5))


def runs_len(runs: np.ndarray) -> int:
    """Tokens in the half-open runs ``runs`` (int [n, 2])."""
    return int((runs[:, 1] - runs[:, 0]).sum()) if len(runs) else 0


def all_runs(plan: Plan) -> np.ndarray:
    """Every rank's owned runs concatenated in rank order (int64 [n, 2]): the row order of a gather."""
    return np.concatenate([rp.segments for rp in plan.ranks])


def rank_order_ids(plan: Plan) -> np.ndarray | None:
    """Global ids of the rows concatenated in rank order (int64 [seqlen]); None when that is global
    order (contiguous layouts)."""

    def build():
        ids = np.concatenate([plan.local_ids(r) for r in range(plan.cp_size)])
        return None if np.array_equal(ids, np.arange(len(ids))) else ids

    return cached(plan, ("rank_order_ids",), build)


def global_order(plan: Plan, device):
    """(perm, inv): int64 tensors taking rows concatenated in rank order to global order
    (``x[perm]``) and back (``y[inv]``); (None, None) when rank order is global order."""

    def build():
        ids = rank_order_ids(plan)
        if ids is None:
            return None, None
        perm = np.empty_like(ids)
        perm[ids] = np.arange(len(ids))
        return upload(perm, device), upload(ids, device)

    return cached(plan, ("global_order", str(device)), build)


def repeat_kv(k, v, f: int):
    """k/v [s, Hkv, D] -> [s, Hkv*f, D], each K/V head repeated ``f`` times in place (GQA-preserving)."""
    if f == 1:
        return k, v
    return k.repeat_interleave(f, dim=1), v.repeat_interleave(f, dim=1)


class TileAttention(torch.autograd.Function):
    """One differentiable backend call over one prepared tile list: (q, k, v) -> (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, backend, prepared, scale):
        out, lse = backend.forward(q, k, v, prepared, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.prepared, ctx.scale = backend, prepared, scale
        ctx.set_materialize_grads(False)  # an unused lse gives dlse None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        refuse_double_backward("this attention strategy")
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = ctx.backend.backward(q, k, v, out, lse, dout, ctx.prepared, ctx.scale, delta(dout, out, dlse))
        return dq, dk, dv, None, None, None


def delta(dout, out, dlse):
    """rowsum(dout * out) - dlse [s, H] in the accumulation dtype, or None without an lse gradient: the
    backend then computes rowsum(dout * out) itself (one fused pass; dense pieces may use cuDNN)."""
    if dlse is None:
        return None
    cdt = accumulate_dtype(out.dtype)
    return (dout.to(cdt) * out.to(cdt)).sum(-1) - dlse.to(cdt)


def empty_result(q, head_dim_v: int):
    """(out, lse) of rows that keep no key: zeros [s, H, head_dim_v] like q and lse -inf [s, H] of
    ``accumulate_dtype(q.dtype)``.
    q stays in the graph (zero gradient), so backward reaches every input."""
    out = q.new_zeros(q.shape[:2] + (head_dim_v,))
    lse = torch.full(q.shape[:2], float("-inf"), dtype=accumulate_dtype(q.dtype), device=q.device)
    return out + 0 * q.sum(), lse
