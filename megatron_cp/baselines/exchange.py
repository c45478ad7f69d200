"""Point-to-point exchanges inside a CP group: the Ulysses all-to-all between sequence and heads.

Used by ``usp``/``ulysses`` (strategies.py) and ``head_context`` (hybrid.py). Peers are ranks of the CP group
(``group_peer``), so no sub-group is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import _wire


def _p2p(sends: dict, recvs: dict, group) -> None:
    """Send ``sends[peer]`` and receive into ``recvs[peer]`` (peers are ranks of ``group``); waits."""
    ops = [dist.P2POp(dist.isend, _wire(t.contiguous()), group=group, group_peer=p) for p, t in sends.items() if t.numel()]
    ops += [dist.P2POp(dist.irecv, _wire(t), group=group, group_peer=p) for p, t in recvs.items() if t.numel()]
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _seq_to_heads(x, peers, me, counts, group):
    """[counts[me], H, ...] -> [sum(counts), H/u, ...]: head group j goes to peers[j]; rows arrive
    in peer order."""
    u = len(peers)
    chunks = list(x.chunk(u, dim=1))
    hh = chunks[0].shape[1]
    out = x.new_empty((sum(counts), hh) + tuple(x.shape[2:]))
    parts = list(out.split(counts, dim=0))
    parts[me].copy_(chunks[me])
    _p2p({peers[j]: chunks[j] for j in range(u) if j != me}, {peers[j]: parts[j] for j in range(u) if j != me}, group)
    return out


def _heads_to_seq(y, peers, me, counts, group):
    """Inverse of ``_seq_to_heads``: [sum(counts), H/u, ...] -> [counts[me], H, ...]."""
    u = len(peers)
    parts = list(y.split(counts, dim=0))
    out = y.new_empty((counts[me], y.shape[1] * u) + tuple(y.shape[2:]))
    chunks = list(out.chunk(u, dim=1))
    chunks[me].copy_(parts[me])
    recv = {peers[j]: torch.empty_like(chunks[j]) for j in range(u) if j != me}
    _p2p({peers[j]: parts[j] for j in range(u) if j != me}, recv, group)
    for j, t in recv.items():
        chunks[peers.index(j)].copy_(t)
    return out


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, peers, me, counts, group):
        ctx.args = (peers, me, counts, group)
        return _seq_to_heads(x, peers, me, counts, group)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g.contiguous(), *ctx.args), None, None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, peers, me, counts, group):
        ctx.args = (peers, me, counts, group)
        return _heads_to_seq(y, peers, me, counts, group)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g.contiguous(), *ctx.args), None, None, None, None
