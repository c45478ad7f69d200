"""The optimal chunk assignment of a small instance, as a mixed-integer linear program (scipy's HiGHS).

A yardstick for the heuristic solvers, not a solver ``plan()`` runs: it answers "how far is a layout
from the best one under the same rules?" for a few ranks and a few dozen chunks (UltraAttn's
objective: the busiest rank's received key/value tokens).

The rules are the heuristics' (``planner.solvers``): the sequence is cut into ``n`` equal chunks, every
rank owns ``n / cp`` of them (equal token counts), its work is the mask area of its rows and may exceed
the mean by at most ``imbalance_target`` (``plan()``'s default 3%), and its traffic is the keys its rows
need that other ranks own, each token counted once (as ``Plan.stats()``'s ``remote_kv_tokens_per_rank``).

Formulation. ``x[i, r]`` (binary): rank ``r`` owns chunk ``i``. The keys chunk ``i``'s rows need
outside chunk ``i`` are cut at every chunk bound and span end into pieces; pieces of one chunk ``j``
needed by the same set ``I`` of chunks form a group of ``w`` tokens. ``y[g, r]`` (continuous in [0, 1])
is at least ``x[i, r] - x[j, r]`` for every ``i`` in ``I``: rank ``r`` receives the group when it owns a
chunk that needs it and not the chunk that holds it. Minimise ``T`` subject to ``T >= sum_g w_g y[g, r]``
for every rank, ``sum_r x[i, r] = 1``, ``sum_i x[i, r] = n / cp`` and ``sum_i area_i x[i, r] <= (1 +
imbalance_target) * area / cp``. At an optimum each ``y`` that matters is exactly 0 or 1, so ``T`` is the
busiest rank's received tokens. Ranks are interchangeable, so only the labelling that orders ranks by
their first chunk is allowed (``x[i, r] <= sum_{i' < i} x[i', r - 1]``), which removes ``cp!`` copies
of every layout from the search. Two additions make HiGHS prove optima in seconds where it otherwise
finds no balanced layout at all: a cut that bounds the owner of each chunk from below (see the code),
and an incumbent, the best known layout within the rules, which the program must beat by one token
(infeasible then means the incumbent is optimal).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from ..masks import AttnMask
from ..masks import geometry
from . import solvers
from .choose import evaluate
from .keys import KeySpans, merge_runs, subtract_runs
from .plan import Plan


@dataclass(frozen=True)
class ChunkOptimum:
    """What ``optimal_assignment`` found.

    ``status``: ``optimal`` (proven), ``time_limit`` (``max_remote`` is the best layout found, the
    optimum lies in ``[lower_bound, max_remote]``; ``bounds`` / ``owner`` are empty when none was found)
    or ``infeasible`` (no layout of these chunks balances within ``imbalance_target``).
    ``bounds`` int64 [n + 1], ``owner`` int32 [n]: the layout, in ``Plan.bounds`` / ``Plan.owner`` form.
    ``remote_kv_tokens_per_rank`` and ``imbalance``: that layout, counted by the planner's own rule.
    """

    status: str
    num_chunks: int
    chunk_size: int
    imbalance_target: float
    max_remote: int | None
    lower_bound: int
    bounds: np.ndarray
    owner: np.ndarray
    remote_kv_tokens_per_rank: list
    imbalance: float | None
    seconds: float

    @property
    def optimal(self) -> bool:
        return self.status == "optimal"


def _need_groups(traps: np.ndarray, seqlen: int, bounds: np.ndarray):
    """Key groups (chunk j holding them, tokens w, chunks I needing them) of the keys each chunk's rows
    need outside the chunk itself; every token of a group is needed by exactly the chunks ``I``."""
    n = len(bounds) - 1
    ci, k0, k1 = KeySpans(traps, seqlen).spans(bounds)
    need = []  # per chunk: merged key runs outside the chunk
    for i in range(n):
        sel = ci == i
        runs = merge_runs(np.stack([k0[sel], k1[sel]], axis=1))
        need.append(subtract_runs(runs, bounds[i : i + 2].reshape(1, 2)))
    cuts = np.unique(np.concatenate([bounds] + [r.reshape(-1) for r in need]))
    # needers[a]: the chunks whose needed runs cover piece a = [cuts[a], cuts[a + 1])
    needers = [[] for _ in range(len(cuts) - 1)]
    for i, runs in enumerate(need):
        for s, e in runs.tolist():
            for a in range(int(np.searchsorted(cuts, s)), int(np.searchsorted(cuts, e))):
                needers[a].append(i)
    groups = {}
    for a, who in enumerate(needers):
        if who:
            j = int(np.searchsorted(bounds, cuts[a], side="right")) - 1
            key = (j, tuple(who))
            groups[key] = groups.get(key, 0) + int(cuts[a + 1] - cuts[a])
    return [(j, w, list(who)) for (j, who), w in groups.items()]


def optimal_assignment(
    mask: AttnMask,
    cp_size: int,
    num_chunks: int,
    *,
    imbalance_target: float = 0.03,
    time_limit: float = 20.0,
    layouts=None,
) -> ChunkOptimum:
    """The assignment of ``num_chunks`` equal chunks of ``mask`` to ``cp_size`` ranks that minimises the
    busiest rank's received key/value tokens, with ``num_chunks / cp_size`` chunks per rank and every
    rank's area within ``imbalance_target`` of the mean (module doc: the formulation).

    ``num_chunks`` must divide the sequence length and be a multiple of ``cp_size``; meant for
    ``cp_size <= 8`` and up to about 64 chunks (the program has ``num_chunks * cp_size`` binaries).
    ``time_limit`` (seconds) bounds HiGHS: past it the best layout found and a lower bound come back.
    ``layouts``: known layouts ``(bounds, owner)`` whose chunks are unions of these chunks (plans of the
    heuristics); the best of them within the rules is the incumbent the program must beat (HiGHS finds
    balanced layouts of causal masks poorly by itself). ``None``: the contiguous and zigzag layouts of
    these chunks; ``()``: none, the program alone.
    """
    if not isinstance(mask, AttnMask):
        raise TypeError(f"optimal_assignment() needs an AttnMask, got {type(mask).__name__}")
    if mask.seqlen_q != mask.seqlen_k:
        raise ValueError(f"self-attention only; mask has seqlen_q={mask.seqlen_q} != seqlen_k={mask.seqlen_k}")
    s, cp, n = mask.seqlen_q, int(cp_size), int(num_chunks)
    if cp < 1 or n < cp or n % cp or s % n:
        raise ValueError(f"num_chunks={num_chunks} must be a multiple of cp_size={cp_size} that divides the "
                         f"sequence length {s}")
    if not 0 <= imbalance_target:
        raise ValueError(f"imbalance_target must be >= 0, got {imbalance_target}")
    if not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds, got {time_limit}")
    t0 = time.perf_counter()
    traps = mask.traps
    prefix = geometry.row_area_prefix(traps, s)
    bounds = solvers.even_bounds(s, n)
    area = (prefix[bounds[1:]] - prefix[bounds[:-1]]).astype(np.float64)
    mean = float(prefix[-1]) / cp
    groups = _need_groups(traps, s, bounds)
    g = len(groups)
    pair_w = {}  # (i, j): tokens of chunk j that chunk i needs
    for j, w, who in groups:
        for i in who:
            pair_w[i, j] = pair_w.get((i, j), 0) + w
    pairs = sorted(pair_w)
    nx, ny, npair = n * cp, g * cp, len(pairs)
    X = lambda i, r: i * cp + r  # noqa: E731  (variable indices)
    Y = lambda k, r: nx + k * cp + r  # noqa: E731
    P = nx + ny  # p[(i, j)]: chunks i and j share an owner (at most; see below)
    T = P + npair

    rows, cols, vals, lo, hi = [], [], [], [], []

    def row(entries, lb, ub):
        k = len(lo)
        for c, v in entries:
            rows.append(k)
            cols.append(c)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)

    for i in range(n):  # every chunk has one owner
        row([(X(i, r), 1.0) for r in range(cp)], 1, 1)
    for r in range(cp):  # equal token counts; area within the target (in units of the mean area)
        row([(X(i, r), 1.0) for i in range(n)], n // cp, n // cp)
        if mean > 0:
            row([(X(i, r), area[i] / mean) for i in range(n) if area[i] > 0], -np.inf, 1 + imbalance_target)
    for k, (j, w, who) in enumerate(groups):  # y[k, r] >= x[i, r] - x[j, r]
        for r in range(cp):
            for i in who:
                row([(Y(k, r), 1.0), (X(i, r), -1.0), (X(j, r), 1.0)], 0, np.inf)
    for r in range(cp):  # T >= received tokens of rank r
        row([(T, 1.0)] + [(Y(k, r), -float(w)) for k, (_, w, _) in enumerate(groups)], 0, np.inf)
    # A cut the linear relaxation needs (it is implied for binary x): the owner of chunk i receives
    # every key chunk i needs from chunks it does not also own, and it owns only k - 1 other chunks, so
    # T >= sum_j W_ij (1 - p_ij) with p_ij <= 1 - |x_ir - x_jr| and sum_j p_ij <= k - 1. With fractional
    # x spread evenly over the ranks the y rows above count no traffic at all; this row still gives
    # T >= need_i - (its k - 1 largest W_ij), which for causal masks is already the optimum.
    for q, (i, j) in enumerate(pairs):
        for r in range(cp):
            row([(P + q, 1.0), (X(i, r), 1.0), (X(j, r), -1.0)], -np.inf, 1)
            row([(P + q, 1.0), (X(i, r), -1.0), (X(j, r), 1.0)], -np.inf, 1)
    by_chunk = {}
    for q, (i, j) in enumerate(pairs):
        by_chunk.setdefault(i, []).append(q)
    for i, qs in by_chunk.items():
        row([(P + q, 1.0) for q in qs], -np.inf, n // cp - 1)
        row([(T, 1.0)] + [(P + q, float(pair_w[pairs[q]])) for q in qs], sum(pair_w[pairs[q]] for q in qs), np.inf)
    for r in range(1, cp):  # ranks ordered by their first chunk (symmetry)
        for i in range(n):
            row([(X(i, r), 1.0)] + [(X(i2, r - 1), -1.0) for i2 in range(i)], -np.inf, 0)

    # the incumbent: the best known layout within the rules; the program must beat it by a token
    spans = KeySpans(traps, s)
    known = None
    for lb_, lo_ in (_grid_layouts(n, cp, bounds) if layouts is None else layouts):
        own = _on_grid(np.asarray(lb_), np.asarray(lo_), bounds)
        if own is None or (np.bincount(own, minlength=cp) != n // cp).any():
            continue
        imb, remote = evaluate(traps, spans, bounds, own, cp, prefix)
        if imb <= imbalance_target and (known is None or remote.max() < known[1].max()):
            known = (own, remote, imb)
    if known is not None:
        row([(T, 1.0)], -np.inf, float(known[1].max()) - 1)

    nv = T + 1
    A = coo_array((vals, (rows, cols)), shape=(len(lo), nv)).tocsr()
    cost = np.zeros(nv)
    cost[T] = 1.0
    opts = {"time_limit": float(time_limit), "presolve": True,
            # received tokens are integers: a gap below one token proves the integer optimum
            "mip_rel_gap": min(1e-4, 0.5 / s)}
    program = dict(constraints=LinearConstraint(A, lo, hi),
                   bounds=Bounds(np.zeros(nv), np.r_[np.ones(nx + ny + npair), np.inf]))
    integrality = np.zeros(nv)
    integrality[:nx] = 1
    res = milp(cost, integrality=integrality, options=opts, **program)
    if res.status not in (0, 1, 2):
        raise RuntimeError(f"HiGHS failed on the chunk assignment: {res.message}")
    chunk = s // n
    if res.x is not None:  # a layout beating the incumbent
        own = np.argmax(res.x[:nx].reshape(n, cp), axis=1).astype(np.int32)
        imb, remote = evaluate(traps, spans, bounds, own, cp, prefix)
        known = (own, remote, imb)
    if res.status == 2 or res.status == 0:  # proven: nothing beats the incumbent, or the program's optimum
        if known is None:
            return ChunkOptimum("infeasible", n, chunk, imbalance_target, None, 0, np.zeros(0, np.int64),
                                np.zeros(0, np.int32), [], None, time.perf_counter() - t0)
        lower = int(known[1].max())
        status = "optimal"
    else:  # time limit: the search's bound, else the linear relaxation's (the same program, x continuous)
        dual = res.mip_dual_bound
        if dual is None or not np.isfinite(dual):
            lp = milp(cost, options={"time_limit": float(time_limit)}, **program)
            dual = lp.fun if lp.status == 0 else (np.inf if lp.status == 2 else 0.0)
        lower = int(np.ceil(dual - 1e-6)) if np.isfinite(dual) else None
        if lower is None:  # the relaxation is infeasible: so is beating the incumbent
            lower, status = int(known[1].max()), "optimal"
        else:
            status = "time_limit"
    if known is None:
        return ChunkOptimum(status, n, chunk, imbalance_target, None, lower, np.zeros(0, np.int64),
                            np.zeros(0, np.int32), [], None, time.perf_counter() - t0)
    own, remote, imb = known
    best = int(remote.max())
    return ChunkOptimum(status, n, chunk, imbalance_target, best, min(lower, best), bounds, own,
                        remote.tolist(), float(imb), time.perf_counter() - t0)


def _grid_layouts(n: int, cp: int, bounds: np.ndarray) -> list:
    """Contiguous and zigzag layouts (every round count that divides the chunks per rank) of the grid."""
    out = []
    for m in range(1, n // cp + 1):
        if (n // cp) % m == 0:
            u = np.arange(n) // (n // (m * cp))  # run of each chunk
            r = u % cp
            out.append((bounds, np.where((u // cp) % 2 == 1, cp - 1 - r, r)))
    return out


def _on_grid(lb: np.ndarray, lo: np.ndarray, grid: np.ndarray) -> np.ndarray | None:
    """Owner of every grid chunk under the layout (bounds ``lb``, owner ``lo``), or None when a cut of
    the layout is not a grid point."""
    if lb[0] != grid[0] or lb[-1] != grid[-1] or not np.isin(lb, grid).all():
        return None
    return np.asarray(lo)[np.searchsorted(lb, grid[:-1], side="right") - 1].astype(np.int32)


def in_feasible_set(plan: Plan, result: ChunkOptimum) -> bool:
    """Whether ``plan``'s layout is one the program of ``result`` ranges over: its chunks are unions of
    the program's chunks, every rank holds the same number of tokens, its imbalance is within the
    target and it has no guest rows. Such a plan cannot receive fewer tokens on its busiest rank than
    ``result.lower_bound``."""
    grid = solvers.even_bounds(plan.seqlen, result.num_chunks)
    tokens = {r.num_tokens for r in plan.ranks}
    return bool(
        np.isin(plan.bounds, grid).all()
        and len(tokens) == 1
        and plan.stats()["imbalance"] <= result.imbalance_target
        and not plan.has_guests
    )
