"""How a tile list runs on FlashAttention-4: the tiles as FA4 calls (numpy; FA4 is not imported).

Every tile kind is a window on its rectangle. FA4's windows are bottom-right aligned: in a sequence of
``sq`` rows and ``sk`` keys, local row ``i`` keeps key ``j`` iff
``i + sk - sq - left <= j <= i + sk - sq + right`` (None: unbounded on that side), so (kinds.py)::

    FULL       left None      right None
    CAUSAL     left None      right 0         (FA4's causal)
    INV_CAUSAL left sk - sq   right None
    BI_CAUSAL  left sk - sq   right 0

A call is one FA4 varlen launch: sequences (one per window segment) sharing the call's (left, right),
rows ``[q0, q0 + used_q)`` of q at offset ``cu_seqlens_q[b] = q0`` and keys ``[k0, k0 + used_k)`` at
``cu_seqlens_k[b] = k0`` (``seqused_q`` / ``seqused_k`` give the lengths, so gaps between segments are
allowed). FA4 writes each sequence's out / lse (forward) and dq / dk / dv (backward) in place, so:

- a call's segments have disjoint rows, in increasing order (forward and backward);
- in the backward also disjoint keys in the same increasing order (FA4 sums dK/dV per sequence, not
  across sequences, and lays its padded accumulators out by sequence order).

Segments that share rows go to different calls, merged by LSE (forward) and summed (backward).

Lists that need more than one call in a direction run that direction as one FA4 block-sparse call
instead (``BlockLists``): 128 x 128 blocks, the full ones in FA4's full lists (no mask arithmetic), the
partial ones through a ``mask_mod``: two comparisons with constants when the partial blocks' cells form
one diagonal band (a causal diagonal, a window's edges), else reads of each row's kept key intervals
from an aux tensor (exact cells; at most ``MASK_INTERVALS`` intervals per row on its partial blocks), or with more
of them arithmetic on the cell's group offset when the cells form a periodic band (a strided mask), else reads of
the cell's bit from a bitmap of the partial blocks' cells (one word per 32 keys of a row, up to
``BITMAP_MAX_BYTES``, else the list does not run block-sparse; ``cells``). The backward takes the transposed lists.

Before grouping, tiles are normalised (rows with no kept key dropped: CAUSAL with sk < sq, INV_CAUSAL
with sk < sq; an empty BI_CAUSAL dropped) and fused: row-adjacent segments whose union is one window
segment become one (a sliding window's causal head and its band are one FA4 window sequence).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from ...kinds import Kind
from ..pieces import uncovered_rows
from .cells import bitmap_by_key, bitmap_words, grid, periodic_band, periodic_cells


@dataclass(frozen=True)
class Segment:
    """One FA4 sequence: rows ``[q0, q1)``, keys ``[k0, k1)``, window ``(left, right)`` (None = unbounded)."""

    q0: int
    q1: int
    k0: int
    k1: int
    left: int | None
    right: int | None

    def bounds(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Kept keys ``[lo, hi)`` (absolute) of absolute ``rows`` of this segment."""
        diag = rows - self.q0 + (self.k1 - self.k0) - (self.q1 - self.q0) + self.k0
        lo = np.full_like(rows, self.k0) if self.left is None else np.maximum(self.k0, diag - self.left)
        hi = np.full_like(rows, self.k1) if self.right is None else np.minimum(self.k1, diag + self.right + 1)
        return lo, hi

    def area(self) -> int:
        lo, hi = self.bounds(np.arange(self.q0, self.q1, dtype=np.int64))
        return int(np.maximum(hi - lo, 0).sum())


