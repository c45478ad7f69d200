"""Head+context 2-D layouts, and the choice between them and plain context parallelism.

``head_context`` (runtime: ``megatron_cp.baselines.head_context``) splits the ``cp`` ranks into
``G = cp / u`` groups of ``u`` consecutive ranks (``u`` = GPUs per node by default). Inside a group a
Ulysses all-to-all turns "my tokens, all heads" into "the group's tokens, my 1/u of the heads"; across
groups, rank ``j`` of every group runs megatron-cp's planned attention over a *group-level* plan of
``G`` ranks (GroupCast of K/V between the groups, only for this rank's heads); an all-to-all brings
the output back to "my tokens, all heads". K/V travel between nodes once per destination group, as
with hierarchical routes, but nothing is forwarded inside the node afterwards: for dense masks that
removes the intra-node fan-out of plain CP at the price of moving q and out over NVLink.

This module is the pure (numpy) half:

- ``head_context_plan(mask, cp, u)``: the cp-rank plan to ``dispatch`` with. The group-level plan
  ``plan(mask, G)`` decides which tokens each group holds; each group's tokens (sorted global order)
  are cut into ``u`` equal pieces, piece ``i`` to rank ``g*u + i``. So the concatenation of a group's
  ranks' local tokens is exactly the group's local order, and the all-to-all needs no reordering.
- ``group_plan(plan, u)``: the G-rank plan of any cp-rank plan (group of a chunk = owner // u), the
  plan the runtime runs across groups; ``group_order`` gives the row permutation when the cp-rank
  plan was not built by ``head_context_plan`` (any plan works; balance is the group plan's).
- ``choose_layout(mask, cp, topology, work, cost)``: predicted bytes per GPU on intra- and inter-node
  links and communication time of (a) the plain CP plan and (b) head_context with u = GPUs per node;
  picks the faster. See ``choose_layout`` for the byte model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..masks import AttnMask, geometry
from . import guests, solvers
from .cost import CostModel, Workload, link_bytes
from .plan import Plan, _rank_plans, plan_digest
from .plan import plan as make_plan
from .schedule import _remote_ids, build_routes, mask_traps
from .topology import Topology

_SOLVER_RE = re.compile(r"^head_context/u(\d+)/")


# --------------------------------------------------------------------------------------- layouts


def kv_head_repeat(hq: int, hkv: int, u: int) -> int:
    """Smallest f with (hkv*f) % u == 0 and hq % (hkv*f) == 0 (K/V heads repeated f times so that u
    ranks can each take an equal share of query and K/V heads), or raise ValueError naming them."""
    if hkv < 1 or hq % hkv:
        raise ValueError(f"number of key/value heads {hkv} must divide number of query heads {hq}")
    if hq % u:
        raise ValueError(f"Ulysses degree {u} must divide the query heads ({hq})")
    for f in range(1, hq // hkv + 1):
        if (hkv * f) % u == 0 and hq % (hkv * f) == 0:
            return f
    raise ValueError(
        f"Ulysses degree {u} must divide the query heads ({hq}) and, after repeating K/V heads, "
        f"the key/value heads ({hkv}); no repeat factor works"
    )


def group_topology(topology: Topology | None, u: int) -> Topology | None:
    """Topology of the group-level plan: groups of ``u`` consecutive ranks as its ranks. ``u``
    dividing GPUs per node: ``nodes x (gpus_per_node / u)``; groups spanning whole nodes: every
    group its own node; otherwise (groups straddle nodes) None."""
    if topology is None:
        return None
    g = topology.gpus_per_node
    kw = dict(intra_node_gbps=topology.intra_node_gbps, inter_node_gbps=topology.inter_node_gbps)
    if g % u == 0:
        return Topology(topology.nodes, g // u, **kw)
    if u % g == 0:
        return Topology(topology.world_size // u, 1, **kw)
    return None


def plan_from_layout(traps: np.ndarray, seqlen: int, bounds: np.ndarray, owner: np.ndarray, cp_size: int, *,
                     chunk_size: int, topology: Topology | None, solver: str) -> Plan:
    """A Plan for a given token layout: chunk cuts ``bounds`` (int64 [n + 1]) and their ranks
    ``owner`` (int [n]) of the mask ``traps`` (int64 [m, 6], ``AttnMask.traps``), with ``plan()``'s
    digest rule (``plan_digest``)."""
    bounds = np.asarray(bounds, dtype=np.int64)
    owner = np.asarray(owner, dtype=np.int32)
    if bounds[0] != 0 or bounds[-1] != seqlen or np.any(np.diff(bounds) <= 0) or len(owner) != len(bounds) - 1:
        raise ValueError(f"bounds must cut [0, {seqlen}) into non-empty chunks, one owner each")
    if len(owner) and (owner.min() < 0 or owner.max() >= cp_size):
        raise ValueError(f"owner ranks must lie in [0, {cp_size})")
    prefix = geometry.row_area_prefix(traps, seqlen)
    spans = solvers.KeySpans(traps, seqlen)
    ranks = _rank_plans(traps, prefix, spans, bounds, owner, cp_size)
    return Plan(cp_size=cp_size, seqlen=seqlen, solver=solver, chunk_size=int(chunk_size), bounds=bounds,
                owner=owner, ranks=ranks, mask_area=int(prefix[-1]), topology=topology,
                digest=plan_digest(cp_size, seqlen, chunk_size, bounds, owner, traps))


def head_context_degree(plan: Plan) -> int | None:
    """The Ulysses degree ``u`` a plan from ``head_context_plan`` was made for (None for others)."""
    m = _SOLVER_RE.match(plan.solver)
    return int(m.group(1)) if m else None


def default_degree(cp_size: int, topology: Topology | None) -> int:
    """u = GPUs per node; without a topology the CP group is one node (u = cp, plain Ulysses)."""
    return topology.gpus_per_node if topology is not None else cp_size


def head_context_plan(mask: AttnMask, cp_size: int, ulysses_degree: int | None = None, *,
                      topology: Topology | None = None, chunk_size: int | None = None, solver: str = "auto",
                      imbalance_target: float = 0.03) -> Plan:
    """The cp-rank plan for ``head_context`` (see module doc): group g's tokens are those
    ``plan(mask, cp/u)`` gives rank g, split into u equal pieces in global order (rank g*u + i gets
    piece i). ``solver``/``chunk_size``/``imbalance_target`` go to the group-level ``plan``; its
    ``topology`` is ``group_topology(topology, u)``. The plan's ``solver`` reads
    ``head_context/u{u}/{group solver}``. Raises ValueError when u does not divide cp_size or a
    group holds fewer than u tokens."""
    u = default_degree(cp_size, topology) if ulysses_degree is None else ulysses_degree
    if not isinstance(u, (int, np.integer)) or isinstance(u, bool) or u < 1 or cp_size % u:
        raise ValueError(f"head_context: ulysses_degree={u!r} must be a positive int dividing cp_size={cp_size}")
    if topology is not None and topology.world_size != cp_size:
        raise ValueError(f"topology {topology} has {topology.world_size} ranks, cp_size={cp_size}")
    u = int(u)
    G = cp_size // u
    gtopo = group_topology(topology, u)
    gp = make_plan(mask, G, chunk_size=chunk_size, topology=gtopo, solver=solver, imbalance_target=imbalance_target,
                   guest_rows="none")  # head_context computes every row where it lives
    runs_all, own_all = [], []
    for g in range(G):
        ids = gp.local_ids(g)
        if len(ids) < u:
            raise ValueError(f"head_context: group {g} holds {len(ids)} tokens, fewer than ulysses_degree={u}")
        piece = (np.arange(len(ids)) * u) // len(ids)  # equal pieces in global order
        brk = np.nonzero((np.diff(ids) != 1) | (np.diff(piece) != 0))[0]
        starts = np.concatenate([[0], brk + 1])
        ends = np.concatenate([brk, [len(ids) - 1]])
        runs_all.append(np.stack([ids[starts], ids[ends] + 1], axis=1))
        own_all.append(g * u + piece[starts])
    runs = np.concatenate(runs_all)
    own = np.concatenate(own_all)
    order = np.argsort(runs[:, 0], kind="stable")
    runs, own = runs[order], own[order]
    bounds = np.append(runs[:, 0], mask.seqlen_q)
    return plan_from_layout(mask.traps, mask.seqlen_q, bounds, own, cp_size, chunk_size=gp.chunk_size,
                            topology=topology, solver=f"head_context/u{u}/{gp.solver}")


def group_plan(plan: Plan, u: int) -> Plan:
    """The plan over ``cp/u`` groups of ``u`` consecutive ranks of ``plan`` (a chunk's group is its
    owner // u), with ``group_topology(plan.topology, u)``; cached on ``plan``. The mask is recovered
    exactly from ``plan`` (``schedule.mask_traps``)."""
    if u < 1 or plan.cp_size % u:
        raise ValueError(f"ulysses_degree={u} must divide cp_size={plan.cp_size}")
    key = ("head_context", "group_plan", u)
    gp = plan.cache.get(key)
    if gp is None:
        traps = mask_traps(plan)
        owner = plan.owner.astype(np.int64) // u
        keep = np.concatenate([[True], owner[1:] != owner[:-1]])  # merge neighbouring chunks of a group
        bounds = np.append(plan.bounds[:-1][keep], plan.seqlen)
        gp = plan_from_layout(traps, plan.seqlen, bounds, owner[keep], plan.cp_size // u,
                              chunk_size=plan.chunk_size, topology=group_topology(plan.topology, u),
                              solver=f"group/u{u}/{plan.solver}")
        plan.cache[key] = gp
    return gp


def group_order(plan: Plan, u: int, g: int) -> np.ndarray | None:
    """Row permutation (int64 [n_g]) from the concatenation of group ``g``'s ranks' local tokens (rank
    order) to the group plan's local order (sorted global order): ``x_group = x_concat[perm]``. None
    when they already agree (always for ``head_context_plan`` plans)."""
    ids = np.concatenate([plan.local_ids(g * u + i) for i in range(u)])
    if len(ids) < 2 or np.all(np.diff(ids) > 0):
        return None
    return np.argsort(ids, kind="stable").astype(np.int64)


# ------------------------------------------------------------------------------------ prediction


@dataclass(frozen=True)
class Phase:
    """One collective of a layout: the busiest GPU's bytes (max over GPUs of max(sent, received))
    on intra- and inter-node links, and its predicted time (``CostModel.comm_time``)."""

    name: str
    intra_bytes: int
    inter_bytes: int
    seconds: float


@dataclass(frozen=True)
class LayoutPrediction:
    """Predicted communication of one layout for one forward + backward pass.

    ``intra_bytes``/``inter_bytes``: sums over phases of the busiest GPU's bytes; ``comm_s``: sum
    of the phases' times (phases run one after another; overlap with compute is not counted)."""

    layout: str  # "cp" | "head_context"
    ulysses_degree: int  # 1 for cp
    kv_repeat: int  # K/V head repeat factor (head_context with Hkv < u), 1 for cp
    solver: str  # the plan's solver
    phases: tuple  # Phase, forward then backward
    intra_bytes: int
    inter_bytes: int
    comm_s: float


@dataclass(frozen=True)
class LayoutChoice:
    """``choose_layout``'s answer: ``layout`` is "cp" or "head_context"; both predictions (``head_context``
    None, with ``reason``, when it does not apply)."""

    layout: str
    ulysses_degree: int
    cp: LayoutPrediction
    head_context: LayoutPrediction | None
    reason: str


def _phase(name: str, M: np.ndarray, node: np.ndarray, cost: CostModel) -> Phase:
    """Phase of a byte matrix ``M[src, dst]`` (float, [cp, cp], diagonal ignored)."""
    intra, inter = link_bytes(M, node)
    return Phase(name, int(round(intra)), int(round(inter)), cost.comm_time(intra, inter))


def _route_matrices(plan: Plan, topo: Topology | None) -> tuple[np.ndarray, np.ndarray]:
    """Rows sent src -> dst in phase A and phase B of one GroupCast of every remote key ([cp, cp])."""
    routes, _ = build_routes(plan, [_remote_ids(plan, r) for r in range(plan.cp_size)], topo)
    A = np.array([rt.a_send_counts for rt in routes], dtype=np.float64).reshape(plan.cp_size, plan.cp_size)
    B = np.array([rt.b_send_counts if rt.b_send_counts is not None else [0] * plan.cp_size for rt in routes],
                 dtype=np.float64).reshape(plan.cp_size, plan.cp_size)
    return A, B


def _acc_bytes(work: Workload) -> int:
    """Element size of reduced gradients: float32 (float64 for float64 inputs)."""
    return 8 if work.dtype_bytes == 8 else 4


def cp_traffic(plan: Plan, work: Workload, hierarchical: bool = True) -> list[tuple[str, np.ndarray]]:
    """Plain CP over ``plan``: ``(phase, bytes[src, dst])`` (float64 [cp, cp]) of one GroupCast of every
    remote K/V row (forward; ``hierarchical``: the runtime's two-phase routes when ``plan.topology``
    has several nodes, else flat) and the GroupReduce of dK/dV over the same routes (backward), then
    the guest rows' exchanges (``guests.traffic``)."""
    topo = plan.topology if hierarchical else None
    A, B = _route_matrices(plan, topo)
    kv = work.kv_bytes_per_token
    acc = 2 * work.num_kv_heads * work.head_dim * _acc_bytes(work)
    out = [("cast_a", A * kv)]
    if B.any():
        out += [("cast_b", B * kv), ("reduce_b", B.T * acc)]
    out.append(("reduce_a", A.T * acc))
    return out + guests.traffic(plan, work)  # guest rows' q / partial outputs, backward dout / dq


def head_context_traffic(plan: Plan, u: int, work: Workload, hierarchical: bool = True) -> list[tuple[str, np.ndarray]]:
    """head_context over the cp-rank ``plan`` with groups of ``u``: ``(phase, bytes[src, dst])``
    (float64 [cp, cp]) of every exchange, forward then backward, as the runtime
    (``baselines.head_context``) issues them (see ``choose_layout``)."""
    cp = plan.cp_size
    f = kv_head_repeat(work.num_heads, work.num_kv_heads, u)
    b, D, acc = work.dtype_bytes, work.head_dim, _acc_bytes(work)
    hq_u, hkv_u = work.num_heads // u, work.num_kv_heads * f // u
    n = np.array([plan.num_local(r) for r in range(cp)], dtype=np.float64)
    grp = np.arange(cp) // u
    # rows[i, j]: rows of rank i that member j of its group handles (for j's heads)
    rows = (grp[:, None] == grp[None, :]) * n[:, None]
    np.fill_diagonal(rows, 0.0)
    gp = plan if u == 1 else group_plan(plan, u)
    gtopo = gp.topology
    A, B = _route_matrices(gp, gtopo if (hierarchical and gtopo is not None and gtopo.gpus_per_node > 1) else None)
    # the group plan's rank g' is CP rank g'*u + j for the heads of j: one copy of its routes per j
    eye = np.eye(u)
    A, B = np.kron(A, eye), np.kron(B, eye)
    kv = 2 * hkv_u * D
    out = [("a2a_qkv", rows * (hq_u + 2 * hkv_u) * D * b), ("cast_a", A * kv * b)]
    if B.any():
        out.append(("cast_b", B * kv * b))
    # backward exchanges also carry an int32 "gradient present" flag per tensor to every group peer
    # (dout and dlse travel together: two flags; the q, k and v gradients: three)
    pairs = (grp[:, None] == grp[None, :]) & ~np.eye(cp, dtype=bool)
    out += [("a2a_out", rows.T * hq_u * D * b), ("a2a_lse", rows.T * hq_u * 4),
            ("a2a_dout", rows * hq_u * D * b + pairs * 8), ("a2a_dlse", rows * hq_u * 4)]
    if B.any():
        out.append(("reduce_b", B.T * kv * acc))
    out += [("reduce_a", A.T * kv * acc), ("a2a_dqkv", rows.T * (hq_u + 2 * hkv_u) * D * b + pairs * 12)]
    return out


def _predict(layout: str, u: int, f: int, plan: Plan, traffic, cost: CostModel) -> LayoutPrediction:
    topo = plan.topology if plan.topology is not None else Topology(1, plan.cp_size)
    node = np.arange(plan.cp_size) // topo.gpus_per_node
    phases = [_phase(name, M, node, cost) for name, M in traffic]
    return LayoutPrediction(layout, u, f, plan.solver, tuple(phases), sum(p.intra_bytes for p in phases),
                            sum(p.inter_bytes for p in phases), float(sum(p.seconds for p in phases)))


def predict_cp(plan: Plan, work: Workload, cost: CostModel | None = None, hierarchical: bool = True) -> LayoutPrediction:
    """Predicted communication of plain CP over ``plan`` (``cp_traffic``)."""
    return _predict("cp", 1, 1, plan, cp_traffic(plan, work, hierarchical), cost or CostModel())


def predict_head_context(plan: Plan, u: int, work: Workload, cost: CostModel | None = None,
                         hierarchical: bool = True) -> LayoutPrediction:
    """Predicted communication of head_context over the cp-rank ``plan`` (``head_context_traffic``)."""
    f = kv_head_repeat(work.num_heads, work.num_kv_heads, u)
    return _predict("head_context", u, f, plan, head_context_traffic(plan, u, work, hierarchical), cost or CostModel())


def choose_layout(mask: AttnMask, cp_size: int, topology: Topology | None, work: Workload,
                  cost: CostModel | None = None, *, hierarchical: bool = True, chunk_size: int | None = None,
                  solver: str = "auto") -> LayoutChoice:
    """Plain CP or head_context (u = GPUs per node), whichever is predicted to communicate less.

    Byte model (exact counts of rows from the plans' routes; every figure is the busiest GPU's,
    max over GPUs of max(bytes sent, bytes received), per link class; ``b`` = work.dtype_bytes,
    ``D`` = head_dim, gradients reduced in float32):

    (a) cp: ``plan(mask, cp, topology)``; forward one GroupCast of every remote K/V row
        (``2*Hkv*D*b`` bytes a row) over the runtime's routes: hierarchical (phase A crosses nodes
        once per destination node to the rail GPU, phase B forwards inside the node) or flat;
        backward the GroupReduce of dK/dV (``2*Hkv*D*4`` a row) over the same routes.
    (b) head_context: ``head_context_plan(mask, cp, u)``; an all-to-all of q|k|v inside each group
        (a rank sends ``n_local*(u-1)/u`` rows of ``(Hq + 2*Hkv*f)*D*b`` bytes, ``f`` the K/V head
        repeat), the group plan's GroupCast of ``2*Hkv*f/u*D*b`` bytes a row (each rank only its
        heads), the all-to-alls of out (``Hq*D*b``) and lse (``Hq*4``) back; backward mirrors it
        (dout, dlse forth, the dK/dV GroupReduce in float32, dq|dk|dv back).

    Time = sum over phases of ``cost.comm_time(intra, inter)`` (latency per collective, intra/inter
    bandwidths concurrent within a phase). Ties go to cp. head_context does not apply (``reason``
    says why) when the query heads are not divisible by u or no K/V repeat works.
    """
    cost = cost or CostModel()
    topo = topology if topology is not None else Topology(1, cp_size)
    if topo.world_size != cp_size:
        raise ValueError(f"topology {topo} has {topo.world_size} ranks, cp_size={cp_size}")
    u = topo.gpus_per_node
    p_cp = make_plan(mask, cp_size, chunk_size=chunk_size, topology=topology, solver=solver)
    a = predict_cp(p_cp, work, cost, hierarchical)
    try:
        kv_head_repeat(work.num_heads, work.num_kv_heads, u)
    except ValueError as e:
        return LayoutChoice("cp", 1, a, None, f"head_context does not apply: {e}")
    p_hc = head_context_plan(mask, cp_size, u, topology=topology, chunk_size=chunk_size, solver=solver)
    b = predict_head_context(p_hc, u, work, cost, hierarchical)
    if b.comm_s < a.comm_s:
        return LayoutChoice("head_context", u, a, b,
                            f"head_context {b.comm_s * 1e3:.3f} ms < cp {a.comm_s * 1e3:.3f} ms predicted communication")
    return LayoutChoice("cp", 1, a, b,
                        f"cp {a.comm_s * 1e3:.3f} ms <= head_context {b.comm_s * 1e3:.3f} ms predicted communication")
