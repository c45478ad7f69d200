"""The static part of sparse attention for one rank: blocks, envelope, key buffer, owners.

Built once per (plan, rank, block) on the host and cached with the plan. The key/value buffer of a rank
holds every global key block its envelope touches (``env_ids``, ascending); a call fills only the blocks
some head selected (``sparse.exchange``), and the kernels' tile list covers the envelope over
(local q rows, buffer rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..masks import geometry
from ..planner import Plan
from .view import block_runs, envelope_blocks


@dataclass(frozen=True)
class SparseLayout:
    """rank's static layout at ``block`` tokens per block.

    q_blocks int64 [nq]: global ids of the rank's blocks in local order; envelope int8 [nq, nb] (CPU);
    env_ids int64 [ne]: buffer blocks (ascending global ids); tiles int32 [n, 5]: the envelope over
    (local q rows, buffer rows); owner int64 [nb]: rank of each global block; owner_pos int64 [nb]: its
    index in the owner's local block order; buffer_pos int64 [nb]: its index in this rank's buffer or -1.

    Rows the envelope reads from other ranks (the dense plan's exchange, ``RankPlan.send_runs`` /
    ``recv_runs``): perm int64 [n_local]: local rows in ascending global order; send_need bool
    [cp, n_local]: in that order, rows rank d's envelope reads from this rank; row_block int64 [n_local]:
    their global blocks; recv_need bool [ne * B]: buffer rows this rank's envelope reads from others;
    buf_owner / buf_block int64 [ne * B]: owner rank and global block of each buffer row.
    """

    rank: int
    cp_size: int
    block: int
    num_blocks: int
    q_blocks: np.ndarray
    envelope: torch.Tensor
    env_ids: np.ndarray
    tiles: torch.Tensor
    owner: np.ndarray
    owner_pos: np.ndarray
    buffer_pos: np.ndarray
    traps: np.ndarray
    perm: np.ndarray
    send_need: np.ndarray
    row_block: np.ndarray
    recv_need: np.ndarray
    buf_owner: np.ndarray
    buf_block: np.ndarray

    @property
    def identity(self) -> bool:
        """The buffer is the local K/V itself: one process holding every block its rows need, in order.
        (With several ranks every rank joins the exchange, even one that needs nothing from the others.)"""
        return (self.cp_size == 1 and len(self.env_ids) == len(self.q_blocks)
                and bool((self.env_ids == self.q_blocks).all()))

    @property
    def nq(self) -> int:
        return len(self.q_blocks)

    @property
    def ne(self) -> int:
        return len(self.env_ids)


def _local_blocks(plan: Plan, rank: int, block: int) -> np.ndarray:
    ids = plan.local_ids(rank)
    return ids[::block] // block


def check_plan(plan: Plan, block: int) -> None:
    """ValueError unless ``plan`` lays tokens out in whole blocks of ``block`` and has no guest rows."""
    if plan.seqlen % block:
        raise ValueError(f"sparse attention needs the sequence length ({plan.seqlen}) to be a multiple of the "
                         f"selector's block ({block})")
    bad = np.asarray(plan.bounds) % block
    if bad.any():
        raise ValueError(f"sparse attention needs every plan chunk to be whole blocks of {block} tokens; this plan "
                         f"has chunk_size {plan.chunk_size} (cut at {int(np.asarray(plan.bounds)[bad.nonzero()[0][0]])})"
                         f": make it with mcp.plan(mask, cp_size, block={block}, guest_rows='none') (a chunk_size "
                         f"alone can still cut documents off the block grid)")
    if plan.has_guests:
        raise ValueError("sparse attention runs every query row on its own rank: make the plan with "
                         "guest_rows='none'")


def sparse_layout(plan: Plan, rank: int, block: int) -> SparseLayout:
    """The layout of ``rank`` (see ``SparseLayout``); raises ValueError via ``check_plan``."""
    check_plan(plan, block)
    nb = plan.seqlen // block
    owner = np.zeros(nb, dtype=np.int64)
    owner_pos = np.zeros(nb, dtype=np.int64)
    for r in range(plan.cp_size):
        g = _local_blocks(plan, r, block)
        owner[g] = r
        owner_pos[g] = np.arange(len(g))
    q_blocks = _local_blocks(plan, rank, block)
    env = envelope_blocks(plan.traps, plan.seqlen, q_blocks, block)
    env_ids = np.nonzero(env.numpy().any(0))[0].astype(np.int64)
    buffer_pos = np.full(nb, -1, dtype=np.int64)
    buffer_pos[env_ids] = np.arange(len(env_ids))
    q_runs, k_runs = block_runs(q_blocks, block), block_runs(env_ids, block)
    tiles = geometry.traps_to_tiles(plan.traps, q_runs, k_runs) if len(env_ids) else np.zeros((0, 5), np.int32)
    rp = plan.ranks[rank]
    ids = plan.local_ids(rank)
    perm = np.argsort(ids, kind="stable")
    sorted_ids = ids[perm]
    send_need = np.zeros((plan.cp_size, len(ids)), dtype=bool)
    for d, runs in enumerate(rp.send_runs):
        _mark(send_need[d], sorted_ids, runs)
    buf_ids = (env_ids[:, None] * block + np.arange(block)).reshape(-1)
    recv_need = np.zeros(len(buf_ids), dtype=bool)
    for runs in rp.recv_runs:
        _mark(recv_need, buf_ids, runs)
    return SparseLayout(rank, plan.cp_size, block, nb, q_blocks, env, env_ids,
                        torch.as_tensor(np.asarray(tiles), dtype=torch.int32), owner, owner_pos, buffer_pos,
                        np.asarray(plan.traps), perm.astype(np.int64), send_need, sorted_ids // block, recv_need,
                        owner[buf_ids // block], buf_ids // block)


def _mark(flags: np.ndarray, sorted_ids: np.ndarray, runs) -> None:
    """Set ``flags[i]`` where ascending ``sorted_ids[i]`` lies in one of the half-open global ``runs``."""
    for a, b in np.asarray(runs, dtype=np.int64).reshape(-1, 2).tolist():
        flags[np.searchsorted(sorted_ids, a): np.searchsorted(sorted_ids, b)] = True