@dataclass(frozen=True)
class Call:
    """One FA4 launch. ``segments`` sorted by rows. ``dense``: one segment covering every row of q and
    key of k (called without cu_seqlens, the fastest form)."""

    left: int | None
    right: int | None
    segments: tuple[Segment, ...]
    dense: bool = False

    @functools.cached_property  # a route's class sums it on first use: made with the list (the planning helper)
    def area(self) -> int:
        """Cells the call computes."""
        return sum(s.area() for s in self.segments)

    @property
    def causal(self) -> bool:
        return self.left is None and self.right == 0

    @property
    def max_q(self) -> int:
        return max(s.q1 - s.q0 for s in self.segments)

    @property
    def max_k(self) -> int:
        return max(s.k1 - s.k0 for s in self.segments)

    def arrays(self) -> dict[str, np.ndarray]:
        """int32 ``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_q``, ``seqused_k`` (the varlen form)."""
        q0 = np.array([s.q0 for s in self.segments], np.int64)
        k0 = np.array([s.k0 for s in self.segments], np.int64)
        uq = np.array([s.q1 - s.q0 for s in self.segments], np.int64)
        uk = np.array([s.k1 - s.k0 for s in self.segments], np.int64)
        return {"cu_seqlens_q": np.append(q0, q0[-1] + uq[-1]).astype(np.int32),
                "cu_seqlens_k": np.append(k0, k0[-1] + uk[-1]).astype(np.int32),
                "seqused_q": uq.astype(np.int32), "seqused_k": uk.astype(np.int32)}

    def row_spans(self) -> list[tuple[int, int]]:
        return _spans((s.q0, s.q1) for s in self.segments)

    def key_spans(self) -> list[tuple[int, int]]:
        return _spans((s.k0, s.k1) for s in self.segments)


BLOCK = 128  # FA4's block-sparse granularity (its sm90 backward needs 128 x 128)
MASK_INTERVALS = 2  # kept key intervals per row the mask_mod reads (on the row's partial blocks)
# Route rules, measured with FA4 4.0.0b36 on sm90 (TFLOP/s fwd / bwd; docs/measurements.md names the run):
# - a list whose blocks are all full or empty runs block-sparse: no mask arithmetic at all, and FA4's
#   block-sparse launch beat its varlen launch over segments sharing keys (block-causal 667 vs 628 fwd);
# - else up to two varlen launches beat one block-sparse launch (a causal zigzag rank's backward: 572 vs
#   511), and with more one block-sparse launch wins (strided: 507 vs 199 fwd);
# - FA4's block-sparse backward reads the mask_mod's intervals per element: with many partial blocks (a
#   sink + window list, 30% partial) it ran at 163 where Triton ran 288.
# These are the prior: on a device that can be timed, FA4 and Triton are measured per list class
# (``measured.py``) and the faster runs.
VARLEN_MAX_CALLS = 2
BWD_MAX_PARTIAL_FRACTION = 0.2


