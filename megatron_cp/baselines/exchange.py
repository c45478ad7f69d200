"""Point-to-point exchanges inside a CP group: the Ulysses all-to-all between sequence and heads.

Used by ``usp``/``ulysses`` (strategies.py) and ``head_context`` (hybrid.py). Peers are ranks of the CP group
(``group_peer``), so no sub-group is needed.

Layout: the sequence side of an exchange is ``[u, n, G, ...]`` (slice j holds the head share that member
j receives, contiguous, so it is sent as it is); the heads side is ``[sum(counts), G, ...]`` (member j's
rows at offset ``sum(counts[:j])``, received in place). Several tensors (q, k and v; out and lse) travel
in one batch of point-to-point ops (one latency, not one per tensor), each into its own buffer. In backward a missing gradient (``None``: the
caller did not use that output) travels as zeros with a flag, and comes out ``None`` when no rank had
it, so an unused lse costs no gradient pass later on; ranks never disagree on what is exchanged. Only a
rank that lacks a gradient reads the flags: a host sync, which leaves the GPU idle while the host issues
the rest of backward (3-4 ms of a 4 x 128k step on H200). Outputs the caller declares without gradient
(``to_seq(..., grads=...)``; the strategies' ``lse_grad=False``) skip it: no exchange in backward at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import _wire


def check_lse_grad(lse_grad, name: str) -> None:
    """The strategies' ``lse_grad`` option: True or False (a ValueError before any collective)."""
    if not isinstance(lse_grad, bool):
        raise ValueError(f"{name}: lse_grad must be True or False, got {lse_grad!r}")


def _p2p(sends: dict, recvs: dict, group) -> None:
    """Send the tensors ``sends[peer]`` and receive into ``recvs[peer]`` (lists; peers are ranks of
    ``group``) in one batch; waits."""
    ops = [dist.P2POp(dist.isend, _wire(t.contiguous()), group=group, group_peer=p)
           for p, ts in sends.items() for t in ts if t.numel()]
    ops += [dist.P2POp(dist.irecv, _wire(t), group=group, group_peer=p) for p, ts in recvs.items() for t in ts if t.numel()]
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
    # the flags are set on the device: a host-to-device copy of them would wait for the stream (on 2 x
    # H200 Ulysses' backward took the host 43-126 ms to issue back to back, 2026-11-22 10:51)
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
