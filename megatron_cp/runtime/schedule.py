"""Stages and routes: how a plan's remote keys/values travel, and in what order they are computed.

A ``Schedule`` splits every rank's work into stage 0 (its own keys: no communication) and
``num_stages`` remote stages. Remote stage ``s`` of rank ``r`` holds the ``s``-th of ``num_stages``
equal pieces of ``r``'s remote key tokens in global order (of its node's, when routes are
hierarchical, so a row shared by a node's GPUs travels in one stage); its tiles are the rank's tiles clipped to
those keys (``geometry.traps_to_tiles``), in the stage buffer's coordinates (the stage's tokens in global order).
The runtime prefetches stage ``s + 1`` while computing stage ``s`` and merges stage outputs by LSE.

A ``Route`` moves one stage's rows. Flat: one all-to-all-v (phase A). Hierarchical (topology with
more than one node): a row needed on another node crosses once per destination node, to the
rail-aligned GPU there (same local index as the owner), in phase A, and that GPU forwards it to the
other GPUs of its node that need it in phase B (an all-to-all-v with only intra-node traffic). The
adjoint (GroupReduce) runs B backwards (pre-reducing on the relay), then A backwards.

The number of stages is chosen here among candidates ``runtime.predict`` prices, one call a candidate
(``choose_num_stages``): the fewest stages whose predicted pipelined time is within 2% of the best; and the
single exchange against the staged path the same way (``choose_schedule``). Nothing here prices.

Pure numpy; every rank builds the same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..masks import geometry
from ..planner import Plan, Topology, Workload
from .cost import CostModel
from .predict import predict, predict_single, staged_floor


@dataclass(frozen=True)
class Route:
    """One rank's part of one stage's exchange. Index arrays are int64 numpy.

    Phase A sends ``x_local[a_send_idx]`` (destination-major, ``a_send_counts``) and receives
    ``a_recv_counts`` rows per source (source-major). Phase B (None when flat) sends
    ``cat[x_local, recvA][b_send_idx]`` and receives ``b_recv_counts``. The stage buffer is
    ``cat[x_local, recvA, recvB][out_idx]``.
    """

    n_local: int
    a_send_idx: np.ndarray
    a_send_counts: tuple
    a_recv_counts: tuple
    b_send_idx: np.ndarray | None
    b_send_counts: tuple | None
    b_recv_counts: tuple | None
    out_idx: np.ndarray

    @property
    def hierarchical(self) -> bool:
        return self.b_send_idx is not None

    @property
    def n_a(self) -> int:
        return int(sum(self.a_recv_counts))

    @property
    def n_b(self) -> int:
        return int(sum(self.b_recv_counts)) if self.b_recv_counts is not None else 0


@dataclass(frozen=True)
class Stage:
    tiles: np.ndarray  # int32 [n, 5]: q local, k in the stage buffer
    buf_len: int  # rows of the stage buffer (stage 0: the rank's own tokens)
    route: Route | None  # None for stage 0 (own keys)


@dataclass(frozen=True)
class Schedule:
    num_stages: int  # remote stages (0: every rank computes with its own keys only)
    hierarchical: bool
    ranks: tuple  # ranks[r] = tuple of Stage (stage 0 first)
    active: tuple  # active[s]: does remote stage s move any row on any rank (else no collective)
    inter_node_rows: tuple  # rows crossing nodes in phase A, per remote stage, all ranks together
    predicted: dict  # cost-model prediction (seconds) and the candidates tried


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    """np.unique for int64 by sorting (numpy's hash-based unique is much slower on large arrays)."""
    if len(x) == 0:
        return x
    x = np.sort(x)
    return x[np.concatenate([[True], x[1:] != x[:-1]])]


def _remote_ids(plan: Plan, rank: int) -> np.ndarray:
    return plan.ranks[rank].remote_ids()


def _ids_to_runs(ids: np.ndarray) -> np.ndarray:
    if len(ids) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    brk = np.nonzero(np.diff(ids) != 1)[0]
    starts = np.concatenate([[0], brk + 1])
    ends = np.concatenate([brk, [len(ids) - 1]])
    return np.stack([ids[starts], ids[ends] + 1], axis=1).astype(np.int64)


def _relay(owner_rank: np.ndarray, dst: int, topo: Topology | None) -> np.ndarray:
    """Phase-A destination of rows owned by ``owner_rank`` that rank ``dst`` needs."""
    if topo is None or topo.nodes == 1:
        return np.full(len(owner_rank), dst, dtype=np.int64)
    g = topo.gpus_per_node
    same = owner_rank // g == dst // g
    return np.where(same, dst, (dst // g) * g + owner_rank % g)


def build_routes(plan: Plan, need: list[np.ndarray], topo: Topology | None) -> tuple[list[Route], int]:
    """Routes of one stage: ``need[r]`` = sorted global ids rank r must receive; ``topo`` None for
    flat routes. Returns the routes and the number of phase-A rows that cross nodes of
    ``plan.topology`` (0 without one)."""
    cp, S = plan.cp_size, plan.seqlen
    owner_tok = np.repeat(plan.owner.astype(np.int64), np.diff(plan.bounds))
    lpos = np.empty(S, dtype=np.int64)
    n_local = []
    for r in range(cp):
        ids = plan.local_ids(r)
        lpos[ids] = np.arange(len(ids))
        n_local.append(len(ids))
    hier = topo is not None and topo.nodes > 1
    # phase A rows (src, dst, id), deduplicated: one copy per destination node when hierarchical
    a_src, a_dst, a_id, b_src, b_dst, b_id = [], [], [], [], [], []
    for r in range(cp):
        ids = need[r]
        o = owner_tok[ids]
        rel = _relay(o, r, topo)
        a_src.append(o), a_dst.append(rel), a_id.append(ids)
        fw = rel != r
        b_src.append(rel[fw]), b_dst.append(np.full(int(fw.sum()), r, dtype=np.int64)), b_id.append(ids[fw])
    def rows(src, dst, ids):  # unique (src, dst, id) rows in lexicographic order, via one int64 key
        key = _sorted_unique((np.concatenate(src) * cp + np.concatenate(dst)) * S + np.concatenate(ids))
        return np.stack([key // (cp * S), (key // S) % cp, key % S], axis=1)

    A = rows(a_src, a_dst, a_id)
    B = rows(b_src, b_dst, b_id)
    pt = plan.topology
    inter = int((A[:, 0] // pt.gpus_per_node != A[:, 1] // pt.gpus_per_node).sum()) if pt is not None else 0
    # recvA at p: rows of A with dst p, ordered (src, id) = lexicographic order of A restricted
    routes = []
    for r in range(cp):
        sa = A[A[:, 0] == r]  # sorted by (dst, id)
        ra = A[A[:, 1] == r]  # sorted by (src, id)
        a_send_counts = tuple(np.bincount(sa[:, 1], minlength=cp).tolist())
        a_recv_counts = tuple(np.bincount(ra[:, 0], minlength=cp).tolist())
        key_a = ra[:, 0] * S + ra[:, 2]
        nl = n_local[r]
        ids = need[r]
        o = owner_tok[ids]
        rel = _relay(o, r, topo)
        if hier:
            sb = B[B[:, 0] == r]  # rows r forwards, sorted by (dst, id)
            rb = B[B[:, 1] == r]  # rows r receives in phase B, sorted by (src relay, id)
            b_send_idx = nl + np.searchsorted(key_a, owner_tok[sb[:, 2]] * S + sb[:, 2])
            b_send_counts = tuple(np.bincount(sb[:, 1], minlength=cp).tolist())
            b_recv_counts = tuple(np.bincount(rb[:, 0], minlength=cp).tolist())
            key_b = rb[:, 0] * S + rb[:, 2]
            direct = rel == r
            out_idx = np.empty(len(ids), dtype=np.int64)
            out_idx[direct] = nl + np.searchsorted(key_a, o[direct] * S + ids[direct])
            out_idx[~direct] = nl + len(ra) + np.searchsorted(key_b, rel[~direct] * S + ids[~direct])
        else:
            b_send_idx = b_send_counts = b_recv_counts = None
            out_idx = nl + np.searchsorted(key_a, o * S + ids)
        routes.append(
            Route(
                n_local=nl,
                a_send_idx=lpos[sa[:, 2]],
                a_send_counts=a_send_counts,
                a_recv_counts=a_recv_counts,
                b_send_idx=b_send_idx,
                b_send_counts=b_send_counts,
                b_recv_counts=b_recv_counts,
                out_idx=out_idx.astype(np.int64),
            )
        )
    return routes, inter


def _stage_ids(plan: Plan, num_stages: int, topo: Topology | None = None) -> list[list[np.ndarray]]:
    """stage_ids[r][s]: global ids of remote stage s of rank r (sorted). The cuts are equal pieces of
    the rank's remote keys; with a multi-node ``topo`` they are equal pieces of its node's remote keys,
    shared by the node's GPUs, so that a row needed by several GPUs of a node travels in one stage and
    crosses nodes once."""
    cp = plan.cp_size
    ids = [_remote_ids(plan, r) for r in range(cp)]
    if not num_stages:
        return [[] for _ in range(cp)]
    g = topo.gpus_per_node if topo is not None and topo.nodes > 1 else 1
    out = [None] * cp
    for first in range(0, cp, g):
        members = range(first, min(first + g, cp))
        u = ids[first] if len(members) == 1 else _sorted_unique(np.concatenate([ids[r] for r in members]))
        cuts = [u[(i * len(u)) // num_stages] if (i * len(u)) // num_stages < len(u) else plan.seqlen
                for i in range(1, num_stages)] if len(u) else [plan.seqlen] * (num_stages - 1)
        edges = np.concatenate([[-1], np.asarray(cuts, dtype=np.int64), [plan.seqlen]])
        for r in members:
            pos = np.searchsorted(ids[r], edges, side="left")
            pos[0] = 0
            out[r] = [ids[r][pos[i]:pos[i + 1]] for i in range(num_stages)]
    return out


def _stage_tiles(plan: Plan, stage_ids, traps_by_rank) -> list[list[np.ndarray]]:
    out = []
    for r in range(plan.cp_size):
        segs = plan.ranks[r].segments
        tl = [geometry.traps_to_tiles(traps_by_rank[r], None, segs)]
        tl += [geometry.traps_to_tiles(traps_by_rank[r], None, _ids_to_runs(ids)) for ids in stage_ids[r]]
        out.append(tl)
    return out


CANDIDATE_STAGES = (1, 2, 3, 4, 6, 8)


def choose_num_stages(plan: Plan, cost: CostModel, work: Workload, topo: Topology | None, candidates=CANDIDATE_STAGES,
                      tiles_one=None):
    """Fewest remote stages whose predicted fwd+bwd time is within 2% of the best candidate.

    Stage compute is estimated as an equal share of the rank's remote tiles (clipping once, for one
    stage: ``tiles_one`` = ``_stage_tiles(plan, _stage_ids(plan, 1, topo), traps)`` when the caller
    has it); stage transfers are counted exactly for every candidate."""
    if plan.cp_size == 1 or all(r.num_remote == 0 for r in plan.ranks):
        return 0, {}
    if tiles_one is None:
        traps = [rp.traps for rp in plan.ranks]
        tiles_one = _stage_tiles(plan, _stage_ids(plan, 1, topo), traps)
    min_rem = min(r.num_remote for r in plan.ranks if r.num_remote > 0)
    preds = {}
    for n in candidates:
        if n > 1 and n > min_rem:
            break
        ids = _stage_ids(plan, n, topo)
        p = predict(plan, ids, tiles_one, topo, cost, work, split=n)
        preds[n] = p["fwd_s"] + p["bwd_s"]
    best = min(preds.values())
    n = min(k for k, v in preds.items() if v <= 1.02 * best)
    return n, preds


def choose_schedule(plan: Plan, stages: int | None, cost: CostModel, work: Workload,
                    hierarchical: bool = True) -> "Schedule | None":
    """The runtime's execution choice for ``plan``: None for the single exchange (one GroupCast of every
    remote row, then one kernel call), else the staged schedule. ``stages`` 0 asks for the single
    exchange, n > 0 for n remote stages, None lets the cost model choose the faster (ties go to the
    single exchange: simpler, no running-output passes). Multi-node plans with hierarchical routes
    always stage (the single exchange is flat)."""
    if stages == 0:
        return None
    if stages is not None:
        return schedule(plan, stages, cost=cost, work=work, hierarchical=hierarchical)
    topo = plan.topology if hierarchical else None
    if plan.cp_size == 1 or all(r.num_remote == 0 for r in plan.ranks):
        return None
    one = _stage_tiles(plan, _stage_ids(plan, 1, topo), [rp.traps for rp in plan.ranks])
    single = None
    if not (topo is not None and topo.nodes > 1):
        single = predict_single(plan, cost, work)
        single = single["fwd_s"] + single["bwd_s"]
        # no staged candidate can beat the single exchange when it is no slower than every candidate's floor
        # (own keys' compute and passes, one stage's overhead more): then none is priced
        if single <= staged_floor(plan, one, cost, work):
            return None
    # price the candidates first and build the staged schedule (routes, per-stage tiles) only when it
    # wins: for packed documents the single exchange usually does, and the build is half the choice's cost
    _, n, preds = _priced(plan, cost, work, topo, one)
    if n == 0 or (single is not None and single <= preds[n]):
        return None
    return _build(plan, n, cost, work, topo, one, preds)


def schedule(
    plan: Plan,
    num_stages: int | None = None,
    *,
    cost: CostModel | None = None,
    work: Workload | None = None,
    hierarchical: bool = True,
) -> Schedule:
    """Build the staged, routed schedule of ``plan`` (see module doc).

    ``num_stages``: remote stages; None lets the cost model choose. ``hierarchical``: use two-phase
    routes when ``plan.topology`` has more than one node. Pure: the runtime keeps what it builds.
    """
    if num_stages is not None and (not isinstance(num_stages, (int, np.integer)) or num_stages < 0):
        raise ValueError(f"num_stages must be None or an int >= 0, got {num_stages!r}")
    cost = cost or CostModel()
    work = work or Workload()
    topo = plan.topology if hierarchical else None
    preds, one = {}, None
    if num_stages is None:
        one, num_stages, preds = _priced(plan, cost, work, topo)
    if plan.cp_size == 1:
        num_stages = 0
    return _build(plan, num_stages, cost, work, topo, one, preds)


def _priced(plan: Plan, cost: CostModel, work: Workload, topo: Topology | None, one=None):
    """(the one-stage tiles, or None when nothing moves; the stage count the cost model picks; every
    candidate's predicted fwd + bwd time). ``one``: the one-stage tiles when the caller has cut them."""
    if one is None and plan.cp_size > 1 and any(r.num_remote for r in plan.ranks):
        one = _stage_tiles(plan, _stage_ids(plan, 1, topo), [rp.traps for rp in plan.ranks])
    n, preds = choose_num_stages(plan, cost, work, topo, tiles_one=one)
    return one, n, preds


def _build(plan: Plan, num_stages: int, cost: CostModel, work: Workload, topo: Topology | None, one, preds: dict
           ) -> Schedule:
    """The schedule of ``num_stages`` remote stages (``one``: the one-stage tiles when already cut;
    ``preds``: the candidates' predicted times, kept in ``predicted``)."""
    traps = [rp.traps for rp in plan.ranks]
    ids = _stage_ids(plan, num_stages, topo)
    tiles = one if (num_stages == 1 and one is not None) else _stage_tiles(plan, ids, traps)
    per_rank = [[Stage(tiles[r][0], plan.ranks[r].num_tokens, None)] for r in range(plan.cp_size)]
    active, inter = [], []
    for s in range(num_stages):
        routes, n_inter = build_routes(plan, [ids[r][s] for r in range(plan.cp_size)], topo)
        active.append(any(sum(rt.a_recv_counts) for rt in routes))
        inter.append(n_inter)
        for r in range(plan.cp_size):
            per_rank[r].append(Stage(tiles[r][s + 1], len(ids[r][s]), routes[r]))
    sched = Schedule(
        num_stages=num_stages,
        hierarchical=topo is not None and topo.nodes > 1,
        ranks=tuple(tuple(st) for st in per_rank),
        active=tuple(active),
        inter_node_rows=tuple(inter),
        predicted={"candidates": preds, **predict(plan, ids, tiles, plan.topology, cost, work)},
    )
    return sched