@dataclass(frozen=True, eq=False)
class BlockLists:
    """A list as FA4 block-sparse tensors (int32, 128 x 128 blocks; padded index rows, ascending).

    fwd: per q-block ``(mask_cnt [M], mask_idx [M, N], full_cnt [M], full_idx [M, N])`` of k-blocks;
    bwd: the transpose, per k-block ``(mask_cnt [N], mask_idx [N, M], full_cnt [N], full_idx [N, M])``;
    band: (sink, dlo, dhi) when the partial blocks' cells are exactly those with
    ``c - r <= dhi and (c < sink or c - r >= dlo)``: one diagonal band, its lower edge lifted for the
    first ``sink`` keys (attention sinks); the mask_mod then compares with constants. A six-tuple
    ``(0, -(sq + sk), dhi, group, period, local)`` is a periodic band (``cells.periodic_band``; rows keeping more
    than two intervals, as a strided mask's): the cells with ``c - r <= dhi`` whose group offset
    ``r // group - c // group`` is below ``local`` or a multiple of ``period``, arithmetic too. Else
    bounds: int32 [sq, 2 * intervals]: row r keeps key c of a partial block iff
    ``bounds[r, 2i] <= c < bounds[r, 2i + 1]`` for some i (empty intervals are (0, 0)); ``intervals``
    (1 or 2) is the most any row needs, so the mask_mod reads no more than that (0 with a band); the backward reads
    ``bounds_t`` instead where each key keeps at most two row intervals there (documents, windows): int32
    [sk, 2 * its intervals], key c kept by row r iff ``bounds_t[c, 2i] <= r < bounds_t[c, 2i + 1]``.
    ``bitmap``: the partial blocks' cells as bits instead, for rows keeping more than two intervals over their
    partial blocks (fine-grained patterns: a strided mask of 16-token blocks): bounds int32 [sq, 4 * N], bit
    ``c & 31`` of word ``[r, c >> 5]`` set iff row r keeps key c (one read per cell, whatever the pattern); the
    backward reads ``bounds_t`` instead, the same bits by key: int32 [sk, 4 M], bit ``r & 31`` of word ``[c, r >> 5]``
    (FA4's sm90 backward computes S transposed at head_dim <= 128, the sparse backward's dims: a thread's cells then
    share a few keys and span many rows, and reading by key keeps its reads in a few words; docs/measurements.md; the
    same holds for the intervals)."""

    fwd: tuple[np.ndarray, ...]
    bwd: tuple[np.ndarray, ...]
    bounds: np.ndarray
    full_blocks: int
    partial_blocks: int
    band: tuple[int, int, int] | None = None  # (sink, dlo, dhi), see _band
    bitmap: bool = False
    bounds_t: np.ndarray | None = None

    def mask(self, direction: str) -> tuple[int | str | None, np.ndarray | None]:
        """(the backend's ``Fa4Functions.interval_masks`` key, the aux array it reads) of ``direction``'s partial
        blocks; (None, None) with a band (its mask_mod reads no array)."""
        if self.band is not None:
            return None, None
        if direction == "bwd" and self.bounds_t is not None:
            return ("bitmap_t" if self.bitmap else f"by_key_{self.bounds_t.shape[1] // 2}"), self.bounds_t
        return self.mask_key, self.bounds

    @property
    def intervals(self) -> int:
        return 0 if self.bitmap else self.bounds.shape[1] // 2

    @property
    def mask_key(self) -> int | str:
        """Which mask_mod reads ``bounds`` (the backend's ``Fa4Functions.interval_masks`` key): the intervals per row,
        or "bitmap"."""
        return "bitmap" if self.bitmap else self.intervals


@dataclass(frozen=True)
class Fa4Calls:
    """The calls of one tile list, per direction, and what they leave uncovered. A direction with more
    than one varlen call runs as one block-sparse call (``blocks``) when ``blocks`` is not None."""

    seqlen_q: int
    seqlen_k: int
    fwd: tuple[Call, ...]
    bwd: tuple[Call, ...]
    row_gaps: tuple[tuple[int, int], ...] = field(default=())  # rows no segment covers: out 0, lse -inf
    key_gaps: tuple[tuple[int, int], ...] = field(default=())  # keys no segment reads: dk = dv = 0
    blocks: BlockLists | None = None

    def route(self, direction: str) -> str:
        """How the direction runs: "varlen" (its calls), "blocks" (one block-sparse call) or "triton"
        (``triton_reason`` says why)."""
        return self._route(direction)[0]

    def triton_reason(self, direction: str) -> str | None:
        return self._route(direction)[1]

    def fa4_route(self, direction: str) -> str | None:
        """How FA4 itself runs the direction: "varlen" (its calls) or "blocks" (one block-sparse call), or None
        where it cannot (more varlen calls than ``VARLEN_MAX_CALLS`` and no block-sparse form)."""
        calls = self.fwd if direction == "fwd" else self.bwd
        n, b = len(calls), self.blocks
        if n == 1 and calls[0].dense:
            return "varlen"
        if b is not None and b.partial_blocks == 0:
            return "blocks"
        if n <= VARLEN_MAX_CALLS:
            return "varlen"
        return None if b is None else "blocks"

    def _route(self, direction: str) -> tuple[str, str | None]:
        r = self.fa4_route(direction)
        calls, b = (self.fwd if direction == "fwd" else self.bwd), self.blocks
        if r is None:
            return "triton", (f"{len(calls)} varlen calls and no block-sparse form (rows with more than "
                              f"{MASK_INTERVALS} key intervals on partial blocks and a bitmap of their cells above "
                              f"{BITMAP_MAX_BYTES / 2 ** 20:g} MiB)")
        if r == "varlen" or b.partial_blocks == 0:
            return r, None
        frac = b.partial_blocks / max(1, b.partial_blocks + b.full_blocks)
        if direction == "bwd" and frac > BWD_MAX_PARTIAL_FRACTION:
            return "triton", (f"{frac:.0%} partial blocks: FA4's block-sparse backward is slower than Triton "
                              f"above {BWD_MAX_PARTIAL_FRACTION:.0%}")
        return "blocks", None

    def describe(self) -> str:
        def one(d):
            r = self.route(d)
            if r == "blocks":
                return f"1 block-sparse FA4 call ({self.blocks.full_blocks} full + {self.blocks.partial_blocks} partial blocks)"
            if r == "triton":
                return f"Triton ({self.triton_reason(d)})"
            n = len(self.fwd if d == "fwd" else self.bwd)
            return f"{n} varlen FA4 call(s)"
        return f"forward: {one('fwd')}; backward: {one('bwd')}"


