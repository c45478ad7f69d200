"""Baseline context-parallel strategies, one uniform entry point:

    fn = get_strategy(name, **options)
    out, lse = fn(q, k, v, plan, group, softmax_scale)

q [s_local, Hq, D], k/v [s_local, Hkv, D] in the plan's local order (``dispatch``); out like q, lse
[s_local, Hq] float32. Every strategy is differentiable and exact for any mask the plan describes
(the plan carries the mask exactly); they differ in what moves and how work is balanced:

- ``ring``: K/V blocks travel around a p2p ring (next block in flight while the current one computes;
  dK/dV travel with them in backward). Needs a ``zigzag`` (causal) or ``contiguous`` (full) plan.
- ``ulysses``: all-to-all from sequence to heads, every rank attends over the whole sequence for
  Hq/cp heads, all-to-all back. Needs Hkv*f divisible by cp for some f with Hq % (Hkv*f) == 0
  (K/V heads are repeated when Hkv < cp). Any plan.
- ``usp``: Ulysses inside groups of ``ulysses_degree`` consecutive ranks (a node) x ring across groups.
- ``allgather``: all-gather K/V, local tiles, reduce-scatter dK/dV. Any plan, any mask.
- ``head_context`` (not a peer baseline: our 2-D option): Ulysses all-to-all over heads inside groups
  of ``ulysses_degree`` consecutive ranks (default: the plan topology's GPUs per node), then
  megatron-cp's planned, staged GroupCast attention across the cp/u groups over the group-level plan
  (``planner.layout.group_plan``), then the all-to-all back. Like usp, but the cross-group part only
  moves the key rows the mask needs, balanced by the planner, for any mask. It needs one process group
  per position in a group; they are created once per (CP group, u) on first use, by every CP rank in
  the same order (``hybrid.head_context_groups``). ``planner.choose_layout`` predicts whether it
  communicates less than plain CP (dense masks, many GPUs per node) or not (sparse masks).

``plan_for(name, mask, cp_size)`` builds the plan layout each strategy is meant for (ring: zigzag for
causal-like masks, contiguous when it is as balanced; ulysses contiguous; allgather the planner's
``auto`` layout; head_context ``planner.layout.head_context_plan``: each group's tokens are what a
cp/u-rank plan gives it, cut into u equal pieces).
"""

from __future__ import annotations

from .hybrid import head_context, head_context_groups
from .strategies import STRATEGIES, allgather, plan_for, ring, ulysses, usp


def get_strategy(name: str, **options):
    """The strategy function called ``name`` (``ring``, ``ulysses``, ``usp``, ``allgather``,
    ``head_context``); options (e.g. ``ulysses_degree`` for usp / head_context, ``backend``) are bound
    as keyword arguments."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown context-parallel strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    fn = STRATEGIES[name]
    if not options:
        return fn

    def bound(q, k, v, plan, group=None, softmax_scale=None):
        return fn(q, k, v, plan, group, softmax_scale, **options)

    bound.__name__ = bound.__qualname__ = f"{name}_strategy"
    bound.__doc__ = fn.__doc__
    return bound


__all__ = ["get_strategy", "plan_for", "ring", "ulysses", "usp", "allgather", "head_context", "head_context_groups",
           "STRATEGIES"]
