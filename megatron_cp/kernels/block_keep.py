"""Per-head block selection on top of a tile list (dynamic sparse attention).

A ``BlockKeep`` narrows a prepared tile list per query head: cell ``(i, j)`` of head ``h`` is computed
iff a tile keeps it (the static envelope) and ``mask[h, i // block, j // block]``. Selection is not
differentiable; gradients flow through the kept cells only. Every backend's ``forward`` and
``backward`` take ``keep=None`` (no narrowing) or a ``BlockKeep``; the mask lives on the inputs' device
and is read there (no host synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockKeep:
    """mask: bool [Hq, ceil(sq / block), ceil(sk / block)] on the inputs' device; block: rows and keys per
    block (the same for both)."""

    mask: torch.Tensor
    block: int

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Raise ValueError unless the mask fits q [sq, Hq, D] and k [sk, Hkv, D]."""
        b = self.block
        if not isinstance(b, int) or b < 1:
            raise ValueError(f"BlockKeep.block must be a positive int, got {b!r}")
        want = (q.shape[1], -(-q.shape[0] // b), -(-k.shape[0] // b))
        m = self.mask
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != want:
            raise ValueError(f"BlockKeep.mask must be a bool tensor of shape {want} (Hq, q blocks, k blocks of "
                             f"{b}), got {getattr(m, 'dtype', type(m))} {tuple(getattr(m, 'shape', ()))}")
        if m.device != q.device:
            raise ValueError(f"BlockKeep.mask is on {m.device} but the inputs are on {q.device}")

    def cells(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """bool [Hq, len(rows), len(cols)]: the selection at cell resolution for local rows / keys."""
        return self.mask[:, (rows // self.block)][:, :, (cols // self.block)]


def block_classes(tiles: torch.Tensor, seqlen_q: int, seqlen_k: int, block: int) -> torch.Tensor:
    """int8 [ceil(sq / block), ceil(sk / block)] on the CPU: 0 when no tile of ``tiles`` (int [n, 5])
    keeps a cell of the block pair, 2 when one tile keeps all of its cells, else 1."""
    from .triton.blocks import block_pairs, tile_descriptors

    nq, nk = -(-seqlen_q // block), -(-seqlen_k // block)
    out = torch.zeros(nq, nk, dtype=torch.int8)
    if tiles.shape[0] == 0:
        return out
    _, m, n, full = block_pairs(tile_descriptors(tiles), block, block)
    # a pair is full only if one tile covers it whole: the cells of a block past sq / sk do not exist,
    # so a ragged last block counts as full when its existing cells are all kept
    val = 1 + full.to(torch.int8)
    flat = out.view(-1)
    flat.scatter_reduce_(0, m * nk + n, val, reduce="amax")
    return out
