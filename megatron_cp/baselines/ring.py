"""Ring attention: K/V blocks travel around a ring of ranks, the next block in flight while the current
one computes; in backward each block's dK/dV accumulator travels with it and arrives home.

``ring`` runs it over every rank of the CP group (each rank one ring position); ``usp``
(``baselines.ulysses``) runs the same ring across groups of ranks, through ``ring_attention``. The
ring uses point-to-point ops inside the CP group (peers are its ranks: no sub-group is created, so any
CP group works). Each step's tiles are the plan's mask (``plan.traps``) clipped to (this position's
query runs x the travelling block's key runs), so the ring is exact for any mask; the layouts it needs
(zigzag for causal, contiguous for full) are about balance, not correctness.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..comm import wire
from ..kernels import accumulate_dtype, refuse_double_backward
from ..masks import geometry
from ..planner import Plan
from .common import cached, delta, runs_len, setup


class RingAttention(torch.autograd.Function):
    """K|V ring over ``peers`` (ranks of ``group`` in ring order; this rank is ``peers[me]``).

    q [n, Hq, D]: this position's rows; kv [n, 2*hkv, D]: its K|V block (K heads first). Step i computes
    q against the block that started at ring position (me - i) % R (``steps[i]``: its prepared tiles,
    None when there are none; ``block_rows[p]``: rows of position p's block), while block i + 1 is in
    flight; the backend adds each step into one running (out, lse) of ``accumulate_dtype(q.dtype)``.
    Backward runs the same order; the dK|dV sum of a block travels with it (one hop per step, each send
    overlapping the next step's kernel) and is home after R hops. Returns out [n, Hq, D] (q's dtype) and
    lse [n, Hq] of ``accumulate_dtype(q.dtype)``.
    """

    @staticmethod
    def forward(ctx, q, kv, hkv, peers, me, block_rows, steps, backend, scale, group):
        R = len(peers)
        cdt = accumulate_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=cdt, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=cdt, device=q.device)
        nxt_peer, prv_peer = peers[(me + 1) % R], peers[(me - 1) % R]
        cur, blocks = kv, []
        for i in range(R):
            works = []
            if i < R - 1:
                nxt = kv.new_empty((block_rows[(me - i - 1) % R],) + tuple(kv.shape[1:]))
                ops = [dist.P2POp(dist.isend, wire(cur), group=group, group_peer=nxt_peer),
                       dist.P2POp(dist.irecv, wire(nxt), group=group, group_peer=prv_peer)]
                works = dist.batch_isend_irecv(ops)
            if steps[i] is not None:
                backend.forward_accumulate(q, cur[:, :hkv], cur[:, hkv:], steps[i], scale, out, lse)
            blocks.append(cur)
            for w in works:
                w.wait()
            if i < R - 1:
                cur = nxt
        out = out.to(q.dtype)  # lse stays in the accumulation dtype (float64 for float64 inputs)
        ctx.save_for_backward(q, out, lse, *blocks)
        ctx.args = (hkv, peers, me, block_rows, steps, backend, scale, group)
        ctx.set_materialize_grads(False)  # an unused lse gives dlse None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        refuse_double_backward("ring attention")
        q, out, lse, *blocks = ctx.saved_tensors
        hkv, peers, me, block_rows, steps, backend, scale, group = ctx.args
        R = len(peers)
        cdt = accumulate_dtype(q.dtype)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        d = delta(dout, out, dlse)  # computed once for every step (None: each step's backend call does it)
        nxt_peer, prv_peer = peers[(me + 1) % R], peers[(me - 1) % R]
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        works, recv, sent = [], None, None
        for i in range(R):
            b = blocks[i]
            # this step's dK|dV go into a fresh sum while the block's travelling sum is still in flight
            g = torch.zeros(b.shape, dtype=cdt, device=q.device)
            if steps[i] is not None:
                backend.backward_into(q, b[:, :hkv], b[:, hkv:], out, lse, dout, steps[i], scale, d,
                                      dq, g[:, :hkv], g[:, hkv:])
            for w in works:
                w.wait()
            acc = g if recv is None else g.add_(recv)
            if R == 1:
                recv = acc
                break
            recv = torch.empty((block_rows[(me - i - 1) % R],) + tuple(b.shape[1:]), dtype=cdt, device=q.device)
            sent = acc  # keep alive until the send completes
            ops = [dist.P2POp(dist.isend, sent, group=group, group_peer=nxt_peer),
                   dist.P2POp(dist.irecv, recv, group=group, group_peer=prv_peer)]
            works = dist.batch_isend_irecv(ops)
        for w in works:
            w.wait()
        dkv = recv.to(q.dtype)  # this position's own block, home after R hops
        return dq.to(q.dtype), dkv, None, None, None, None, None, None, None, None


def group_runs(plan: Plan, u: int) -> list[np.ndarray]:
    """Row runs of each group of ``u`` consecutive ranks: its ranks' owned runs concatenated in rank
    order (int64 [n, 2] each; ``u`` = 1: each rank's own runs)."""
    return cached(plan, ("group_runs", u), lambda: [
        np.concatenate([plan.ranks[g * u + i].segments for i in range(u)]) for g in range(plan.cp_size // u)])


def ring_tiles(plan: Plan, u: int, g: int) -> list[np.ndarray]:
    """Tiles (int32 [n, 5]) of ring position ``g`` (a group of ``u`` consecutive ranks; u = 1: rank
    ``g``) for each step i: the mask clipped to group g's rows x the keys of group (g - i) % (cp / u),
    queries and keys in their groups' rank order."""

    def build():
        runs = group_runs(plan, u)
        return [geometry.traps_to_tiles(plan.traps, runs[g], runs[(g - i) % len(runs)]) for i in range(len(runs))]

    return cached(plan, ("ring_tiles", u, g), build)


def ring_steps(plan: Plan, u: int, g: int, backend, backend_key) -> list:
    """``ring_tiles`` prepared by ``backend`` (None for a step without tiles)."""

    def build():
        runs = group_runs(plan, u)
        sq = runs_len(runs[g])
        return [backend.prepare(torch.from_numpy(t.astype("int32")), sq, max(runs_len(runs[(g - i) % len(runs)]), 1))
                if len(t) else None for i, t in enumerate(ring_tiles(plan, u, g))]

    return cached(plan, ("ring_steps", backend_key, u, g), build)


def ring_attention(q, k, v, plan: Plan, u: int, rank: int, backend, backend_key, scale: float, group):
    """The K/V ring across the cp/u groups of ``u`` consecutive ranks of ``plan``.

    This rank (``rank`` = g*u + j) is position j of group g; q [n_g, h, D] and k/v [n_g, hkv, D] hold
    group g's rows (its ranks' local rows concatenated in rank order) for the heads position j holds,
    and the ring runs over position j of every group. Returns (out [n_g, h, D], lse [n_g, h] float32).
    """
    g, j = divmod(rank, u)
    R = plan.cp_size // u
    rows = [runs_len(r) for r in group_runs(plan, u)]
    steps = ring_steps(plan, u, g, backend, backend_key)
    peers = [gg * u + j for gg in range(R)]
    kv = torch.cat([k, v], dim=1)
    return RingAttention.apply(q, kv, k.shape[1], peers, g, rows, steps, backend, scale, group)


def check_ring_plan(plan: Plan, name: str) -> None:
    """The ring is balanced on zigzag (causal) and contiguous (full) layouts only: others raise."""
    if plan.cp_size > 1 and not (plan.solver.startswith("zigzag") or plan.solver == "contiguous"):
        raise ValueError(
            f"{name} needs a plan made with solver='zigzag' (causal) or 'contiguous' (full), got "
            f"solver={plan.solver!r}; build it with megatron_cp.baselines.plan_for"
        )


def ring(q, k, v, plan: Plan, group=None, softmax_scale=None, *, backend="auto", lse_grad: bool = True):
    """Ring attention (p2p K/V ring, next block prefetched, dK/dV travel home in backward).

    q [s_local, Hq, D], k/v [s_local, Hkv, D] in ``plan``'s local order (``dispatch``); returns out
    [s_local, Hq, D] (q's dtype) and lse [s_local, Hq] float32. Plan: ``solver='zigzag'`` (2*cp runs,
    rank r owns r and 2cp-1-r: balanced causal) or ``'contiguous'`` (full); other solvers raise
    ValueError. Masks: exact for any mask; balanced for causal (zigzag) and full (contiguous).
    ``backend``: a kernel backend name or ``kernels.Backend`` object. ``lse_grad=False`` (every
    strategy): lse comes back without gradient (for callers that use only out, as Megatron's core
    attention; the Ulysses exchanges then skip the lse gradient and its flags, a host sync).
    """
    if group is not None:
        check_ring_plan(plan, "ring")
    rank, scale, bkey, be = setup(q, k, v, plan, group, softmax_scale, backend, lse_grad, "ring")
    out, lse = ring_attention(q, k, v, plan, 1, rank, be, bkey, scale, group)
    return out, (lse if lse_grad else lse.detach())
