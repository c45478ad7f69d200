"""Ulysses (DeepSpeed-Ulysses) and USP: all-to-all from sequence to heads inside groups of ranks.

``ulysses``: every rank sends each other rank its share of the heads; each rank then holds the whole
sequence for Hq/cp query heads (and Hkv*f/cp K/V heads, K/V heads repeated f times when Hkv < cp),
attends over it with the mask's own tiles, and an all-to-all brings out and lse back to "my tokens,
all heads". ``usp``: the same all-to-all inside groups of ``u`` consecutive ranks (a node), then the
K/V ring of ``baselines.ring`` across the cp/u groups for this rank's heads. ``head_context``
(``baselines.head_context``) uses the same exchanges with megatron-cp's planned attention across groups.

The exchanges are point-to-point ops inside the CP group (peers are its ranks: no sub-group is created).
Layout: the sequence side of an exchange is ``[u, n, G, ...]`` (slice j holds the head share that member
j receives, contiguous, so it is sent as it is); the heads side is ``[sum(counts), G, ...]`` (member j's
rows at offset ``sum(counts[:j])``, received in place). Several tensors (q, k and v; out and lse) travel
in one batch of point-to-point ops (one latency, not one per tensor), each into its own buffer. In
backward a missing gradient (``None``: the caller did not use that output) travels as zeros with a
flag, and comes out ``None`` when no rank had it, so an unused lse costs no gradient pass later on;
ranks never disagree on what is exchanged. Only a rank that lacks a gradient reads the flags: a host
sync, which leaves the GPU idle while the host issues the rest of backward. Outputs the caller declares
without gradient (``to_seq(..., grads=...)``; the strategies' ``lse_grad=False``) skip it: no exchange
in backward at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import wire
from ..planner import Plan
from ..planner.layout import kv_head_repeat
from .common import TileAttention, empty_result, global_order, mask_tiles, prepared, repeat_kv, setup
from .ring import check_ring_plan, ring_attention

# ------------------------------------------------------------------- the sequence <-> heads exchange


def _p2p(sends: dict, recvs: dict, group) -> None:
    """Send the tensors ``sends[peer]`` and receive into ``recvs[peer]`` (lists; peers are ranks of
    ``group``) in one batch; waits."""
    ops = [dist.P2POp(dist.isend, wire(t.contiguous()), group=group, group_peer=p)
           for p, ts in sends.items() for t in ts if t.numel()]
    ops += [dist.P2POp(dist.irecv, wire(t), group=group, group_peer=p)
            for p, ts in recvs.items() for t in ts if t.numel()]
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _swap(send, recv, peers, me, group, flags):
    """Member j of ``peers`` gets ``send[j]`` (a list of tensors) and its tensors land in ``recv[j]``,
    in one batch; ``flags`` (int32 [m] or None) also go to every peer. Returns {peer: its flags}."""
    others = [j for j in range(len(peers)) if j != me]
    got = {peers[j]: flags.new_empty(flags.shape) for j in others} if flags is not None else {}
    extra = [flags] if flags is not None else []
    _p2p({peers[j]: send[j] + extra for j in others},
         {peers[j]: recv[j] + ([got[peers[j]]] if got else []) for j in others}, group)
    return got


def _seq_to_heads(xs, peers, me, counts, group, flags=None):
    """xs: tensors [u, counts[me], G_i, ...] -> [sum(counts), G_i, ...]: slice j goes to peers[j], rows
    arrive in peer order. ``flags`` (int32 [m]) also go to every peer; returns (outs, flags per peer)."""
    outs = [x.new_empty((sum(counts),) + tuple(x.shape[2:])) for x in xs]
    parts = [list(o.split(counts, dim=0)) for o in outs]
    for x, p in zip(xs, parts):
        p[me].copy_(x[me])
    u = range(len(peers))
    return outs, _swap([[x[j] for x in xs] for j in u], [[p[j] for p in parts] for j in u], peers, me, group, flags)


def _heads_to_seq(ys, peers, me, counts, group, flags=None):
    """Inverse of ``_seq_to_heads``: ys [sum(counts), G_i, ...] -> [u, counts[me], G_i, ...]."""
    outs = [y.new_empty((len(peers), counts[me]) + tuple(y.shape[1:])) for y in ys]
    parts = [list(y.split(counts, dim=0)) for y in ys]
    for o, p in zip(outs, parts):
        o[me].copy_(p[me])
    u = range(len(peers))
    return outs, _swap([[p[j] for p in parts] for j in u], [[o[j] for o in outs] for j in u], peers, me, group, flags)


def _grads_exchange(fn, gs, like, args):
    """Backward of an exchange: missing gradients travel as zeros with a flag; a gradient no rank had
    comes out None (the same on every rank, since every rank receives every flag)."""
    present = torch.tensor([g is not None for g in gs], dtype=torch.int32)
    zs = [g if g is not None else torch.zeros(shape, dtype=dt, device=dev) for g, (shape, dev, dt) in zip(gs, like)]
    # the flags are set on the device: a host-to-device copy of them would wait for the stream, and the
    # host could not issue the rest of backward meanwhile
    flags = torch.zeros(len(gs), dtype=torch.int32, device=like[0][1])
    for i, g in enumerate(gs):
        if g is not None:
            flags[i] = 1
    outs, got = fn(zs, *args, flags=flags)
    if all(g is not None for g in gs):
        return outs  # no flag needs reading (no host sync)
    anyone = present.clone()
    for f in got.values():
        anyone |= f.cpu()
    return [o if a else None for o, a in zip(outs, anyone.tolist())]


class _SeqToHeads(torch.autograd.Function):
    """``_seq_to_heads`` of several tensors in one exchange; differentiable (backward: ``_heads_to_seq``)."""

    @staticmethod
    def forward(ctx, peers, me, counts, group, *xs):
        ctx.args = (peers, me, counts, group)
        ctx.like = [(x.shape, x.device, x.dtype) for x in xs]
        ctx.set_materialize_grads(False)
        return tuple(_seq_to_heads(xs, peers, me, counts, group)[0])

    @staticmethod
    def backward(ctx, *gs):
        like = [((sum(ctx.args[2]),) + tuple(s[2:]), d, t) for s, d, t in ctx.like]
        return (None,) * 4 + tuple(_grads_exchange(_heads_to_seq, gs, like, ctx.args))


class _HeadsToSeq(torch.autograd.Function):
    """``_heads_to_seq`` of several tensors in one exchange; differentiable (backward: ``_seq_to_heads``)
    in the outputs ``grads`` marks (the others are returned without gradient and their backward
    exchange is not made: no zeros, no flag, no host sync)."""

    @staticmethod
    def forward(ctx, peers, me, counts, group, grads, *ys):
        ctx.args = (peers, me, counts, group)
        ctx.grads = grads
        ctx.like = [(y.shape, y.device, y.dtype) for y, g in zip(ys, grads) if g]
        ctx.set_materialize_grads(False)
        outs = tuple(_heads_to_seq(ys, peers, me, counts, group)[0])
        ctx.mark_non_differentiable(*[o for o, g in zip(outs, grads) if not g])
        return outs

    @staticmethod
    def backward(ctx, *gs):
        peers, me, counts, _ = ctx.args
        like = [((len(peers), counts[me]) + tuple(s[1:]), d, t) for s, d, t in ctx.like]
        if not like:
            return (None,) * (5 + len(ctx.grads))
        got = iter(_grads_exchange(_seq_to_heads, [x for x, g in zip(gs, ctx.grads) if g], like, ctx.args))
        return (None,) * 5 + tuple(next(got) if g else None for g in ctx.grads)


def to_heads(tensors, peers, me, counts, group, perm=None):
    """Sequence -> heads for Ulysses: tensors [n, H_i, ...] (H_i divisible by u = len(peers)) ->
    contiguous [sum(counts), H_i / u, ...] each, in one exchange: each tensor is laid out once in the
    send layout ([u, n, H_i / u, ...], one write) and its head shares arrive in place in their own buffer
    (what the kernels and cuDNN read best). ``perm`` (int64 [sum(counts)]): the received rows are
    reordered by it."""
    u = len(peers)
    packed = []
    for t in tensors:
        n, h = t.shape[0], t.shape[1] // u
        p = t.new_empty((u, n, h) + tuple(t.shape[2:]))
        p.copy_(t.reshape((n, u, h) + tuple(t.shape[2:])).transpose(0, 1))
        packed.append(p)
    outs = _SeqToHeads.apply(peers, me, counts, group, *packed)
    if perm is not None:
        outs = [x.index_select(0, perm) for x in outs]
    return list(outs)


def to_seq(tensors, peers, me, counts, group, grads=None):
    """Heads -> sequence: tensors [sum(counts), h_i, ...] -> [counts[me], u * h_i, ...] (head share j from
    peers[j]), all in one exchange. ``grads`` (bools, default all True): which outputs are
    differentiable; the others come back without gradient and cost no backward exchange."""
    u = len(peers)
    grads = tuple(True for _ in tensors) if grads is None else tuple(bool(g) for g in grads)
    outs = _HeadsToSeq.apply(peers, me, counts, group, grads, *[t.contiguous() for t in tensors])
    return [o.transpose(0, 1).reshape((counts[me], u * o.shape[2]) + tuple(o.shape[3:])) for o in outs]


# ---------------------------------------------------------------------------------- the strategies


def _ulysses_ring(q, k, v, plan: Plan, group, softmax_scale, u: int, backend, lse_grad, name: str):
    """Ulysses all-to-all inside groups of ``u`` consecutive ranks, then the K/V ring across the cp/u
    groups; u = cp: no ring (one group holds the whole sequence); u = 1: no all-to-all."""
    rank, scale, bkey, be = setup(q, k, v, plan, group, softmax_scale, backend, lse_grad, name)
    cp = plan.cp_size
    if u < 1 or cp % u:
        raise ValueError(f"{name}: ulysses_degree={u} must divide cp_size={cp}")
    f = kv_head_repeat(q.shape[1], k.shape[1], u) if u > 1 else 1  # raises naming the heads
    g, j = divmod(rank, u)  # ulysses group g (ranks g*u .. g*u+u-1), position j inside it
    members = [g * u + i for i in range(u)]
    counts = [plan.num_local(r) for r in members]
    whole = u == cp  # one group holds the whole sequence
    # there, in global order, the mask's own trapezoids are the tiles (no clipping over pairs of runs);
    # the received rows are put in global order unless they arrive so (contiguous layouts)
    perm, inv = global_order(plan, q.device) if whole else (None, None)
    kr, vr = repeat_kv(k, v, f)
    if u > 1:  # q, k and v in one exchange, each received into its own contiguous buffer
        qh, kh, vh = to_heads([q, kr, vr], members, j, counts, group, perm)
    else:
        qh, kh, vh = q, kr, vr
    if whole:
        prep = prepared(plan, (bkey, "global"), be, mask_tiles(plan), plan.seqlen, plan.seqlen)
        if prep is None:
            o, l = empty_result(qh, qh.shape[-1])
        else:
            o, l = TileAttention.apply(qh, kh, vh, be, prep, scale)
        if inv is not None:
            o, l = o.index_select(0, inv), l.index_select(0, inv)
    else:  # ring position = group index; the peers hold the same head share
        o, l = ring_attention(qh, kh, vh, plan, u, rank, be, bkey, scale, group)
    if u > 1:
        o, l = to_seq([o, l.unsqueeze(-1)], members, j, counts, group, grads=(True, lse_grad))
        l = l.squeeze(-1)
    return o, (l if lse_grad else l.detach())


def ulysses(q, k, v, plan: Plan, group=None, softmax_scale=None, *, backend="auto", lse_grad: bool = True):
    """DeepSpeed-Ulysses: all-to-all sequence -> heads, full-sequence attention on Hq/cp heads,
    all-to-all back.

    q [s_local, Hq, D], k/v [s_local, Hkv, D] in ``plan``'s local order; returns out [s_local, Hq, D]
    (q's dtype) and lse [s_local, Hq] float32. Plan: any (contiguous recommended: the received rows
    then need no reordering). Masks: any. Needs cp to divide Hq and Hkv*f for some K/V head repeat f
    with Hq % (Hkv*f) == 0 (raises ValueError otherwise). ``backend``/``lse_grad``: as ``ring``.
    """
    return _ulysses_ring(q, k, v, plan, group, softmax_scale, plan.cp_size, backend, lse_grad, "ulysses")


def default_usp_degree(plan: Plan, num_kv_heads: int) -> int:
    """usp's default Ulysses degree: the largest divisor of cp that divides ``num_kv_heads``, capped
    by the plan topology's GPUs per node (1 when none does)."""
    cp = plan.cp_size
    cap = plan.topology.gpus_per_node if plan.topology is not None else cp
    return max(d for d in range(1, cp + 1) if cp % d == 0 and d <= cap and (num_kv_heads % d == 0 or d == 1))


def usp(q, k, v, plan: Plan, group=None, softmax_scale=None, *, ulysses_degree: int | None = None,
        backend="auto", lse_grad: bool = True):
    """USP: Ulysses inside groups of ``ulysses_degree`` consecutive ranks x ring across groups.

    q [s_local, Hq, D], k/v [s_local, Hkv, D] in ``plan``'s local order; returns out [s_local, Hq, D]
    (q's dtype) and lse [s_local, Hq] float32. ``ulysses_degree`` None: ``default_usp_degree``. Plan:
    ``zigzag`` or ``contiguous`` (the ring's layout; any plan when the degree is cp). Masks: any,
    balanced for causal/full. ``backend``/``lse_grad``: as ``ring``.
    """
    if ulysses_degree is None:
        hkv = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 3 else 1
        ulysses_degree = default_usp_degree(plan, hkv)
    if group is not None and ulysses_degree < plan.cp_size:
        check_ring_plan(plan, "usp")
    return _ulysses_ring(q, k, v, plan, group, softmax_scale, int(ulysses_degree), backend, lse_grad, "usp")
