"""What a selector may know about the sequence beyond this rank's own tokens (``SelectionView``).

See docs/sparse.md for the contract and the exactness rule (``combine`` sums entries each written by
one rank; reductions across key blocks run over a global-length axis).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..kernels.block_keep import block_classes
from ..masks import AttnMask, geometry


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class SelectionView:
    """This rank's view for selectors.

    block: tokens per block B; num_blocks: nb = seqlen / B; q_blocks long [nq]: global ids of this rank's
    blocks in local order (its queries and keys alike); envelope int8 [nq, nb]: 0 empty, 1 partial,
    2 full block pairs of the static mask; traps long [n, 6]: the mask's cells (``AttnMask.traps``) on
    the device, for ``keeps``. ``combine``: sum over the CP group; ``combine_max``: elementwise max over
    the CP group (exact in any order); ``envelope_keys``: see docs/sparse.md.
    """

    block: int
    num_blocks: int
    q_blocks: torch.Tensor
    envelope: torch.Tensor
    traps: torch.Tensor
    combine: Callable[[torch.Tensor], torch.Tensor] = _identity
    combine_max: Callable[[torch.Tensor], torch.Tensor] = _identity
    envelope_keys: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    spans: np.ndarray | None = None  # int64 [nb, 2] on the host: ``envelope_spans`` (made from traps if None)
    q_host: np.ndarray | None = None  # int64 [nq] on the host: q_blocks (copied from the device if None)
    traps_host: np.ndarray | None = None  # int64 [n, 6] on the host: traps (copied from the device if None)
    envelope_host: torch.Tensor | None = None  # int8 [nq, nb] on the CPU: envelope (made from the traps if None)
    # what a selector derives from the static fields once (per plan, rank and block when the runtime owns it)
    cache: dict = field(default_factory=dict)

    def q_blocks_host(self) -> np.ndarray:
        """``q_blocks`` as a host array (the runtime passes its own copy: no wait for the device)."""
        if self.q_host is None:
            self.q_host = self.q_blocks.cpu().numpy().astype(np.int64)
        return self.q_host

    def host_traps(self) -> np.ndarray:
        """``traps`` as a host array (the runtime passes its own copy: no wait for the device)."""
        if self.traps_host is None:
            self.traps_host = self.traps.cpu().numpy().astype(np.int64)
        return np.asarray(self.traps_host, dtype=np.int64).reshape(-1, 6)

    def host_envelope(self) -> torch.Tensor:
        """``envelope`` on the CPU, made from the host traps when the runtime did not pass it."""
        if self.envelope_host is None:
            self.envelope_host = envelope_blocks(self.host_traps(), self.seqlen, self.q_blocks_host(), self.block)
        return self.envelope_host

    def block_spans(self) -> np.ndarray:
        """int64 [nb, 2]: per global q block, the key blocks [first, last + 1) its envelope may touch
        (``envelope_spans``; a function of the mask alone, the same on every rank)."""
        if self.spans is None:
            self.spans = envelope_spans(self.host_traps(), self.seqlen, self.block)
        return self.spans

    @property
    def seqlen(self) -> int:
        return self.block * self.num_blocks

    @property
    def device(self) -> torch.device:
        return self.q_blocks.device

    def q_positions(self) -> torch.Tensor:
        """long [nq * B]: global position of each local row."""
        b = self.block
        return (self.q_blocks[:, None] * b + torch.arange(b, device=self.device)).reshape(-1)

    def keeps(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """bool, broadcast of ``i`` and ``j`` (long tensors of global query / key positions): whether the
        envelope keeps cell (i, j). For small index sets (the work is ``len(traps)`` x the broadcast)."""
        i, j = torch.broadcast_tensors(i, j)
        out = torch.zeros(i.shape, dtype=torch.bool, device=i.device)
        for q0, q1, lo_a, lo_s, hi_a, hi_s in self.traps.tolist():
            out |= (i >= q0) & (i < q1) & (j >= lo_a + lo_s * i) & (j < hi_a + hi_s * i)
        return out


def block_runs(blocks: np.ndarray, block: int) -> np.ndarray:
    """int64 [n, 2] token runs of the blocks ``blocks`` (in the given order), consecutive blocks merged
    (the tile builders loop over runs: one run per block would make them quadratic in the blocks)."""
    blocks = np.asarray(blocks, dtype=np.int64)
    if len(blocks) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    new = np.ones(len(blocks), dtype=bool)
    new[1:] = blocks[1:] != blocks[:-1] + 1
    starts = blocks[new]
    ends = np.append(blocks[np.flatnonzero(new)[1:] - 1], blocks[-1]) + 1
    return np.stack([starts * block, ends * block], 1)


def envelope_blocks(traps: np.ndarray, seqlen: int, q_blocks: np.ndarray, block: int) -> torch.Tensor:
    """int8 [len(q_blocks), nb] block classes of the cells ``traps`` (``AttnMask.traps``) for the given
    global q blocks (host)."""
    s = seqlen
    tiles = geometry.traps_to_tiles(traps, block_runs(q_blocks, block), np.array([[0, s]]))
    return block_classes(torch.as_tensor(tiles, dtype=torch.int32), len(q_blocks) * block, s, block)


def envelope_spans(traps: np.ndarray, seqlen: int, block: int) -> np.ndarray:
    """int64 [nb, 2]: for each q block of ``block`` rows, a range of key blocks [first, last + 1) holding every
    key its rows keep under ``traps`` (``AttnMask.traps``); [0, 0] for a block that keeps none. Each trap's keys
    are linear in the row, so its extreme keys over a block's rows are at the rows' ends: O(traps + blocks)."""
    nb = seqlen // block
    t = np.asarray(traps, dtype=np.int64).reshape(-1, 6)
    t = t[t[:, 1] > t[:, 0]]
    first, last = t[:, 0] // block, (t[:, 1] - 1) // block
    n = last - first + 1
    tid = np.repeat(np.arange(len(t)), n)
    blk = first[tid] + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    q0, q1, lo_a, lo_s, hi_a, hi_s = (t[tid, c] for c in range(6))
    r0, r1 = np.maximum(q0, blk * block), np.minimum(q1, (blk + 1) * block) - 1  # the trap's rows in the block
    lo = np.clip(np.minimum(lo_a + lo_s * r0, lo_a + lo_s * r1), 0, seqlen)
    hi = np.clip(np.maximum(hi_a + hi_s * r0, hi_a + hi_s * r1), 0, seqlen)
    keep = hi > lo
    out = np.zeros((nb, 2), dtype=np.int64)
    lo_b = np.full(nb, nb, dtype=np.int64)
    hi_b = np.zeros(nb, dtype=np.int64)
    np.minimum.at(lo_b, blk[keep], lo[keep] // block)
    np.maximum.at(hi_b, blk[keep], -(-hi[keep] // block))
    some = hi_b > 0
    out[some, 0], out[some, 1] = lo_b[some], hi_b[some]
    return out


def most_candidates(traps: np.ndarray, seqlen: int, block: int) -> int:
    """The most key blocks any q block's envelope holds besides its own block (host; chunks of q blocks keep
    the block matrix small at any length)."""
    nb = seqlen // block
    most = 0
    for s in range(0, nb, 1024):
        ids = np.arange(s, min(nb, s + 1024))
        env = envelope_blocks(traps, seqlen, ids, block) > 0
        own = env[torch.arange(len(ids)), torch.as_tensor(ids)]
        most = max(most, int((env.sum(1) - own.to(torch.int64)).max()))
    return most


def single_view(mask: AttnMask, block: int, k: torch.Tensor | None = None) -> SelectionView:
    """The view of one process holding the whole sequence (CP = 1); ``k`` [S, Hkv, D] serves
    ``envelope_keys`` when given. Raises ValueError unless the length is a multiple of ``block``."""
    s = mask.seqlen_q
    if not isinstance(block, int) or block < 1 or s % block:
        raise ValueError(f"sequence length {s} must be a multiple of the selector's block {block!r}")
    nb = s // block
    dev = k.device if k is not None else torch.device("cpu")
    ids = np.arange(nb)
    env_host = envelope_blocks(mask.traps, s, ids, block)
    env = env_host.to(dev)
    view = SelectionView(block, nb, torch.arange(nb, device=dev), env,
                         torch.as_tensor(np.asarray(mask.traps), dtype=torch.long, device=dev),
                         spans=envelope_spans(mask.traps, s, block), q_host=ids,
                         traps_host=np.asarray(mask.traps, dtype=np.int64), envelope_host=env_host)
    if k is not None:
        def keys():
            need = torch.nonzero((env > 0).any(0)).flatten()
            return need, k.view(nb, block, *k.shape[1:])[need]
        view.envelope_keys = keys
    return view
