"""Head+context 2-D attention: Ulysses over heads inside groups of ``u`` ranks x megatron-cp across groups.

The ``cp`` ranks form ``G = cp / u`` groups of ``u`` consecutive ranks (a node when ``u`` = GPUs per
node). Per layer:

1. all-to-all inside the group (one exchange of q|k|v, ``baselines.ulysses.to_heads``): rank ``(g, j)``
   ends up with every token of group ``g`` for its ``1/u`` share of the query heads and of the
   (repeated, when Hkv < u) K/V heads;
2. megatron-cp's staged runtime (``megatron_cp.attention``) over the *group-level* plan
   (``planner.layout.group_plan``: G ranks, group of a chunk = owner // u) in the process group of
   position ``j`` of every group: the GroupCast moves K/V between groups for this rank's heads only;
3. all-to-alls of out and lse back to "my tokens, all heads".

Compared with ``usp`` (same all-to-all, a K/V ring across groups) the cross-group part is planned:
exact and balanced for any mask, only the key rows that are needed travel, stages overlap compute.

Process groups: the cross-group exchange needs a process group per ``j``. They are created once per
(CP group, u) on first use (``head_context_groups``): every rank of the CP group creates all ``u`` of
them in the same order (j = 0..u-1) with ``use_local_synchronization=True``, so ranks outside the CP
group (other data/tensor-parallel replicas) take no part. Creating process groups is collective within
the CP group: call ``head_context_groups`` at start-up on every rank of the CP group (or let the first
layer do it, which every CP rank reaches in the same order), never from code that only some of its
ranks run.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.distributed as dist

from ..planner import Plan, group_plan
from ..planner.layout import default_degree, group_order, head_context_degree, kv_head_repeat
from ..kernels import upload
from ..runtime import CostModel, attention
from .common import cached, repeat_kv, setup
from .ulysses import to_heads, to_seq

# CP group object -> {u: the u cross-group process groups}; an entry goes with its CP group
_GROUPS: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict]" = weakref.WeakKeyDictionary()


def head_context_groups(group, u: int) -> list:
    """The ``u`` cross-group process groups of CP group ``group``: element ``j`` holds position ``j``
    of every group of ``u`` consecutive CP ranks, in group order (its rank ``g`` is CP rank ``g*u + j``);
    ``[None] * u`` when there is one group, ``[group]`` when u = 1. Collective over ``group`` on the
    first call per (group, u) (see module doc), cached after."""
    ranks = dist.get_process_group_ranks(group)
    cp = len(ranks)
    if u < 1 or cp % u:
        raise ValueError(f"ulysses_degree={u} must divide the CP group size {cp}")
    made = _GROUPS.setdefault(group, {})
    if u not in made:
        if cp // u == 1:
            made[u] = [None] * u
        elif u == 1:
            made[u] = [group]
        else:
            made[u] = [dist.new_group([ranks[g * u + j] for g in range(cp // u)], use_local_synchronization=True)
                       for j in range(u)]
    return made[u]


def _degree(plan: Plan, ulysses_degree) -> int:
    """The Ulysses degree to run: the given one (it must match a head_context plan's), else the plan's,
    else the topology's GPUs per node, else cp."""
    made_for = head_context_degree(plan)
    if ulysses_degree is None:
        return made_for if made_for is not None else default_degree(plan.cp_size, plan.topology)
    if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, (int, np.integer)):
        raise ValueError(f"head_context: ulysses_degree must be an int, got {ulysses_degree!r}")
    if made_for is not None and made_for != ulysses_degree:
        raise ValueError(
            f"head_context: ulysses_degree={ulysses_degree} but the plan was made for ulysses_degree={made_for} "
            f"(plan_for('head_context', ..., ulysses_degree={ulysses_degree}))"
        )
    return int(ulysses_degree)


