"""How a tile list runs on FlashAttention-4: the tiles as FA4 calls (pure numpy; FA4 is not imported).

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

Before grouping, tiles are normalised (rows with no kept key dropped: CAUSAL with sk < sq, INV_CAUSAL
with sk < sq; an empty BI_CAUSAL dropped) and fused: row-adjacent segments whose union is one window
segment become one (a sliding window's causal head and its band are one FA4 window sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..kinds import Kind


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


@dataclass(frozen=True)
class Fa4Calls:
    """The calls of one tile list, per direction, and what they leave uncovered."""

    seqlen_q: int
    seqlen_k: int
    fwd: tuple[Call, ...]
    bwd: tuple[Call, ...]
    row_gaps: tuple[tuple[int, int], ...] = field(default=())  # rows no segment covers: out 0, lse -inf
    key_gaps: tuple[tuple[int, int], ...] = field(default=())  # keys no segment reads: dk = dv = 0

    def describe(self) -> str:
        return f"{len(self.fwd)} forward / {len(self.bwd)} backward FA4 calls"


def _spans(pairs) -> list[tuple[int, int]]:
    """Sorted, merged [a, b) spans of ``pairs``."""
    out: list[list[int]] = []
    for a, b in sorted(pairs):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _gaps(spans, n: int) -> tuple[tuple[int, int], ...]:
    gaps, at = [], 0
    for a, b in spans:
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    if at < n:
        gaps.append((at, n))
    return tuple(gaps)


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


def _fuse(a: Segment, b: Segment) -> Segment | None:
    """One segment with exactly the cells of row-adjacent ``a`` (above) and ``b``, or None."""
    if a.q1 != b.q0:
        return None
    k0, k1 = min(a.k0, b.k0), max(a.k1, b.k1)
    rows_a = np.arange(a.q0, a.q1, dtype=np.int64)
    rows_b = np.arange(b.q0, b.q1, dtype=np.int64)
    want = [a.bounds(rows_a), b.bounds(rows_b)]
    for left in dict.fromkeys((a.left, b.left, None)):
        for right in dict.fromkeys((a.right, b.right, None)):
            c = Segment(a.q0, b.q1, k0, k1, left, right)
            if all(np.array_equal(x, y) for got, w in zip((c.bounds(rows_a), c.bounds(rows_b)), want)
                   for x, y in zip(got, w)):
                return _canonical(c)
    return None


def _fused(segs: list[Segment]) -> list[Segment]:
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


def fa4_calls(tiles: np.ndarray, seqlen_q: int, seqlen_k: int) -> Fa4Calls:
    """The FA4 calls of tile list ``tiles`` (int [n, 5], kernels/protocol.py) on ``seqlen_q`` rows and
    ``seqlen_k`` keys."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    segs = [s for s in (segment_of(*map(int, row)) for row in t) if s is not None]
    segs = _fused(segs)
    rows = _spans((s.q0, s.q1) for s in segs)
    keys = _spans((s.k0, s.k1) for s in segs)
    return Fa4Calls(int(seqlen_q), int(seqlen_k), _calls(segs, seqlen_q, seqlen_k, False),
                    _calls(segs, seqlen_q, seqlen_k, True), _gaps(rows, seqlen_q), _gaps(keys, seqlen_k))
