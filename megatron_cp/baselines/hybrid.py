"""Head+context 2-D attention: Ulysses over heads inside groups of ``u`` ranks x megatron-cp across groups.

The ``cp`` ranks form ``G = cp / u`` groups of ``u`` consecutive ranks (a node when ``u`` = GPUs per
node). Per layer:

1. all-to-all inside the group (one exchange of q|k|v): rank ``(g, j)`` ends up with every token of
   group ``g`` for its ``1/u`` share of the query heads and of the (repeated, when Hkv < u) K/V heads;
2. megatron-cp's staged runtime (``megatron_cp.attention``) over the *group-level* plan
   (``planner.layout.group_plan``: G ranks, group of a chunk = owner // u) in the process group of
   rank ``j`` of every group: the GroupCast moves K/V between groups for this rank's heads only;
3. all-to-alls of out and lse back to "my tokens, all heads".

Compared with ``usp`` (same all-to-all, a K/V ring across groups) the cross-group part is planned:
exact and balanced for any mask, only the key rows that are needed travel, stages overlap compute.

Process groups: the cross-group exchange needs a process group per ``j``. They are created once per
(CP group ranks, u) on first use and cached (``head_context_groups``): every rank of the CP group
creates all ``u`` of them in the same order (j = 0..u-1) with ``use_local_synchronization=True``,
so ranks outside the CP group (other data/tensor-parallel replicas) take no part. Creating process
groups is collective within the CP group: call ``head_context_groups`` at start-up on every rank of
the CP group (or let the first layer do it, which every CP rank reaches in the same order), never
from code that only some of its ranks run.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..planner import Plan
from ..planner.cost import CostModel
from ..planner.layout import default_degree, group_order, group_plan, head_context_degree, kv_head_repeat
from ..runtime.attention import _backend, _check_inputs, _group_rank
from ..runtime.attention import attention as cp_attention
from .exchange import check_lse_grad, to_heads, to_seq

_GROUPS: dict = {}


def head_context_groups(group, u: int) -> list:
    """The ``u`` cross-group process groups of CP group ``group``: element ``j`` holds rank ``j`` of
    every group of ``u`` consecutive CP ranks, in group order (its rank ``g`` is CP rank ``g*u + j``).
    Collective over ``group`` on first call (see module doc); cached per (the group's global ranks, u)
    for the life of the default process group."""
    ranks = tuple(dist.get_process_group_ranks(group))
    cp = len(ranks)
    if u < 1 or cp % u:
        raise ValueError(f"ulysses_degree={u} must divide the CP group size {cp}")
    key = (ranks, u)
    hit = _GROUPS.get(key)
    if hit is not None and hit[0] is dist.group.WORLD:
        return hit[1]
    if cp // u == 1:
        subs = [None] * u
    elif u == 1:
        subs = [group]
    else:
        subs = [dist.new_group([ranks[g * u + j] for g in range(cp // u)], use_local_synchronization=True)
                for j in range(u)]
    _GROUPS[key] = (dist.group.WORLD, subs)
    return subs


def _degree(plan: Plan, ulysses_degree) -> int:
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
    rank = _group_rank(plan, group)
    _check_inputs(q, k, v, plan, rank, softmax_scale)
    cp = plan.cp_size
    u = _degree(plan, ulysses_degree)
    if u < 1 or cp % u:
        raise ValueError(f"head_context: ulysses_degree={u} must divide cp_size={cp}")
    hq, hkv = q.shape[1], k.shape[1]
    f = kv_head_repeat(hq, hkv, u)
    if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 0):
        raise ValueError(f"stages must be None or an int >= 0, got {stages!r}")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    check_lse_grad(lse_grad, "head_context")
    _backend(backend, q.device)  # an unknown backend raises here, not after the all-to-all
    G, (g, j) = cp // u, divmod(rank, u)
    gp = plan if u == 1 else group_plan(plan, u)  # pure and cached: no collective
    perm = plan.cache.get(("head_context", "order", u, g, str(q.device)), False)
    if perm is False:
        p = group_order(plan, u, g)
        perm = None if p is None else (torch.from_numpy(p).to(q.device), torch.from_numpy(np.argsort(p)).to(q.device))
        plan.cache[("head_context", "order", u, g, str(q.device))] = perm
    sub = head_context_groups(group, u)[j] if G > 1 else None  # first call creates the groups

    kr = k.repeat_interleave(f, dim=1) if f > 1 else k
    vr = v.repeat_interleave(f, dim=1) if f > 1 else v
    if u > 1:
        # one exchange: head share i of q, k and v goes to member i
        members = [g * u + i for i in range(u)]
        counts = [plan.num_local(r) for r in members]
        qh, kh, vh = to_heads([q, kr, vr], members, j, counts, group, None if perm is None else perm[0])
    else:
        qh, kh, vh = q, kr, vr
        if perm is not None:
            qh, kh, vh = (x.index_select(0, perm[0]) for x in (qh, kh, vh))
    # single-GPU groups per node (or none): flat routes are the same rows without an empty phase B
    hier = gp.topology is not None and gp.topology.gpus_per_node > 1
    o, l = cp_attention(qh, kh, vh, gp, sub, softmax_scale, backend=backend, stages=stages,
                        cost_model=cost_model, hierarchical=hier)
    if perm is not None:
        o, l = o.index_select(0, perm[1]), l.index_select(0, perm[1])
    if u > 1:
        o, l = to_seq([o, l.unsqueeze(-1)], members, j, counts, group, grads=(True, lse_grad))
        l = l.squeeze(-1)
    return o, (l if lse_grad else l.detach())
