"""Exact geometry of masks: slices as row trapezoids, their disjoint union, and clipping.

Every slice kind keeps, on each row ``i`` (global index), one interval of keys ``[lo(i), hi(i))``
whose ends are lines of slope 0 or 1 in ``i``:

    kind        lo(i)          hi(i)
    full        k0             k1
    causal      k0             i + k1 - q1 + 1
    inv_causal  i + k0 - q0    k1
    bi_causal   i + k0 - q0    i + k1 - q1 + 1

A *trapezoid* (``Trap``) is such a row range with two lines, non-empty on every row. The four kinds
are exactly the four slope pairs, so a trapezoid converts back to one slice. Lines of different
slopes cross at integer rows (intercepts are integers, slopes 0/1), which makes the union exact with
integer arithmetic: cut the rows where the order of any two lines changes, and within each band the
union is a fixed set of trapezoids.

Array form used by the planner: ``int64 [n, 6]`` rows ``(q0, q1, lo_a, lo_s, hi_a, hi_s)`` with
``lo(i) = lo_a + lo_s * i`` and ``hi(i) = hi_a + hi_s * i`` for ``i`` in ``[q0, q1)``.
"""

from __future__ import annotations

import numpy as np

from ..kinds import KIND_NAMES as KINDS, Kind

KIND_CODE = {k: Kind(c) for c, k in enumerate(KINDS)}
# (lo slope, hi slope) -> kind, and back
_SLOPES_TO_KIND = {(0, 0): Kind.FULL, (0, 1): Kind.CAUSAL, (1, 0): Kind.INV_CAUSAL, (1, 1): Kind.BI_CAUSAL}
_KIND_TO_SLOPES = {v: k for k, v in _SLOPES_TO_KIND.items()}

Q0, Q1, LO_A, LO_S, HI_A, HI_S = range(6)


def slice_to_trap(q0: int, q1: int, k0: int, k1: int, kind: int) -> tuple | None:
    """The trapezoid of one slice (global coordinates), trimmed to its non-empty rows, or None."""
    lo_s, hi_s = _KIND_TO_SLOPES[kind]
    lo_a = k0 - q0 * lo_s
    hi_a = k1 - (q1 - 1) * hi_s
    r0, r1 = _nonempty_rows(q0, q1, lo_a, lo_s, hi_a, hi_s)
    if r0 >= r1:
        return None
    return (r0, r1, lo_a, lo_s, hi_a, hi_s)


def _nonempty_rows(r0, r1, lo_a, lo_s, hi_a, hi_s):
    """Rows of [r0, r1) where hi(i) - lo(i) > 0 (an interval because the width is linear)."""
    w_a, w_s = hi_a - lo_a, hi_s - lo_s
    if w_s == 0:
        return (r0, r1) if w_a > 0 else (r0, r0)
    if w_s > 0:  # width grows: rows i > -w_a
        return (max(r0, -w_a + 1), r1)
    return (r0, min(r1, w_a))  # width shrinks: rows i < w_a


def trap_to_slice(t) -> tuple[int, int, int, int, int]:
    """(q0, q1, k0, k1, kind) of the slice whose cells are exactly trapezoid ``t``."""
    q0, q1, lo_a, lo_s, hi_a, hi_s = (int(x) for x in t)
    k0 = lo_a + lo_s * q0
    k1 = hi_a + hi_s * (q1 - 1)
    return q0, q1, k0, k1, _SLOPES_TO_KIND[(lo_s, hi_s)]


