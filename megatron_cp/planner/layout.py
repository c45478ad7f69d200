"""Head+context 2-D layouts: Ulysses over heads inside groups of ranks x context parallelism across them.

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
"""

from __future__ import annotations

import re

import numpy as np

from ..masks import AttnMask, geometry
from .keys import KeySpans
from .plan import Plan, plan_digest
from .ranks import rank_plans
from .plan import plan as make_plan
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
    spans = KeySpans(traps, seqlen)
    ranks = rank_plans(traps, prefix, spans, bounds, owner, cp_size)
    return Plan(cp_size=cp_size, seqlen=seqlen, solver=solver, chunk_size=int(chunk_size), bounds=bounds,
                owner=owner, ranks=ranks, mask_area=int(prefix[-1]), topology=topology,
                digest=plan_digest(cp_size, seqlen, chunk_size, bounds, owner, traps), traps=traps)


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
    owner // u), with ``group_topology(plan.topology, u)``, of the same mask (``plan.traps``)."""
    if u < 1 or plan.cp_size % u:
        raise ValueError(f"ulysses_degree={u} must divide cp_size={plan.cp_size}")
    owner = plan.owner.astype(np.int64) // u
    keep = np.concatenate([[True], owner[1:] != owner[:-1]])  # merge neighbouring chunks of a group
    bounds = np.append(plan.bounds[:-1][keep], plan.seqlen)
    return plan_from_layout(plan.traps, plan.seqlen, bounds, owner[keep], plan.cp_size // u,
                            chunk_size=plan.chunk_size, topology=group_topology(plan.topology, u),
                            solver=f"group/u{u}/{plan.solver}")


def group_order(plan: Plan, u: int, g: int) -> np.ndarray | None:
    """Row permutation (int64 [n_g]) from the concatenation of group ``g``'s ranks' local tokens (rank
    order) to the group plan's local order (sorted global order): ``x_group = x_concat[perm]``. None
    when they already agree (always for ``head_context_plan`` plans)."""
    ids = np.concatenate([plan.local_ids(g * u + i) for i in range(u)])
    if len(ids) < 2 or np.all(np.diff(ids) > 0):
        return None
    return np.argsort(ids, kind="stable").astype(np.int64)
