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
- ``documents``: whole independent segments of the mask (packed documents) per rank by area,
  cut only where balance or the token quotas need it, then balanced by trades of head / tail
  pieces: for packed documents almost no key leaves its rank (``auto`` tries it when the mask has
  more independent segments than ranks).
- ``hierarchical``: node layout first (least inter-node keys among balanced node-level candidates),
  then each node's rows dealt to its GPUs in order and balanced by swaps. Without a multi-node
  topology the whole sequence is one node.
- ``auto`` (default): evaluates the candidates above and keeps the one with the least key traffic
  among those within the imbalance target, else the best balanced one.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

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


def _grid(seqlen: int, c: int) -> np.ndarray:
    """int64 bounds of [0, seqlen) cut every ``c`` tokens (the last chunk shorter)."""
    return np.append(np.arange(0, seqlen, c, dtype=np.int64), seqlen)


@dataclass(frozen=True)
class Chunking:
    """The inputs the chunk solvers (``greedy``, ``swap_balanced``, ``hierarchical``) share: the mask's
    row-area ``prefix`` (int64 [seqlen + 1]), the largest ``chunk_size`` to try, the mask's ``key_spans``
    and the imbalance target ``tol``."""

    prefix: np.ndarray
    chunk_size: int
    key_spans: "KeySpans"
    tol: float

    def chunk(self, seqlen: int, cp: int) -> int:
        """Largest power-of-two chunk <= ``chunk_size`` whose heaviest chunk is at most ``tol/2`` of a
        rank's mean area, so that largest-first assignment can balance to about ``tol``."""
        prefix = self.prefix
        limit = self.tol * float(prefix[-1]) / cp / 2
        c = self.chunk_size
        while c > 1:
            b = _grid(seqlen, c)
            if (prefix[b[1:]] - prefix[b[:-1]]).max() <= limit or seqlen // c >= 64 * cp:
                break
            c //= 2
        return c

    def grid(self, seqlen: int, cp: int) -> np.ndarray:
        """int64 bounds of the equal chunks of ``chunk`` tokens."""
        return _grid(seqlen, self.chunk(seqlen, cp))