def _group_order(plan: Plan, u: int, g: int, device):
    """(perm, inv) int64 tensors from group g's rows in rank order to the group plan's local order and
    back; None when they agree (always for ``head_context_plan`` plans)."""

    def build():
        p = group_order(plan, u, g)
        return None if p is None else (upload(p, device), upload(np.argsort(p), device))

    return cached(plan, ("head_context_order", u, g, str(device)), build)


def head_context(q, k, v, plan: Plan, group=None, softmax_scale=None, *, ulysses_degree: int | None = None,
                 backend="auto", stages: int | None = None, cost_model=None, lse_grad: bool = True):
    """Ulysses all-to-all over heads inside groups of ``ulysses_degree`` consecutive ranks x
    megatron-cp's planned attention across the ``cp / ulysses_degree`` groups (see module doc).

    q: [s_local, Hq, D], k/v: [s_local, Hkv, D] in ``plan``'s local order (``dispatch``);
    float32/bfloat16/float16/float64. Returns out [s_local, Hq, D] (q's dtype) and lse [s_local, Hq]
    float32; differentiable in q, k, v. Plan: any; ``plan_for('head_context', mask, cp, ...)``
    (``planner.layout.head_context_plan``) gives the layout it is balanced for, in which a group's rows
    need no reordering. Masks: any (exact). ``ulysses_degree`` None: the plan's own (head_context
    plans record it), else the plan topology's GPUs per node, else cp (one node: plain Ulysses).
    Needs ``ulysses_degree`` to divide cp and Hq, and Hkv*f for a K/V head repeat f with
    Hq % (Hkv*f) == 0. ``backend``/``stages``/``cost_model`` go to ``megatron_cp.attention`` (across
    groups every rank holds Hq/u query and Hkv*f/u K/V heads). ``lse_grad=False``: lse comes back
    without gradient and the head exchange skips its gradient (and the flags' host sync). Bad input
    raises ValueError before any collective (the cross-group process groups are created after the
    checks, on first use).
    """
    rank, _, _, _ = setup(q, k, v, plan, group, softmax_scale, backend, lse_grad, "head_context")
    cp = plan.cp_size
    u = _degree(plan, ulysses_degree)
    if u < 1 or cp % u:
        raise ValueError(f"head_context: ulysses_degree={u} must divide cp_size={cp}")
    f = kv_head_repeat(q.shape[1], k.shape[1], u)
    if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 0):
        raise ValueError(f"stages must be None or an int >= 0, got {stages!r}")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    G, (g, j) = cp // u, divmod(rank, u)
    # the group-level plan is built once per (plan, u); the runtime then keeps its own state for it
    gp = plan if u == 1 else cached(plan, ("group_plan", u), lambda: group_plan(plan, u))
    perm = _group_order(plan, u, g, q.device)
    sub = head_context_groups(group, u)[j] if G > 1 else None  # the first call creates the groups

    kr, vr = repeat_kv(k, v, f)
    if u > 1:  # one exchange: head share i of q, k and v goes to member i
        members = [g * u + i for i in range(u)]
        counts = [plan.num_local(r) for r in members]
        qh, kh, vh = to_heads([q, kr, vr], members, j, counts, group, None if perm is None else perm[0])
    else:
        qh, kh, vh = q, kr, vr
        if perm is not None:
            qh, kh, vh = (x.index_select(0, perm[0]) for x in (qh, kh, vh))
    # single-GPU groups per node (or none): flat routes are the same rows without an empty phase B
    hier = gp.topology is not None and gp.topology.gpus_per_node > 1
    o, l = attention(qh, kh, vh, gp, sub, softmax_scale, backend=backend, stages=stages, cost_model=cost_model,
                     hierarchical=hier)
    if perm is not None:
        o, l = o.index_select(0, perm[1]), l.index_select(0, perm[1])
    if u > 1:
        o, l = to_seq([o, l.unsqueeze(-1)], members, j, counts, group, grads=(True, lse_grad))
        l = l.squeeze(-1)
    return o, (l if lse_grad else l.detach())