def _spans(pairs) -> list[tuple[int, int]]:
    """Sorted, merged [a, b) spans of ``pairs``."""
    out: list[list[int]] = []
    for a, b in sorted(pairs):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def segment_of(q0: int, q1: int, k0: int, k1: int, kind: int) -> Segment | None:
    """The tile as a window segment with no empty row, or None when it keeps nothing; bounds that
    never bind are None."""
    sq, sk = q1 - q0, k1 - k0
    if kind == Kind.FULL:
        left, right = None, None
    elif kind == Kind.CAUSAL:
        if sk < sq:  # rows i < sq - sk keep no key
            q0, sq = q1 - sk, sk
        left, right = None, 0
    elif kind == Kind.INV_CAUSAL:
        if sk < sq:  # rows i >= sk keep no key
            q1, sq = q0 + sk, sk
        left, right = sk - sq, None
    elif kind == Kind.BI_CAUSAL:
        if sk < sq:
            return None
        left, right = sk - sq, 0
    else:
        raise ValueError(f"unknown tile kind {kind}")
    if sq <= 0 or sk <= 0:
        return None
    return _canonical(Segment(q0, q1, k0, k1, left, right))


def _canonical(s: Segment) -> Segment:
    """``s`` with bounds that never bind set to None (the same cells, fewer FA4 variants)."""
    sq, sk = s.q1 - s.q0, s.k1 - s.k0
    left, right = s.left, s.right
    if left is not None and left >= sk - 1:  # the last row's lower bound is <= k0
        left = None
    if right is not None and sk - sq + right >= sk - 1:  # the first row's upper bound is >= k1 - 1
        right = None
    return Segment(s.q0, s.q1, s.k0, s.k1, left, right)


def _kinks(s: Segment) -> tuple[int, ...]:
    """The rows where ``s.bounds`` changes slope: lo = max(k0, r + k1 - q1 - left) and hi = min(k1, r + k1 - q1 +
    right + 1) are each a constant and a unit-slope line, kinked where the two meet."""
    out = ()
    if s.left is not None:
        out += (s.k0 + s.q1 - s.k1 + s.left,)
    if s.right is not None:
        out += (s.q1 - s.right - 1,)
    return out


def _bounds_agree(x: Segment, y: Segment, r0: int, r1: int) -> bool:
    """Whether ``x.bounds`` and ``y.bounds`` are equal on rows [r0, r1): both are piecewise linear with integer
    kinks, so equal at the ends and at every kink between they are equal on every row."""
    rows = {r0, r1 - 1, *(r for r in _kinks(x) + _kinks(y) if r0 <= r < r1)}
    return all(_row_bounds(x, r) == _row_bounds(y, r) for r in rows)