def greedy(
    seqlen: int, cp: int, inputs: Chunking, *, slack_frac: float = 0.25, split_heavy: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Largest-area-first assignment of equal chunks, equal chunk counts per rank, key affinity as
    the tie-break among ranks whose load is within ``tol/4`` of the least loaded (see module doc).
    ``split_heavy`` first deals chunks too heavy to place whole out to all ranks in cp pieces."""
    prefix, key_spans, tol = inputs.prefix, inputs.key_spans, inputs.tol
    total = float(prefix[-1])
    bounds = inputs.grid(seqlen, cp)
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
    n_free = n - len(dealt)
    hi_cap, n_hi = -(-n_free // cp), n_free % cp  # n_free % cp ranks may hold one chunk more
    slack = slack_frac * tol * total / cp
    # One chunk at a time in Python scalars (the same float64 sums as numpy): ``ranked`` holds (load,
    # rank) of the ranks with room, sorted, so the near-ties are a prefix of it; ``placed`` the sorted
    # indices of placed chunks, so a long key run without any is skipped.
    load_l, count, own = load.tolist(), [0] * cp, owner.tolist()
    size_l, area_l = size.tolist(), area.tolist()
    first_l, last_l, starts_l = first.tolist(), last.tolist(), starts.tolist()
    placed = sorted(dealt)
    long_runs = bool(len(first)) and bool((last - first >= 32).any())  # else ``placed`` is never read
    at_hi = 0  # ranks holding hi_cap chunks

    def room(cap):
        return sorted((load_l[r], r) for r in range(cp) if count[r] < cap)

    cap = hi_cap  # no rank is full yet
    ranked = room(cap)
    for i in np.lexsort((np.arange(n), -area)).tolist():
        if i in dealt:
            continue
        r = ranked[0][1]  # least loaded, lowest rank first
        thr = ranked[0][0] + slack
        if len(ranked) > 1 and ranked[1][0] <= thr:  # near-ties: prefer the rank holding the chunk's keys
            gain = {}
            for j in range(starts_l[i], starts_l[i + 1]):
                f, l = first_l[j], last_l[j]
                if l - f < 32:
                    for k in range(f, l + 1):
                        o = own[k]
                        if o >= 0:
                            gain[o] = gain.get(o, 0) + size_l[k]
                elif bisect.bisect_left(placed, f) != bisect.bisect_right(placed, l):
                    o = owner[f : l + 1]
                    w = np.bincount(o[o >= 0], weights=size[f : l + 1][o >= 0], minlength=cp)
                    for o in np.nonzero(w)[0].tolist():
                        gain[o] = gain.get(o, 0) + int(w[o])
            best = [(-g, load_l[o], o) for o, g in gain.items() if g > 0 and count[o] < cap and load_l[o] <= thr]
            if best:
                r = min(best)[2]
        ranked.pop(bisect.bisect_left(ranked, (load_l[r], r)))
        owner[i] = own[i] = r
        if long_runs:
            bisect.insort(placed, i)
        load_l[r] += area_l[i]
        count[r] += 1
        at_hi += count[r] == hi_cap
        new_cap = hi_cap if (n_hi == 0 or at_hi < n_hi) else n_free // cp
        if new_cap != cap:
            cap, ranked = new_cap, room(new_cap)
        elif count[r] < cap:
            bisect.insort(ranked, (load_l[r], r))
    return bounds, owner


def swap_balanced(seqlen: int, cp: int, inputs: Chunking) -> tuple[np.ndarray, np.ndarray]:
    """Start from the contiguous layout (equal chunks) and swap chunks between the most and the
    least loaded ranks until within ``tol/2``: locality is kept wherever balance allows. Each swap
    moves the pair whose area difference is closest to half the load gap; among pairs within 10% of
    that, the one whose moved chunks need the fewest keys the receiving rank does not own."""
    prefix, key_spans, tol = inputs.prefix, inputs.key_spans, inputs.tol
    bounds = inputs.grid(seqlen, cp)
    n = len(bounds) - 1
    area = (prefix[bounds[1:]] - prefix[bounds[:-1]]).astype(np.float64)
    owner = (np.arange(n) * cp // n).astype(np.int32)
    load = np.bincount(owner, weights=area, minlength=cp)
    target = float(prefix[-1]) / cp
    first, last, starts = key_spans.chunk_runs(bounds)
    size = np.diff(bounds)
    # held[r, k]: tokens of the chunks before chunk k that rank r owns (kept up to date by the swaps)
    held = np.zeros((cp, n + 1), dtype=np.int64)
    held[owner, np.arange(1, n + 1)] = size
    held = np.cumsum(held, axis=1)
    tot = np.concatenate([[0], np.cumsum(size)])
    run_keys = tot[last + 1] - tot[first]  # key tokens of each key run

    def foreign(xs, rs):  # per chunk xs[i], the key tokens its runs need that rank rs[i] does not own
        cnt = starts[xs + 1] - starts[xs]
        j = np.repeat(starts[xs] - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))
        r = np.repeat(rs, cnt)
        v = run_keys[j] - held[r, last[j] + 1] + held[r, first[j]]
        return np.bincount(np.repeat(np.arange(len(xs)), cnt), weights=v, minlength=len(xs))  # exact: ints

    mine = [np.nonzero(owner == r)[0] for r in range(cp)]  # each rank's chunks, ascending
    for _ in range(4 * n):
        a, b = int(np.argmax(load)), int(np.argmin(load))
        gap = load[a] - load[b]
        if target <= 0 or load[a] / target - 1 <= tol / 2 or gap <= 0:
            break
        xa, xb = mine[a], mine[b]
        delta = area[xa][:, None] - area[xb]
        # min(delta, gap - delta) is positive exactly for 0 < delta < gap: no pair else can be picked
        gain = np.minimum(delta, gap - delta)
        best = gain.max()
        if best <= 0:
            break
        ii, jj = np.nonzero(gain >= 0.9 * best)
        if len(ii) > 16:  # the 16 largest gains, ties in row-major order
            v = gain[ii, jj]
            sel = np.flatnonzero(v >= np.partition(v, len(v) - 16)[len(v) - 16])
            sel = sel[np.argsort(-v[sel], kind="stable")[:16]]
            ii, jj = ii[sel], jj[sel]
        m = len(ii)
        cost = foreign(np.concatenate([xa[ii], xb[jj]]), np.repeat(np.array([b, a]), m))
        k = int(np.argmin(cost[:m] + cost[m:]))
        x, y = xa[ii[k]], xb[jj[k]]
        owner[x], owner[y] = b, a
        for r, xs, i, z in ((a, xa, ii[k], y), (b, xb, jj[k], x)):
            mine[r] = xs.copy()
            mine[r][i] = z
            mine[r].sort()
        for z, src, dst in ((x, a, b), (y, b, a)):
            held[src, z + 1:] -= size[z]
            held[dst, z + 1:] += size[z]
        d = area[x] - area[y]
        load[a] -= d
        load[b] += d
    return bounds, owner


def independent_cuts(traps: np.ndarray, seqlen: int) -> np.ndarray:
    """Sorted positions ``0 = c_0 < ... < c_m = seqlen`` where the mask falls apart: no row on one side
    of a cut keeps a key on the other (document boundaries of packed documents). O(traps log traps + cuts).

    A trapezoid's rows ``>= p`` keep a key ``< p`` exactly for ``p`` in ``(lo(q0), q1)`` when its lower
    line is flat or lies below the diagonal (else never); its rows ``< p`` keep a key ``>= p`` exactly
    for ``p`` in ``(q0, hi(q1 - 1))`` when its upper line is flat or lies above the diagonal."""
    t = np.asarray(traps, dtype=np.int64).reshape(-1, 6)
    q0, q1, lo_a, lo_s, hi_a, hi_s = (t[:, j] for j in range(6))
    m1 = (lo_s == 0) | (lo_a < 0)
    m2 = (hi_s == 0) | (hi_a > 1)
    a = np.concatenate([(lo_a + lo_s * q0)[m1] + 1, q0[m2] + 1])  # blocked p in [a, b)
    b = np.concatenate([q1[m1], (hi_a + hi_s * (q1 - 1))[m2]])
    a, b = np.clip(a, 1, seqlen), np.clip(b, 1, seqlen)
    a, b = a[a < b], b[a < b]
    # the free positions are the gaps between the blocked intervals, merged
    o = np.argsort(a, kind="stable")
    a, b = a[o], np.maximum.accumulate(b[o])
    new = np.ones(len(a), dtype=bool)
    new[1:] = a[1:] > b[:-1]
    last = np.append(np.flatnonzero(new)[1:] - 1, len(a) - 1)  # each merged interval's last member
    gap0 = np.concatenate([[0], b[last]]) if len(a) else np.zeros(1, np.int64)
    gap1 = np.append(a[new], seqlen)
    n = gap1 - gap0
    free = np.repeat(gap0 - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
    return np.append(free, seqlen).astype(np.int64)


def documents(
    seqlen: int,
    cp: int,
    *,
    prefix: np.ndarray,
    traps: np.ndarray,
    tol: float,
    cuts: np.ndarray | None = None,
    **_,
) -> tuple[np.ndarray, np.ndarray]:
    """Whole independent segments (documents) per rank, cut only where balance or the token quotas
    need it (``cuts``: ``independent_cuts`` when already known). Works on any mask; pays off when
    the mask has many more segments than ranks (``auto`` only tries it then).

    The mask's independent segments (``independent_cuts``) need no key from outside themselves, so a
    rank holding whole segments receives nothing. (1) Segments go largest area first to the least
    loaded rank with token room for them; those that fit nowhere are cut to fill the ranks' leftover
    room (each piece needs the keys of the pieces before it in its segment). (2) While the most loaded
    rank is above ``tol / 2`` of the mean, it trades with the least loaded one: a whole unit against a
    head or tail piece of the same token count cut off a unit of the other rank, picking the trade
    whose area shift is closest to half their gap and, among those within 10% of it, the one that
    makes the fewest keys remote. Token counts stay exactly the contiguous layout's."""
    cuts = independent_cuts(traps, seqlen) if cuts is None else cuts
    whole = (np.array([0, seqlen], dtype=np.int64), np.zeros(1, dtype=np.int32))  # one node of cp GPUs
    return node_documents(seqlen, cp, prefix=prefix, tol=tol, gpus_per_node=cp, node_layout=whole, cuts=cuts)


def node_documents(
    seqlen: int,
    cp: int,
    *,
    prefix: np.ndarray,
    tol: float,
    gpus_per_node: int,
    node_layout: tuple[np.ndarray, np.ndarray],
    cuts: np.ndarray,
    **_,
) -> tuple[np.ndarray, np.ndarray]:
    """Inside each node of ``node_layout`` (bounds, node owner), the ``documents`` packing over the
    node's rows cut at the mask's independent ``cuts``: whole documents per GPU, equal token shares of
    the node. Rank = node * gpus_per_node + local GPU."""
    g = gpus_per_node
    nb, no = node_layout
    if len(cuts) - 1 > 64 * cp:  # bound the work: neighbours merge into segments of >= S / (64 cp)
        cuts = _coarsen(cuts, seqlen // (64 * cp))
    bounds = np.unique(np.concatenate([nb, cuts]))
    node = no[np.searchsorted(nb, bounds[:-1], side="right") - 1].astype(np.int64)
    seg = cuts[np.searchsorted(cuts, bounds[:-1], side="right") - 1]
    target = float(prefix[-1]) / cp
    out = []
    for n, idx in _groups(node):
        units = np.stack([bounds[idx], bounds[idx + 1], seg[idx]], axis=1)
        u = _pack(units, prefix, np.diff(even_bounds(int((units[:, 1] - units[:, 0]).sum()), g)), target, tol)
        u[:, 2] += n * g
        out.append(u)
    u = np.concatenate(out)
    u = u[np.argsort(u[:, 0])]
    return np.append(u[:, 0], seqlen), u[:, 2].astype(np.int32)


def _pack(units: np.ndarray, prefix: np.ndarray, room: np.ndarray, target: float, tol: float) -> np.ndarray:
    """Steps (1) and (2) of ``documents`` for units int64 [n, 3] (start, end, segment start) over
    ``len(room)`` ranks with token quotas ``room``; returns [m, 4] (start, end, owner, segment start)."""
    s0, s1, seg = units[:, 0], units[:, 1], units[:, 2]
    size = s1 - s0
    area = (prefix[s1] - prefix[s0]).astype(np.float64)
    # one unit at a time in Python scalars (loads are sums of whole cells: exact in float64);
    # ``ranked``: (load, rank) of the ranks with room left, sorted, so the least loaded one that
    # fits is the first that does
    room_l, load_l = room.tolist(), [0.0] * len(room)
    ranked = sorted((0.0, r) for r in range(len(room)) if room_l[r] > 0)
    s0_l, s1_l, seg_l, size_l, area_l = s0.tolist(), s1.tolist(), seg.tolist(), size.tolist(), area.tolist()
    out = []
    deferred = []

    def place(k, r, a, b, cells):
        ranked.pop(k)
        load_l[r] += cells
        room_l[r] -= b - a
        if room_l[r] > 0:
            bisect.insort(ranked, (load_l[r], r))

    for i in np.lexsort((s0, -size, -area)).tolist():
        k = next((k for k, (_, r) in enumerate(ranked) if room_l[r] >= size_l[i]), None)
        if k is None:
            deferred.append(i)
            continue
        r = ranked[k][1]
        out.append([s0_l[i], s1_l[i], r, seg_l[i]])
        place(k, r, s0_l[i], s1_l[i], area_l[i])
    for i in sorted(deferred, key=lambda i: s0_l[i]):  # cut to fill leftover room, least loaded first
        a = s0_l[i]
        while a < s1_l[i]:
            r = ranked[0][1]
            b = min(s1_l[i], a + room_l[r])
            out.append([a, b, r, seg_l[i]])
            place(0, r, a, b, float(prefix[b] - prefix[a]))
            a = b
    return _trade(np.array(out, dtype=np.int64).reshape(-1, 4), prefix, len(room), tol, np.array(load_l), target)


def _coarsen(cuts: np.ndarray, min_size: int) -> np.ndarray:
    """Drop cuts so that every segment but the last has at least ``min_size`` tokens."""
    keep, last = [0], 0
    for c in cuts[1:-1].tolist():
        if c - last >= min_size:
            keep.append(c)
            last = c
    return np.array(keep + [int(cuts[-1])], dtype=np.int64)


_TRADES = ((None, False), ("a", True), ("b", True), ("a", False), ("b", False))  # (side cut, tail?)


def _trade(u: np.ndarray, prefix: np.ndarray, cp: int, tol: float, load: np.ndarray, target: float) -> np.ndarray:
    """Balancing trades of ``documents`` (its step 2) on units ``[start, end, owner, segment start]``
    over ``cp`` ranks whose mean load is ``target``."""
    ranks = range(cp)
    for _ in range(8 * cp + 4 * len(u)):
        lo = load.tolist()  # Python floats for the small picks: numpy's per-call cost dominates on cp values
        a, b = max(ranks, key=lo.__getitem__), min(ranks, key=lo.__getitem__)  # first of ties, as argmax
        gap = load[a] - load[b]
        if target <= 0 or load[a] / target - 1 <= tol / 2 or gap <= 0:
            break
        ia, ib = np.flatnonzero(u[:, 2] == a), np.flatnonzero(u[:, 2] == b)
        sa, ea, ga = u[ia, 0], u[ia, 1], u[ia, 3]  # pairs (unit of a, unit of b), by flat index i * nb + j
        sb, eb, gb = u[ib, 0], u[ib, 1], u[ib, 3]
        la, lb = ea - sa, eb - sb
        ar_a, ar_b = prefix[ea] - prefix[sa], prefix[eb] - prefix[sb]
        nb = len(ib)
        # per trade of _TRADES, on the pairs it applies to (tokens traded: the smaller unit's size), the area
        # it shifts from a to b and the keys it makes remote, approximately: a tail needs its segment's keys
        # before it, and the rest of a unit whose head leaves needs that head (plus keys before the unit)
        eq, gt, lt = (np.flatnonzero(f(la[:, None], lb)) for f in (np.equal, np.greater, np.less))
        i0, j0, i1, j1, i2, j2 = eq // nb, eq % nb, gt // nb, gt % nb, lt // nb, lt % nb
        t1, t2 = lb[j1], la[i2]
        trades = (  # (pairs, area shift, remote keys)
            (eq, ar_a[i0] - ar_b[j0], np.zeros(len(eq))),
            (gt, prefix[ea[i1]] - prefix[ea[i1] - t1] - ar_b[j1], ea[i1] - t1 - ga[i1]),
            (lt, ar_a[i2] - prefix[eb[j2]] + prefix[eb[j2] - t2], eb[j2] - t2 - gb[j2]),
            (gt, prefix[sa[i1] + t1] - prefix[sa[i1]] - ar_b[j1], sa[i1] - ga[i1] + t1),
            (lt, ar_a[i2] - prefix[sb[j2] + t2] + prefix[sb[j2]], sb[j2] - gb[j2] + t2),
        )
        gains = [np.minimum(d, gap - d) for _, d, _ in trades]  # positive exactly for 0 < d < gap
        best = max((g.max() for g in gains if len(g)), default=0.0)
        if best <= 0:
            break
        # least remote keys, then largest gain, among trades within 10% of the best gain; ties go to
        # the first trade kind, then row-major order (lexsort is stable)
        hits = [np.flatnonzero(g >= 0.9 * best) for g in gains]
        g = np.concatenate([gains[k][h] for k, h in enumerate(hits)])
        cost = np.concatenate([trades[k][2][h] for k, h in enumerate(hits)]).astype(np.float64)
        p = int(np.lexsort((-g, cost))[0])
        ends = list(itertools.accumulate(len(h) for h in hits))
        k = bisect.bisect_right(ends, p)
        pair = int(trades[k][0][hits[k][p - (ends[k - 1] if k else 0)]])
        (side, tail), i, j = _TRADES[k], pair // nb, pair % nb
        n = int(min(la[i], lb[j]))  # tokens traded
        ra, rb = ia[i], ib[j]
        if side is None:
            u[ra, 2], u[rb, 2] = b, a
        else:  # cut the piece off the unit of ``side``; it and the other side's whole unit change owner
            cut_row, whole_row, to = (ra, rb, b) if side == "a" else (rb, ra, a)
            st, e, _, seg = (int(x) for x in u[cut_row])
            c = e - n if tail else st + n
            u[cut_row, :2] = [st, c] if tail else [c, e]
            u[whole_row, 2] = a if side == "a" else b
            u = np.concatenate([u, np.array([[c, e, to, seg] if tail else [st, c, to, seg]], dtype=np.int64)])
        load = np.bincount(u[:, 2], weights=(prefix[u[:, 1]] - prefix[u[:, 0]]).astype(np.float64), minlength=cp)
    return u


def hierarchical(
    seqlen: int, cp: int, inputs: Chunking, *, gpus_per_node: int, node_layout: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Node first, then GPUs: ``node_layout`` = (bounds, node owner) from a solver run with
    cp = nodes (chosen by the caller for least inter-node keys under balance). Each node's rows are
    cut into fine chunks, dealt to its GPUs in order (equal token shares: neighbours stay together,
    keys mostly stay on the GPU), then chunks of equal size are swapped between the most and least
    loaded GPUs of the node until within ``tol/2`` (the swap whose area difference is closest to half
    the gap).
    Rank = node * gpus_per_node + local GPU."""
    prefix, tol = inputs.prefix, inputs.tol
    g = gpus_per_node
    nb, no = node_layout
    # fine chunks, at least two per GPU's share; node boundaries are cuts too (pieces of a documents
    # node layout can be far smaller than a chunk: they stay whole)
    c = max(1, min(inputs.chunk(seqlen, cp), seqlen // (2 * cp)))
    grid = np.arange(0, seqlen, c, dtype=np.int64)
    bounds = np.unique(np.concatenate([nb, grid, [seqlen]]))
    node = no[np.searchsorted(nb, bounds[:-1], side="right") - 1].astype(np.int64)
    # cut where a node's running token count (in sequence order) reaches each GPU's equal share
    extra = []
    for _, idx in _groups(node):
        cum = np.cumsum(bounds[idx + 1] - bounds[idx])
        for share in even_bounds(int(cum[-1]), g)[1:-1]:
            j = int(np.searchsorted(cum, share, side="left"))
            extra.append(bounds[idx[j] + 1] - (cum[j] - share))
    bounds = np.unique(np.concatenate([bounds, np.asarray(extra, dtype=np.int64)]))
    node = no[np.searchsorted(nb, bounds[:-1], side="right") - 1].astype(np.int64)
    size = np.diff(bounds)
    area = (prefix[bounds[1:]] - prefix[bounds[:-1]]).astype(np.float64)
    owner = np.zeros(len(bounds) - 1, dtype=np.int32)
    target = float(prefix[-1]) / cp
    gpus = range(g)
    for n, idx in _groups(node):
        sz, ar = size[idx], area[idx]
        before = np.cumsum(sz) - sz  # in order, equal token shares
        local = np.searchsorted(even_bounds(int(sz.sum()), g), before, side="right") - 1
        # the loads as Python floats (the same float64 sums): the loop runs thousands of times at hundreds of
        # nodes, and numpy's per-call cost on 8 values would dominate it
        load = np.bincount(local, weights=ar, minlength=g).tolist()
        for _ in range(4 * len(idx)):
            a, b = max(gpus, key=load.__getitem__), min(gpus, key=load.__getitem__)  # first of ties, as argmax
            gap = load[a] - load[b]
            if target <= 0 or load[a] / target - 1 <= tol / 2 or gap <= 0:
                break
            xa, xb = np.flatnonzero(local == a), np.flatnonzero(local == b)
            delta = ar[xa][:, None] - ar[xb][None, :]
            ok = (delta > 0) & (delta < gap) & (sz[xa][:, None] == sz[xb][None, :])
            if not ok.any():
                break
            i, j = divmod(int(np.argmin(np.where(ok, np.abs(delta - gap / 2), np.inf))), len(xb))
            local[xa[i]], local[xb[j]] = b, a
            d = float(delta[i, j])
            load[a] -= d
            load[b] += d
        owner[idx] = (n * g + local).astype(np.int32)
    return bounds, owner


def _groups(labels: np.ndarray):
    """(label, ascending positions holding it) for each distinct label, in label order: what ``np.nonzero(labels
    == x)`` per ``np.unique`` value gives, in one sort."""
    order = np.argsort(labels, kind="stable")
    cuts = np.flatnonzero(np.diff(labels[order])) + 1
    return [(int(labels[p[0]]), p) for p in np.split(order, cuts)] if len(order) else []


SOLVERS = ("auto", "contiguous", "zigzag", "greedy", "swap", "documents", "hierarchical")
