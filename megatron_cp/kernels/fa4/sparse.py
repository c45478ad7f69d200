"""Per-head block-sparse FA4 calls for a ``BlockKeep`` (dynamic sparse attention on FlashAttention-4).

A tile list narrowed by ``keep`` (kernels/block_keep.py) runs as ONE FA4 block-sparse call per direction
with per-query-head block lists, in two parts:

- static, once per (list, device) and cached in the prepared object (``SparseStatic``): the list's
  128 x 128 block classes (empty / partial / full) and the partial blocks' ``mask_mod`` (the band of
  constants, each row's kept key intervals, at most ``MASK_INTERVALS``, or the cells' bitmap, in an aux tensor) - exactly
  the list's own block-sparse form (``fa4_calls.block_lists``);
- dynamic, per call on the device (``head_lists``): ``keep.mask`` expanded to 128-blocks, then
  full lists = selected & static full, partial lists = selected & static partial (the partial ones go
  through the static ``mask_mod``: a selected keep block holds whole 128-blocks, so the selection
  never cuts a 128-block and the mask_mod's cells stay exact). Fixed shapes (counts ``[1, Hq, M]``,
  indices padded to ``[1, Hq, M, N]``), torch ops only: nothing reads a device value on the host.

FA4's block-sparse tensors (flash_attn.cute.block_sparsity, 4.0.0b3x): ``mask_block_cnt [B, H, M]``,
``mask_block_idx [B, H, M, N]`` (ascending, the first ``cnt`` entries read), ``full_*`` alike; ``H`` is
the number of QUERY heads (``q.shape[-2]``) or 1 (broadcast); batch 1 or B. Per-head lists make FA4 turn
off its pack-GQA forward (it needs a broadcast head axis); K/V are never expanded (GQA is native: query
head h reads K/V head h // (Hq // Hkv)). The backward takes the transposed lists, per k block its q
blocks (``[B, H, N]`` / ``[B, H, N, M]``), with ``block_size=(128, 128)``: FA4's sm90 backward then picks
a q tile dividing 128 (head_dim <= 128; above, its n tile is 96 or 64 and 128-key blocks do not divide),
its sm100 backward needs 2-CTA at head_dim 192, which 128-key blocks exclude: the sparse backward runs
head_dim <= ``FA4_SPARSE_BWD_MAX_HEAD_DIM`` on FA4, larger on Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .calls import BITMAP_MAX_BYTES, BLOCK, MASK_INTERVALS, BlockLists, fuse_segments, block_lists, segment_of
from ..upload import upload

FA4_SPARSE_BWD_MAX_HEAD_DIM = 128  # see the module doc: 128 x 128 blocks in FA4's backward tiles


@dataclass(eq=False)
class SparseStatic:
    """The selection-independent part of a list's per-head block-sparse calls (host, built once).

    classes: int8 [M, N] per 128 x 128 block pair: 0 empty, 1 partial, 2 full (M = ceil(sq / 128),
    N = ceil(sk / 128)); blocks: the list's ``BlockLists`` (its mask_mod: ``band`` or ``bounds``), None when
    the list keeps no cell or has no block-sparse form (``fa4_calls.block_lists``);
    reason: why the list cannot run per-head block-sparse (then Triton runs it), else None."""

    seqlen_q: int
    seqlen_k: int
    classes: np.ndarray
    blocks: BlockLists | None
    reason: str | None
    _device: dict = field(default_factory=dict)  # str(device) -> (full bool [M, N], partial bool [M, N], {dir: aux})

    @property
    def empty(self) -> bool:
        """No tile keeps a cell: every row gives out 0 / lse -inf, every gradient 0 (no FA4 call)."""
        return self.blocks is None and self.reason is None

    def on(self, device) -> tuple:
        """(static full bool [M, N], static partial bool [M, N], {"fwd" / "bwd": aux tensors or None}) on ``device``,
        cached."""
        key = str(device)
        got = self._device.get(key)
        if got is None:
            c = upload(self.classes, device)
            b = self.blocks
            fwd, bwd = (None if b is None else b.mask(d)[1] for d in ("fwd", "bwd"))
            up = None if fwd is None else [upload(fwd, device)]
            aux = {"fwd": up, "bwd": up if bwd is fwd else [upload(bwd, device)]}  # one upload unless a bitmap
            got = self._device[key] = (c == 2, c == 1, aux)
        return got


def sparse_static(tiles: np.ndarray, seqlen_q: int, seqlen_k: int) -> SparseStatic:
    """The static part of tile list ``tiles`` (int [n, 5], kernels/protocol.py) on seqlen_q rows and
    seqlen_k keys: the list's own block-sparse form (every list, however many varlen calls it has)."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    segs = fuse_segments([s for s in (segment_of(*map(int, row)) for row in t) if s is not None])
    m, n = -(-seqlen_q // BLOCK), -(-seqlen_k // BLOCK)
    classes = np.zeros((m, n), dtype=np.int8)
    if not segs:
        return SparseStatic(int(seqlen_q), int(seqlen_k), classes, None, None)
    b = block_lists(segs, seqlen_q, seqlen_k, partial_ok=True)
    if b is None:
        return SparseStatic(int(seqlen_q), int(seqlen_k), classes, None,
                            f"rows with more than {MASK_INTERVALS} key intervals on partial 128-blocks and a bitmap of "
                            f"their cells above {BITMAP_MAX_BYTES / 2 ** 20:g} MiB (no per-head block-sparse form)")
    mask_cnt, mask_idx, full_cnt, full_idx = b.fwd
    for cnt, idx, val in ((mask_cnt, mask_idx, 1), (full_cnt, full_idx, 2)):
        rows = np.repeat(np.arange(m), cnt)
        cols = idx[np.arange(n)[None, :] < cnt[:, None]]  # row-major: the listed entries in row order
        classes[rows, cols] = val
    return SparseStatic(int(seqlen_q), int(seqlen_k), classes, b, None)


def expand_keep(mask: torch.Tensor, block: int, m_blocks: int, n_blocks: int) -> torch.Tensor:
    """keep.mask bool [Hq, ceil(sq / block), ceil(sk / block)] -> bool [Hq, m_blocks, n_blocks] at 128-blocks
    (``block`` a multiple of 128; the last keep block may hold fewer 128-blocks: trimmed)."""
    if block % BLOCK:
        raise ValueError(f"keep.block {block} is not a multiple of FA4's {BLOCK}-blocks")
    r = block // BLOCK
    if r == 1:
        return mask
    # a broadcast view reshaped: shapes from the host alone (repeat_interleave may size its output by
    # reading a repeats tensor on the device)
    h, mq, mk = mask.shape
    big = mask[:, :, None, :, None].expand(h, mq, r, mk, r).reshape(h, mq * r, mk * r)
    return big[:, :m_blocks, :n_blocks]


def packed_lists(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [H, R, C] -> (cnt int32 [1, H, R], idx int32 [1, H, R, C]): per row the selected columns in
    ascending order, packed left, padded with 0. Torch ops only, shapes from ``sel``'s shape alone (no
    host synchronisation): each selected column goes to slot (its rank among the row's selected), the
    others to a spare last column that is dropped."""
    h, r, c = sel.shape
    cnt = sel.sum(-1, dtype=torch.int32)
    slot = torch.cumsum(sel, -1) - 1
    slot = torch.where(sel, slot, c)
    cols = torch.arange(c, device=sel.device, dtype=torch.int32).expand(h, r, c)
    idx = torch.zeros(h, r, c + 1, device=sel.device, dtype=torch.int32)
    idx.scatter_(-1, slot, cols)
    return cnt.unsqueeze(0), idx[..., :c].contiguous().unsqueeze(0)  # FA4 reads rows of C int32


def head_lists(static: SparseStatic, keep, direction: str) -> tuple[torch.Tensor, ...]:
    """Per-head FA4 block-sparse lists of ``static`` narrowed by ``keep`` (a BlockKeep), on keep.mask's
    device, int32: forward ``(mask_cnt [1, Hq, M], mask_idx [1, Hq, M, N], full_cnt, full_idx)`` per q
    block; backward (``direction == "bwd"``) the transpose, per k block ``([1, Hq, N], [1, Hq, N, M], ...)``."""
    full, partial, _ = static.on(keep.mask.device)
    m, n = full.shape
    sel = expand_keep(keep.mask, keep.block, m, n)
    f, p = sel & full, sel & partial
    if direction == "bwd":
        f, p = f.transpose(1, 2), p.transpose(1, 2)
    return (*packed_lists(p), *packed_lists(f))


def call_kwargs(static: SparseStatic, keep, direction: str, fns) -> dict:
    """The FA4 keyword arguments of the direction's one per-head block-sparse call (``fns``: the backend's
    Fa4Functions): the lists, block size and the list's partial-block mask_mod (band or intervals)."""
    b = static.blocks
    _, _, aux = static.on(keep.mask.device)
    kw = {"block_sparse_tensors": fns.block_sparse(*head_lists(static, keep, direction), block_size=(BLOCK, BLOCK))}
    if b.band is not None:
        kw["mask_mod"] = fns.band_mask(*b.band)
    else:
        kw.update(mask_mod=fns.interval_masks[b.mask(direction)[0]], aux_tensors=aux[direction])
    return kw


def input_reason(phase: str, q: torch.Tensor, keep, dtypes, deterministic: bool) -> str | None:
    """Why ``phase`` ("fwd" / "bwd") of inputs like ``q`` with ``keep`` runs on Triton instead of one per-head
    FA4 block-sparse call, or None; ``dtypes``: what FA4 runs (the backend's Fa4Functions.dtypes). Decided
    from the inputs alone, before the list's static part is built; the list's own reason is
    ``SparseStatic.reason``."""
    d = q.shape[-1]
    if q.dtype not in dtypes:
        return f"{q.dtype}: FA4 runs float16 / bfloat16"
    if d % 8 or d > 256:
        return f"head_dim {d}: FA4 runs multiples of 8 up to 256"
    if keep.block % BLOCK:
        return f"keep.block {keep.block}: FA4's block-sparse calls need multiples of {BLOCK}"
    if phase == "bwd" and d > FA4_SPARSE_BWD_MAX_HEAD_DIM:
        return (f"head_dim {d}: FA4's block-sparse backward at {BLOCK} x {BLOCK} blocks runs head_dim <= "
                f"{FA4_SPARSE_BWD_MAX_HEAD_DIM}")
    if phase == "bwd" and deterministic:
        return "deterministic: FA4's sm90 block-sparse backward is not deterministic"
    return None
