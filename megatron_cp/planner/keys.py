"""Which keys each query row needs, and the run algebra the planner reads them with.

A mask is a union of trapezoids (rows ``[r0, r1)``, keys ``[lo(r), hi(r))`` with both bounds non-decreasing in
the row); ``KeySpans`` gives, for a layout's chunks, the key interval each trapezoid's rows in a chunk need.
The run helpers encode sets of token runs per group (``group * W + position``), merge, subtract and cut them at
chunk bounds: what a rank owns, what it lacks and from whom, counted without a loop over ranks or
trapezoids in Python. Used by the solver choice (``choose``), the per-rank plans (``ranks``) and the plan.
"""

from __future__ import annotations

import numpy as np


def merge_runs(runs: np.ndarray) -> np.ndarray:
    """Sort and merge touching/overlapping half-open runs; int64 [n, 2]."""
    if len(runs) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    runs = runs[np.argsort(runs[:, 0], kind="stable")]  # the order of equal starts changes no merged run
    start, end = runs[:, 0], np.maximum.accumulate(runs[:, 1])
    new = np.empty(len(runs), dtype=bool)
    new[0] = True
    np.greater(start[1:], end[:-1], out=new[1:])
    idx = np.flatnonzero(new)
    ends = np.empty_like(idx)
    ends[:-1], ends[-1] = idx[1:] - 1, len(runs) - 1
    return np.stack([start[idx], end[ends]], axis=1).astype(np.int64, copy=False)


def subtract_runs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Runs of ``a`` minus runs of ``b`` (both merged and sorted)."""
    out = []
    j = 0
    for s, e in a.tolist():
        while j < len(b) and b[j, 1] <= s:
            j += 1
        k = j
        while s < e and k < len(b) and b[k, 0] < e:
            if b[k, 0] > s:
                out.append((s, int(b[k, 0])))
            s = max(s, int(b[k, 1]))
            k += 1
        if s < e:
            out.append((s, e))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def positions(runs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Index of global token ``x`` in the concatenation of sorted ``runs`` (x must be covered)."""
    off = np.concatenate([[0], np.cumsum(runs[:, 1] - runs[:, 0])])
    i = np.searchsorted(runs[:, 0], x, side="right") - 1
    return off[i] + x - runs[i, 0]


def run_tokens(runs: np.ndarray) -> int:
    return int((runs[:, 1] - runs[:, 0]).sum())


def runs_to_ids(runs: np.ndarray) -> np.ndarray:
    if len(runs) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in runs.tolist()])


def encode(runs: np.ndarray, group, W: int) -> np.ndarray:
    return runs + (np.asarray(group, dtype=np.int64) * W)[:, None]


def decode(enc: np.ndarray, W: int) -> tuple[np.ndarray, np.ndarray]:
    """(runs, group) of encoded runs."""
    g = enc[:, 0] // W
    return enc - (g * W)[:, None], g


