"""Dispatch solvers: which rank owns which chunk of the sequence.

Every solver returns ``(bounds, owner)``: ``bounds`` int64 [n + 1] cuts the sequence into ``n``
chunks and ``owner`` int32 [n] names each chunk's rank. Queries never move after dispatch: a rank
computes attention for the rows it owns, so its compute is the mask area of its rows and its remote
traffic is the keys those rows need that other ranks own.

Token counts per rank are kept equal up to one chunk (MLP and projection work is per token, so a
plan that balances attention by giving one rank most of the tokens would only move the imbalance).

- ``contiguous``: rank r owns the r-th of cp equal runs. Best locality; balanced only for
  uniform masks (full, sliding window, many short documents).
- ``zigzag``: 2*cp equal runs, rank r owns runs r and 2cp-1-r (Megatron's causal layout); the
  generalisation ``zigzag{m}`` snakes over m*cp runs.
- ``greedy``: chunks sorted by area (largest first) go to the least-loaded rank that has token room,
  preferring among near-ties the rank that already holds the keys the chunk needs. Chunks whose
  rows are too heavy to balance (dense global rows) are split finer first.
- ``hierarchical``: node layout first (least inter-node keys among balanced node-level candidates),
  then each node's rows dealt to its GPUs in order and balanced by swaps. Without a multi-node
  topology the whole sequence is one node.
- ``auto`` (default): evaluates the candidates above and keeps the one with the least key traffic
  among those within the imbalance target, else the best balanced one.
"""

from __future__ import annotations

import numpy as np


def even_bounds(seqlen: int, parts: int) -> np.ndarray:
    """Cut [0, seqlen) into ``parts`` runs whose sizes differ by at most one token."""
    return (np.arange(parts + 1, dtype=np.int64) * seqlen) // parts


def contiguous(seqlen: int, cp: int, **_) -> tuple[np.ndarray, np.ndarray]:
    return even_bounds(seqlen, cp), np.arange(cp, dtype=np.int32)