def _row_bounds(s: Segment, r: int) -> tuple[int, int]:
    """``s.bounds`` of one row, in plain ints (a few rows: no arrays)."""
    diag = r + s.k1 - s.q1
    return (s.k0 if s.left is None else max(s.k0, diag - s.left),
            s.k1 if s.right is None else min(s.k1, diag + s.right + 1))


def _fuse(a: Segment, b: Segment) -> Segment | None:
    """One segment with exactly the cells of row-adjacent ``a`` (above) and ``b``, or None."""
    if a.q1 != b.q0:
        return None
    # a window's bounds rise by 0 or 1 from one row to the next: most pairs fail here, before the candidates are
    # built (a strided list of 16-token blocks meets a few dozen row-adjacent segments per segment)
    (la, ha), (lb, hb) = _row_bounds(a, a.q1 - 1), _row_bounds(b, b.q0)
    if not (0 <= lb - la <= 1 and 0 <= hb - ha <= 1):
        return None
    k0, k1 = min(a.k0, b.k0), max(a.k1, b.k1)
    for left in dict.fromkeys((a.left, b.left, None)):
        for right in dict.fromkeys((a.right, b.right, None)):
            c = Segment(a.q0, b.q1, k0, k1, left, right)
            if _bounds_agree(c, a, a.q0, a.q1) and _bounds_agree(c, b, b.q0, b.q1):
                return _canonical(c)
    return None


def fuse_segments(segs: list[Segment]) -> list[Segment]:
    """Greedy fusion in row order: each segment joins a segment ending on its first row if they fuse."""
    out: list[Segment] = []
    ending: dict[int, list[int]] = {}  # q1 -> indices into out
    for s in sorted(segs, key=lambda s: (s.q0, s.k0)):
        for i in ending.get(s.q0, ()):
            f = _fuse(out[i], s)
            if f is not None:
                ending[s.q0].remove(i)
                out[i] = f
                ending.setdefault(f.q1, []).append(i)
                break
        else:
            out.append(s)
            ending.setdefault(s.q1, []).append(len(out) - 1)
    return out


def _chains(segs: list[Segment], keys_too: bool) -> list[list[Segment]]:
    """First-fit partition of one window's segments into calls: increasing disjoint rows (and keys)."""
    layers: list[list[Segment]] = []
    for s in sorted(segs, key=lambda s: (s.q0, s.k0)):
        for layer in layers:
            last = layer[-1]
            if last.q1 <= s.q0 and (not keys_too or last.k1 <= s.k0):
                layer.append(s)
                break
        else:
            layers.append([s])
    return layers


def _calls(segs: list[Segment], seqlen_q: int, seqlen_k: int, keys_too: bool) -> tuple[Call, ...]:
    by_window: dict[tuple, list[Segment]] = {}
    for s in segs:
        by_window.setdefault((s.left, s.right), []).append(s)
    calls = []
    for (left, right), group in by_window.items():
        for layer in _chains(group, keys_too):
            s0 = layer[0]
            dense = len(layer) == 1 and (s0.q0, s0.q1, s0.k0, s0.k1) == (0, seqlen_q, 0, seqlen_k)
            calls.append(Call(left, right, tuple(layer), dense))
    # the call covering the most rows first: it writes the output, later calls merge into it
    calls.sort(key=lambda c: -sum(b - a for a, b in c.row_spans()))
    return tuple(calls)