def subtract_merged(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Maximal runs of ``a`` minus ``b`` (each merged: disjoint, sorted), by a sweep: between event
    positions, coverage ``in_a + 2 * in_b`` is 1 exactly where ``a`` is kept."""
    pos = np.concatenate([a[:, 0], a[:, 1], b[:, 0], b[:, 1]])
    step = np.repeat(np.array([1, -1, 2, -2], dtype=np.int64), [len(a), len(a), len(b), len(b)])
    o = np.argsort(pos, kind="stable")
    pos, cover = pos[o], np.cumsum(step[o])
    keep = (cover[:-1] == 1) & (pos[1:] > pos[:-1])
    return merge_runs(np.stack([pos[:-1][keep], pos[1:][keep]], axis=1))


def remote_all(ci, k0, k1, bounds, group) -> tuple[np.ndarray, np.ndarray]:
    """(own runs, remote key runs), encoded by group: per group (``group[c]`` of chunk ``c``: a rank or
    a node), its chunks' merged runs and the merged keys its chunks' rows need (key spans ``(ci, k0,
    k1)`` of ``KeySpans.spans(bounds)``) that it does not own."""
    W = int(bounds[-1]) + 1
    group = np.asarray(group, dtype=np.int64)
    own = merge_runs(encode(np.stack([bounds[:-1], bounds[1:]], axis=1), group, W))
    need = merge_runs(encode(np.stack([k0, k1], axis=1), group[ci], W))
    return own, subtract_merged(need, own)


def remote_counts(ci, k0, k1, bounds, group, n: int) -> np.ndarray:
    """Per group (``group[c]`` of chunk ``c``, ``n`` groups), the key tokens its chunks' rows need (key
    spans ``(ci, k0, k1)``) that it does not own (int64 [n]), by one sweep over the encoded spans (+1
    each) and chunks (+m each, m = spans + 1): a stretch is remote where the count lies in (0, m)."""
    W = int(bounds[-1]) + 1
    off = np.asarray(group, dtype=np.int64) * W
    m = len(k0) + 1
    pos = np.concatenate([k0 + off[ci], k1 + off[ci], bounds[:-1] + off, bounds[1:] + off])
    step = np.repeat(np.array([1, -1, m, -m], dtype=np.int64), [len(k0), len(k0), len(off), len(off)])
    o = np.argsort(pos, kind="stable")
    pos, cover = pos[o], np.cumsum(step[o])[:-1]
    keep = (cover > 0) & (cover < m)
    return np.bincount(pos[:-1][keep] // W, weights=np.diff(pos)[keep], minlength=n).astype(np.int64)


def split_at_chunks(runs, group, bounds, owner) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Non-empty runs cut at the chunk bounds: (pieces [n, 2], each piece's run's group, the rank owning
    its chunk)."""
    c0 = np.searchsorted(bounds, runs[:, 0], side="right") - 1
    n = np.searchsorted(bounds, runs[:, 1], side="left") - c0
    ri = np.repeat(np.arange(len(runs)), n)
    c = np.repeat(c0, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    pieces = np.stack([np.maximum(runs[ri, 0], bounds[c]), np.minimum(runs[ri, 1], bounds[c + 1])], axis=1)
    return pieces, group[ri], np.asarray(owner, dtype=np.int64)[c]


class KeySpans:
    """For each query row range, the key interval it needs: the rows of one trapezoid need the
    contiguous keys ``[lo(first row), hi(last row))`` because both lines are non-decreasing."""

    def __init__(self, traps: np.ndarray, seqlen: int):
        self.traps = traps
        self.seqlen = seqlen

    def chunk_runs(self, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Key chunks each chunk's rows need, as chunk-index runs ``[first[j], last[j]]`` for
        ``j`` in ``starts[c]:starts[c + 1]`` of chunk ``c``."""
        ci, k0, k1 = self.spans(bounds)
        order = np.argsort(ci, kind="stable")
        first = (np.searchsorted(bounds, k0, side="right") - 1)[order]
        last = (np.searchsorted(bounds, k1 - 1, side="right") - 1)[order]
        starts = np.searchsorted(ci[order], np.arange(len(bounds)))
        return first, last, starts

    def spans(self, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(chunk index, key start, key end) for every (trapezoid, chunk) overlap."""
        t = self.traps
        if len(t) == 0:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z
        first = np.searchsorted(bounds, t[:, 0], side="right") - 1
        last = np.searchsorted(bounds, t[:, 1] - 1, side="right") - 1
        reps = last - first + 1
        ti = np.repeat(np.arange(len(t)), reps)
        ci = np.repeat(first, reps) + (np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps))
        tt = t[ti]
        r0 = np.maximum(tt[:, 0], bounds[ci])
        r1 = np.minimum(tt[:, 1], bounds[ci + 1])
        k0 = tt[:, 2] + tt[:, 3] * r0
        k1 = tt[:, 4] + tt[:, 5] * (r1 - 1)
        return ci, k0, k1
