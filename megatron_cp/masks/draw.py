"""Pictures of a mask at block resolution (``AttnMask.draw``), and the exact block counts behind them.

``block_cells`` counts, for every block of ``block x block`` cells, how many cells of a set of
trapezoids it holds, exactly and without visiting rows one by one: a trapezoid row keeps one key
interval whose ends move with slope 0 or 1, so the cells of a row range below a key bound are a sum of
clipped linear terms, which has a closed form. Work is proportional to the blocks the mask touches,
which keeps 1M-token masks at a 1024-block side fast.

matplotlib is imported inside ``draw_mask`` only, so the masks package never needs it.
"""

from __future__ import annotations

import numpy as np

from .geometry import HI_A, HI_S, LO_A, LO_S, Q0, Q1


def require_matplotlib(what: str) -> None:
    """Raise an ImportError that says how to get matplotlib when it is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(f"{what} needs matplotlib: pip install matplotlib (or the project's [plot] extra)")


def auto_block(seqlen: int, max_blocks: int = 1024) -> int:
    """The smallest power of two ``b`` with ``ceil(seqlen / b) <= max_blocks``."""
    b = 1
    while -(-int(seqlen) // b) > max_blocks:
        b *= 2
    return b


def _sum_positive(p, q, a, b):
    """sum over integers i in [a, b) of max(0, p + q * i), elementwise; q in {-1, 0, 1} (int64 arrays)."""
    lo = np.where(q > 0, np.maximum(a, 1 - p), a)
    hi = np.where(q < 0, np.minimum(b, p), b)
    n = np.maximum(hi - lo, 0)
    n = np.where((q == 0) & (p <= 0), 0, n)
    # sum_{i=lo}^{lo+n-1} (p + q i) = n p + q n (2 lo + n - 1) / 2
    return n * p + q * (n * (2 * lo + n - 1) // 2)


def _cells_below(t, a, b, c):
    """Cells of trapezoids ``t`` (rows of an int64 [n, 6] array) in rows [a, b) with key < c."""
    la, ls, ha, hs = t[:, LO_A], t[:, LO_S], t[:, HI_A], t[:, HI_S]
    # per row i: max(0, min(c - lo(i), hi(i) - lo(i))); both terms linear, slopes differ by 0 or 1
    p1, q1 = c - la, -ls
    p2, q2 = ha - la, hs - ls
    d = q1 - q2
    same = _sum_positive(np.minimum(p1, p2), q1, a, b)
    # d = +1: term 1 is the smaller for i <= x; d = -1: for i >= x (x integer: p1 - p2 + d x = 0)
    x = -(p1 - p2) * d
    up = np.clip(np.where(d > 0, x + 1, x), a, b)
    first = np.where(d > 0, _sum_positive(p1, q1, a, up), _sum_positive(p2, q2, a, up))
    second = np.where(d > 0, _sum_positive(p2, q2, up, b), _sum_positive(p1, q1, up, b))
    return np.where(d == 0, same, first + second)


def block_cells(traps: np.ndarray, block: int, row_cuts=None):
    """Exact cell counts of (disjoint) trapezoids ``traps`` (int64 [n, 6], ``AttnMask.traps`` form) per
    ``block x block`` block.

    ``row_cuts``: optional sorted row positions where pieces must also end (a plan's chunk bounds), so
    that each piece's rows lie in one chunk. Returns ``(piece_row, row_block, key_block, cells)``, int64
    arrays of one entry per (row piece, key block) with cells > 0; ``piece_row`` is the first row of the
    piece (to look up its owner). Summing ``cells`` over equal ``(row_block, key_block)`` gives the
    block's count.
    """
    t = np.asarray(traps, dtype=np.int64).reshape(-1, 6)
    empty = np.zeros(0, dtype=np.int64)
    if len(t) == 0:
        return empty, empty, empty, empty
    end = int(t[:, Q1].max())
    cuts = np.arange(0, end + block, block, dtype=np.int64)
    if row_cuts is not None:
        cuts = np.union1d(cuts, np.asarray(row_cuts, dtype=np.int64))
    # split each trapezoid's rows at the cuts
    i0 = np.searchsorted(cuts, t[:, Q0], side="right") - 1
    i1 = np.searchsorted(cuts, t[:, Q1] - 1, side="right") - 1
    n = i1 - i0 + 1
    ti = np.repeat(np.arange(len(t)), n)
    ci = np.repeat(i0 - np.cumsum(n) + n, n) + np.arange(n.sum())
    tp = t[ti]
    a = np.maximum(tp[:, Q0], cuts[ci])
    b = np.minimum(tp[:, Q1], cuts[ci + 1])
    # the key blocks each piece touches: lo and hi never decrease with the row
    kb0 = (tp[:, LO_A] + tp[:, LO_S] * a) // block
    kb1 = (tp[:, HI_A] + tp[:, HI_S] * (b - 1) - 1) // block
    m = kb1 - kb0 + 1
    pi = np.repeat(np.arange(len(tp)), m)
    kb = np.repeat(kb0 - np.cumsum(m) + m, m) + np.arange(m.sum())
    aq, bq = a[pi], b[pi]
    # blocks every row of the piece keeps whole (between the last row's lo and the first row's hi) need
    # no formula: the bulk of a large mask
    lo_last = (tp[:, LO_A] + tp[:, LO_S] * (b - 1))[pi]
    hi_first = (tp[:, HI_A] + tp[:, HI_S] * a)[pi]
    inside = (kb * block >= lo_last) & ((kb + 1) * block <= hi_first)
    cells = (bq - aq) * block
    e = np.nonzero(~inside)[0]
    tq, ae, be, ke = tp[pi[e]], aq[e], bq[e], kb[e]
    cells[e] = _cells_below(tq, ae, be, (ke + 1) * block) - _cells_below(tq, ae, be, ke * block)
    keep = cells > 0
    return aq[keep], (aq // block)[keep], kb[keep], cells[keep]


def block_grid(traps: np.ndarray, seqlen_q: int, seqlen_k: int, block: int) -> np.ndarray:
    """Cells kept per block: int64 [ceil(seqlen_q / block), ceil(seqlen_k / block)]."""
    _, rb, kb, cells = block_cells(traps, block)
    nq, nk = -(-seqlen_q // block), -(-seqlen_k // block)
    return np.bincount(rb * nk + kb, weights=cells, minlength=nq * nk).astype(np.int64).reshape(nq, nk)


def block_sizes(seqlen: int, block: int) -> np.ndarray:
    """Rows (or keys) in each block: the last may be short. int64 [ceil(seqlen / block)]."""
    edges = np.minimum(np.arange(0, seqlen + block, block), seqlen)
    return np.diff(np.unique(edges))


def tokens_label(v: float) -> str:
    """A token position as a short label: 131072 -> ``128k``, 1536 -> ``1.5k``, 1048576 -> ``1M``."""
    v = int(round(v))
    if v and v % (1 << 20) == 0:
        return f"{v >> 20}M"
    if v >= 1 << 20:
        return f"{v / (1 << 20):.3g}M"
    if v >= 1024 and v % 128 == 0:
        return f"{v / 1024:g}k"
    return f"{v}"


def draw_mask(mask, path, *, block: int | None = None, max_blocks: int = 1024, title: str | None = None,
              dpi: int = 100) -> str:
    """Save a picture of ``mask`` (an ``AttnMask``) to ``path`` and return the path.

    Like FlexAttention's BlockMask picture: one pixel per ``block x block`` block (``block``: auto, the
    smallest power of two giving at most ``max_blocks`` blocks a side), shaded by the fraction of the
    block's cells the mask keeps; the title gives the exact cells kept, the density and the counts of
    full, partial and empty blocks.
    """
    require_matplotlib("AttnMask.draw")
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no backend or global figure state is touched
    from matplotlib.ticker import FixedLocator, FuncFormatter

    sq, sk = mask.seqlen_q, mask.seqlen_k
    b = int(block) if block is not None else auto_block(max(sq, sk), max_blocks)
    grid = block_grid(mask.traps, sq, sk, b)
    size = np.outer(block_sizes(sq, b), block_sizes(sk, b))
    frac = grid / size
    full, partial = int((grid == size).sum()), int(((grid > 0) & (grid < size)).sum())
    area = int(grid.sum())

    fig = Figure(figsize=(7.5, 7.0 * sq / max(sq, sk) + 0.8), dpi=dpi)
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["Blues"].with_extremes(bad="white")  # empty blocks: white
    im = ax.imshow(np.ma.masked_equal(frac, 0.0), cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest",
                   extent=(0, sk, sq, 0), aspect="auto")
    for axis, n in ((ax.xaxis, sk), (ax.yaxis, sq)):
        axis.set_major_locator(FixedLocator(np.linspace(0, n, 9)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: tokens_label(v)))
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    head = title if title is not None else repr(mask)
    ax.set_title(f"{head}\n{area:,} cells kept ({area / (sq * sk):.2%}); block {b}: "
                 f"{full:,} full, {partial:,} partial, {grid.size - full - partial:,} empty", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label="kept fraction of the block")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return path
