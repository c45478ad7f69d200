"""A step's predicted time: a plan and an exchange choice priced by a ``CostModel``.

Every price of a step is here, read top to bottom: the staged path (``predict``: stage transfers per link,
stage kernels, the pipeline of both), the floor under every staged candidate (``staged_floor``), the single
exchange (``predict_single``) and what guest rows add to either (``guest_predict``). Each prices its parts
with the model's own calls (``CostModel.tile_time``, ``comm_time``, ``stage_overhead``, ``exchange_passes``,
``call_time``; runtime.cost). ``runtime.schedule`` cuts the stages and chooses among the candidates these
price; nothing here builds routes.

Pure numpy; every rank predicts the same numbers.
"""

from __future__ import annotations

import numpy as np

from ..planner import Plan, Topology, Workload
from .cost import CostModel

__all__ = ["predict", "staged_floor", "predict_single", "guest_predict", "guest_traffic", "guest_pairs", "link_bytes"]


def predict(plan: Plan, stage_ids, stage_tiles, topo: Topology | None, cost: CostModel, work: Workload,
            split: int | None = None) -> dict:
    """Pipelined time (seconds) of forward and backward, the busiest rank, with this staging:
    ``stage_ids[r][s]`` the global ids of rank r's remote stage s, ``stage_tiles[r]`` its own keys' tiles then
    each remote stage's; ``topo``: the routes' topology (None: flat). ``split``: ``stage_tiles`` hold one remote
    stage, to be counted as ``split`` equal stages. Returns ``fwd_s``, ``bwd_s`` and each stage's ``comm_s``."""
    cp = plan.cp_size
    n = len(stage_ids[0]) if cp else 0
    per_tok = work.kv_bytes_per_token
    # links: the plan's topology decides what crosses nodes, whatever the routes; hierarchical routes
    # (``topo`` with several nodes) cross once per destination node, spread over the node's rail-aligned
    # relays, and fan out inside the node (phase B: intra-node bytes too); flat routes cross per rank
    pt = plan.topology
    g = pt.gpus_per_node if pt is not None else cp
    hier = topo is not None and topo.nodes > 1
    owner_tok = np.repeat(plan.owner.astype(np.int64), np.diff(plan.bounds))
    comm = []
    for s in range(n):
        intra = np.zeros(cp)
        inter = np.zeros(cp)
        node_seen = {}
        for r in range(cp):
            ids = stage_ids[r][s]
            o = owner_tok[ids]
            far = (o // g) != (r // g)
            intra[r] += ((~far).sum() + (far.sum() if hier else 0)) * per_tok
            if far.any():
                if hier:
                    node_seen.setdefault(r // g, []).append(ids[far])
                else:
                    inter[r] += far.sum() * per_tok
        for node, lst in node_seen.items():
            inter[node * g:(node + 1) * g] += _count_unique(np.concatenate(lst)) * per_tok / g
        comm.append(cost.comm_time(intra.max(), inter.max()))
    fwd = np.zeros(cp)
    bwd = np.zeros(cp)
    for r in range(cp):
        if split is not None:  # one remote stage's tiles, counted as ``split`` stages of equal key pieces
            own, one = stage_tiles[r][0], stage_tiles[r][1]
            kf = [cost.tile_time(own, work, accumulate=True)] + [cost.tile_time(one, work, key_split=split)] * split
            kb = [cost.tile_time(own, work, True)] + [cost.tile_time(one, work, True, key_split=split)] * split
        else:
            kf = [cost.tile_time(t, work, accumulate=True) for t in stage_tiles[r]]  # stages add into a running output
            kb = [cost.tile_time(t, work, backward=True) for t in stage_tiles[r]]
        ov_f = cost.stage_overhead(plan.num_local(r), work)
        ov_b = cost.stage_overhead(plan.num_local(r), work, backward=True)
        kf = [t + ov_f for t in kf]
        kb = [t + ov_b for t in kb]
        # the exchanges' row gathers and placements (delta: in stage_bwd_bytes) and the call's fixed time
        n_recv, n_send = _exchange_rows(plan, r)
        kf[0] += cost.call_time() + cost.exchange_passes(plan.num_local(r), n_recv, n_send, work)
        kb[0] += cost.call_time(True) + cost.exchange_passes(plan.num_local(r), n_recv, n_send, work, True, False)
        # forward: cast of stage i+1 issued when stage i starts computing
        start, end, comm_end = 0.0, kf[0], 0.0
        comm_end = comm[0] if n else 0.0
        for s in range(1, n + 1):
            start = max(end, comm_end)
            if s < n:
                comm_end = max(start, comm_end) + comm[s]
            end = start + kf[s]
        fwd[r] = end
        # backward: remote stages first, each reduce issued after its compute, then own keys
        t, red = 0.0, 0.0
        for s in range(1, n + 1):
            t += kb[s]
            red = max(red, t) + comm[s - 1]
        t += kb[0]
        bwd[r] = max(t, red)
    g = guest_predict(plan, cost, work)  # guest rows: their exchanges and call, after the stages
    return {"fwd_s": float(fwd.max()) + g["fwd_s"], "bwd_s": float(bwd.max()) + g["bwd_s"], "comm_s": comm}


def staged_floor(plan: Plan, one, cost: CostModel, work: Workload) -> float:
    """A floor under ``predict``'s fwd + bwd time of every staged candidate (any stage count): each rank
    computes its stages one after another, so a rank takes at least its own keys' stage (running-output
    passes, call and exchange passes included) plus one remote stage's overhead, forward and backward.
    ``one``: the one-stage tiles (``one[r][0]``: rank r's own keys')."""
    fwd = bwd = 0.0
    for r in range(plan.cp_size):
        n_recv, n_send = _exchange_rows(plan, r)
        nl = plan.num_local(r)
        fwd = max(fwd, cost.tile_time(one[r][0], work, accumulate=True) + 2 * cost.stage_overhead(nl, work)
                  + cost.call_time() + cost.exchange_passes(nl, n_recv, n_send, work))
        bwd = max(bwd, cost.tile_time(one[r][0], work, True) + 2 * cost.stage_overhead(nl, work, backward=True)
                  + cost.call_time(True) + cost.exchange_passes(nl, n_recv, n_send, work, True, False))
    g = guest_predict(plan, cost, work)
    return fwd + bwd + g["fwd_s"] + g["bwd_s"]


def predict_single(plan: Plan, cost: CostModel, work: Workload) -> dict:
    """Time of the single-exchange path (``stages=0``): one flat GroupCast of every remote row, then one
    kernel call over the rank's whole tile list (no running-output passes); backward mirrors it."""
    cp = plan.cp_size
    per_tok = work.kv_bytes_per_token
    g = plan.topology.gpus_per_node if plan.topology is not None else cp
    owner_tok = np.repeat(plan.owner.astype(np.int64), np.diff(plan.bounds))
    intra, inter = np.zeros(cp), np.zeros(cp)
    for r in range(cp):
        o = owner_tok[plan.ranks[r].remote_ids()]
        far = (o // g) != (r // g)
        intra[r], inter[r] = (~far).sum() * per_tok, far.sum() * per_tok
    comm = cost.comm_time(intra.max(), inter.max())
    kf = kb = 0.0
    for r, rp in enumerate(plan.ranks):
        n_recv, n_send = _exchange_rows(plan, r)
        kf = max(kf, cost.tile_time(rp.tiles, work) + cost.exchange_passes(rp.num_tokens, n_recv, n_send, work))
        kb = max(kb, cost.tile_time(rp.tiles, work, backward=True)
                 + cost.exchange_passes(rp.num_tokens, n_recv, n_send, work, backward=True))
    g = guest_predict(plan, cost, work)  # guest rows: their exchanges and call, after the main call
    return {"fwd_s": cost.call_time() + comm + kf + g["fwd_s"], "bwd_s": cost.call_time(True) + kb + comm + g["bwd_s"],
            "comm_s": [comm]}


def _exchange_rows(plan: Plan, r: int) -> tuple[int, int]:
    """(rows rank r receives, rows it sends) in one exchange of everything it needs / others need."""
    rp = plan.ranks[r]
    n_send = sum(int((x[:, 1] - x[:, 0]).sum()) for x in rp.send_runs if len(x))
    return int(rp.num_remote), n_send


def _count_unique(x: np.ndarray) -> int:
    """Distinct values of int64 ``x``, by sorting (numpy's hash-based unique is much slower on large arrays)."""
    return int(np.count_nonzero(np.diff(np.sort(x)))) + 1 if len(x) else 0


# -- guest rows (planner.guests): what their exchanges and calls add


def guest_predict(plan: Plan, cost: CostModel, work: Workload) -> dict:
    """Time the guest rows add to a step (seconds): their exchanges (each a collective; the busiest
    GPU's bytes per link class) and the kernel calls over the guest tiles, the busiest rank's."""
    if not plan.has_guests:
        return {"fwd_s": 0.0, "bwd_s": 0.0}
    cp = plan.cp_size
    g = plan.topology.gpus_per_node if plan.topology is not None else cp
    node = np.arange(cp) // g
    t = {}
    for name, B in guest_traffic(plan, work):
        intra, inter = link_bytes(B, node)
        t[name] = cost.comm_time(intra, inter) if intra + inter > 0 else cost.links.latency_us * 1e-6
    kf = max(cost.tile_time(rp.guest_tiles, work) for rp in plan.ranks)
    kb = max(cost.tile_time(rp.guest_tiles, work, backward=True) for rp in plan.ranks)
    # the partials / dq travel back while the own tiles compute: only their latency is exposed
    lat = cost.links.latency_us * 1e-6
    return {"fwd_s": t["guest_q"] + kf + min(t["guest_out"], lat),
            "bwd_s": t["guest_dout"] + t["guest_lse"] + kb + min(t["guest_dq"], lat)}


def guest_traffic(plan: Plan, work: Workload) -> list[tuple[str, np.ndarray]]:
    """The guest rows' exchanges as the runtime issues them, forward then backward: ``(phase,
    bytes[src, dst])`` (float64 [cp, cp], self pairs included: callers ignore the diagonal)."""
    if not plan.has_guests:
        return []
    M = guest_pairs(plan).astype(np.float64)
    h, d, b = work.num_heads, work.head_dim, work.dtype_bytes
    acc = 8 if b == 8 else 4
    return [("guest_q", M * h * d * b), ("guest_out", M.T * h * (d + 1) * acc),
            ("guest_dout", M * 2 * h * d * b), ("guest_lse", M * 2 * h * acc), ("guest_dq", M.T * h * d * b)]


def guest_pairs(plan: Plan) -> np.ndarray:
    """``M[a, b]`` of a built plan: guest rows rank ``a`` sends to rank ``b`` (self included)."""
    cp = plan.cp_size
    M = np.zeros((cp, cp), dtype=np.int64)
    for rp in plan.ranks:
        for b, runs in enumerate(rp.guest_send_runs):
            M[rp.rank, b] = int((runs[:, 1] - runs[:, 0]).sum()) if len(runs) else 0
    return M


def link_bytes(M: np.ndarray, node: np.ndarray) -> tuple[float, float]:
    """(intra, inter): the busiest GPU's bytes (max of sent and received) inside its node and across
    nodes in one collective with byte matrix ``M[src, dst]`` ([cp, cp], diagonal ignored)."""
    M = np.array(M, dtype=np.float64)
    np.fill_diagonal(M, 0.0)
    same = node[:, None] == node[None, :]
    a, b = np.where(same, M, 0.0), np.where(same, 0.0, M)
    intra = float(np.maximum(a.sum(1), a.sum(0)).max(initial=0.0))
    inter = float(np.maximum(b.sum(1), b.sum(0)).max(initial=0.0))
    return intra, inter
