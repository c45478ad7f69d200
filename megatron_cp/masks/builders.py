"""Builders for common attention masks, each returning an ``AttnMask`` made of few slices.

Every builder emits the smallest handful of ``AttnSlice`` objects that its pattern allows: O(1) for
dense patterns (full, causal, sliding window, prefix-LM, streaming), O(documents) for packed
sequences and O(blocks) for block patterns. ``from_mask_mod`` is the escape hatch for anything
else: it evaluates a FlexAttention-style predicate and recovers the slices exactly.

All builders share one geometric fact (see ``geometry``): on each query row a slice keeps one
interval of keys whose two ends move with slope 0 or 1 as the row advances, and the four slice kinds
are exactly the four slope pairs::

    (lo slope, hi slope)   (0, 0) full   (0, 1) causal   (1, 0) inv_causal   (1, 1) bi_causal

so a row trapezoid converts into exactly one slice (``_trap``), and a band ``i - left <= j <= i +
right`` clipped to a key range is at most three such trapezoids (``_band``).

Pictures in the docstrings: rows are queries (top = 0), columns are keys, ``#`` kept, ``.`` masked.
"""

from __future__ import annotations

from enum import IntEnum

import operator

import numpy as np

from . import geometry
from .slices import AttnMask, AttnSlice

__all__ = [
    "Block",
    "full",
    "causal",
    "sliding_window",
    "varlen",
    "block_causal",
    "prefix_lm",
    "strided",
    "global_local",
    "star",
    "streaming",
    "from_block_table",
    "from_mask_mod",
]

class Block(IntEnum):
    """Entries of a block table (``from_block_table``): what a block keeps. Not the cell kinds of
    slices and tiles (``megatron_cp.kinds.Kind``), which code a whole trapezoid's shape."""

    EMPTY = 0
    FULL = 1
    CAUSAL = 2


EMPTY, FULL, CAUSAL = Block.EMPTY, Block.FULL, Block.CAUSAL  # this module's own shorthand

_SLOPES_TO_KIND = {(0, 0): "full", (0, 1): "causal", (1, 0): "inv_causal", (1, 1): "bi_causal"}


# --------------------------------------------------------------------------------------------------
# argument checks


def _int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as a Python int in ``[lo, hi]``; ValueError naming ``name`` and ``value`` otherwise."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        v = operator.index(value)  # ints, numpy ints, 0-d integer tensors; rejects floats
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return int(v)