def _row_intervals(segs: list[Segment]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, lo, hi) of every row's kept key intervals, sorted, touching intervals of a row merged
    (the segments are cell-disjoint, so intervals of a row never overlap)."""
    parts = []
    for s in segs:
        r = np.arange(s.q0, s.q1, dtype=np.int64)
        parts.append((r, *s.bounds(r)))
    return _merged(parts)


def _key_intervals(segs: list[Segment], wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(key, lo, hi) of the keeping row intervals of every key in a ``wanted`` key block (bool per block), as
    ``_row_intervals`` by key: a window segment's bounds never decrease with the row, so the rows keeping key c are
    one run, from the first whose hi passes c to the first whose lo does."""
    parts = []
    for s in segs:
        lo, hi = s.bounds(np.arange(s.q0, s.q1, dtype=np.int64))
        c = np.arange(s.k0, s.k1, dtype=np.int64)
        c = c[wanted[c // BLOCK]]
        a, b = s.q0 + np.searchsorted(hi, c, side="right"), s.q0 + np.searchsorted(lo, c, side="right")
        ok = a < b
        parts.append((c[ok], a[ok], b[ok]))
    return _merged(parts)


def _merged(parts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    row = np.concatenate([p[0] for p in parts])
    lo = np.concatenate([p[1] for p in parts])
    hi = np.concatenate([p[2] for p in parts])
    order = np.lexsort((lo, row))
    row, lo, hi = row[order], lo[order], hi[order]
    new = np.ones(len(row), dtype=bool)
    new[1:] = (row[1:] != row[:-1]) | (lo[1:] != hi[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(row)) - 1
    return row[first], lo[first], hi[last]


def _on_partial(row, lo, hi, partial: np.ndarray) -> tuple[np.ndarray, ...]:
    """(row, lo, hi, slot) of the intervals that meet a partial block of their row's block (what a mask_mod must
    reproduce), slot = the interval's place among its row's."""
    mb = partial.shape[0]
    pc = np.concatenate([np.zeros((mb, 1), np.int64), np.cumsum(partial, axis=1)], axis=1)
    m = row // BLOCK
    meets = pc[m, (hi - 1) // BLOCK + 1] - pc[m, lo // BLOCK] > 0
    row, lo, hi = row[meets], lo[meets], hi[meets]
    return row, lo, hi, np.arange(len(row)) - np.searchsorted(row, row, side="left")


def _bounds(n: int, row, lo, hi, slot, used: int) -> np.ndarray:
    bounds = np.zeros((n, 2 * used), dtype=np.int32)
    if used:
        bounds[row, 2 * slot] = lo
        bounds[row, 2 * slot + 1] = hi
    return bounds


def _block_cells(row, lo, hi, m_blocks: int, n_blocks: int) -> np.ndarray:
    """Kept cells per (q-block, k-block) of 128 x 128 blocks, int64 [M, N]."""
    m = row // BLOCK
    a, b = lo // BLOCK, (hi - 1) // BLOCK
    w = n_blocks + 1

    def summed(cols, vals):  # sums per (q-block, col) as one bincount (np.add.at is several times slower);
        # float64 sums of ints below 2^53 are exact
        return np.bincount(m * w + cols, weights=vals, minlength=m_blocks * w).reshape(m_blocks, w)

    one = a == b
    cells = summed(a, np.where(one, hi - lo, (a + 1) * BLOCK - lo))
    cells += summed(b, np.where(one, 0, hi - b * BLOCK))
    # blocks strictly between a and b: BLOCK cells each
    inner = summed(np.where(one, a, a + 1), np.where(one, 0, BLOCK)) - summed(b, np.where(one, 0, BLOCK))
    return (cells + np.cumsum(inner, axis=1))[:, :n_blocks].astype(np.int64)


def _lists(full: np.ndarray, partial: np.ndarray) -> tuple[np.ndarray, ...]:
    """(mask_cnt, mask_idx, full_cnt, full_idx) of boolean [rows, cols] block maps, int32."""
    def one(b):
        cnt = b.sum(1).astype(np.int32)
        idx = np.zeros(b.shape, dtype=np.int32)
        r, c = np.nonzero(b)
        pos = np.arange(len(r)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        idx[r, pos] = c
        return cnt, idx
    return (*one(partial), *one(full))


BAND_CHECK_MAX_CELLS = 1 << 26  # partial-block cells compared densely when looking for one band


def _band(segs, row, lo, hi, partial: np.ndarray, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int] | None:
    """(sink, dlo, dhi) when every partial block's kept cells are exactly those with
    ``c - r <= dhi and (c < sink or c - r >= dlo)`` (a causal diagonal, a window's edges, a window with
    attention sinks), the band among the segments' own and the sink among their full segments from key 0;
    else None. Then the mask_mod compares with constants instead of reading each row's intervals.

    Compared per row of every partial block by interval lengths, all blocks at once: a row's kept keys A (its
    disjoint intervals clipped to the block's keys) equal the band's B iff |A| = |B| = |A n B|."""
    mb, nb = np.nonzero(partial)
    if not len(mb) or len(mb) * BLOCK * BLOCK > BAND_CHECK_MAX_CELLS:
        return None
    big = seqlen_q + seqlen_k  # an unbounded side
    cands = []
    for s in segs:
        d = s.k0 + (s.k1 - s.k0) - (s.q1 - s.q0) - s.q0  # c - r on the segment's diagonal
        c = (-big if s.left is None else d - s.left, big if s.right is None else d + s.right)
        if c not in cands:
            cands.append(c)
    start = np.searchsorted(row, np.arange(seqlen_q + 1))  # row -> its intervals [start[r], start[r + 1])
    width = int(np.diff(start).max())
    # every row of every partial block, with the block's keys [c0, c1)
    r = (mb[:, None] * BLOCK + np.arange(BLOCK)[None, :]).reshape(-1)
    c0 = np.repeat(nb * BLOCK, BLOCK)
    inside = r < seqlen_q
    r, c0 = r[inside], c0[inside]
    c1 = np.minimum(c0 + BLOCK, seqlen_k)
    idx = start[r][:, None] + np.arange(width)[None, :]
    ok = idx < start[r + 1][:, None]
    idx = np.minimum(idx, len(lo) - 1)
    a_lo = np.where(ok, np.maximum(lo[idx], c0[:, None]), 0)
    a_hi = np.where(ok, np.minimum(hi[idx], c1[:, None]), 0)
    size_a = np.maximum(a_hi - a_lo, 0).sum(1)

    def common(x0, x1):  # |A n [x0, x1)| per row
        return np.maximum(np.minimum(a_hi, x1[:, None]) - np.maximum(a_lo, x0[:, None]), 0).sum(1)

    sinks = [0] + sorted({s.k1 for s in segs if s.k0 == 0 and s.left is None and s.right is None})
    for sink in sinks:
        for dlo, dhi in cands:
            top = np.minimum(c1, r + dhi + 1)
            s0, s1 = c0, np.minimum(top, sink)  # B = [c0, min(top, sink)) u [max(c0, r + dlo), top)
            w0, w1 = np.maximum(c0, r + dlo), top
            o0, o1 = np.maximum(s0, w0), np.minimum(s1, w1)
            size_b = np.maximum(s1 - s0, 0) + np.maximum(w1 - w0, 0) - np.maximum(o1 - o0, 0)
            if np.array_equal(size_a, size_b) and np.array_equal(
                    common(s0, s1) + common(w0, w1) - common(o0, o1), size_a):
                return int(sink), int(max(dlo, -big)), int(min(dhi, big))
    return None


def band_keep(r: np.ndarray, c: np.ndarray, sink: int, dlo: int, dhi: int, group: int = 0, period: int = 0,
              local: int = 0) -> np.ndarray:
    """The band mask_mod's cells [len(r), len(c)]: c - r <= dhi and (c < sink or c - r >= dlo); with ``group`` (sink
    0, dlo below every cell) the periodic band's, by the arithmetic its mask_mod runs (``cells.periodic_cells``)."""
    if group:
        return periodic_cells(r[:, None], c[None, :], dhi, group, period, local)
    d = c[None, :] - r[:, None]
    return (d <= dhi) & ((c[None, :] < sink) | (d >= dlo))


def block_lists(segs: list[Segment], seqlen_q: int, seqlen_k: int, partial_ok: bool = True) -> BlockLists | None:
    """The block-sparse form of ``segs`` (see BlockLists), or None when some row keeps more than
    MASK_INTERVALS intervals on its partial blocks and their bitmap exceeds BITMAP_MAX_BYTES, or when there are
    partial blocks and not
    ``partial_ok`` (the caller wants the form only for lists of whole blocks)."""
    if not segs:
        return None
    row, lo, hi = _row_intervals(segs)
    mb, nb = -(-seqlen_q // BLOCK), -(-seqlen_k // BLOCK)
    cells = _block_cells(row, lo, hi, mb, nb)
    rows_in = np.minimum(BLOCK, seqlen_q - np.arange(mb) * BLOCK)
    keys_in = np.minimum(BLOCK, seqlen_k - np.arange(nb) * BLOCK)
    full = cells == rows_in[:, None] * keys_in[None, :]
    partial = (cells > 0) & ~full
    if not partial_ok and partial.any():
        return None
    band = _band(segs, row, lo, hi, partial, seqlen_q, seqlen_k)
    row, lo, hi, slot = _on_partial(row, lo, hi, partial)
    lists = (_lists(full, partial), _lists(full.T, partial.T))
    if band is None and len(slot) and slot.max() >= MASK_INTERVALS:
        group = grid((x for s in segs for x in (s.q0, s.q1, s.k0, s.k1)), seqlen_q, seqlen_k)
        got = periodic_band(row, lo, hi, partial, seqlen_q, seqlen_k, group)
        if got is not None:
            band = (0, -(seqlen_q + seqlen_k), got[0], group, got[1], got[2])
        else:
            bits = bitmap_words(row, lo, hi, partial, seqlen_q, BITMAP_MAX_BYTES)
            if bits is None:
                return None
            return BlockLists(*lists, bits, int(full.sum()), int(partial.sum()), None, bitmap=True,
                              bounds_t=bitmap_by_key(bits, seqlen_q, seqlen_k))
    used = 0 if band is not None else (int(slot.max()) + 1 if len(slot) else 1)
    by_key = None
    if used and partial.any():  # the backward's by key where every key keeps at most MASK_INTERVALS row intervals there
        key, k_lo, k_hi, k_slot = _on_partial(*_key_intervals(segs, partial.any(0)), partial.T)
        k_used = int(k_slot.max()) + 1 if len(k_slot) else 1
        by_key = _bounds(seqlen_k, key, k_lo, k_hi, k_slot, k_used) if k_used <= MASK_INTERVALS else None
    return BlockLists(*lists, _bounds(seqlen_q, row, lo, hi, slot, used), int(full.sum()), int(partial.sum()), band,
                      bounds_t=by_key)


# each of the bitmap form's two aux tensors, by row and by key (sq x sk / 8 bytes: a strided 4k list's 2 MiB). One read
# a cell: faster than two intervals per row and key block (four reads a cell). The cap keeps lists where it lost
# out of the form (a strided 16k list's 32 MiB: FA4 2.3x / 3x Triton's time; docs/measurements.md) and bounds what
# a plan's lists carry from the planning helper and upload
BITMAP_MAX_BYTES = 4 << 20


def fa4_calls(tiles: np.ndarray, seqlen_q: int, seqlen_k: int) -> Fa4Calls:
    """The FA4 calls of tile list ``tiles`` (int [n, 5], kernels/protocol.py) on ``seqlen_q`` rows and
    ``seqlen_k`` keys."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    segs = [s for s in (segment_of(*map(int, row)) for row in t) if s is not None]
    segs = fuse_segments(segs)
    rows = _spans((s.q0, s.q1) for s in segs)
    keys = _spans((s.k0, s.k1) for s in segs)
    fwd = _calls(segs, seqlen_q, seqlen_k, False)
    bwd = _calls(segs, seqlen_q, seqlen_k, True)
    dense = len(fwd) == 1 and fwd[0].dense
    many = max(len(fwd), len(bwd)) > VARLEN_MAX_CALLS
    blocks = None if dense else block_lists(segs, seqlen_q, seqlen_k, partial_ok=many)
    return Fa4Calls(int(seqlen_q), int(seqlen_k), fwd, bwd, tuple(uncovered_rows(rows, seqlen_q)),
                    tuple(uncovered_rows(keys, seqlen_k)), blocks)
