"""Builders for common attention masks, each returning an ``AttnMask`` made of few slices.

Every builder emits the smallest handful of ``AttnSlice`` objects that its pattern allows: O(1) for
dense patterns (full, causal, sliding window, prefix-LM, streaming), O(documents) for packed
sequences and O(blocks) for block patterns. ``general.py`` holds the two general builders: a block table
(``from_block_table``) and ``from_mask_mod``, the escape hatch for anything else (it evaluates a
FlexAttention-style predicate and recovers the slices exactly); ``registry.py`` lists every builder with the
kind of its arguments.

All builders share one geometric fact (see ``geometry``): on each query row a slice keeps one
interval of keys whose two ends move with slope 0 or 1 as the row advances, and the four slice kinds
are exactly the four slope pairs::

    (lo slope, hi slope)   (0, 0) full   (0, 1) causal   (1, 0) inv_causal   (1, 1) bi_causal

so a row trapezoid converts into exactly one slice (``trapezoids.trapezoid``), and a band ``i - left <= j <= i +
right`` clipped to a key range is at most three such trapezoids (``trapezoids.band``).

Pictures in the docstrings: rows are queries (top = 0), columns are keys, ``#`` kept, ``.`` masked.
"""

from __future__ import annotations

import numpy as np

from . import geometry
from .slices import AttnMask, AttnSlice
from .trapezoids import as_numpy, band, causal_slices, check_int

__all__ = ["full", "causal", "sliding_window", "varlen", "block_causal", "prefix_lm", "strided", "global_local", "star",
           "streaming", "streaming_within", "block_diagonal"]

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
    sq = check_int("seqlen_q", seqlen_q, 1)
    sk = sq if seqlen_k is None else check_int("seqlen_k", seqlen_k, 1)
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
    sq = check_int("seqlen_q", seqlen_q, 1)
    sk = sq if seqlen_k is None else check_int("seqlen_k", seqlen_k, 1)
    return AttnMask(causal_slices(0, sq, 0, sk), sq, sk)


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
    n = check_int("seqlen", seqlen, 1)
    left = check_int("left", left, 0)
    right = check_int("right", right, 0)
    return AttnMask(band(0, n, 0, n, left, right), n, n)


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
    n = check_int("seqlen", seqlen, 1)
    p = check_int("prefix", prefix, 0, n)
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
    n = check_int("seqlen", seqlen, 1)
    s = min(check_int("sink", sink, 0), n)
    w = check_int("window", window, 1)
    # keys [0, s): causal among the sink rows, full below them; keys [s, n): the window band
    slices = band(0, n, 0, s, None, 0) + band(0, n, s, n, w - 1, 0)
    return AttnMask(slices, n, n)


# --------------------------------------------------------------------------------------------------
# packed documents


def _cu_seqlens(cu_seqlens) -> np.ndarray:
    cu = as_numpy(cu_seqlens)
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
        left = None if window[0] is None else check_int("window left", window[0], 0)
        right = None if window[1] is None else check_int("window right", window[1], 0)
        return left, (0 if causal else right)
    if not causal:
        raise ValueError(
            f"window={window!r}: an int window (left reach) needs causal=True; "
            "pass window=(left, right) for a non-causal window"
        )
    return check_int("window", window, 0), 0


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
        slices = [sl for s, e in zip(starts, ends) for sl in band(s, e, s, e, left, right)]
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
    n = check_int("seqlen", seqlen, 1)
    bs = check_int("block", block, 1)
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
    n = check_int("seqlen", seqlen, 1)
    bs = check_int("block", block, 1)
    st = check_int("stride", stride, 1)
    loc = check_int("local_blocks", local_blocks, 0)
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
    n = check_int("seqlen", seqlen, 1)
    bs = check_int("block", block, 1)
    ng = check_int("n_global", n_global, 0)
    w = check_int("window_blocks", window_blocks, 0)
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
    n = check_int("seqlen", seqlen, 1)
    a = check_int("anchor", anchor, 1, n)
    bs = a if block is None else check_int("block", block, 1)
    # the anchor plus the first block is one causal triangle: row i keeps [0, a) + [a, i] = [0, i]
    e1 = min(a + bs, n)
    slices = [AttnSlice((0, e1), (0, e1), "causal")]
    if e1 < n:
        slices.append(AttnSlice((e1, n), (0, a), "full"))
    for s in range(e1, n, bs):
        e = min(s + bs, n)
        slices.append(AttnSlice((s, e), (s, e), "causal"))
    return AttnMask(slices, n, n)


# --------------------------------------------------------------------------------------------------
# masks made from masks


def streaming_within(mask: AttnMask, sink: int, window: int) -> AttnMask:
    """The streaming part of ``mask`` (DuoAttention's streaming heads): of the cells ``mask`` keeps, each row
    keeps its ``sink`` first keys (attention sinks) and the keys within ``window`` of the query
    (``i - window < j``). "First" is per interval of the row: for causal masks the sequence's first tokens,
    for packed documents each document's. ``streaming_within(causal(n), s, w) == streaming(n, s, w)``."""
    if not isinstance(mask, AttnMask):
        raise ValueError(f"streaming_within needs an AttnMask, got {type(mask).__name__}")
    s = check_int("sink", sink, 0)
    w = check_int("window", window, 1)
    n = mask.seqlen_q
    traps = mask.traps
    recent = np.array([[0, n, 1 - w, 1, mask.seqlen_k, 0]], dtype=np.int64)  # keys i - w < j
    parts = [geometry.intersect(traps, recent)]
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
