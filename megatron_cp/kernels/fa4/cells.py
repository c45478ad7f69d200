"""A list's partial 128 x 128 blocks in the forms a block-sparse call's mask_mod reads where per-row key intervals
do not fit (rows keeping more than ``calls.MASK_INTERVALS`` intervals over their partial blocks: fine-grained
patterns such as a strided mask of 16-token blocks):

- a periodic band (``periodic_band``): the cells with ``c - r <= dhi`` whose group offset
  ``r // group - c // group`` is below ``local`` or a multiple of ``period`` - the Sparse Transformer's strided
  pattern at any group size. Arithmetic on the cell's coordinates, no memory read: a bitmap's read a cell cost
  FA4 a quarter of its forward rate against FlexAttention's arithmetic mask_mod on FA4's kernels (docs/measurements.md);
- a bitmap (``bitmap_words``): one bit a cell, a word per 32 keys of a row, whatever the pattern.

Both are found from each row's kept key intervals (sorted by row, then key) and the list's partial-block map, and
are exact on every partial block: a list's periodic band is taken only where it reproduces every partial cell."""

from __future__ import annotations

import math

import numpy as np

BLOCK = 128  # FA4's block-sparse granularity (calls.BLOCK)
PERIODIC_CHECK_MAX_CELLS = 1 << 25  # partial-block cells compared densely when looking for a periodic band


