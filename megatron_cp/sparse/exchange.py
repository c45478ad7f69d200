"""Moving only the key/value blocks some head selected (forward) and their gradients back (backward).

``need[g]`` (bool [nb] on the device) says this rank's selection uses global key block ``g``. Needs are
all-gathered (nb bytes per rank), so every owner knows which of its blocks each rank wants. Of a wanted
block only the rows the receiver's envelope reads travel (the dense plan's rows: a block at a document
edge is read in part), so the exchange never moves more than the dense plan; they travel in one
all-to-all-v, by source rank and ascending global position. The all-to-all-v's row counts
must be on the host: one device-to-host copy of the counts per call (the exchange's only host
synchronisation). The backward is the adjoint: each buffer block's gradient travels back to its owner
and is summed there in the accumulation dtype (float32, float64 for float64 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import all_gather_single, all_to_all_v
from ..kernels import accumulate_dtype
from .layout import SparseLayout


@dataclass(frozen=True)
class DeviceLayout:
    """``SparseLayout``'s index arrays on the device: owner [nb], owner_pos [nb], buffer_pos [nb],
    env_ids [ne], perm / row_block [n_local], buf_owner / buf_block [ne * B] (long); send_need [cp, n_local],
    recv_need [ne * B] (bool)."""

    rank: int
    cp_size: int
    block: int
    num_blocks: int
    owner: torch.Tensor
    owner_pos: torch.Tensor
    buffer_pos: torch.Tensor
    env_ids: torch.Tensor
    perm: torch.Tensor
    send_need: torch.Tensor
    row_block: torch.Tensor
    recv_need: torch.Tensor
    buf_owner: torch.Tensor
    buf_block: torch.Tensor

    @staticmethod
    def of(lay: SparseLayout, device) -> "DeviceLayout":
        t = lambda a: torch.as_tensor(a, dtype=torch.long, device=device)  # noqa: E731
        b = lambda a: torch.as_tensor(a, dtype=torch.bool, device=device)  # noqa: E731
        return DeviceLayout(lay.rank, lay.cp_size, lay.block, lay.num_blocks, t(lay.owner), t(lay.owner_pos),
                            t(lay.buffer_pos), t(lay.env_ids), t(lay.perm), b(lay.send_need), t(lay.row_block),
                            b(lay.recv_need), t(lay.buf_owner), t(lay.buf_block))


def _rows(blocks: torch.Tensor, b: int) -> torch.Tensor:
    """long [n * b]: the token rows of blocks ``blocks`` (long [n])."""
    return (blocks[:, None] * b + torch.arange(b, device=blocks.device)).reshape(-1)


def _first(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Flat indices of the ``n`` True entries of ``mask`` in row-major order (``n`` known on the host, so
    no second synchronisation as ``nonzero`` would make)."""
    return torch.argsort((~mask.flatten()).to(torch.int8), stable=True)[:n]


@dataclass
class Route:
    """One call's exchange: rows to send / receive / copy locally, and the counts (host ints)."""

    send_local: torch.Tensor  # long [n_send] local rows, by destination, then global position
    recv_buffer: torch.Tensor  # long [n_recv] buffer rows, by source, then global position
    own_local: torch.Tensor
    own_buffer: torch.Tensor
    send_counts: list
    recv_counts: list

    @property
    def rows_received(self) -> int:
        return sum(self.recv_counts)


def route(need: torch.Tensor, lay: DeviceLayout, group, whole: bool = False) -> Route:
    """The exchange for ``need`` (bool [nb]); one all-gather of needs and one count synchronisation.
    ``whole``: every row of a wanted block travels (selectors that read keys the envelope does not)."""
    cp, me, nb, b = lay.cp_size, lay.rank, lay.num_blocks, lay.block
    if group is None or cp == 1:
        needs = need[None]
    else:
        needs = torch.empty(cp * nb, dtype=torch.uint8, device=need.device)
        all_gather_single(needs, need.to(torch.uint8).contiguous(), group=group)
        needs = needs.view(cp, nb).bool()
    ranks = torch.arange(cp, device=need.device)
    own = lay.owner == me
    # rows: wanted block and read by the receiver's envelope (send_need is all False for d == me)
    if whole:
        send = (ranks != me)[:, None] & needs[:, lay.row_block]
        read = lay.buf_owner != me
    else:
        send = lay.send_need & needs[:, lay.row_block]
        read = lay.recv_need
    recv = (lay.buf_owner[None] == ranks[:, None]) & (read & needs[me][lay.buf_block])[None]
    own_need = needs[me] & own
    counts = torch.cat([send.sum(1), recv.sum(1), own_need.sum()[None]]).tolist()  # the host sync
    send_counts, recv_counts, n_own = counts[:cp], counts[cp:2 * cp], counts[-1]
    send_local = lay.perm[_first(send, sum(send_counts)) % send.shape[1]]
    recv_buffer = _first(recv, sum(recv_counts)) % max(recv.shape[1], 1)
    g_own = _first(own_need, n_own)
    return Route(send_local, recv_buffer, _rows(lay.owner_pos[g_own], b), _rows(lay.buffer_pos[g_own], b),
                 send_counts, recv_counts)


def fill(r: Route, x: torch.Tensor, lay: DeviceLayout, group) -> torch.Tensor:
    """The buffer [ne * B, H, D] of ``x`` [nq * B, H, D] (local rows) holding the routed blocks (zeros
    elsewhere)."""
    b = lay.block
    buf = x.new_zeros((lay.env_ids.numel() * b,) + tuple(x.shape[1:]))
    buf[r.own_buffer] = x[r.own_local]
    if group is not None and lay.cp_size > 1:
        got = all_to_all_v(x[r.send_local], r.send_counts, r.recv_counts, group)
        buf[r.recv_buffer] = got
    return buf


def drain(r: Route, g: torch.Tensor, n_local: int, lay: DeviceLayout, group) -> torch.Tensor:
    """Adjoint of ``fill``: buffer gradients [ne * B, H, D] summed into the local rows [n_local, H, D] of
    their owners, in the accumulation dtype."""
    acc = torch.zeros((n_local,) + tuple(g.shape[1:]), dtype=accumulate_dtype(g.dtype), device=g.device)
    acc.index_add_(0, r.own_local, g[r.own_buffer].to(acc.dtype))
    if group is not None and lay.cp_size > 1:
        back = all_to_all_v(g[r.recv_buffer].contiguous(), r.recv_counts, r.send_counts, group)
        acc.index_add_(0, r.send_local, back.to(acc.dtype))
    return acc


class GatherBlocks(torch.autograd.Function):
    """(k, v) local [nq * B, Hkv, D] -> buffers [ne * B, Hkv, D] holding the routed blocks; the backward
    returns each block's gradient to its owner. K and V travel together in one all-to-all-v."""

    @staticmethod
    def forward(ctx, r: Route, lay: DeviceLayout, group, k, v):
        h = k.shape[1]
        buf = fill(r, torch.cat([k, v], dim=1), lay, group)
        ctx.r, ctx.lay, ctx.group, ctx.h, ctx.n = r, lay, group, h, k.shape[0]
        return buf[:, :h], buf[:, h:]

    @staticmethod
    def backward(ctx, dk, dv):
        h = ctx.h
        dk = torch.zeros_like(dv) if dk is None else dk
        dv = torch.zeros_like(dk) if dv is None else dv
        acc = drain(ctx.r, torch.cat([dk, dv], dim=1), ctx.n, ctx.lay, ctx.group)
        return None, None, None, acc[:, :h].to(dk.dtype), acc[:, h:].to(dv.dtype)