def traps_area(traps: np.ndarray) -> int:
    """Exact number of cells in an array of (disjoint) trapezoids."""
    if len(traps) == 0:
        return 0
    t = traps.astype(np.int64)
    n = t[:, Q1] - t[:, Q0]
    w0 = (t[:, HI_A] - t[:, LO_A]) + (t[:, HI_S] - t[:, LO_S]) * t[:, Q0]
    ws = t[:, HI_S] - t[:, LO_S]
    # sum over rows of w0 + ws * (i - q0), i - q0 in [0, n)
    return int(np.sum(n * w0 + ws * (n * (n - 1) // 2)))


def row_area_prefix(traps: np.ndarray, seqlen_q: int) -> np.ndarray:
    """``P[r]`` = number of cells in rows ``[0, r)``; int64 [seqlen_q + 1]. O(n + seqlen_q)."""
    # A row's width is piecewise linear in the row, so the third difference of P is non-zero only
    # next to the trapezoids' first and last rows: scatter it there, then three prefix sums in place.
    d = np.zeros(seqlen_q + 3, dtype=np.int64)
    if len(traps):
        t = traps.astype(np.int64)
        q0, q1, ws = t[:, Q0], t[:, Q1], t[:, HI_S] - t[:, LO_S]
        w0 = t[:, HI_A] - t[:, LO_A] + ws * q0  # width of the first row
        w1 = w0 + ws * (q1 - 1 - q0)  # and of the last
        np.add.at(d, np.concatenate([q0, q0 + 1, q0 + 1, q1, q1, q1 + 1]) + 1,
                  np.concatenate([w0, -w0, ws, -ws, -w1, w1]))
    for _ in range(3):
        np.cumsum(d, out=d)
    return d[: seqlen_q + 1]


def union(traps: list[tuple]) -> np.ndarray:
    """Disjoint trapezoids covering exactly the union of ``traps``; int64 [m, 6], sorted, deterministic."""
    if not traps:
        return np.zeros((0, 6), dtype=np.int64)
    arr = np.array(sorted(traps), dtype=np.int64)
    cuts = np.unique(np.concatenate([arr[:, Q0], arr[:, Q1]]))
    # fast path: no two trapezoids share a row -> already disjoint
    if len(arr) == 1 or np.all(arr[1:, Q0] >= np.maximum.accumulate(arr[:-1, Q1])):
        return _coalesce(arr)
    out: list[tuple] = []
    order = np.argsort(arr[:, Q0], kind="stable")
    arr = arr[order]
    active: list[int] = []
    nxt = 0
    for b in range(len(cuts) - 1):
        r0, r1 = int(cuts[b]), int(cuts[b + 1])
        while nxt < len(arr) and arr[nxt, Q0] <= r0:
            active.append(nxt)
            nxt += 1
        active = [a for a in active if arr[a, Q1] > r0]
        if not active:
            continue
        if len(active) == 1:
            t = arr[active[0]]
            out.append((r0, r1, *(int(x) for x in t[2:])))
            continue
        _union_band(arr[active], r0, r1, out)
    return _coalesce(np.array(out, dtype=np.int64).reshape(-1, 6))


def _union_band(band: np.ndarray, r0: int, r1: int, out: list) -> None:
    """Union of trapezoids all spanning rows [r0, r1); appends disjoint trapezoids to ``out``."""
    lines = np.concatenate([band[:, [LO_A, LO_S]], band[:, [HI_A, HI_S]]])  # [2n, 2]
    a, s = lines[:, 0], lines[:, 1]
    # crossing rows of lines with different slopes: a1 + s1*i = a2 + s2*i -> i = (a2 - a1)/(s1 - s2)
    i0 = np.nonzero(s == 0)[0]
    i1 = np.nonzero(s == 1)[0]
    cross = (a[i0][:, None] - a[i1][None, :]).ravel() if len(i0) and len(i1) else np.zeros(0, np.int64)
    cross = cross[(cross >= r0) & (cross < r1)]
    # each crossing row becomes a band of its own, so longer bands have a strict, fixed line order
    pts = np.unique(np.concatenate([[r0, r1], cross, cross + 1]))
    pts = pts[(pts >= r0) & (pts <= r1)]
    for b in range(len(pts) - 1):
        s0, s1 = int(pts[b]), int(pts[b + 1])
        lo = band[:, LO_A] + band[:, LO_S] * s0
        hi = band[:, HI_A] + band[:, HI_S] * s0
        order = np.lexsort((-hi, lo))
        cur = None  # [lo_idx, hi_idx] of the merged run being built
        for j in order:
            if cur is None:
                cur = [j, j]
                continue
            hi_cur = band[cur[1], HI_A] + band[cur[1], HI_S] * s0
            if lo[j] <= hi_cur:
                if hi[j] > hi_cur or (hi[j] == hi_cur and band[j, HI_S] > band[cur[1], HI_S]):
                    cur[1] = j
            else:
                out.append(_emit(s0, s1, band[cur[0]], band[cur[1]]))
                cur = [j, j]
        out.append(_emit(s0, s1, band[cur[0]], band[cur[1]]))


def _emit(s0, s1, tlo, thi):
    return (s0, s1, int(tlo[LO_A]), int(tlo[LO_S]), int(thi[HI_A]), int(thi[HI_S]))


def _coalesce(arr: np.ndarray) -> np.ndarray:
    """Join vertically adjacent trapezoids that continue the same two lines; sort by (q0, lo(q0))."""
    if len(arr) <= 1:
        return arr.astype(np.int64)
    key = np.lexsort((arr[:, Q0], arr[:, HI_S], arr[:, HI_A], arr[:, LO_S], arr[:, LO_A]))
    arr = arr[key]
    merged = [list(arr[0])]
    for t in arr[1:]:
        m = merged[-1]
        if m[2:] == list(t[2:]) and m[Q1] == t[Q0]:
            m[Q1] = t[Q1]
        else:
            merged.append(list(t))
    res = np.array(merged, dtype=np.int64)
    lo0 = res[:, LO_A] + res[:, LO_S] * res[:, Q0]
    return res[np.lexsort((lo0, res[:, Q0]))]


def clip(traps: np.ndarray, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> list[tuple]:
    """Cells of ``traps`` inside rows [q_lo, q_hi) x keys [k_lo, k_hi), as trapezoids."""
    res = []
    for t in traps:
        q0, q1 = max(int(t[Q0]), q_lo), min(int(t[Q1]), q_hi)
        if q0 >= q1:
            continue
        lo_a, lo_s, hi_a, hi_s = (int(x) for x in t[2:])
        # rows where a sloped line crosses the clip bound
        pts = {q0, q1}
        if lo_s:
            pts.add(k_lo - lo_a)  # lo(i) >= k_lo from here on
        if hi_s:
            pts.add(k_hi - hi_a + 1)  # hi(i) > k_hi from here on
        pts = sorted(p for p in pts if q0 <= p <= q1)
        for r0, r1 in zip(pts[:-1], pts[1:]):
            if r0 >= r1:
                continue
            if lo_s and lo_a + r0 >= k_lo:
                la, ls = lo_a, 1
            else:
                la, ls = max(lo_a + lo_s * r0, k_lo) if not lo_s else k_lo, 0
            if hi_s and hi_a + r0 <= k_hi:
                ha, hs = hi_a, 1
            else:
                ha, hs = min(hi_a + hi_s * r0, k_hi) if not hi_s else k_hi, 0
            a, b = _nonempty_rows(r0, r1, la, ls, ha, hs)
            if a < b:
                res.append((a, b, la, ls, ha, hs))
    return res


def shift_rows(traps: np.ndarray, d: int) -> np.ndarray:
    """``traps`` moved by ``d`` rows (int64 [n, 6]): row ``i`` becomes row ``i + d`` with the same keys."""
    t = np.asarray(traps, dtype=np.int64).reshape(-1, 6).copy()
    t[:, Q0] += d
    t[:, Q1] += d
    t[:, LO_A] -= t[:, LO_S] * d
    t[:, HI_A] -= t[:, HI_S] * d
    return t


def traps_to_tiles(traps: np.ndarray, q_runs, k_runs) -> np.ndarray:
    """Tiles (int32 [n, 5]) of the cells of ``traps`` (int64 [n, 6]) for queries laid out as the
    concatenation of the row runs ``q_runs`` and keys as the concatenation of the key runs ``k_runs``
    (int [m, 2] half-open). ``q_runs=None``: the trapezoids' rows are already the query positions (no
    row clipping or shift). Neighbour tiles are joined (``merge_tiles``)."""
    traps = np.asarray(traps, dtype=np.int64).reshape(-1, 6)
    k_runs = np.asarray(k_runs, dtype=np.int64).reshape(-1, 2)
    if q_runs is None:
        q_list = [(int(traps[:, 0].min()) if len(traps) else 0, int(traps[:, 1].max()) if len(traps) else 0, 0)]
    else:
        q_runs = np.asarray(q_runs, dtype=np.int64).reshape(-1, 2)
        qo = np.concatenate([[0], np.cumsum(q_runs[:, 1] - q_runs[:, 0])])
        q_list = [(int(a), int(b), int(qo[i]) - int(a)) for i, (a, b) in enumerate(q_runs.tolist())]
    ko = np.concatenate([[0], np.cumsum(k_runs[:, 1] - k_runs[:, 0])])
    klo = traps[:, LO_A] + traps[:, LO_S] * traps[:, Q0]  # smallest key of each trapezoid
    khi = traps[:, HI_A] + traps[:, HI_S] * (traps[:, Q1] - 1)  # one past its largest key
    tiles = []
    for qa, qb, dq in q_list:
        rows = (traps[:, Q0] < qb) & (traps[:, Q1] > qa)
        for j, (ka, kb) in enumerate(k_runs.tolist()):
            sel = rows & (klo < kb) & (khi > ka)
            if not sel.any():
                continue
            dk = int(ko[j]) - ka
            for t in clip(traps[sel], qa, qb, ka, kb):
                q0, q1, k0, k1, kind = trap_to_slice(t)
                tiles.append((q0 + dq, q1 + dq, k0 + dk, k1 + dk, kind))
    return merge_tiles(tiles)


def traps_to_dense(traps: np.ndarray, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Boolean [seqlen_q, seqlen_k] picture of ``traps`` (tests and small sizes only)."""
    d = np.zeros((seqlen_q, seqlen_k), dtype=bool)
    j = np.arange(seqlen_k)
    for q0, q1, lo_a, lo_s, hi_a, hi_s in np.asarray(traps, dtype=np.int64).reshape(-1, 6):
        i = np.arange(q0, q1)[:, None]
        d[q0:q1] |= (j[None, :] >= lo_a + lo_s * i) & (j[None, :] < hi_a + hi_s * i)
    return d


def _join_rows(arr: np.ndarray) -> np.ndarray:
    """Join trapezoids of the same rows that touch on every row (the right end line of one is the
    left end line of the next): their union is one trapezoid, (left's lo, right's hi)."""
    lo0 = arr[:, LO_A] + arr[:, LO_S] * arr[:, Q0]
    arr = arr[np.lexsort((lo0, arr[:, Q1], arr[:, Q0]))]
    merged = [list(arr[0])]
    for t in arr[1:].tolist():
        m = merged[-1]
        if m[Q0] == t[Q0] and m[Q1] == t[Q1] and m[HI_A] == t[LO_A] and m[HI_S] == t[LO_S]:
            m[HI_A], m[HI_S] = t[HI_A], t[HI_S]
        else:
            merged.append(t)
    return np.array(merged, dtype=np.int64)


def merge_tiles(tiles) -> np.ndarray:
    """The fewest-pieces form of a cell-disjoint tile list (int [n, 5] of (q0, q1, k0, k1, kind), any
    one coordinate system): tiles that touch on every row of the same rows join into one (full keys
    followed by a causal tile become one causal tile), and tiles that continue the same two lines
    on adjacent rows join too; repeated until nothing joins. Same cells; int32 [m, 5] sorted by (q0, k0).

    A plan's tiles are built per mask slice and per run of keys; after the keys are laid out in a
    rank's buffer, slices of far-apart global blocks can be neighbours (the strided mask's blocks of one
    residue class form one causal tile), which lets a backend run them as one dense piece."""
    t = np.asarray(tiles, dtype=np.int64).reshape(-1, 5)
    if len(t) <= 1:
        return t.astype(np.int32)
    arr = [slice_to_trap(*x) for x in t.tolist()]
    arr = np.array([a for a in arr if a is not None], dtype=np.int64).reshape(-1, 6)
    n = len(arr) + 1
    while 1 < len(arr) < n:
        n = len(arr)
        arr = _coalesce(_join_rows(arr))
    out = np.array([trap_to_slice(a) for a in arr.tolist()], dtype=np.int64).reshape(-1, 5)
    return out[np.lexsort((out[:, 2], out[:, 0]))].astype(np.int32)


def _pieces(r0: int, r1: int, a1: int, s1: int, a2: int, s2: int, upper: bool) -> list[tuple[int, int, int, int]]:
    """Rows [r0, r1) cut where lines (a1 + s1 i) and (a2 + s2 i) cross; each piece with the larger line
    (``upper``) or the smaller one: [(p0, p1, a, s)]."""
    if s1 == s2:
        a = max(a1, a2) if upper else min(a1, a2)
        return [(r0, r1, a, s1)]
    # (s1 - s2) is +1 or -1: line 1 - line 2 = (a1 - a2) + (s1 - s2) i changes sign once
    c = a2 - a1 if s1 > s2 else a1 - a2 + 1  # first row where the rising line is at least the other
    rising, flat = ((a1, s1), (a2, s2)) if s1 > s2 else ((a2, s2), (a1, s1))
    before, after = (flat, rising) if upper else (rising, flat)
    out = []
    if r0 < min(c, r1):
        out.append((r0, min(c, r1)) + before)
    if max(c, r0) < r1:
        out.append((max(c, r0), r1) + after)
    return out


def intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cells in both trapezoid lists ``a`` and ``b`` (int64 [n, 6] each), canonical (``union``)."""
    a = np.asarray(a, dtype=np.int64).reshape(-1, 6)
    b = np.asarray(b, dtype=np.int64).reshape(-1, 6)
    out = []
    for t in a.tolist():
        rows = (b[:, Q0] < t[Q1]) & (b[:, Q1] > t[Q0])
        for u in b[rows].tolist():
            r0, r1 = max(t[Q0], u[Q0]), min(t[Q1], u[Q1])
            for p0, p1, la, ls in _pieces(r0, r1, t[LO_A], t[LO_S], u[LO_A], u[LO_S], upper=True):
                for q0, q1, ha, hs in _pieces(p0, p1, t[HI_A], t[HI_S], u[HI_A], u[HI_S], upper=False):
                    n0, n1 = _nonempty_rows(q0, q1, la, ls, ha, hs)
                    if n0 < n1:
                        out.append((n0, n1, la, ls, ha, hs))
    return union(out)