def _pieces(row, lo, hi, partial: np.ndarray):
    """Each interval's pieces on the partial blocks of its q-block: (the partial block's position among
    ``np.flatnonzero(partial)``, its key block, the row, the piece's keys [a, e))."""
    nb = partial.shape[1]
    where = np.flatnonzero(partial.ravel())
    m = row // BLOCK
    first = np.searchsorted(where, m * nb + lo // BLOCK)
    count = np.searchsorted(where, m * nb + (hi - 1) // BLOCK, side="right") - first
    which = np.repeat(np.arange(len(row)), count)
    p = np.repeat(first, count) + np.arange(len(which)) - np.repeat(np.cumsum(count) - count, count)
    j = where[p] % nb
    return p, j, row[which], np.maximum(lo[which], j * BLOCK), np.minimum(hi[which], (j + 1) * BLOCK)


def bitmap_words(row, lo, hi, partial: np.ndarray, seqlen_q: int, max_bytes: int) -> np.ndarray | None:
    """The bitmap form (``calls.BlockLists``): int32 [sq, 4 N], bit ``c & 31`` of word ``[r, c >> 5]`` set iff row r
    keeps key c of a partial block of its q-block; None above ``max_bytes``."""
    nb = partial.shape[1]
    words = nb * (BLOCK // 32)
    if seqlen_q * words * 4 > max_bytes:
        return None
    _, j, r, p_lo, p_hi = _pieces(row, lo, hi, partial)
    # each piece's bits in the block's words: [lo, hi) clipped to the word's 32 keys
    w = j[:, None] * (BLOCK // 32) + np.arange(BLOCK // 32)[None, :]
    a = np.clip(p_lo[:, None] - 32 * w, 0, 32)
    e = np.clip(p_hi[:, None] - 32 * w, 0, 32)
    bits = (np.left_shift(np.int64(1), e) - np.left_shift(np.int64(1), a)).astype(np.float64)
    # pieces are disjoint: their bits' sum is their union (float64 sums of ints below 2^53 are exact)
    flat = np.bincount((r[:, None] * words + w).ravel(), weights=bits.ravel(), minlength=seqlen_q * words)
    return flat.astype(np.uint32).view(np.int32).reshape(seqlen_q, words)


def bitmap_by_key(bits: np.ndarray, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """The bitmap ``bits`` (int32 [sq, 4 N], bit c & 31 of word [r, c >> 5]) by key: int32 [sk, 4 M], bit r & 31 of
    word [c, r >> 5]; transposed a 128-row block at a time (a few MB of bits at once)."""
    m_blocks = -(-seqlen_q // BLOCK)
    out = np.zeros((seqlen_k, 4 * m_blocks), dtype=np.int32)
    for m in range(m_blocks):
        rows = np.zeros((BLOCK, bits.shape[1]), dtype=np.int32)
        part = bits[m * BLOCK:(m + 1) * BLOCK]
        rows[:len(part)] = part
        cells = np.unpackbits(rows.view(np.uint8), axis=1, bitorder="little")[:, :seqlen_k]  # [128, sk]
        out[:, 4 * m:4 * m + 4] = np.ascontiguousarray(np.packbits(cells.T, axis=1, bitorder="little")).view(np.int32)
    return out


def grid(bounds, seqlen_q: int, seqlen_k: int) -> int:
    """The coarsest group size every segment boundary (``bounds``: ints) falls on, the sequence ends aside (a last
    group may be short); 0 when there is none."""
    g = 0
    for x in bounds:
        if x not in (seqlen_q, seqlen_k):
            g = math.gcd(g, int(x))
    return g


def periodic_keep(r: np.ndarray, c: np.ndarray, dhi: int, group: int, period: int, local: int) -> np.ndarray:
    """The periodic band's cells [len(r), len(c)] (``c - r <= dhi <= 0``, so the group offset is never negative)."""
    off = (r // group)[:, None] - (c // group)[None, :]
    return (c[None, :] - r[:, None] <= dhi) & ((off < local) | (off % period == 0))


def periodic_cells(r, c, dhi: int, group: int, period: int, local: int, const=int):
    """``periodic_keep``'s cells as the band's mask_mod computes them on FA4 (``backend``): operators only, so one
    expression serves CuTe DSL values there (``const`` wraps the constants) and integer arrays in the tests. Where
    ``group`` and ``period`` are powers of two no division: the offset's residue modulo the period is the XOR of the
    row's and key's bits from log2(group) to log2(group * period) - in FA4's backward (rows varying across a key's
    column) a quarter faster than the two ANDs and a subtraction that give the offset itself, used only where
    ``local`` > 1 needs it."""
    upper = c - r <= const(dhi)
    if not group & (group - 1) and not period & (period - 1):
        every = ((r ^ c) & const(group * period - group)) == const(0)
        if local <= 1:  # offset 0 is a multiple of the period
            return upper & every
        return upper & (((r & const(-group)) - (c & const(-group)) < const(group * local)) | every)
    off = r // const(group) - c // const(group)  # >= 0 where upper holds (dhi <= 0)
    every = off % const(period) == const(0)
    if local <= 1:
        return upper & every
    return upper & ((off < const(local)) | every)


def periodic_band(row, lo, hi, partial: np.ndarray, seqlen_q: int, seqlen_k: int,
                  group: int) -> tuple[int, int, int] | None:
    """(dhi, period, local) when every partial block's kept cells are exactly ``periodic_keep``'s at ``group``, else
    None: the kept cells' largest ``c - r`` is ``dhi`` (at most 0: the form is causal), and within ``c - r <= dhi``
    each group offset keeps all its cells or none, the kept offsets being those below ``local`` and the multiples of
    ``period``."""
    mb, nb = np.nonzero(partial)
    n = len(mb)
    if group < 1 or not n or n * BLOCK * BLOCK > PERIODIC_CHECK_MAX_CELLS:
        return None
    p, j, r, a, e = _pieces(row, lo, hi, partial)
    # the partial blocks' cells, [n, 128, 128]: +1 where a row's piece starts, -1 past its end, summed along keys
    edge = np.zeros((n, BLOCK, BLOCK + 1), dtype=np.int8)
    rr = r - mb[p] * BLOCK
    np.add.at(edge, (p, rr, a - j * BLOCK), 1)
    np.add.at(edge, (p, rr, e - j * BLOCK), -1)
    cells = np.cumsum(edge, axis=2, dtype=np.int8)[:, :, :BLOCK] > 0
    rows = (mb[:, None] * BLOCK + np.arange(BLOCK)[None, :]).astype(np.int32)  # [n, 128]
    keys = (nb[:, None] * BLOCK + np.arange(BLOCK)[None, :]).astype(np.int32)
    d = keys[:, None, :] - rows[:, :, None]
    if not cells.any():
        return None
    dhi = int(d[cells].max())
    if dhi > 0:
        return None
    inside = (d <= dhi) & (rows < seqlen_q)[:, :, None] & (keys < seqlen_k)[:, None, :]
    off = ((rows // group)[:, :, None] - (keys // group)[:, None, :])[inside]
    kept = cells[inside]
    total = np.bincount(off)
    held = np.bincount(off, weights=kept, minlength=len(total))
    seen = total > 0
    all_kept, none_kept = seen & (held == total), seen & (held == 0)
    if (seen & ~all_kept & ~none_kept).any():
        return None
    gaps = np.flatnonzero(none_kept)
    if not len(gaps):
        return None  # no offset dropped: not a pattern of groups
    local = int(gaps[0])
    later = np.flatnonzero(all_kept[local:])
    period = int(local + later[0]) if len(later) else len(total)
    o = np.arange(len(total))
    if period < 1 or not np.array_equal(((o < local) | (o % period == 0))[seen], all_kept[seen]):
        return None
    return dhi, period, local