def _to_numpy(x) -> np.ndarray:
    """A list, numpy array or torch tensor (any device) as a numpy array."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu().numpy()
    return np.asarray(x)


# --------------------------------------------------------------------------------------------------
# geometry helpers


def _trap(q0: int, q1: int, lo: int, hi: int, lo_s: int, hi_s: int) -> AttnSlice:
    """The slice keeping, on row ``q0 + t`` (t in [0, q1 - q0)), keys ``[lo + lo_s*t, hi + hi_s*t]``.

    ``lo``/``hi`` are the inclusive ends on the first row; every row must be non-empty. The kind
    follows from the slopes; the key range is chosen so the kind's formula gives exactly these cells:
    the lower line starts at ``k0`` on the first row, the upper line ends at ``k1 - 1`` on the last.
    """
    n = q1 - q0
    if n == 1:
        lo_s = hi_s = 0  # one row: all kinds coincide, use the simplest
    assert n >= 1 and lo <= hi and lo + lo_s * (n - 1) <= hi + hi_s * (n - 1), (q0, q1, lo, hi, lo_s, hi_s)
    return AttnSlice((q0, q1), (lo, hi + hi_s * (n - 1) + 1), _SLOPES_TO_KIND[(lo_s, hi_s)])


def _causal_slice(q0: int, q1: int, k0: int, k1: int) -> list[AttnSlice]:
    """A bottom-right aligned causal slice, with its leading rows that keep no key trimmed off."""
    sq, sk = q1 - q0, k1 - k0
    if sq > sk:  # local rows i < sq - sk keep nothing (j <= i + sk - sq < 0)
        q0 += sq - sk
    return [AttnSlice((q0, q1), (k0, k1), "causal")]


def _band(q0: int, q1: int, k0: int, k1: int, left: int | None, right: int | None) -> list[AttnSlice]:
    """Rows ``[q0, q1)`` x keys ``[k0, k1)`` keeping ``i - left <= j <= i + right`` (global indices).

    ``None`` means unbounded on that side. Needs ``left + right >= 0``. On row ``i`` the kept keys
    are ``[max(k0, i - left), min(k1 - 1, i + right)]``: the lower end has slope 0 until row
    ``k0 + left`` and slope 1 after, the upper end slope 1 until row ``k1 - right`` and slope 0
    after. Cutting the non-empty rows at those two rows gives at most three trapezoids.
    """
    if q0 >= q1 or k0 >= k1:
        return []
    r0 = q0 if right is None else max(q0, k0 - right)  # rows whose upper end reaches k0
    r1 = q1 if left is None else min(q1, k1 + left)  # rows whose lower end stays below k1
    if r0 >= r1:
        return []
    cuts = {r0, r1}
    if left is not None:
        cuts.add(k0 + left)
    if right is not None:
        cuts.add(k1 - right)
    cuts = sorted(c for c in cuts if r0 <= c <= r1)
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        lo_s = int(left is not None and a >= k0 + left)
        hi_s = int(right is not None and a < k1 - right)
        lo = k0 if left is None else max(k0, a - left)
        hi = k1 - 1 if right is None else min(k1 - 1, a + right)
        out.append(_trap(a, b, lo, hi, lo_s, hi_s))
    return out


# --------------------------------------------------------------------------------------------------
# dense patterns


def full(seqlen_q: int, seqlen_k: int | None = None) -> AttnMask:
    """Every query attends every key. One slice.

    Rule: keep (i, j) for all i in [0, seqlen_q), j in [0, seqlen_k); ``seqlen_k`` defaults to
    ``seqlen_q``. ``full(4, 8)``::

        ########
        ########
        ########
        ########
    """
    sq = _int("seqlen_q", seqlen_q, 1)
    sk = sq if seqlen_k is None else _int("seqlen_k", seqlen_k, 1)
    return AttnMask([AttnSlice((0, sq), (0, sk), "full")], sq, sk)


def causal(seqlen_q: int, seqlen_k: int | None = None) -> AttnMask:
    """Causal mask, bottom-right aligned like the ``causal`` slice kind. One slice.

    Rule: keep (i, j) iff ``j <= i + (seqlen_k - seqlen_q)``; ``seqlen_k`` defaults to ``seqlen_q``.
    With more keys than queries (decode with a cache) the last query sees every key; with fewer,
    the first ``seqlen_q - seqlen_k`` rows keep nothing (and are left out of the slice).
    ``causal(4, 8)`` and ``causal(8, 4)``::

        #####...        ....
        ######..        ....
        #######.        ....
        ########        ....
                        #...
                        ##..
                        ###.
                        ####
    """
    sq = _int("seqlen_q", seqlen_q, 1)
    sk = sq if seqlen_k is None else _int("seqlen_k", seqlen_k, 1)
    return AttnMask(_causal_slice(0, sq, 0, sk), sq, sk)


def sliding_window(seqlen: int, left: int, right: int = 0) -> AttnMask:
    """A band around the diagonal: at most three slices.

    Rule: keep (i, j) iff ``i - left <= j <= i + right`` and ``0 <= j < seqlen``. ``left = right =
    0`` keeps the diagonal only; windows longer than the sequence are clipped. Built from the band's
    clipped top (causal: lower end pinned at key 0), its middle (bi_causal) and its clipped bottom
    (inv_causal: upper end pinned at the last key), whichever exist. ``sliding_window(8, 2, 1)``::

        ##......
        ###.....
        ####....
        .####...
        ..####..
        ...####.
        ....####
        .....###
    """
    n = _int("seqlen", seqlen, 1)
    left = _int("left", left, 0)
    right = _int("right", right, 0)
    return AttnMask(_band(0, n, 0, n, left, right), n, n)


def prefix_lm(seqlen: int, prefix: int) -> AttnMask:
    """Prefix-LM: a bidirectional prefix followed by a causal continuation. At most two slices.

    Rule: rows ``i < prefix`` keep ``j < prefix``; rows ``i >= prefix`` keep ``j <= i``.
    ``0 <= prefix <= seqlen``; ``prefix = 0`` is plain causal, ``prefix = seqlen`` plain full.
    ``prefix_lm(8, 3)``::

        ###.....
        ###.....
        ###.....
        ####....
        #####...
        ######..
        #######.
        ########
    """
    n = _int("seqlen", seqlen, 1)
    p = _int("prefix", prefix, 0, n)
    slices = []
    if p > 0:
        slices.append(AttnSlice((0, p), (0, p), "full"))
    if p < n:  # bottom-right aligned over keys [0, n): row i keeps j <= i
        slices.append(AttnSlice((p, n), (0, n), "causal"))
    return AttnMask(slices, n, n)


def streaming(seqlen: int, sink: int, window: int) -> AttnMask:
    """StreamingLLM: causal attention to a few sink tokens plus a recent window. At most four slices.

    Rule: keep (i, j) iff ``j <= i`` and (``j < sink`` or ``j > i - window``). ``sink >= 0``,
    ``window >= 1`` (the window includes the query itself). ``streaming(8, 1, 3)``::

        #.......
        ##......
        ###.....
        ####....
        #.###...
        #..###..
        #...###.
        #....###
    """
    n = _int("seqlen", seqlen, 1)
    s = min(_int("sink", sink, 0), n)
    w = _int("window", window, 1)
    # keys [0, s): causal among the sink rows, full below them; keys [s, n): the window band
    slices = _band(0, n, 0, s, None, 0) + _band(0, n, s, n, w - 1, 0)
    return AttnMask(slices, n, n)


# --------------------------------------------------------------------------------------------------
# packed documents


def _cu_seqlens(cu_seqlens) -> np.ndarray:
    cu = _to_numpy(cu_seqlens)
    if cu.ndim != 1:
        raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu.shape)}")
    if len(cu) < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries (0 and the total length), got {cu.tolist()}")
    if not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must hold integers, got dtype {cu.dtype}")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {int(cu[0])}")
    bad = np.nonzero(np.diff(cu) <= 0)[0]
    if len(bad):
        k = int(bad[0]) + 1
        raise ValueError(
            f"cu_seqlens must be strictly increasing, but cu_seqlens[{k}]={int(cu[k])} "
            f"<= cu_seqlens[{k - 1}]={int(cu[k - 1])}"
        )
    return cu


def _window(window, causal: bool) -> tuple[int | None, int | None]:
    """(left, right) reach of a window argument; None = unbounded."""
    if window is None:
        return None, (0 if causal else None)
    if isinstance(window, (tuple, list)):
        if len(window) != 2:
            raise ValueError(f"window must be an int or a (left, right) pair, got {window!r}")
        left = None if window[0] is None else _int("window left", window[0], 0)
        right = None if window[1] is None else _int("window right", window[1], 0)
        return left, (0 if causal else right)
    if not causal:
        raise ValueError(
            f"window={window!r}: an int window (left reach) needs causal=True; "
            "pass window=(left, right) for a non-causal window"
        )
    return _int("window", window, 0), 0


def varlen(cu_seqlens, causal: bool = True, window=None) -> AttnMask:
    """Packed documents: each token attends only within its own document. O(documents) slices.

    ``cu_seqlens``: 1-D int list / numpy array / torch tensor ``[n_docs + 1]``, starting at 0 and
    strictly increasing; document ``d`` is tokens ``[cu[d], cu[d+1])`` and the mask is square with
    side ``cu[-1]``. Rule for (i, j) in the same document (nothing across documents):

    - ``causal=False``: keep all; ``causal=True``: keep ``j <= i``;
    - ``window=w`` (int, causal only): also ``j >= i - w``;
    - ``window=(left, right)``: also ``i - left <= j <= i + right`` (``None`` = unbounded;
      ``right`` is moot when causal).

    One slice per document, three at most with a window. ``varlen([0, 3, 4, 8])`` (causal)::

        #.......
        ##......
        ###.....
        ...#....
        ....#...
        ....##..
        ....###.
        ....####
    """
    cu = _cu_seqlens(cu_seqlens)
    left, right = _window(window, bool(causal))
    starts, ends = cu[:-1].tolist(), cu[1:].tolist()
    if left is None and right is None:
        slices = [AttnSlice((s, e), (s, e), "full") for s, e in zip(starts, ends)]
    elif left is None and right == 0:
        slices = [AttnSlice((s, e), (s, e), "causal") for s, e in zip(starts, ends)]
    else:
        slices = [sl for s, e in zip(starts, ends) for sl in _band(s, e, s, e, left, right)]
    n = int(cu[-1])
    return AttnMask(slices, n, n)


# --------------------------------------------------------------------------------------------------
# block patterns


def _nblocks(n: int, block: int) -> int:
    return -(-n // block)


def block_causal(seqlen: int, block: int) -> AttnMask:
    """Block-causal: query block ``b`` attends keys of blocks ``0..b`` fully. One slice per block.

    Rule: keep (i, j) iff ``j // block <= i // block`` (``j < seqlen``; the last block may be
    partial). ``block_causal(8, 3)``::

        ###.....
        ###.....
        ###.....
        ######..
        ######..
        ######..
        ########
        ########
    """
    n = _int("seqlen", seqlen, 1)
    bs = _int("block", block, 1)
    slices = []
    for q0 in range(0, n, bs):
        q1 = min(q0 + bs, n)
        slices.append(AttnSlice((q0, q1), (0, q1), "full"))
    return AttnMask(slices, n, n)


def strided(seqlen: int, block: int, stride: int, local_blocks: int = 1) -> AttnMask:
    """Sparse-Transformer strided pattern at block level, causal.

    Query block ``b`` keeps key block ``b' <= b`` iff ``b - b' < local_blocks`` or
    ``(b - b') % stride == 0``. The diagonal block is causal at token level (keep ``j <= i``), the
    other kept blocks are full. Horizontally adjacent kept blocks of a block row are one slice (the
    run ending at the diagonal is one causal slice), so a block row costs ``1 + ~b / stride``
    slices. ``strided(8, 2, 3, local_blocks=1)`` (block rows 0..3; block 3 keeps blocks 0 and 3)::

        #.......
        ##......
        ..#.....
        ..##....
        ....#...
        ....##..
        ##....#.
        ##....##
    """
    n = _int("seqlen", seqlen, 1)
    bs = _int("block", block, 1)
    st = _int("stride", stride, 1)
    loc = _int("local_blocks", local_blocks, 0)
    slices = []
    for b in range(_nblocks(n, bs)):
        q0, q1 = b * bs, min((b + 1) * bs, n)
        kb = np.arange(b + 1)
        d = b - kb
        keep = (d < loc) | (d % st == 0)  # always true on the diagonal (d = 0)
        # runs of kept key blocks: starts where keep rises, ends where it falls
        edges = np.diff(np.concatenate([[False], keep, [False]]).astype(np.int8))
        run_s = np.nonzero(edges == 1)[0]
        run_e = np.nonzero(edges == -1)[0]  # exclusive block index
        for s, e in zip(run_s.tolist(), run_e.tolist()):
            if e == b + 1:  # the run ending at the diagonal: causal slice, row i keeps j <= i
                slices.append(AttnSlice((q0, q1), (s * bs, q1), "causal"))
            else:
                slices.append(AttnSlice((q0, q1), (s * bs, e * bs), "full"))
    return AttnMask(slices, n, n)


def global_local(seqlen: int, block: int, n_global: int, window_blocks: int, causal: bool = False) -> AttnMask:
    """BigBird / Longformer-style global + local attention at block level.

    With ``G = min(n_global * block, seqlen)`` global tokens (the first ``n_global`` blocks): rows
    ``i < G`` keep every key, every row keeps keys ``j < G``, and a row of block ``b >= n_global``
    keeps keys of blocks ``b'`` with ``|b - b'| <= window_blocks``. With ``causal=True`` only
    ``j <= i`` of all that is kept. Two slices for the global rows/columns plus one per non-global
    block. ``global_local(8, 2, 1, 1)`` and the same with ``causal=True``::

        ########        #.......
        ########        ##......
        ######..        ###.....
        ######..        ####....
        ########        #####...
        ########        ######..
        ##..####        ##..###.
        ##..####        ##..####

    (left: block 1 keeps blocks 0..2, block 2 keeps 1..3, block 3 keeps 2..3, each plus the global
    block 0.)
    """
    n = _int("seqlen", seqlen, 1)
    bs = _int("block", block, 1)
    ng = _int("n_global", n_global, 0)
    w = _int("window_blocks", window_blocks, 0)
    nb = _nblocks(n, bs)
    ng = min(ng, nb)
    g = min(ng * bs, n)
    slices = []
    if g > 0:
        if causal:
            slices.append(AttnSlice((0, g), (0, g), "causal"))
        else:
            slices.append(AttnSlice((0, g), (0, n), "full"))
        if g < n:
            slices.append(AttnSlice((g, n), (0, g), "full"))
    for b in range(ng, nb):
        q0, q1 = b * bs, min((b + 1) * bs, n)
        k0 = max(b - w, ng) * bs  # keys below g are already covered by the global column
        if causal:  # blocks b-w..b-1 full and the diagonal causal = one causal slice ending at q1
            slices.append(AttnSlice((q0, q1), (k0, q1), "causal"))
        else:
            slices.append(AttnSlice((q0, q1), (k0, min((b + w + 1) * bs, n)), "full"))
    return AttnMask(slices, n, n)


def star(seqlen: int, anchor: int, block: int | None = None) -> AttnMask:
    """Star Attention, context phase: an anchor block seen by every block, else block-local causal.

    Tokens ``[0, anchor)`` attend causally among themselves; the rest is cut into blocks of
    ``block`` tokens (default ``anchor``; the last may be partial), and a row ``i`` of the block
    starting at ``s`` keeps ``j < anchor`` plus ``s <= j <= i``. ``1 <= anchor <= seqlen``.
    Slices: one causal slice for the anchor and the first block together, one full slice for the
    anchor columns below them, one causal slice per further block. ``star(8, 2, 3)``::

        #.......
        ##......
        ###.....
        ####....
        #####...
        ##...#..
        ##...##.
        ##...###
    """
    n = _int("seqlen", seqlen, 1)
    a = _int("anchor", anchor, 1, n)
    bs = a if block is None else _int("block", block, 1)
    # the anchor plus the first block is one causal triangle: row i keeps [0, a) + [a, i] = [0, i]
    e1 = min(a + bs, n)
    slices = [AttnSlice((0, e1), (0, e1), "causal")]
    if e1 < n:
        slices.append(AttnSlice((e1, n), (0, a), "full"))
    for s in range(e1, n, bs):
        e = min(s + bs, n)
        slices.append(AttnSlice((s, e), (s, e), "causal"))
    return AttnMask(slices, n, n)


def from_block_table(table, block_size: int, seqlen_q: int | None = None, seqlen_k: int | None = None) -> AttnMask:
    """A mask given block by block: ``table[qb, kb]`` in {EMPTY=0, FULL=1, CAUSAL=2}.

    ``table``: 2-D int (or bool) list / numpy array / torch tensor ``[nqb, nkb]``. Block ``(qb, kb)``
    covers rows ``[qb*block_size, (qb+1)*block_size)`` and keys ``[kb*block_size, (kb+1)*block_size)``,
    truncated to ``seqlen_q`` / ``seqlen_k`` (default ``nqb*block_size`` / ``nkb*block_size``; a
    smaller value must still reach into the last block). FULL keeps the whole block; CAUSAL keeps
    ``j <= i + (sk - sq)`` in the block's local indices (bottom-right aligned on a truncated edge
    block). Horizontally adjacent FULL blocks become one slice, and a FULL run directly left of a
    CAUSAL block joins its causal slice. Table ``[[2, 0, 0], [1, 2, 0], [1, 0, 2]]``, block 3,
    seqlen 8 (the last block row and column hold 2 tokens)::

        #.......
        ##......
        ###.....
        ####....
        #####...
        ######..
        ###...#.
        ###...##
    """
    t = _to_numpy(table)
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"table must be a non-empty 2-D array [nqb, nkb], got shape {tuple(t.shape)}")
    if t.dtype == np.bool_:
        t = t.astype(np.int64)
    if not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"table must hold integers EMPTY=0, FULL=1, CAUSAL=2, got dtype {t.dtype}")
    bad = np.argwhere((t != EMPTY) & (t != FULL) & (t != CAUSAL))
    if len(bad):
        qb, kb = (int(x) for x in bad[0])
        raise ValueError(f"table[{qb}, {kb}] = {int(t[qb, kb])} is not EMPTY=0, FULL=1 or CAUSAL=2")
    bs = _int("block_size", block_size, 1)
    nqb, nkb = t.shape
    sq = nqb * bs if seqlen_q is None else _int("seqlen_q", seqlen_q, (nqb - 1) * bs + 1, nqb * bs)
    sk = nkb * bs if seqlen_k is None else _int("seqlen_k", seqlen_k, (nkb - 1) * bs + 1, nkb * bs)

    # FULL runs per block row, found at once: rise / fall of the FULL indicator along each row
    isfull = np.zeros((nqb, nkb + 2), dtype=np.int8)
    isfull[:, 1:-1] = t == FULL
    edges = np.diff(isfull, axis=1)
    rs, cs = np.nonzero(edges == 1)
    _, ce = np.nonzero(edges == -1)  # same row order as the starts, exclusive end block
    runs = {(int(r), int(e)): int(s) for r, s, e in zip(rs, cs, ce)}  # (row, end block) -> start block

    slices = []
    for qb, kb in np.argwhere(t == CAUSAL).tolist():
        q0, q1 = qb * bs, min((qb + 1) * bs, sq)
        k0, k1 = kb * bs, min((kb + 1) * bs, sk)
        s = runs.get((qb, kb))
        # merging a FULL run [s, kb) into the causal slice keeps it exact iff the causal block's
        # first row keeps local key -1, i.e. (k1 - k0) - (q1 - q0) >= -1
        if s is not None and (k1 - k0) - (q1 - q0) >= -1:
            del runs[(qb, kb)]
            slices.append(AttnSlice((q0, q1), (s * bs, k1), "causal"))
        else:
            slices += _causal_slice(q0, q1, k0, k1)
    for (qb, e), s in runs.items():
        slices.append(AttnSlice((qb * bs, min((qb + 1) * bs, sq)), (s * bs, min(e * bs, sk)), "full"))
    slices.sort(key=lambda x: (x.q_range, x.k_range))
    return AttnMask(slices, sq, sk)


# --------------------------------------------------------------------------------------------------
# arbitrary predicates


class _Open:
    """A trapezoid being grown row by row in ``from_mask_mod``."""

    __slots__ = ("q0", "rows", "lo", "hi", "lo_s", "hi_s", "last_lo", "last_hi")

    def __init__(self, q0, lo, hi):
        self.q0, self.rows, self.lo, self.hi = q0, 1, lo, hi
        self.lo_s = self.hi_s = None  # fixed by the second row
        self.last_lo, self.last_hi = lo, hi

    def slice(self) -> AttnSlice:
        return _trap(self.q0, self.q0 + self.rows, self.lo, self.hi, self.lo_s or 0, self.hi_s or 0)


def from_mask_mod(mask_mod, seqlen_q: int, seqlen_k: int | None = None, block: int = 128) -> AttnMask:
    """Exact slices of a FlexAttention-style predicate ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    ``mask_mod`` is called with torch tensors: ``b = h = torch.tensor(0)``, ``q_idx`` int64 ``[n, 1]``
    (one block of at most ``block`` rows), ``kv_idx`` int64 ``[1, seqlen_k]``; it returns a bool
    tensor broadcastable to ``[n, seqlen_k]`` (any device). The predicate must not depend on
    ``b``/``h`` (one row per block is evaluated again at ``b = h = 1``: a difference raises). Cost: ``seqlen_q * seqlen_k`` predicate evaluations (use a builder where one
    exists for long sequences), memory ``O(block * seqlen_k)``.

    Recovery, exact for any predicate: each row's kept keys split into maximal runs ``[lo, hi]``;
    a run continues the trapezoid of the previous row's run when its ends moved by 0 or 1 with the
    same slopes as before (the slopes are fixed by a trapezoid's second row), else it starts a new
    one. Trapezoids grow across row blocks, so the result does not depend on ``block``: fully kept
    or empty key blocks cost nothing extra, a causal predicate gives one slice, a sliding window
    three, a document mask one per document, and a row with several runs feeds several trapezoids.
    Each trapezoid becomes one slice of the kind of its slopes ((0,0) full, (0,1) causal,
    (1,0) inv_causal, (1,1) bi_causal). The mask ``(q*7 + kv*3) % 5 < 2`` on 8x8::

        #.#..#.#
        .#.#..#.
        ..#.#..#
        #..#.#..
        .#..#.#.
        #.#..#.#
        .#.#..#.
        ..#.#..#

    (six slices: each diagonal stripe is one bi_causal slice.)
    """
    import torch  # only this builder needs torch

    if not callable(mask_mod):
        raise ValueError(f"mask_mod must be callable, got {mask_mod!r}")
    sq = _int("seqlen_q", seqlen_q, 1)
    sk = sq if seqlen_k is None else _int("seqlen_k", seqlen_k, 1)
    bs = _int("block", block, 1)

    zero, one = torch.tensor(0), torch.tensor(1)
    kv_idx = torch.arange(sk).view(1, sk)
    done: list[AttnSlice] = []
    open_: dict[int, _Open] = {}  # start key of the previous row's run -> its trapezoid
    for r0 in range(0, sq, bs):
        r1 = min(r0 + bs, sq)
        m = mask_mod(zero, zero, torch.arange(r0, r1).view(-1, 1), kv_idx)
        m = torch.as_tensor(m)
        if m.dtype != torch.bool:
            raise ValueError(f"mask_mod must return a bool tensor, got dtype {m.dtype}")
        try:
            m = torch.broadcast_to(m, (r1 - r0, sk))
        except RuntimeError:
            raise ValueError(
                f"mask_mod returned shape {tuple(m.shape)}, not broadcastable to {(r1 - r0, sk)}"
            ) from None
        # one row of each block again at b = h = 1: a predicate that reads b or h would otherwise be taken at
        # b = h = 0 for every head without a word (one extra row per block: a 1 / block share of the cost)
        alt = torch.as_tensor(mask_mod(one, one, torch.arange(r0, r0 + 1).view(1, 1), kv_idx))
        if not torch.equal(torch.broadcast_to(alt, (1, sk)).to(m.device), m[:1]):
            raise ValueError(f"mask_mod depends on b or h (row {r0} differs between b = h = 0 and b = h = 1): a mask "
                             "is the same for every batch entry and head; per-head selections are megatron_cp.sparse's "
                             "(selectors) and head gating's")
        dense = np.zeros((r1 - r0, sk + 2), dtype=np.int8)
        dense[:, 1:-1] = m.cpu().numpy()
        edges = np.diff(dense, axis=1)
        run_r, run_lo = np.nonzero(edges == 1)  # row-major, so the k-th start pairs with the k-th end
        run_hi = np.nonzero(edges == -1)[1] - 1  # inclusive
        row_ptr = np.searchsorted(run_r, np.arange(r1 - r0 + 1))
        run_lo, run_hi = run_lo.tolist(), run_hi.tolist()
        for t in range(r1 - r0):
            row = r0 + t
            nxt: dict[int, _Open] = {}
            for k in range(row_ptr[t], row_ptr[t + 1]):
                lo, hi = run_lo[k], run_hi[k]
                # previous-row runs are separated by a gap, so at most one starts at lo or lo - 1
                tr, dl = open_.pop(lo, None), 0
                if tr is None:
                    tr, dl = open_.pop(lo - 1, None), 1
                if tr is not None:
                    dh = hi - tr.last_hi
                    if dh in (0, 1) and (tr.lo_s is None or (tr.lo_s, tr.hi_s) == (dl, dh)):
                        tr.lo_s, tr.hi_s = dl, dh
                        tr.rows += 1
                        tr.last_lo, tr.last_hi = lo, hi
                        nxt[lo] = tr
                        continue
                    done.append(tr.slice())  # no other run of this row can continue it
                nxt[lo] = _Open(row, lo, hi)
            done.extend(tr.slice() for tr in open_.values())
            open_ = nxt
    done.extend(tr.slice() for tr in open_.values())
    done.sort(key=lambda x: (x.q_range, x.k_range))
    return AttnMask(done, sq, sk)


def streaming_within(mask: AttnMask, sink: int, window: int) -> AttnMask:
    """The streaming part of ``mask`` (DuoAttention's streaming heads): of the cells ``mask`` keeps, each row
    keeps its ``sink`` first keys (attention sinks) and the keys within ``window`` of the query
    (``i - window < j``). "First" is per interval of the row: for causal masks the sequence's first tokens,
    for packed documents each document's. ``streaming_within(causal(n), s, w) == streaming(n, s, w)``."""
    if not isinstance(mask, AttnMask):
        raise ValueError(f"streaming_within needs an AttnMask, got {type(mask).__name__}")
    s = _int("sink", sink, 0)
    w = _int("window", window, 1)
    n = mask.seqlen_q
    traps = mask.traps
    band = np.array([[0, n, 1 - w, 1, mask.seqlen_k, 0]], dtype=np.int64)  # keys i - w < j
    parts = [geometry.intersect(traps, band)]
    if s:
        sinks = traps.copy()
        sinks[:, geometry.HI_A] = traps[:, geometry.LO_A] + s
        sinks[:, geometry.HI_S] = traps[:, geometry.LO_S]
        parts.append(geometry.intersect(traps, sinks))
    both = geometry.union([tuple(t) for p in parts for t in p.tolist()])
    return AttnMask.from_traps(both, mask.seqlen_q, mask.seqlen_k)


def block_diagonal(masks) -> AttnMask:
    """Square masks side by side on the diagonal, nothing across them: mask ``d`` covers tokens
    ``[off_d, off_d + side_d)`` with ``off_d`` the sum of the sides before it. What every data-parallel
    rank's micro-batch becomes when one plan covers the whole DP x CP world (``runtime.gather_global_batch``).
    ``block_diagonal([varlen(a), varlen(b)])`` is ``varlen`` of the two documents lists one after the other."""
    masks = list(masks)
    if not masks:
        raise ValueError("block_diagonal needs at least one mask")
    out, off = [], 0
    for d, m in enumerate(masks):
        if not isinstance(m, AttnMask):
            raise ValueError(f"block_diagonal: mask {d} is a {type(m).__name__}, not an AttnMask")
        if m.seqlen_q != m.seqlen_k:
            raise ValueError(f"block_diagonal: mask {d} is [{m.seqlen_q}, {m.seqlen_k}], not square")
        out.extend(AttnSlice((s.q_range[0] + off, s.q_range[1] + off), (s.k_range[0] + off, s.k_range[1] + off),
                             s.kind) for s in m.slices)
        off += m.seqlen_q
    return AttnMask(out, off)