def zigzag(seqlen: int, cp: int, rounds: int = 2, **_) -> tuple[np.ndarray, np.ndarray]:
    """``rounds * cp`` equal runs dealt out in a snake: 0..cp-1, cp-1..0, 0..cp-1, ..."""
    n = rounds * cp
    if n > seqlen:
        return contiguous(seqlen, cp)
    r = np.arange(n) % cp
    rev = (np.arange(n) // cp) % 2 == 1
    owner = np.where(rev, cp - 1 - r, r).astype(np.int32)
    return even_bounds(seqlen, n), owner


def greedy_chunk(seqlen: int, cp: int, prefix: np.ndarray, chunk_size: int, tol: float) -> int:
    """Largest power-of-two chunk <= ``chunk_size`` whose heaviest chunk is at most ``tol/2`` of a
    rank's mean area, so that largest-first assignment can balance to about ``tol``."""
    limit = tol * float(prefix[-1]) / cp / 2
    c = chunk_size
    while c > 1:
        b = np.append(np.arange(0, seqlen, c, dtype=np.int64), seqlen)
        if (prefix[b[1:]] - prefix[b[:-1]]).max() <= limit or seqlen // c >= 64 * cp:
            break
        c //= 2
    return c


def greedy(
    seqlen: int,
    cp: int,
    *,
    prefix: np.ndarray,
    chunk_size: int,
    key_spans: "KeySpans",
    tol: float,
    slack_frac: float = 0.25,
    split_heavy: bool = False,
    **_,
) -> tuple[np.ndarray, np.ndarray]:
    """Largest-area-first assignment of equal chunks, equal chunk counts per rank, key affinity as
    the tie-break among ranks whose load is within ``tol/4`` of the least loaded (see module doc).
    ``split_heavy`` first deals chunks too heavy to place whole out to all ranks in cp pieces."""
    total = float(prefix[-1])
    c = greedy_chunk(seqlen, cp, prefix, chunk_size, tol)
    bounds = np.append(np.arange(0, seqlen, c, dtype=np.int64), seqlen)
    # Chunks still too heavy to place whole (dense rows, e.g. global tokens) are cut into cp equal
    # pieces dealt one per rank, which keeps token counts equal and spreads their area evenly.
    area = prefix[bounds[1:]] - prefix[bounds[:-1]]
    heavy = np.nonzero((area > tol * total / cp / 2) & (np.diff(bounds) >= cp))[0] if split_heavy else []
    dealt = {}
    if len(heavy):
        coarse = bounds
        cuts = [coarse] + [coarse[h] + even_bounds(int(coarse[h + 1] - coarse[h]), cp)[1:-1] for h in heavy]
        bounds = np.unique(np.concatenate(cuts))
        for k, h in enumerate(heavy):
            first = int(np.searchsorted(bounds, coarse[h]))
            for j in range(cp):
                dealt[first + j] = (j + k) % cp
    n = len(bounds) - 1
    area = (prefix[bounds[1:]] - prefix[bounds[:-1]]).astype(np.float64)
    size = np.diff(bounds)
    first, last, starts = key_spans.chunk_runs(bounds)
    owner = np.full(n, -1, dtype=np.int32)
    load = np.zeros(cp)
    for i, r in dealt.items():
        owner[i] = r
        load[r] += area[i]
    count = np.zeros(cp, dtype=np.int64)
    n_free = n - len(dealt)
    hi_cap, n_hi = -(-n_free // cp), n_free % cp  # n_free % cp ranks may hold one chunk more
    slack = slack_frac * tol * total / cp
    for i in np.lexsort((np.arange(n), -area)):
        if i in dealt:
            continue
        cap = hi_cap if (n_hi == 0 or (count == hi_cap).sum() < n_hi) else n_free // cp
        cand = np.nonzero(count < cap)[0]
        best = load[cand].min()
        near = cand[load[cand] <= best + slack]
        r = int(near[np.argmin(load[near])])
        if len(near) > 1:
            gain = np.zeros(cp)
            for f, l in zip(first[starts[i]:starts[i + 1]], last[starts[i]:starts[i + 1]]):
                o = owner[f : l + 1]
                w = size[f : l + 1]
                gain += np.bincount(o[o >= 0], weights=w[o >= 0], minlength=cp)
            g = gain[near]
            if g.max() > 0:
                r = int(near[np.lexsort((load[near], -g))[0]])
        owner[i] = r
        load[r] += area[i]
        count[r] += 1
    return bounds, owner


def swap_balanced(
    seqlen: int,
    cp: int,
    *,
    prefix: np.ndarray,
    chunk_size: int,
    key_spans: "KeySpans",
    tol: float,
    **_,
) -> tuple[np.ndarray, np.ndarray]:
    """Start from the contiguous layout (equal chunks) and swap chunks between the most and the
    least loaded ranks until within ``tol/2``: locality is kept wherever balance allows. Each swap
    moves the pair whose area difference is closest to half the load gap; among pairs within 10% of
    that, the one whose moved chunks need the fewest keys the receiving rank does not own."""
    c = greedy_chunk(seqlen, cp, prefix, chunk_size, tol)
    bounds = np.append(np.arange(0, seqlen, c, dtype=np.int64), seqlen)
    n = len(bounds) - 1
    area = (prefix[bounds[1:]] - prefix[bounds[:-1]]).astype(np.float64)
    owner = (np.arange(n) * cp // n).astype(np.int32)
    load = np.bincount(owner, weights=area, minlength=cp)
    target = float(prefix[-1]) / cp
    first, last, starts = key_spans.chunk_runs(bounds)
    size = np.diff(bounds)

    def foreign(x, r):  # key tokens chunk x needs that rank r does not own
        tot = 0
        for f, l in zip(first[starts[x]:starts[x + 1]], last[starts[x]:starts[x + 1]]):
            tot += int(size[f : l + 1][owner[f : l + 1] != r].sum())
        return tot

    for _ in range(4 * n):
        a, b = int(np.argmax(load)), int(np.argmin(load))
        gap = load[a] - load[b]
        if target <= 0 or load[a] / target - 1 <= tol / 2 or gap <= 0:
            break
        xa, xb = np.nonzero(owner == a)[0], np.nonzero(owner == b)[0]
        delta = area[xa][:, None] - area[xb][None, :]
        gain = np.where((delta > 0) & (delta < gap), np.minimum(delta, gap - delta), 0.0)
        best = gain.max()
        if best <= 0:
            break
        ii, jj = np.nonzero(gain >= 0.9 * best)
        if len(ii) > 16:
            top = np.argsort(-gain[ii, jj], kind="stable")[:16]
            ii, jj = ii[top], jj[top]
        cost = [foreign(xa[i], b) + foreign(xb[j], a) for i, j in zip(ii, jj)]
        k = int(np.argmin(cost))
        x, y = xa[ii[k]], xb[jj[k]]
        owner[x], owner[y] = b, a
        d = area[x] - area[y]
        load[a] -= d
        load[b] += d
    return bounds, owner


def hierarchical(
    seqlen: int,
    cp: int,
    *,
    prefix: np.ndarray,
    chunk_size: int,
    key_spans: "KeySpans",
    tol: float,
    gpus_per_node: int,
    node_layout: tuple[np.ndarray, np.ndarray],
    **_,
) -> tuple[np.ndarray, np.ndarray]:
    """Node first, then GPUs: ``node_layout`` = (bounds, node owner) from a solver run with
    cp = nodes (chosen by the caller for least inter-node keys under balance). Each node's rows are
    cut into fine chunks, dealt to its GPUs in order (equal chunk counts: neighbours stay together,
    keys mostly stay on the GPU), then chunks are swapped between the most and least loaded GPUs of
    the node until within ``tol/2`` (the swap whose area difference is closest to half the gap).
    Rank = node * gpus_per_node + local GPU."""
    g = gpus_per_node
    nb, no = node_layout
    c = max(1, min(greedy_chunk(seqlen, cp, prefix, chunk_size, tol), max(1, int(np.diff(nb).min()) // 2)))
    grid = np.arange(0, seqlen, c, dtype=np.int64)
    bounds = np.unique(np.concatenate([nb, grid, [seqlen]]))
    node = no[np.searchsorted(nb, bounds[:-1], side="right") - 1].astype(np.int64)
    area = (prefix[bounds[1:]] - prefix[bounds[:-1]]).astype(np.float64)
    owner = np.zeros(len(bounds) - 1, dtype=np.int32)
    target = float(prefix[-1]) / cp
    for n in np.unique(node):
        idx = np.nonzero(node == n)[0]
        local = (np.arange(len(idx)) * g // max(len(idx), 1)).astype(np.int64)  # in order, equal counts
        load = np.bincount(local, weights=area[idx], minlength=g)
        for _ in range(4 * len(idx)):
            a, b = int(np.argmax(load)), int(np.argmin(load))
            gap = load[a] - load[b]
            if target <= 0 or load[a] / target - 1 <= tol / 2 or gap <= 0:
                break
            xa, xb = np.nonzero(local == a)[0], np.nonzero(local == b)[0]
            delta = area[idx[xa]][:, None] - area[idx[xb]][None, :]
            ok = (delta > 0) & (delta < gap)
            if not ok.any():
                break
            i, j = np.unravel_index(np.argmin(np.where(ok, np.abs(delta - gap / 2), np.inf)), delta.shape)
            local[xa[i]], local[xb[j]] = b, a
            load[a] -= delta[i, j]
            load[b] += delta[i, j]
        owner[idx] = (n * g + local).astype(np.int32)
    return bounds, owner


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


SOLVERS = ("auto", "contiguous", "zigzag", "greedy", "swap", "hierarchical")
